"""The OpenAI-compatible server as a real process on loopback, on the bundled demo pair (CPU,
float32): answers over HTTP equal `Engine.generate` in-process, streams join to the whole
answer, bad input gets a 400 naming the problem while the server keeps serving, a client that
disconnects aborts its request, and concurrent clients each get their own answer."""
import base64
import io
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from benchmarks.world.scenarios import examples  # noqa: E402
from tabed_engine import Engine, SamplingParams  # noqa: E402

pytestmark = pytest.mark.one_worker     # one server process (~12 s to start) for the module

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(ROOT, "tabed_engine", "assets", "demo")
MODEL = "demo"
TEXT_PROMPT = "USER : add two and five . ASSISTANT :"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(next(line for line in f if line.startswith("VmRSS:")).split()[1])


class Server:
    """The `tabed-engine serve` process under test."""

    def __init__(self, proc: subprocess.Popen, url: str, log_path: str):
        self.proc, self.url, self.log_path = proc, url, log_path
        self.http = httpx.Client(base_url=url, timeout=60)
        self.openai = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)

    def log(self, tail: int = 4000) -> str:
        """The server's output: its last `tail` characters (None: all of it)."""
        with open(self.log_path) as f:
            text = f.read()
        return text if tail is None else text[-tail:]

    def metric(self, name: str) -> float:
        """One sample's value from GET /metrics (0 when it has none yet)."""
        text = self.http.get("/metrics").text
        m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
        return float(m.group(1)) if m else 0.0


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    if not os.path.isfile(os.path.join(DEMO, "target", "config.json")):
        pytest.skip("the bundled demo pair is not installed")
    port = _free_port()
    log_path = str(tmp_path_factory.mktemp("server") / "server.log")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])),
               OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "tabed_engine.serving.cli", "serve", "--target", os.path.join(DEMO, "target"),
           "--draft", os.path.join(DEMO, "draft"), "--device", "cpu", "--dtype", "float32",
           "--port", str(port), "--model-name", MODEL, "--max-batch", "8",    # 16 clients: some wait
           "--warmup"]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    srv = Server(proc, f"http://127.0.0.1:{port}", log_path)
    deadline = time.monotonic() + 120
    while True:
        if proc.poll() is not None:
            pytest.fail(f"the server exited with status {proc.returncode}:\n{srv.log()}")
        try:
            if srv.http.get("/health", timeout=2).status_code == 200:
                break
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"the server did not come up in 120 s:\n{srv.log()}")
        time.sleep(0.2)
    yield srv
    proc.terminate()        # SIGTERM: uvicorn drains, the lifespan stops the engine thread
    try:
        code = proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"the server did not stop within 30 s of SIGTERM:\n{srv.log()}")
    # uvicorn re-raises the signal it handled once it has shut down
    assert code in (0, -signal.SIGTERM) and "Application shutdown complete" in srv.log(), srv.log()


@pytest.fixture(scope="module")
def engine():
    return Engine.from_pretrained(os.path.join(DEMO, "target"), os.path.join(DEMO, "draft"), device="cpu",
                                  dtype="float32")


def data_url(image) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def openai_messages(ex) -> list[dict]:
    """An example's chat as OpenAI messages, its images as data: URLs in their turns."""
    images, msgs = iter(ex.images), []
    for i, turn in enumerate(ex.turns):
        parts = [{"type": "image_url", "image_url": {"url": data_url(next(images))}}
                 for _ in range(turn.n_images)]
        msgs.append({"role": "user", "content": parts + [{"type": "text", "text": turn.user}]})
        if i < len(ex.turns) - 1:
            msgs.append({"role": "assistant", "content": turn.answer})
    return msgs


def greedy(engine, ex, max_tokens):
    return engine.generate(ex.messages(), images=ex.images, sampling=SamplingParams(max_new_tokens=max_tokens))


def chat(server, messages, max_tokens, **kw):
    return server.openai.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                                 max_tokens=max_tokens, **kw)


def test_health_and_models(server):
    assert server.http.get("/health").json() == {"status": "ok"}
    assert "warm-up done in" in server.log(tail=None)   # --warmup ran before serving
    assert [m.id for m in server.openai.models.list().data] == [MODEL]
    assert server.openai.models.retrieve(MODEL).id == MODEL


@pytest.mark.parametrize("scenario", ["S1", "S2", "S4", "S5"])
def test_greedy_chat_equals_engine_generate(server, engine, scenario):
    """Image turns, a second turn after an answer, and two-image prompts (S5) over HTTP give
    the in-process greedy answer, with its token counts and speculation stats."""
    for ex in examples(scenario, 2, seed=3):
        ref = greedy(engine, ex, 40)
        resp = chat(server, openai_messages(ex), 40)
        choice = resp.choices[0]
        assert choice.message.content == ref.text, (scenario, ex.prompt)
        assert choice.finish_reason == ref.finish_reason
        assert (resp.usage.prompt_tokens, resp.usage.completion_tokens) == \
               (ref.stats.prompt_tokens, len(ref.token_ids))
        spec = resp.model_extra["speculation"]
        assert spec["speculative"] and spec["target_forwards"] >= 1
        assert len(spec["accepted_lengths"]) == spec["target_forwards"]


def test_completions_equals_engine_generate(server, engine):
    ref = engine.generate(TEXT_PROMPT, sampling=SamplingParams(max_new_tokens=24))
    resp = server.openai.completions.create(model=MODEL, prompt=TEXT_PROMPT, temperature=0, max_tokens=24)
    assert resp.choices[0].text == ref.text and ref.text
    assert resp.usage.completion_tokens == len(ref.token_ids)
    short = server.openai.completions.create(model=MODEL, prompt=TEXT_PROMPT, temperature=0, max_tokens=2)
    assert short.choices[0].finish_reason == "length" and short.usage.completion_tokens == 2


def test_stream_pieces_join_to_the_whole_answer(server, engine):
    ex = examples("S1", 1, seed=5)[0]
    ref = greedy(engine, ex, 48)
    stream = chat(server, openai_messages(ex), 48, stream=True, stream_options={"include_usage": True})
    pieces, finish, usage = [], None, None
    for ev in stream:
        if ev.choices:
            pieces.append(ev.choices[0].delta.content or "")
            finish = ev.choices[0].finish_reason or finish
        if ev.usage:
            usage = ev.usage
    assert "".join(pieces) == ref.text == chat(server, openai_messages(ex), 48).choices[0].message.content
    assert sum(bool(p) for p in pieces) >= 2, pieces           # pieces come as blocks are accepted
    assert finish == ref.finish_reason and usage.completion_tokens == len(ref.token_ids)
    # the raw event stream: OpenAI's framing, ending with [DONE]
    body = {"model": MODEL, "prompt": TEXT_PROMPT, "temperature": 0, "max_tokens": 8, "stream": True}
    with server.http.stream("POST", "/v1/completions", json=body) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert events[-1] == "data: [DONE]" and all(e.startswith("data: ") for e in events)
    text = "".join(json.loads(e[6:])["choices"][0]["text"] for e in events[:-1])
    assert text == engine.generate(TEXT_PROMPT, sampling=SamplingParams(max_new_tokens=8)).text


def test_stop_strings_and_seeded_sampling_equal_engine_generate(server, engine):
    """`stop` ends the answer before the stop string (streamed or not); a seeded sampled request
    (alone in the engine) reproduces the in-process answer for the same seed."""
    ex = examples("S1", 1, seed=9)[0]
    ref = engine.generate(ex.messages(), images=ex.images,
                          sampling=SamplingParams(max_new_tokens=40, stop=(" column", "zebra")))
    assert ref.finish_reason == "stop" and " column" not in ref.text and ref.text
    whole = chat(server, openai_messages(ex), 40, stop=[" column", "zebra"]).choices[0]
    streamed = chat(server, openai_messages(ex), 40, stop=[" column", "zebra"], stream=True)
    assert (whole.message.content, whole.finish_reason) == (ref.text, "stop")
    assert "".join(ev.choices[0].delta.content or "" for ev in streamed if ev.choices) == ref.text
    sampled = [server.openai.completions.create(model=MODEL, prompt=TEXT_PROMPT, temperature=1.5, seed=seed,
                                                max_tokens=12).choices[0].text for seed in (1, 2, 1)]
    refs = [engine.generate(TEXT_PROMPT, sampling=SamplingParams(max_new_tokens=12, temperature=1.5, seed=s)).text
            for s in (1, 2)]
    assert sampled == [refs[0], refs[1], refs[0]]


def test_local_image_path_equals_data_url(server, tmp_path):
    ex = examples("S2", 1, seed=7)[0]
    path = tmp_path / "scene.png"
    ex.images[0].save(path)
    answers = set()
    for url in (data_url(ex.images[0]), str(path), f"file://{path}"):
        msgs = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                             {"type": "text", "text": ex.turns[0].user}]}]
        answers.add(chat(server, msgs, 24).choices[0].message.content)
    assert len(answers) == 1 and answers != {""}


def _image_msg(url: str, text: str = "describe the image .") -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": text}]}]


NOT_AN_IMAGE = "data:image/png;base64," + base64.b64encode(b"plain text, not a picture").decode()
SCENE = examples("S1", 1, seed=0)[0].images[0]
BAD = {   # case: (endpoint, body (raw bytes or an object), words the message must hold, param)
    "malformed JSON": ("chat", b'{"model": "demo", "messages": [', "malformed JSON", None),
    "body not an object": ("chat", b"[1, 2]", "JSON object", None),
    "unknown model": ("chat", {"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]},
                      "'gpt-4o' is not served", "model"),
    "no messages": ("chat", {"model": MODEL, "messages": []}, "messages must be a non-empty list", "messages"),
    "invalid base64": ("chat", {"messages": _image_msg("data:image/png;base64,@@not*base64@@")},
                       "invalid base64", "messages[0].content[0]"),
    "not an image": ("chat", {"messages": _image_msg(NOT_AN_IMAGE)}, "not a readable image",
                     "messages[0].content[0]"),
    "missing file": ("chat", {"messages": _image_msg("/nonexistent/scene.png")}, "does not exist", None),
    "http URL": ("chat", {"messages": _image_msg("https://example.com/cat.png")}, "not fetched",
                 "messages[0].content[0]"),
    "placeholders vs images": ("chat", {"messages": _image_msg(data_url(SCENE), "<image> and this ?")},
                               "2 image placeholder(s) but 1 image(s)", None),
    "image in a completion": ("completions", {"prompt": "USER : <image>\n describe the image . ASSISTANT :"},
                              "1 image placeholder(s) but 0 image(s)", None),
    "too many images": ("chat", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(SCENE)}}] * 16 + [
        {"type": "text", "text": "describe the image ."}]}], "max_tokens": 8}, "exceeds the cache length", None),
    "prompt beyond the context": ("completions", {"prompt": "USER : " + "one two " * 200 + "ASSISTANT :"},
                                  "exceeds the cache length", None),
    "max_tokens beyond the context": ("completions", {"prompt": TEXT_PROMPT, "max_tokens": 1000},
                                      "exceeds the cache length", None),
    "negative max_tokens": ("completions", {"prompt": TEXT_PROMPT, "max_tokens": -3},
                            "max_tokens must be >= 1", "max_tokens"),
    "temperature < 0": ("chat", {"messages": [{"role": "user", "content": "hi"}], "temperature": -0.5},
                        "temperature must be >= 0", "temperature"),
    "top_p out of range": ("completions", {"prompt": TEXT_PROMPT, "top_p": 1.5}, "top_p must be in", "top_p"),
    "n > 1": ("chat", {"messages": [{"role": "user", "content": "hi"}], "n": 2}, "n must be 1", "n"),
    "logprobs": ("completions", {"prompt": TEXT_PROMPT, "logprobs": 2}, "logprobs is not supported", "logprobs"),
    "bad stop": ("completions", {"prompt": TEXT_PROMPT, "stop": [1]}, "stop must be", "stop"),
    "bad role": ("chat", {"messages": [{"role": "robot", "content": "hi"}]}, "role", "messages[0]"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_gets_400_and_the_server_keeps_serving(server, case):
    endpoint, body, words, param = BAD[case]
    url = f"/v1/{endpoint.replace('chat', 'chat/completions')}"
    if isinstance(body, bytes):
        r = server.http.post(url, content=body, headers={"content-type": "application/json"})
    else:
        r = server.http.post(url, json={"model": MODEL, "temperature": 0, **body})
    assert r.status_code == 400, (case, r.status_code, r.text)
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["code"] is None
    assert words in err["message"], (case, err["message"])
    if param is not None:
        assert err["param"] == param, (case, err)
    good = server.openai.completions.create(model=MODEL, prompt=TEXT_PROMPT, temperature=0, max_tokens=3)
    assert good.usage.completion_tokens == 3 and good.choices[0].text


def test_openai_client_raises_bad_request(server):
    with pytest.raises(openai.BadRequestError, match="not served"):
        server.openai.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
    assert server.metric('tabed_rejected_requests_total{status="400"}') >= 1


def test_client_disconnect_aborts_the_request(server):
    """A stream closed after its first piece is aborted at the next block: it finishes with
    finish_reason "abort" long before its max_tokens, and nothing stays in flight."""
    aborted = server.metric('tabed_requests_total{finish_reason="abort"}')
    tokens = server.metric("tabed_completion_tokens_total")
    body = {"model": MODEL, "prompt": TEXT_PROMPT, "max_tokens": 230, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with httpx.Client(base_url=server.url, timeout=30) as c, c.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        next(line for line in r.iter_lines() if line.startswith("data: {"))
    deadline = time.monotonic() + 20
    while server.metric('tabed_requests_total{finish_reason="abort"}') == aborted:
        assert time.monotonic() < deadline, server.log()
        time.sleep(0.05)
    assert server.metric("tabed_completion_tokens_total") - tokens < 230
    assert server.metric("tabed_requests_running") == 0


def test_metrics_report_tokens_and_latency_histograms(server):
    text = server.http.get("/metrics").text
    for name in ("tabed_time_to_first_token_seconds", "tabed_inter_token_latency_seconds",
                 "tabed_accepted_length", "tabed_block_efficiency"):
        assert f"# TYPE {name} histogram" in text
        assert float(re.search(rf"^{name}_count (\S+)$", text, re.M).group(1)) > 0, name
        assert re.search(rf'^{name}_bucket{{le="\+Inf"}} ', text, re.M)
    assert server.metric("tabed_prompt_tokens_total") > 0 and server.metric("tabed_completion_tokens_total") > 0


def test_prefix_cache_hits_in_usage_and_metrics(server):
    """The same picture asked again: the second answer's usage reports the cached prompt tokens
    (OpenAI's prompt_tokens_details.cached_tokens, the image's run among them), the answer is
    the same, and /metrics counts the hit."""
    scene = examples("S2", 1, seed=23)[0].images[0]
    first = chat(server, _image_msg(data_url(scene), "what color is the sky ?"), 8)
    second = chat(server, _image_msg(data_url(scene), "what color is the sky ?"), 8)
    assert second.choices[0].message.content == first.choices[0].message.content
    cached = [r.usage.prompt_tokens_details.cached_tokens for r in (first, second)]
    assert cached[1] == second.usage.prompt_tokens - 1 > cached[0]    # all but the last prompt token
    assert server.metric("tabed_prompt_tokens_cached_total") >= cached[1]
    assert server.metric("tabed_prefix_cache_hits_total") >= 1
    assert 0 < server.metric("tabed_prefix_cache_hit_rate") < 1


def _round(server, jobs, refs, clients):
    """Every job (an index into refs) once, `clients` at a time; returns latencies (s)."""
    def one(i):
        ex, ref = refs[i]
        t0 = time.perf_counter()
        if i % 2:       # half of them streamed
            stream = chat(server, openai_messages(ex), 16, stream=True)
            text = "".join(ev.choices[0].delta.content or "" for ev in stream if ev.choices)
        else:
            text = chat(server, openai_messages(ex), 16).choices[0].message.content
        assert text == ref.text, (i, ex.prompt, text, ref.text)     # its own answer, not another's
        return time.perf_counter() - t0

    with ThreadPoolExecutor(clients) as pool:
        return list(pool.map(one, jobs))


@pytest.mark.slow
def test_concurrent_clients_each_get_their_own_answer(server, engine):
    """16 concurrent clients × 2 requests, two rounds, against a batch of at most 8: every
    answer equals its own prompt's in-process greedy answer, steps serve several requests at
    once, the server's memory does not grow from round to round."""
    exs = [ex for sc in ("S1", "S2", "S3", "S4", "S5") for ex in examples(sc, 7, seed=11)][:32]
    assert len({(ex.prompt, tuple(ex.captions)) for ex in exs}) == len(exs)     # distinct requests
    refs = [(ex, greedy(engine, ex, 16)) for ex in exs]
    assert len({ref.text for _, ref in refs}) > 16           # distinct answers: a mix-up would show
    done = server.metric("tabed_requests_total{finish_reason=\"stop\"}") + \
        server.metric("tabed_requests_total{finish_reason=\"length\"}")
    latencies, rss = [], []
    for _ in range(2):
        latencies += _round(server, list(range(len(refs))), refs, clients=16)
        rss.append(_rss_kib(server.proc.pid))
    q = statistics.quantiles(latencies, n=100)
    print(f"\n{len(latencies)} requests, 16 clients: latency p50 {q[49] * 1e3:.0f} ms, "
          f"p99 {q[98] * 1e3:.0f} ms; server RSS {rss[0] / 1024:.0f} -> {rss[1] / 1024:.0f} MiB")
    assert server.metric("tabed_requests_total{finish_reason=\"stop\"}") + \
        server.metric("tabed_requests_total{finish_reason=\"length\"}") - done == 2 * len(refs)
    assert rss[1] - rss[0] < 16 * 1024, rss
    steps = server.http.get("/metrics").text
    single = float(re.search(r'^tabed_step_requests_bucket{le="1"} (\S+)$', steps, re.M).group(1))
    assert server.metric("tabed_step_requests_count") > single, "no engine step served two requests at once"


def test_greedy_and_sampling_clients_at_once(server, engine):
    """Clients with different sampling settings at the same time (they share the engine's
    batch): each greedy answer equals its in-process greedy answer; sampled ones come back
    whole, to their length."""
    exs = examples("S3", 8, seed=5)
    refs = [greedy(engine, ex, 12) for ex in exs]
    settings = [dict(temperature=0), dict(temperature=0.8, seed=1), dict(temperature=0),
                dict(temperature=1.3, top_p=0.7, seed=2)]

    def one(i):
        kw = settings[i % len(settings)]
        extra = {} if kw["temperature"] == 0 else {"extra_body": {"ignore_eos": True}}
        r = server.openai.chat.completions.create(model=MODEL, messages=openai_messages(exs[i]), max_tokens=12,
                                                  **kw, **extra).choices[0]
        if kw["temperature"] == 0:
            assert r.message.content == refs[i].text, i
        else:
            assert r.finish_reason == "length" and r.message.content, i

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(one, range(len(exs))))
