"""Many requests at once (continuous batching), LLaVA-1.5-7B shape with random weights.

Sections:
* `fixed`: for B in {1, 4, 16, 64} requests admitted together (one image + 40 words each,
  128 new tokens): throughput (generated tokens / decode wall time, prefills excluded) and
  per-request ms/token, for AR and for SD at fixed acceptance rates: each draft accepted with
  the probability alpha that gives tau in {1, 2.31, 4} tokens per block to chains of gamma = 5
  (`e2e.geometric_schedule` through `Engine.bench_accept_schedule`; a shorter chain gets what
  it would really get at that rate), with the cost model on (the default: AR or a chain of
  1..gamma per block; the kinds it chose are recorded) and off (every block a gamma-chain).
  The floor per step is (target weight bytes + the batch's KV bytes at the mean context) /
  copy bandwidth measured in the same run.
* `mixed`: requests of different prompt lengths and answer lengths arriving over time (a
  Poisson process, 10 and 40 arrivals/s) on a warmed-up engine (`Engine.warmup`: every
  bucket's graphs): throughput, p50 / p99 time to first token (from arrival) and inter-token
  latency, the share of the run spent in prefills, AR against SD at tau = 2.31 (the geometric
  schedule).
* `sampling`: B in {4, 16}, one sampling setting for every request against greedy requests
  and three sampling settings mixed in the batch (per-row target processing), AR and SD.
* `concurrency` (`--concurrency N`): N requests of `--concurrency-prompt` tokens (one image +
  words) and `--concurrency-new` new tokens added at once; the most that run at once (the paged
  KV pool's admissions: `--kv-cache-tokens`, default max-batch x max-len, an unpaged cache's
  memory) against kv_cache_tokens / max_len (what an unpaged cache of that memory held), then
  the rest are aborted. E.g. `--max-len 4096 --max-batch 256 --kv-cache-tokens 196608
  --concurrency 256` (48 rows of 4096: the 7B target's unpaged cache at 48 requests).

    python benchmarks/batch.py --out DIR [--preset tiny]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import copy_bandwidth_gbs, provenance  # noqa: E402
from e2e import PRESETS, geometric_schedule  # noqa: E402
from e2e_common import build_llava_pair, lm_weight_bytes, log  # noqa: E402

BATCHES = (1, 4, 16, 64)
TAUS = (1.0, 2.31, 4.0)


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))] if xs else None


class BatchBench:
    def __init__(self, args):
        self.args = args
        self.p = dataclasses.replace(PRESETS[args.preset])
        self.dev = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.dt = torch.bfloat16 if self.dev.type == "cuda" else torch.float32
        self.R = {"provenance": provenance(self.dev), "preset": args.preset, "command": " ".join(sys.argv)}
        self.batches = tuple(b for b in args.batches if b <= args.max_batch)

    def save(self):
        os.makedirs(self.args.out, exist_ok=True)
        with open(os.path.join(self.args.out, f"batch_{self.args.preset}.json"), "w") as f:
            json.dump(self.R, f, indent=1, default=str)

    def setup(self):
        from tabed_engine import Engine
        from tabed_engine.models.tiny import random_image, words

        p, dev, dt = self.p, self.dev, self.dt
        self.processor, _, self.target, self.draft = build_llava_pair(p, dev, dt)
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        self.eng = Engine(self.target, self.processor, draft=self.draft, device=dev, dtype=dt, views=("M", "T"),
                          gamma=p.gamma, max_len=self.args.max_len, max_batch=self.args.max_batch,
                          kv_cache_tokens=self.args.kv_cache_tokens,
                          prefix_cache=False)   # the arrivals repeat one prompt: prefills measured cold
        self.default_chunk = self.eng.prefill_chunk
        if self.args.prefill_chunks is None:
            self.args.prefill_chunks = [self.default_chunk or 0]
        self.words, self.image = words, random_image(0, p.vision["image_size"])
        gbs = copy_bandwidth_gbs(dev, p.copy_bytes, reps=10) if dev.type == "cuda" else None
        cfg = self.target.lm.cfg
        self.kv_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * dt.itemsize
        self.wbytes = lm_weight_bytes(self.target)
        self.gbs = gbs
        return {"copy_GBs": gbs, "target_lm_weight_bytes": self.wbytes, "kv_bytes_per_token": self.kv_per_token,
                "max_batch": self.eng.runner.max_batch, "max_len": self.eng.max_len, "gamma": p.gamma,
                "kv_cache_tokens": self.eng.kv_cache_tokens,
                "views": list(self.eng.views), "policy": self.eng.ensemble.policy, "adaptive": self.eng.adaptive}

    def prompt(self, i: int, n_words: int):
        return "<image>\n " + self.words(1000 + i, n_words, self.p.target["vocab_size"])

    def run_batch(self, B: int, n_new: int, speculative: bool, sampling=None, trace: bool = False) -> dict:
        """B requests added at once; decode wall time from the step after the last admission.
        `sampling`: a list of SamplingParams fields (dicts) the requests take in turn (default
        greedy). `trace`: also each decode step's kind ("ar", "chainG", "admit") and host
        interval in ms (where the cost model's probes and switches spend their time)."""
        from tabed_engine import SamplingParams

        eng = self.eng
        kinds = sampling or [{}]
        sps = [SamplingParams(max_new_tokens=n_new, stop_at_eos=False, **kinds[i % len(kinds)]) for i in range(B)]
        ids = [eng.add_request(self.prompt(i, self.p.text_tokens - 1), images=[self.image], sampling=sps[i],
                               speculative=speculative) for i in range(B)]
        outs, t_dec, steps = {}, None, []
        while eng.has_unfinished():
            admitting = bool(eng.scheduler.waiting)
            before, t_step = dict(eng.scheduler.kinds), time.perf_counter()
            for o in eng.step():
                if o.finished:
                    outs[o.request_id] = o.output
            if trace and t_dec is not None:
                ran = [g for g, n in eng.scheduler.kinds.items() if n > before.get(g, 0)]
                steps.append([",".join("ar" if g == 0 else f"chain{g}" for g in ran) or "admit",
                              round((time.perf_counter() - t_step) * 1e3, 3)])
            if admitting and not eng.scheduler.waiting and t_dec is None:
                if self.dev.type == "cuda":
                    torch.cuda.synchronize()
                t_dec = time.perf_counter()
        if self.dev.type == "cuda":
            torch.cuda.synchronize()
        wall = time.perf_counter() - t_dec
        outs = [outs[i] for i in ids]
        n_tok = sum(len(o.token_ids) - 1 for o in outs)
        itl = [(o.stats.time_total - o.stats.time_first_token) / (len(o.token_ids) - 1) * 1e3 for o in outs]
        blocks = sum(o.stats.target_forwards for o in outs) / B
        kinds, eng.scheduler.kinds = dict(sorted(eng.scheduler.kinds.items())), type(eng.scheduler.kinds)()
        acc = [a for o in outs for a in o.stats.accepted_lengths]
        return {"B": B, "prompt_tokens": outs[0].stats.prompt_tokens, "tokens_per_s": n_tok / wall, "decode_wall_s": wall,
                "ms_per_token_per_request": wall / (n_tok / B) * 1e3,
                "itl_ms_median": pct(itl, 50), "target_forwards_per_request": blocks,
                "speculative_blocks_per_request": len(acc) / B,
                "tau_measured": (sum(acc) / len(acc) + 1) if acc else None,
                "blocks_by_kind": {("ar" if g == 0 else f"chain{g}"): n for g, n in kinds.items()},
                **({"steps": steps} if trace else {})}

    def concurrency(self, speculative: bool) -> dict:
        """N requests at once: how many the page pool admits together (see the module docstring)."""
        from tabed_engine import SamplingParams

        eng, a = self.eng, self.args
        base = len(eng._request(self.prompt(0, 1), [self.image], None, None, False).prep.ids) - 1
        n_words = max(1, a.concurrency_prompt - base)
        sp = SamplingParams(max_new_tokens=a.concurrency_new, stop_at_eos=False)
        ids = [eng.add_request(self.prompt(i, n_words), images=[self.image], sampling=sp, speculative=speculative)
               for i in range(a.concurrency)]
        peak, steps, t0 = 0, 0, time.perf_counter()
        while eng.scheduler.waiting and steps < 4 * a.concurrency:
            eng.step()
            steps += 1
            peak = max(peak, sum(r is not None for r in eng.scheduler.slots))
        waited = len(eng.scheduler.waiting)
        for rid in ids:
            eng.abort(rid)
        while eng.has_unfinished():
            eng.step()
        return {"speculative": speculative, "requests": a.concurrency, "prompt_tokens": base + n_words,
                "max_new_tokens": a.concurrency_new, "peak_running": peak, "waiting_at_peak": waited,
                "unpaged_rows_same_memory": eng.kv_cache_tokens // eng.max_len,
                "gain_vs_unpaged": peak / max(1, eng.kv_cache_tokens // eng.max_len),
                "admission_wall_s": time.perf_counter() - t0}

    def fixed(self) -> dict:
        eng, n_new = self.eng, self.p.new_tokens
        out = {}
        self.R["warmup_s"] = eng.warmup()         # every bucket and kind of block captured
        for B in self.batches:
            eng.bench_accept_schedule = None
            self.run_batch(B, 8, False)                                   # warm-up: capture graphs
            ar = self.run_batch(B, n_new, False)
            ctx = ar["prompt_tokens"] + n_new / 2
            floor = (self.wbytes + B * ctx * self.kv_per_token) / (self.gbs * 1e9) * 1e3 if self.gbs else None
            row = {"floor_ms_per_step": floor, "ar": ar}
            ar_tps = ar["tokens_per_s"]
            if floor:
                ar["ratio_to_floor"] = ar["ms_per_token_per_request"] / floor
            for tau in self.args.taus:
                for adaptive in (True, False):
                    eng.configure(adaptive=adaptive)
                    eng.bench_accept_schedule = geometric_schedule(tau, self.p.gamma)
                    # warm-up: graphs, and at tau 1 the cost model's probes (draft catch-up kernels)
                    self.run_batch(B, n_new if tau == 1.0 else 16, True)
                    r = self.run_batch(B, n_new, True, trace=tau == 1.0 and adaptive)
                    r["speedup_vs_ar"] = r["tokens_per_s"] / ar_tps
                    row[f"sd_tau{tau}" + ("" if adaptive else "_always")] = r
                    log(f"B={B} tau={tau} adaptive={adaptive}: {r['tokens_per_s']:.0f} tok/s "
                        f"({r['speedup_vs_ar']:.2f}x AR)")
            eng.configure(adaptive=None)
            eng.bench_accept_schedule = None
            # the cost model's block times at this bucket (kind 0 = AR, g = a chain of g), ms
            row["cost_model_block_ms"] = {g: t * 1e3 for (g, b), t in sorted(eng.scheduler.cost.times.items())
                                          if b == B}
            out[f"B={B}"] = row
            self.R["fixed"] = out
            self.save()
        return out

    def mixed(self) -> dict:
        """Poisson arrivals of requests with different prompt and answer lengths, at each rate and
        prefill budget (`Engine.prefill_chunk`; 0: each prompt prefills whole)."""
        warm = self.eng.warmup()         # every bucket's graphs captured before the arrivals start
        out = {}
        for chunk in self.args.prefill_chunks:
            self.eng.prefill_chunk = chunk or None
            for mixed in self.args.mixed_steps:
                self.eng.mixed_steps = bool(mixed)
                for rate in self.args.rates:
                    key = f"rate={rate:g},chunk={chunk}" + (",mixed_steps" if mixed else "")
                    out[key] = self.arrivals(rate, chunk)
                    self.R["mixed"] = out
                    self.save()
        self.eng.prefill_chunk = self.default_chunk
        self.eng.mixed_steps = False
        out["warmup_s"] = warm
        return out

    def arrivals(self, rate: float, chunk: int) -> dict:
        """One arrival run per mode (AR, SD at tau 2.31). Latencies as the serving benchmarks
        report them: TTFT from arrival; TPOT a request's mean time per output token after its
        first; ITL the gaps between successive deliveries of new tokens to one request (a
        speculative block delivers several tokens at once: one gap); each engine step's wall
        time, whose median is the bound's yardstick (ITL p99 <= 2x the median step). With graphs,
        a pass of the same arrivals runs first, unmeasured (the graphs it captures)."""
        eng, args = self.eng, self.args
        rng = random.Random(0)
        reqs, t = [], 0.0
        for i in range(args.mixed_requests):
            t += rng.expovariate(rate)
            reqs.append((t, self.prompt(i, rng.randint(8, 120)), rng.choice((16, 32, 64, 128, 256))))
        out = {}
        graphs = eng.runner.graphs
        for mode, tau in (("ar", None), ("sd", 2.31)):
            eng.bench_accept_schedule = geometric_schedule(tau, self.p.gamma) if tau else None
            if graphs is not None:
                # graphs warmup() does not capture (a mixed step's per (block, batch bucket, chunk
                # bucket), a chain length the cost model picks first here) are captured on first
                # use: a pass of the same arrivals first, not measured, for every mode alike
                self.arrival_pass(reqs, mode)
            n_graphs = 0 if graphs is None else len(graphs)
            mixed0 = eng.scheduler.mixed_steps
            done, gaps, steps, wall = self.arrival_pass(reqs, mode)
            outs = list(done.values())
            ttft = [o.stats.time_first_token * 1e3 for o in outs]
            # TTFT = the wait before the request's prefill began (a slot, pages, earlier prompts'
            # turns) + its prefill (all its chunks, and the steps between them)
            prefill = [o.stats.time_prefill * 1e3 for o in outs]
            queued = [t - p for t, p in zip(ttft, prefill)]
            tpot = [(o.stats.time_total - o.stats.time_first_token) / (len(o.token_ids) - 1) * 1e3
                    for o in outs if len(o.token_ids) > 1]
            itl = [g * 1e3 for g in gaps]
            step_p50 = pct([s * 1e3 for s in steps], 50)
            out[mode] = {"requests": len(outs), "wall_s": wall, "prefill_chunk": chunk,
                         "mixed_steps": eng.mixed_steps, "mixed_steps_run": eng.scheduler.mixed_steps - mixed0,
                         "tokens_per_s": sum(len(o.token_ids) for o in outs) / wall,
                         "requests_per_s": len(outs) / wall,
                         # the share of the run spent in prefills (the batch's decode waits meanwhile)
                         "prefill_share": sum(o.stats.time_prefill for o in outs) / wall,
                         "ttft_ms_p50": pct(ttft, 50), "ttft_ms_p99": pct(ttft, 99),
                         "queued_ms_p50": pct(queued, 50), "queued_ms_p99": pct(queued, 99),
                         "prefill_ms_p50": pct(prefill, 50), "prefill_ms_p99": pct(prefill, 99),
                         "tpot_ms_p50": pct(tpot, 50), "tpot_ms_p99": pct(tpot, 99),
                         # the per-request mean ITL of earlier results files is tpot here
                         "itl_ms_p50": pct(itl, 50), "itl_ms_p99": pct(itl, 99),
                         "step_ms_p50": step_p50, "step_ms_p99": pct([s * 1e3 for s in steps], 99),
                         "steps": len(steps),
                         # graphs captured during the measured pass (each stalls a step)
                         "graphs_captured": 0 if graphs is None else len(graphs) - n_graphs,
                         "itl_p99_over_step_p50": pct(itl, 99) / step_p50 if itl and step_p50 else None}
            log(f"mixed {rate:g}/s chunk {chunk} {mode}: {out[mode]}")
        eng.bench_accept_schedule = None
        return out

    def arrival_pass(self, reqs: list, mode: str) -> tuple:
        """Serve the arrivals reqs [(time s, prompt, new tokens)] in `mode` ("ar" / "sd"), each
        added when its time has come: (outputs by request id, the gaps between one request's
        deliveries, each step's wall time, the pass's wall time), in seconds."""
        from tabed_engine import SamplingParams

        eng = self.eng
        pending, done, last, gaps, steps = list(reqs), {}, {}, [], []
        t0 = time.perf_counter()
        while pending or eng.has_unfinished():
            now = time.perf_counter() - t0
            while pending and pending[0][0] <= now:
                _, prompt, n = pending.pop(0)
                eng.add_request(prompt, images=[self.image], speculative=mode == "sd",
                                sampling=SamplingParams(max_new_tokens=n, stop_at_eos=False))
            if not eng.has_unfinished():
                time.sleep(min(0.001, max(0.0, pending[0][0] - now)))
                continue
            t_step = time.perf_counter()
            outs = eng.step()
            t_end = time.perf_counter()
            steps.append(t_end - t_step)
            for o in outs:
                if o.new_token_ids:
                    if o.request_id in last:
                        gaps.append(t_end - last[o.request_id])
                    last[o.request_id] = t_end
                if o.finished:
                    done[o.request_id] = o.output
        return done, gaps, steps, time.perf_counter() - t0

    def sampling(self) -> dict:
        """What per-row sampling settings cost: a batch of one sampling setting against one
        mixing greedy requests and three sampling settings (the target's distribution then
        processed per row), AR and SD at tau 2.31 (cost model off: gamma-chains)."""
        eng, n_new, out = self.eng, self.p.new_tokens, {}
        same = [dict(temperature=0.8, seed=1)]
        mixed = [dict(temperature=0.8, seed=1), {}, dict(temperature=1.0, top_p=0.9, seed=2),
                 dict(temperature=0.6, top_k=20, seed=3)]
        eng.configure(adaptive=False)
        for B in [b for b in (4, 16) if b in self.batches]:
            row = {}
            for name, kinds in (("one_setting", same), ("mixed_settings", mixed)):
                for spec in (False, True):
                    eng.bench_accept_schedule = geometric_schedule(2.31, self.p.gamma) if spec else None
                    self.run_batch(B, 16, spec, kinds)                          # warm-up: graphs
                    row[f"{name}_{'sd' if spec else 'ar'}"] = r = self.run_batch(B, n_new, spec, kinds)
                    log(f"sampling B={B} {name} {'sd' if spec else 'ar'}: {r['tokens_per_s']:.0f} tok/s")
            for mode in ("ar", "sd"):
                row[f"{mode}_mixed_vs_one"] = row[f"mixed_settings_{mode}"]["tokens_per_s"] / \
                    row[f"one_setting_{mode}"]["tokens_per_s"]
            out[f"B={B}"] = row
        eng.configure(adaptive=None)
        eng.bench_accept_schedule = None
        return out

    def run(self):
        t0 = time.perf_counter()
        self.R["setup"] = self.setup()
        self.save()
        if self.args.concurrency:
            self.R["concurrency"] = [self.concurrency(sd) for sd in (False, True)]
            self.save()
            if self.args.concurrency_only:
                return
        if self.args.fixed:
            self.R["fixed"] = self.fixed()
            self.save()
        if self.args.sampling:
            self.R["sampling"] = self.sampling()
            self.save()
        if self.args.mixed_requests:
            self.R["mixed"] = self.mixed()
        self.R["total_s"] = time.perf_counter() - t0
        self.save()
        log(f"done in {self.R['total_s']:.0f} s")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="llava-1.5-7b")
    ap.add_argument("--out", default=os.path.join("benchmarks", "results"))
    ap.add_argument("--device", default=None)
    ap.add_argument("--max-batch", type=int, default=64)
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--mixed-requests", type=int, default=96)
    ap.add_argument("--taus", type=float, nargs="+", default=list(TAUS))
    ap.add_argument("--batches", type=int, nargs="+", default=list(BATCHES))
    ap.add_argument("--rates", type=float, nargs="+", default=[10.0, 40.0],
                    help="mixed runs: arrivals per second (40/s of 616-token prompts keeps an H200 busy "
                         "with prefills most of the time)")
    ap.add_argument("--sampling", type=int, default=1, help="0: skip the per-row sampling section")
    ap.add_argument("--fixed", type=int, default=1, help="0: skip the fixed-batch section")
    ap.add_argument("--prefill-chunks", type=int, nargs="+", default=None,
                    help="mixed runs: prefill budgets (Engine.prefill_chunk; 0 = whole prompts; "
                         "default: the engine's default)")
    ap.add_argument("--mixed-steps", type=int, nargs="+", default=[0], choices=(0, 1),
                    help="mixed runs: Engine.mixed_steps off (0) / on (1), each side by side at every "
                         "budget and rate (e.g. 0 1)")
    ap.add_argument("--kv-cache-tokens", type=int, default=None,
                    help="the KV page pool in target tokens (default: max-batch x max-len, cut to what fits)")
    ap.add_argument("--concurrency", type=int, default=0, help="requests of the concurrency section (0: skip it)")
    ap.add_argument("--concurrency-prompt", type=int, default=800, help="their prompt tokens (one image + words)")
    ap.add_argument("--concurrency-new", type=int, default=128, help="their max_new_tokens")
    ap.add_argument("--concurrency-only", action="store_true", help="only the setup and the concurrency section")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    BatchBench(args).run()


if __name__ == "__main__":
    main()
