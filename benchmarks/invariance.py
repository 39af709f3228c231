"""Bitwise invariance in bf16: today's decode path against `Engine(..., invariant=True)`,
LLaVA-1.5-7B shape with random weights (the draft: the preset's 68M shape, its own random
weights, so nearly every draft is rejected and every block still verifies gamma + 1 rows).

For each path, N greedy requests of T new tokens (one image + words each):
* equality: each request alone AR and alone SD (chains of gamma, every block speculative), and
  all N batched at B = 16 and B = 64 (AR and SD, continuous batching: requests join as others
  leave); the share of requests whose tokens equal the alone-AR tokens, and where the first
  differing token sits;
* TTFT: median time to first token of 8 alone AR requests (cold prefills, prefix cache off);
* speed (timed first, every path side by side, before the equality runs): AR ms/token at B = 1 and B = 64, SD at a fixed tau (the geometric acceptance
  schedule of benchmarks/e2e.py, NOT lossless: timing only) at B = 1 and B = 64, with the
  copy-bandwidth floor of the target's weights measured in the same run.

    python benchmarks/invariance.py --out DIR [--requests 64 --new-tokens 64]
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import copy_bandwidth_gbs, provenance  # noqa: E402
from e2e import PRESETS, geometric_schedule  # noqa: E402
from e2e_common import build_llava_pair, lm_weight_bytes, log  # noqa: E402


def first_diff(a, b):
    """Index of the first differing token of two sequences (None when equal)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


class InvarianceBench:
    def __init__(self, args):
        self.args = args
        self.p = dataclasses.replace(PRESETS[args.preset])
        self.dev = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.dt = torch.bfloat16 if self.dev.type == "cuda" else torch.float32
        self.R = {"provenance": provenance(self.dev), "preset": args.preset, "command": " ".join(sys.argv),
                  "requests": args.requests, "new_tokens": args.new_tokens, "gamma": args.gamma, "paths": {}}

    def setup(self):
        from tabed_engine.models.tiny import random_image, words

        p, dev, dt = self.p, self.dev, self.dt
        vocab = p.target["vocab_size"]
        self.processor, _, self.target, self.draft = build_llava_pair(p, dev, dt)
        self.image = random_image(0, p.vision["image_size"])
        # prompts of different lengths: 20 to 59 words after the image
        self.prompts = ["<image>\n " + words(2000 + i, 20 + (7 * i) % 40, vocab) for i in range(self.args.requests)]
        self.R["copy_GBs"] = copy_bandwidth_gbs(dev, p.copy_bytes, reps=10) if dev.type == "cuda" else None
        self.R["target_lm_weight_bytes"] = lm_weight_bytes(self.target)

    def engine(self, invariant: bool, max_batch: int):
        from tabed_engine import Engine

        return Engine(self.target, self.processor, draft=self.draft, device=self.dev, dtype=self.dt,
                      views=("M", "T"), gamma=self.args.gamma, max_len=self.args.max_len, max_batch=max_batch,
                      adaptive=False, prefix_cache=False, invariant=invariant)

    def tokens(self, eng, prompts, speculative, new_tokens=None):
        from tabed_engine import SamplingParams

        sp = SamplingParams(max_new_tokens=new_tokens or self.args.new_tokens, stop_at_eos=False)
        outs = eng.generate(prompts, images=[[self.image]] * len(prompts), sampling=sp, speculative=speculative)
        self.ttft += [o.stats.time_first_token for o in outs]
        return [list(o.token_ids) for o in outs]

    def timed(self, eng, B: int, speculative: bool, tau):
        """ms per generated token per request, B requests admitted together (decode only)."""
        from tabed_engine import SamplingParams

        eng.bench_accept_schedule = geometric_schedule(tau, self.args.gamma) if speculative else None
        sp = SamplingParams(max_new_tokens=self.args.timed_tokens, stop_at_eos=False)
        best = None
        for _ in range(2):
            ids = [eng.add_request(self.prompts[i % len(self.prompts)], images=[self.image], sampling=sp,
                                   speculative=speculative) for i in range(B)]
            t0, n = None, {}
            while eng.has_unfinished():
                admitting = bool(eng.scheduler.waiting)
                for o in eng.step():
                    n[o.request_id] = n.get(o.request_id, 0) + len(o.new_token_ids)
                if admitting and not eng.scheduler.waiting and t0 is None:
                    torch.cuda.synchronize(self.dev) if self.dev.type == "cuda" else None
                    t0, base = time.perf_counter(), dict(n)
            torch.cuda.synchronize(self.dev) if self.dev.type == "cuda" else None
            wall = time.perf_counter() - t0
            made = sum(n[i] - base.get(i, 0) for i in ids) / B
            ms = wall / made * 1e3
            best = ms if best is None else min(best, ms)
        eng.bench_accept_schedule = None
        return best

    def speed(self, eng) -> dict:
        """AR and SD ms/token at each timed batch size, and the median cold TTFT alone."""
        a, speed = self.args, {}
        self.ttft = []
        for i in range(12):                                  # the first 4 capture graphs
            self.tokens(eng, [self.prompts[i % len(self.prompts)]], False, new_tokens=2)
        ttft = sorted(self.ttft[4:])
        speed["ttft_ms_median_alone_ar"] = ttft[len(ttft) // 2] * 1e3
        for B in a.timed_batches:
            speed[f"ar_B{B}_ms_per_token"] = self.timed(eng, B, False, None)
            speed[f"sd_tau{a.tau}_B{B}_ms_per_token"] = self.timed(eng, B, True, a.tau)
            log(f"B={B} AR {speed[f'ar_B{B}_ms_per_token']:.3f} ms/token, "
                f"SD {speed[f'sd_tau{a.tau}_B{B}_ms_per_token']:.3f}")
        return speed

    def equality(self, eng, name: str) -> dict:
        """Each request alone AR and SD, and batched; which runs equal the alone-AR tokens. Each
        comparison is saved as it completes (a run cut short keeps what it finished)."""
        a = self.args
        res = self.R["paths"].setdefault(name, {})
        self.ttft = []
        alone_ar = [self.tokens(eng, [p], False)[0] for p in self.prompts]
        log(f"{name}: alone AR done")

        def record(key, outs):
            diffs = [first_diff(o, r) for o, r in zip(outs, alone_ar)]
            res[key] = {"equal": sum(d is None for d in diffs), "of": len(diffs),
                        "first_diff": sorted(d for d in diffs if d is not None)}
            log(f"{name}: {key} equal to alone AR: {res[key]['equal']} / {len(diffs)}")
            self.save()

        record("alone_sd", [self.tokens(eng, [p], True)[0] for p in self.prompts])
        for B in a.batches:
            for spec in (False, True):
                outs = []
                for i in range(0, len(self.prompts), B):
                    outs += self.tokens(eng, self.prompts[i:i + B], spec)
                record(f"batch{B}_{'sd' if spec else 'ar'}", outs)
        return res

    def run(self):
        """Speed of every path first (side by side), then each path's equality runs."""
        a = self.args
        self.setup()
        floor = (self.R["target_lm_weight_bytes"] / (self.R["copy_GBs"] * 1e9) * 1e3) if self.R["copy_GBs"] else None
        self.R["floor_ms_per_token_B1"] = floor
        paths = self.R["paths"]
        if "speed" in a.sections:
            for name in a.paths:
                eng = self.engine(name == "invariant", max(a.timed_batches))
                paths.setdefault(name, {})["speed"] = self.speed(eng)
                log(f"{name}: {paths[name]['speed']}")
                self.release(eng)
                self.save()
            if len(a.paths) == 2:
                d, i = paths["default"]["speed"], paths["invariant"]["speed"]
                self.R["cost"] = {k: i[k] / d[k] - 1 for k in d}
                log("cost of the invariant path: " + ", ".join(f"{k} {v * 100:+.1f}%" for k, v in self.R["cost"].items()))
                self.save()
        if "equality" in a.sections:
            for name in a.paths:
                eng = self.engine(name == "invariant", max(a.batches))
                self.equality(eng, name)
                self.release(eng)
                self.save()

    def release(self, eng):
        del eng
        gc.collect()
        torch.cuda.empty_cache() if self.dev.type == "cuda" else None

    def save(self):
        os.makedirs(self.args.out, exist_ok=True)
        with open(os.path.join(self.args.out, f"invariance_{self.args.preset}{self.args.tag}.json"), "w") as f:
            json.dump(self.R, f, indent=1, default=str)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="llava-1.5-7b")
    ap.add_argument("--out", default=os.path.join("benchmarks", "results"))
    ap.add_argument("--device", default=None)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--timed-tokens", type=int, default=64)
    ap.add_argument("--gamma", type=int, default=2)
    ap.add_argument("--tau", type=float, default=2.31)
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--batches", type=int, nargs="+", default=[16, 64], help="batch sizes of the equality runs")
    ap.add_argument("--timed-batches", type=int, nargs="+", default=[1, 64], help="batch sizes timed")
    ap.add_argument("--paths", nargs="+", choices=("default", "invariant"), default=["default", "invariant"])
    ap.add_argument("--sections", nargs="+", choices=("speed", "equality"), default=["speed", "equality"])
    ap.add_argument("--tag", default="", help="suffix of the results file's name")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    InvarianceBench(args).run()


if __name__ == "__main__":
    main()
