"""Where a decode step's time goes: the LLaVA-1.5-7B-shaped target's AR step and γ+1
verification, and the LLaVA-68M-shaped draft step, run eagerly under torch.profiler; CUDA
kernel time grouped by kernel name, against the weight-read floor.

    python benchmarks/profile_decode.py [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from collections import defaultdict

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import copy_bandwidth_gbs, provenance  # noqa: E402
from e2e import PRESETS, build_lvlm, lm_weight_bytes  # noqa: E402


def profile(fn, steps: int = 5):
    from torch.profiler import ProfilerActivity, profile as prof

    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    with prof(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    by_name = defaultdict(float)
    for e in p.key_averages():
        if e.device_type.name == "CUDA" or getattr(e, "device_time_total", 0):
            by_name[e.key] += getattr(e, "device_time_total", getattr(e, "cuda_time_total", 0)) / steps
    return sorted(by_name.items(), key=lambda kv: -kv[1])


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    from tabed_engine.models.decoder import KVCache

    pre = PRESETS["llava-1.5-7b"]
    dev, dtype = torch.device("cuda"), torch.bfloat16
    report = {"provenance": provenance(dev), "command": " ".join(sys.argv)}
    bw = copy_bandwidth_gbs(dev, 1 << 30)
    # (model, rows, tokens per row): the AR step, verification of gamma + 1 = 6 tokens, and a
    # draft step over 1 and 4 views
    shapes = {"target": ((1, 1), (1, 6)), "draft": ((1, 1), (4, 1))}
    for name, text in (("target", pre.target), ("draft", pre.draft)):
        lv = build_lvlm(pre.vision, text, dev, dtype)
        lm = lv.lm
        floor_us = lm_weight_bytes(lv) / (bw * 1e9) * 1e6
        for rows, T in shapes[name]:
            cache = KVCache(lm.cfg, rows, 2048, dev, dtype)
            cache.lengths.fill_(616)
            ids = torch.randint(0, 32000, (rows, T), device=dev)

            def step():
                pos = cache.lengths.long()[:, None] + torch.arange(T, device=dev)
                with torch.inference_mode():
                    lm(cache, pos, input_ids=ids)

            rows_ = profile(step)
            total = sum(t for _, t in rows_)
            key = f"{name}_rows{rows}_T{T}"
            report[key] = {"kernel_us_total": total, "floor_us": floor_us,
                           "top": [{"kernel": k[:120], "us": t, "share": t / total} for k, t in rows_[:25]]}
            print(f"== {key}: kernels {total:.0f} us per step, weight-read floor {floor_us:.0f} us")
            for k, t in rows_[:20]:
                print(f"  {t:8.1f} us  {100 * t / total:5.1f}%  {k[:100]}")
            del cache
        del lv, lm
        torch.cuda.empty_cache()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "profile_decode.json"), "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
