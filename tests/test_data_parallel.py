"""`tabed-engine serve --data-parallel 2` as a real process on loopback, on the bundled demo pair
(CPU, float32): answers through the front equal one in-process engine's, concurrent requests
spread over both replicas, /metrics totals are the sums of the replicas' series, a killed
replica fails its in-flight request with an OpenAI error naming it while the other keeps
serving and /health reports it, and Ctrl-C leaves no child process behind."""
import json
import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from tabed_engine import Engine, SamplingParams  # noqa: E402
from tabed_engine.serving.replica import plan_replicas  # noqa: E402

pytestmark = pytest.mark.one_worker     # one server (front + 2 replicas, ~17 s to start) for the module

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(ROOT, "tabed_engine", "assets", "demo")
MODEL = "demo"
PROMPTS = ["USER : add two and five . ASSISTANT :", "USER : add three and four . ASSISTANT :",
           "USER : add one and six . ASSISTANT :", "USER : add two and two . ASSISTANT :"]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (from /proc)."""
    kids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                kids.append(int(entry))
    return kids


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class Server:
    def __init__(self, proc, url, log_path):
        self.proc, self.url, self.log_path = proc, url, log_path
        self.http = httpx.Client(base_url=url, timeout=120)

    def log(self) -> str:
        with open(self.log_path) as f:
            return f.read()

    def metrics(self) -> dict:
        """Every sample of GET /metrics: {'name{labels}': value}."""
        text = self.http.get("/metrics").text
        return {k: float(v) for k, v in re.findall(r"^([a-z_]+(?:\{[^}]*\})?) (\S+)$", text, re.M)}

    def complete(self, prompt: str, max_tokens: int, **kw) -> httpx.Response:
        return self.http.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "temperature": 0,
                                                       "max_tokens": max_tokens, **kw})


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    if not os.path.isfile(os.path.join(DEMO, "target", "config.json")):
        pytest.skip("the bundled demo pair is not installed")
    port = _free_port()
    log_path = str(tmp_path_factory.mktemp("dp") / "server.log")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])),
               OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "tabed_engine.serving.cli", "serve", "--target", os.path.join(DEMO, "target"),
           "--draft", os.path.join(DEMO, "draft"), "--device", "cpu", "--dtype", "float32", "--port", str(port),
           "--model-name", MODEL, "--max-batch", "4", "--data-parallel", "2", "--warmup"]
    with open(log_path, "w") as log:
        # a session of its own: the Ctrl-C test signals the whole process group, as a terminal does
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                start_new_session=True)
    srv = Server(proc, f"http://127.0.0.1:{port}", log_path)
    deadline = time.monotonic() + 180
    while True:
        if proc.poll() is not None:
            pytest.fail(f"the server exited with status {proc.returncode}:\n{srv.log()}")
        try:
            if srv.http.get("/health", timeout=2).status_code == 200:
                break
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            pytest.fail(f"the server did not come up in 180 s:\n{srv.log()}")
        time.sleep(0.2)
    yield srv
    if proc.poll() is None:         # the shutdown test did not run: stop everything
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def engine():
    return Engine.from_pretrained(os.path.join(DEMO, "target"), os.path.join(DEMO, "draft"), device="cpu",
                                  dtype="float32")


def test_health_lists_every_replica(server):
    body = server.http.get("/health").json()
    assert body["status"] == "ok" and [r["replica"] for r in body["replicas"]] == [0, 1]
    pids = [r["pid"] for r in body["replicas"]]
    assert len(set(pids)) == 2 and set(pids) <= set(_children(server.proc.pid)), (pids, body)
    for pid in pids:      # NVLink multicast off from each replica's start (the test did not set it)
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
        want = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
        assert {k: env.get(k.encode(), b"").decode() for k in want} == want, pid
    log = server.log()
    assert "[replica 0] warm-up done in" in log and "[replica 1] warm-up done in" in log, log


def test_answers_equal_one_engine_and_spread_over_both_replicas(server, engine):
    """Four concurrent greedy requests (completions and chat, streamed and not): each answer is
    the in-process engine's, token for token, and each replica served some of them."""
    before = server.metrics()
    refs = [engine.generate(p, sampling=SamplingParams(max_new_tokens=24)) for p in PROMPTS]

    def one(i):
        if i % 2:
            body = {"model": MODEL, "temperature": 0, "max_tokens": 24, "stream": True,
                    "stream_options": {"include_usage": True},
                    "messages": [{"role": "user", "content": PROMPTS[i]}]} if i == 3 else \
                {"model": MODEL, "prompt": PROMPTS[i], "temperature": 0, "max_tokens": 24, "stream": True,
                 "stream_options": {"include_usage": True}}
            url = "/v1/chat/completions" if i == 3 else "/v1/completions"
            with server.http.stream("POST", url, json=body) as r:
                events = [json.loads(line[6:]) for line in r.iter_lines()
                          if line.startswith("data: {")]
            text = "".join((c.get("delta", {}).get("content") if i == 3 else c["text"]) or ""
                           for e in events for c in e["choices"])
            return text, events[-1]["usage"]["completion_tokens"]
        r = server.complete(PROMPTS[i], 24)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"], r.json()["usage"]["completion_tokens"]

    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(one, range(4)))
    chat_ref = engine.generate([{"role": "user", "content": [{"type": "text", "text": PROMPTS[3]}]}],
                               sampling=SamplingParams(max_new_tokens=24))
    want = [(r.text, len(r.token_ids)) for r in refs[:3]] + [(chat_ref.text, len(chat_ref.token_ids))]
    assert got == want
    after = server.metrics()
    routed = [after[f'tabed_replica_requests_total{{replica="{i}"}}'] -
              before[f'tabed_replica_requests_total{{replica="{i}"}}'] for i in (0, 1)]
    assert sum(routed) == 4 and min(routed) >= 1, routed


def test_metrics_totals_are_the_sums_of_the_replicas(server):
    samples = server.metrics()
    labelled = {k: v for k, v in samples.items() if 'replica="' in k}
    assert labelled
    totals: dict = {}
    for key, value in labelled.items():
        if key.startswith(("tabed_replica_up", "tabed_replica_requests_total")):
            continue                       # per replica only
        total_key = re.sub(r',?replica="\d+"', "", key).replace("{,", "{").replace("{}", "")
        totals[total_key] = totals.get(total_key, 0.0) + value
    assert totals["tabed_completion_tokens_total"] > 0
    for key, value in totals.items():
        # (sums are written with 6 significant digits)
        assert samples.get(key, 0.0) == pytest.approx(value, rel=1e-5, abs=1e-9), key
    finished = sum(v for k, v in samples.items() if k.startswith("tabed_requests_total{finish_reason="))
    assert finished >= 4 and samples["tabed_requests_running"] == 0


def test_input_a_replica_refuses_gets_400(server):
    """The engine's own checks run in the replica; its refusal comes back as the usual 400."""
    r = server.complete("USER : <image>\n describe the image . ASSISTANT :", 4)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and "1 image placeholder(s) but 0 image(s)" in err["message"]
    assert server.complete(PROMPTS[0], 3).json()["usage"]["completion_tokens"] == 3


def test_killed_replica_fails_its_request_and_the_other_keeps_serving(server):
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 230, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with server.http.stream("POST", "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        next(line for line in lines if line.startswith("data: {"))        # it is decoding
        health = server.http.get("/health").json()["replicas"]
        victim = next(rep for rep in health if rep["running"] == 1)
        os.kill(victim["pid"], signal.SIGKILL)
        events = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    err = events[-1]["error"]
    assert err["type"] == "server_error" and f"replica {victim['replica']}" in err["message"], err
    assert "killed by SIGKILL" in err["message"] and "lost" in err["message"], err
    deadline = time.monotonic() + 10
    while server.http.get("/health").json()["status"] != "degraded":
        assert time.monotonic() < deadline
        time.sleep(0.05)
    h = server.http.get("/health")
    assert h.status_code == 200
    dead = h.json()["replicas"][victim["replica"]]
    assert dead["status"] == "dead" and "SIGKILL" in dead["error"]
    assert server.metrics()[f'tabed_replica_up{{replica="{victim["replica"]}"}}'] == 0
    for _ in range(3):      # the survivor takes every next request
        r = server.complete(PROMPTS[1], 4)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text


def test_ctrl_c_leaves_no_child_process(server):
    """SIGINT to the server's whole process group (a terminal's Ctrl-C): the front stops its
    replicas and exits; none of its children is left."""
    kids = _children(server.proc.pid)
    assert kids
    os.killpg(server.proc.pid, signal.SIGINT)
    try:
        server.proc.wait(60)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the server did not stop within 60 s of SIGINT:\n{server.log()[-4000:]}")
    deadline = time.monotonic() + 10
    while any(_alive(k) for k in kids):
        assert time.monotonic() < deadline, [k for k in kids if _alive(k)]
        time.sleep(0.1)


def test_replica_that_fails_to_load_stops_the_server():
    """A replica whose engine cannot be built: `serve` names it, stops the others, exits with 2."""
    cmd = [sys.executable, "-m", "tabed_engine.serving.cli", "serve", "--target", os.path.join(DEMO, "target"),
           "--device", "cpu", "--policy", "no-such-policy", "--data-parallel", "2", "--port", str(_free_port())]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])),
               OMP_NUM_THREADS="1")
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert done.returncode == 2, done.stderr
    assert re.search(r"error: replica \d \(cpu\) failed to start: ValueError: .*no-such-policy", done.stderr), \
        done.stderr


def test_plan_refuses_bad_degrees_and_places_cpu_replicas():
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="data_parallel must be a positive int"):
            plan_replicas(bad, "cpu")
    with pytest.raises(ValueError, match="CUDA_VISIBLE_DEVICES"):
        plan_replicas(2, "cuda:1")
    plans = plan_replicas(3, "cpu")
    assert [p.index for p in plans] == [0, 1, 2] and {p.device for p in plans} == {"cpu"}
    for p in plans:
        assert p.env["NCCL_NVLS_ENABLE"] == "0" and p.env["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1"
        assert p.env["NVSHMEM_DISABLE_NVLS"] == "1"
