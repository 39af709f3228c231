"""What the HTTP layer adds: the OpenAI server against the engine called directly (issue 40).

One in-process engine built like benchmarks/batch.py (LLaVA-1.5-7B shape, random weights).
For N in {1, 4, 16} concurrent streams (one image + 40 words each, greedy, 128 tokens, EOS
ignored), AR and SD (at tau = 2.31 for 5-draft chains: `e2e.geometric_schedule` through
`Engine.bench_accept_schedule`), each repeat runs:
* direct: N `add_request`s at once, `step()` until done, the times taken when `step()` returns
  text for a request (where the server's engine thread hands on what becomes a content chunk);
* HTTP: `tabed_engine.serving.server.OpenAIServer` on that engine under uvicorn on 127.0.0.1 (a thread
  of this process, as `serve` runs it), N streamed chat completions at once from an httpx
  client in a separate process (the image a data: URL), the times taken when each content
  chunk arrives; the tokens counted by the final usage chunk.
Per request: TTFT from submitting to the first output; ITL = (last - first output) / (tokens -
1), and gap ITL = median gap between outputs / mean tokens per gap (steady decode: a request's
decode stalled by later requests' prefills counts in ITL, not in gap ITL). The engine's own
stats (time_first_token is taken at the request's prefill, before the other prefills of that
step, so with N > 1 it inflates the direct ITL) are kept as *_stats. Throughput = all tokens /
(last output - first submission). The HTTP overhead ratio is HTTP / direct median ITL (goal:
<= 1.05 at N = 16).
With --data-parallel M (M > 1) a third side, http_dp: the same HTTP streams through
`tabed-engine serve --data-parallel M`'s front (`serving.data_parallel.ReplicaPool`: M replica
processes, one per GPU, each building this engine on its GPU, started once per mode), after the
other two; dp_throughput_ratio = http_dp / http tokens per second (goal: >= 1.9 at N = 16, M = 2).

    python benchmarks/serve.py --out DIR [--preset tiny] [--data-parallel 2]
"""
from __future__ import annotations

# stdlib only at the top: the client process (spawn) re-imports this file and should not pay for torch
import argparse
import asyncio
import base64
import contextlib
import io
import json
import multiprocessing
import os
import socket
import statistics
import sys
import threading
import time

STREAMS = (1, 4, 16)
TAU = 2.31
MODEL = "bench"
LATENCIES = ("itl_ms", "gap_itl_ms", "ttft_ms", "itl_ms_stats", "ttft_ms_stats")


# ---------------------------------------------------------------------------- the client process
async def _stream(client, body: bytes) -> dict:
    """One streamed chat completion: when it was sent and when each content chunk came."""
    t_send = time.perf_counter()
    times, pieces, usage, spec = [], [], None, None
    async with client.stream("POST", "/v1/chat/completions", content=body,
                             headers={"content-type": "application/json"}) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:500]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(event["error"]["message"])
            if event.get("usage"):
                usage, spec = event["usage"], event.get("speculation")
            for choice in event["choices"]:
                piece = choice["delta"].get("content")
                if piece:
                    times.append(time.perf_counter())
                    pieces.append(piece)
    if usage is None or not times:
        raise RuntimeError("the stream ended without content or without a usage chunk")
    return {"t_send": t_send, "times": times, "text": "".join(pieces), "tokens": usage["completion_tokens"],
            "accepted": (spec or {}).get("accepted_lengths", [])}


async def _streams(url: str, bodies: list) -> dict:
    import httpx

    limits = httpx.Limits(max_connections=len(bodies), max_keepalive_connections=len(bodies))
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(600.0), limits=limits) as client:
        t0 = time.perf_counter()
        reqs = await asyncio.gather(*(_stream(client, b) for b in bodies))
    return {"t0": t0, "requests": reqs}


def _client_worker(conn):
    """Runs jobs (url, request bodies) until None; a separate process so that the client's
    parsing does not hold the server process's GIL (which the engine thread and the server's
    event loop share, as under `tabed-engine serve`)."""
    while (job := conn.recv()) is not None:
        try:
            conn.send(asyncio.run(_streams(*job)))
        except Exception as e:      # handed back: the parent raises it
            conn.send({"error": f"{type(e).__name__}: {e}"})


# ---------------------------------------------------------------------------- the server
class _NoSpeculation:
    """The engine with `speculative=False` on every request (AR over HTTP: the server has no
    per-request switch); everything else passes through."""

    def __init__(self, engine):
        self._engine = engine

    def add_request(self, *args, **kwargs):
        return self._engine.add_request(*args, speculative=False, **kwargs)

    def __getattr__(self, name):
        return getattr(self._engine, name)


def _bench_replica(args, mode: str, index: int, device: str):
    """A data-parallel replica's engine (run in the replica's process): this benchmark's engine
    on `device`, the same seed as the in-process one, SD at TAU or AR on every request."""
    import torch
    from batch import BatchBench
    from e2e import geometric_schedule

    torch.manual_seed(0)
    bb = BatchBench(argparse.Namespace(preset=args.preset, device=device, max_len=args.max_len,
                                       max_batch=max(args.streams), out=args.out, batches=list(args.streams)))
    bb.setup()
    if mode == "sd":
        bb.eng.bench_accept_schedule = geometric_schedule(TAU, bb.p.gamma)
        return bb.eng
    return _NoSpeculation(bb.eng)


@contextlib.contextmanager
def served(engine, backend=None):
    """`engine` (or a `backend`: a ReplicaPool) behind the OpenAI server (uvicorn in a thread)
    on a free loopback port; yields the base URL. A fresh server each time: its engine thread
    is joined on exit, so the caller may step the engine itself afterwards (a pool's replicas
    are stopped on exit)."""
    import uvicorn

    from tabed_engine.serving.server import OpenAIServer

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(OpenAIServer(engine, MODEL, backend=backend).app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="uvicorn", daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError("the server did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(60)
        sock.close()


# ---------------------------------------------------------------------------- the benchmark
def _stats(xs) -> dict:
    from batch import pct

    return {"median": statistics.median(xs), "p99": pct(xs, 99)} if xs else None


def _latencies(t_submit: float, times: list, tokens: int) -> dict:
    """One request's latencies from when it was submitted, when each of its outputs carrying
    tokens arrived (a step's tokens, or an SSE chunk) and how many tokens it got in all.
    itl: (last - first output) / (tokens - 1), admission stalls included; gap_itl: the median
    gap between outputs / the mean tokens per gap (steady decode, admission stalls excluded)."""
    gaps = [b - a for a, b in zip(times, times[1:])]
    return {"ttft_ms": (times[0] - t_submit) * 1e3, "itl_ms": (times[-1] - times[0]) / (tokens - 1) * 1e3,
            "gap_itl_ms": statistics.median(gaps) * len(gaps) / (tokens - 1) * 1e3 if gaps else None,
            "chunks": len(times)}


def _tau(accepted: list) -> float | None:
    return sum(accepted) / len(accepted) + 1 if accepted else None


class ServeBench:
    def __init__(self, args):
        from batch import BatchBench     # imported here: see the note at the imports

        self.args = args
        self.bb = BatchBench(argparse.Namespace(preset=args.preset, device=args.device, max_len=args.max_len,
                                                max_batch=max(args.streams), out=args.out,
                                                batches=list(args.streams)))
        self.p = self.bb.p
        self.n_new = args.new_tokens or self.p.new_tokens
        self.R = {"provenance": self.bb.R["provenance"], "preset": args.preset, "command": " ".join(sys.argv)}

    def save(self):
        os.makedirs(self.args.out, exist_ok=True)
        with open(os.path.join(self.args.out, f"serve_{self.args.preset}.json"), "w") as f:
            json.dump(self.R, f, indent=1, default=str)

    def setup(self) -> dict:
        import starlette
        import uvicorn

        info = self.bb.setup()
        self.eng = self.bb.eng
        png = io.BytesIO()
        self.bb.image.save(png, format="PNG")
        self.image_url = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
        self.texts = [self.bb.words(1000 + i, self.p.text_tokens - 1, self.p.target["vocab_size"])
                      for i in range(max(self.args.streams))]
        # what uvicorn's "auto" picks for the HTTP parser and the event loop
        info["server"] = {"uvicorn": uvicorn.__version__, "starlette": starlette.__version__,
                          "http": "httptools" if _importable("httptools") else "h11",
                          "loop": "uvloop" if _importable("uvloop") else "asyncio",
                          "image_data_url_bytes": len(self.image_url)}
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.client = ctx.Process(target=_client_worker, args=(child,), name="http-client", daemon=True)
        self.client.start()
        return info

    def messages(self, i: int) -> list:
        return [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": self.texts[i]}]}]

    def body(self, i: int, n_new: int) -> bytes:
        return json.dumps({
            "model": MODEL, "max_tokens": n_new, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True,
            "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": self.image_url}},
                                                      {"type": "text", "text": self.texts[i]}]}]}).encode()

    def direct(self, n: int, n_new: int, speculative: bool) -> dict:
        """N requests added at once, stepped until done; times taken when step() returns text
        for a request (what the server streams as a content chunk: a token whose text is held
        back, e.g. part of a UTF-8 character, sends none)."""
        from tabed_engine import SamplingParams

        eng, sp = self.eng, SamplingParams(max_new_tokens=n_new, stop_at_eos=False)
        sent, times, outs = {}, {}, {}
        t0 = time.perf_counter()
        for i in range(n):
            t = time.perf_counter()
            rid = eng.add_request(self.messages(i), images=[self.bb.image], sampling=sp, speculative=speculative)
            sent[rid], times[rid] = t, []
        while eng.has_unfinished():
            step = eng.step()       # ends with the new tokens on the host: no device sync needed
            now = time.perf_counter()
            for o in step:
                if o.new_text:
                    times[o.request_id].append(now)
                if o.finished:
                    outs[o.request_id] = o.output
        reqs = []
        for rid, t in sent.items():
            o = outs[rid]
            if o.error or len(o.token_ids) != n_new:
                raise RuntimeError(f"direct request {rid}: {len(o.token_ids)} tokens, error {o.error}")
            st = o.stats
            reqs.append({**_latencies(t, times[rid], n_new), "text": o.text, "accepted": list(st.accepted_lengths),
                         "itl_ms_stats": (st.time_total - st.time_first_token) / (n_new - 1) * 1e3,
                         "ttft_ms_stats": st.time_first_token * 1e3})
        wall = max(t[-1] for t in times.values()) - t0
        return {"tokens_per_s": n * n_new / wall, "requests": reqs}

    def http(self, url: str, n: int, n_new: int) -> dict:
        self.conn.send((url, [self.body(i, n_new) for i in range(n)]))
        res = self.conn.recv()
        if "error" in res:
            raise RuntimeError(f"HTTP client: {res['error']}")
        reqs = []
        for r in res["requests"]:
            if r["tokens"] != n_new:
                raise RuntimeError(f"HTTP request: {r['tokens']} tokens, expected {n_new}")
            reqs.append({**_latencies(r["t_send"], r["times"], r["tokens"]), "text": r["text"],
                         "accepted": r["accepted"]})
        wall = max(r["times"][-1] for r in res["requests"]) - res["t0"]
        return {"tokens_per_s": n * n_new / wall, "requests": reqs}

    @contextlib.contextmanager
    def replicas(self, mode: str):
        """With --data-parallel M > 1: M replica processes (one per GPU) behind a front of
        their own for this mode; yields its URL (None without)."""
        if self.args.data_parallel == 1:
            yield None
            return
        import functools

        from e2e_common import log
        from tabed_engine.serving.data_parallel import ReplicaPool
        from tabed_engine.serving.replica import plan_replicas

        plans = plan_replicas(self.args.data_parallel, self.bb.dev.type)   # replica i on GPU i
        pool = ReplicaPool(functools.partial(_bench_replica, self.args, mode), plans)
        try:
            self.R.setdefault("replicas", {})[mode] = pool.start_processes(say=lambda s: log(s.rstrip()))
            with served(None, backend=pool) as url:
                yield url
        finally:
            pool.close()

    def one(self, n: int, mode: str, dp_url: str | None = None) -> dict:
        """Direct and HTTP runs of N streams, interleaved over the repeats (after a warm-up of
        each); then, with `dp_url`, the data-parallel front's runs."""
        from e2e import geometric_schedule

        spec = mode == "sd"
        self.eng.bench_accept_schedule = geometric_schedule(TAU, self.p.gamma) if spec else None
        engine = self.eng if spec else _NoSpeculation(self.eng)
        self.direct(n, 16, spec)                                # warm-up: graphs for this batch size
        runs = {"direct": [], "http": []}
        for rep in range(self.args.repeats):
            runs["direct"].append(self.direct(n, self.n_new, spec))
            with served(engine) as url:
                if rep == 0:
                    self.http(url, n, 16)                       # warm-up
                runs["http"].append(self.http(url, n, self.n_new))
        self.eng.bench_accept_schedule = None
        if dp_url is not None:
            self.http(dp_url, n, 16)                            # warm-up
            runs["http_dp"] = [self.http(dp_url, n, self.n_new) for _ in range(self.args.repeats)]
        row = {}
        for side, rs in runs.items():
            reqs = [q for r in rs for q in r["requests"]]
            row[side] = {k: _stats([q[k] for q in reqs]) for k in LATENCIES if k in reqs[0]}
            row[side].update(tokens_per_s=statistics.median(r["tokens_per_s"] for r in rs),
                             tokens_per_s_runs=[r["tokens_per_s"] for r in rs],
                             tokens_per_output=statistics.mean((self.n_new - 1) / (q["chunks"] - 1) for q in reqs),
                             tau_measured=_tau([a for q in reqs for a in q["accepted"]]),
                             itl_ms_all=[q["itl_ms"] for q in reqs])
        d, h = row["direct"], row["http"]
        row["itl_overhead_ratio"] = h["itl_ms"]["median"] / d["itl_ms"]["median"]
        row["itl_overhead_ratio_p99"] = h["itl_ms"]["p99"] / d["itl_ms"]["p99"]
        row["gap_itl_overhead_ratio"] = h["gap_itl_ms"]["median"] / d["gap_itl_ms"]["median"]
        row["ttft_added_ms_median"] = h["ttft_ms"]["median"] - d["ttft_ms"]["median"]
        row["throughput_ratio"] = h["tokens_per_s"] / d["tokens_per_s"]
        if dp_url is not None:
            row["dp_throughput_ratio"] = row["http_dp"]["tokens_per_s"] / h["tokens_per_s"]
        # same prompts, greedy: a differing text means the batch's numerics differed (requests
        # arrive over HTTP at slightly different steps), not necessarily a bug
        row["texts_equal_direct"] = sum(a["text"] == b["text"] for r, s in zip(runs["direct"], runs["http"])
                                        for a, b in zip(r["requests"], s["requests"]))
        row["requests_per_side"] = len(reqs)
        return row

    def run(self):
        from e2e_common import log

        t0 = time.perf_counter()
        self.R["setup"] = self.setup()
        self.R.update(streams=list(self.args.streams), new_tokens=self.n_new, repeats=self.args.repeats, tau_sd=TAU,
                      method=__doc__.split("\n\n")[1])
        self.R["results"] = res = {"ar": {}, "sd": {}}
        try:
            for mode in ("ar", "sd"):
                with self.replicas(mode) as dp_url:
                    for n in self.args.streams:
                        res[mode][f"N={n}"] = row = self.one(n, mode, dp_url)
                        log(f"{mode} N={n}: ITL direct {row['direct']['itl_ms']['median']:.3f} ms, HTTP "
                            f"{row['http']['itl_ms']['median']:.3f} ms (x{row['itl_overhead_ratio']:.3f})"
                            + (f"; DP={self.args.data_parallel} x{row['dp_throughput_ratio']:.2f} tok/s"
                               if dp_url else ""))
                        self.save()
        finally:
            with contextlib.suppress(OSError):     # the client may be gone already
                self.conn.send(None)
            self.client.join(10)
        top = f"N={max(self.args.streams)}"
        self.R["goal_itl_overhead_le_1.05"] = {m: res[m][top]["itl_overhead_ratio"] <= 1.05 for m in res}
        if self.args.data_parallel > 1:
            self.R["goal_dp_throughput_ge_1.9"] = {m: res[m][top]["dp_throughput_ratio"] >= 1.9 for m in res}
        self.R["total_s"] = time.perf_counter() - t0
        self.save()
        self.table()

    def table(self):
        print(f"{self.R['provenance']['device']}, preset {self.args.preset}, {self.n_new} tokens, "
              f"{self.args.repeats} repeats; ms, median [p99]; ratio = HTTP / direct (gap: gap ITL)")
        print(f"{'':9}{'ITL direct':>17}{'ITL HTTP':>17}{'ratio':>7}{'gap':>7}{'TTFT direct':>13}{'TTFT HTTP':>11}"
              f"{'tok/s direct':>14}{'tok/s HTTP':>12}")
        for mode, rows in self.R["results"].items():
            for key, r in rows.items():
                d, h = r["direct"], r["http"]
                print(f"{mode + ' ' + key:9}{_cell(d['itl_ms']):>17}{_cell(h['itl_ms']):>17}"
                      f"{r['itl_overhead_ratio']:>7.3f}{r['gap_itl_overhead_ratio']:>7.3f}"
                      f"{d['ttft_ms']['median']:>13.2f}{h['ttft_ms']['median']:>11.2f}"
                      f"{d['tokens_per_s']:>14.0f}{h['tokens_per_s']:>12.0f}")
        print(f"goal ITL HTTP/direct <= 1.05 at N={max(self.args.streams)}: {self.R['goal_itl_overhead_le_1.05']}")
        if self.args.data_parallel > 1:
            m = self.args.data_parallel
            for mode, rows in self.R["results"].items():
                print(f"{mode} DP={m}: " + ", ".join(f"{key} {r['http_dp']['tokens_per_s']:.0f} tok/s "
                                                      f"(x{r['dp_throughput_ratio']:.2f} one engine)"
                                                      for key, r in rows.items()))
            print(f"goal DP={m} / one engine >= 1.9 at N={max(self.args.streams)}: "
                  f"{self.R['goal_dp_throughput_ge_1.9']}")


def _cell(s: dict) -> str:
    return f"{s['median']:.3f} [{s['p99']:.3f}]"


def _importable(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def main(argv=None):
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from e2e import PRESETS

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="llava-1.5-7b")
    ap.add_argument("--out", default=os.path.join("benchmarks", "results"))
    ap.add_argument("--device", default=None)
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--streams", type=int, nargs="+", default=list(STREAMS))
    ap.add_argument("--new-tokens", type=int, default=None, help="default: the preset's (128; tiny 32)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--data-parallel", type=int, default=1, metavar="M",
                    help="also measure the HTTP streams through M replica processes (one per GPU) behind one "
                         "front (default 1: not)")
    args = ap.parse_args(argv)
    if args.repeats < 1 or min(args.streams) < 1 or args.data_parallel < 1:
        ap.error("--repeats, --streams and --data-parallel must be >= 1")
    from tabed_engine.parallel.comm import nvls_off

    nvls_off()      # machine rule: NVLink multicast off in this process and every one it starts
    import torch

    torch.manual_seed(0)
    ServeBench(args).run()


if __name__ == "__main__":
    main()
