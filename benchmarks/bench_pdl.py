"""Programmatic dependent launch (PDL) on and off, side by side: graph replays of one decode
forward of the LLaVA-1.5-7B-shaped target (T = 1: an AR step, T = 6: a verification of
γ + 1 tokens) and of the LLaVA-68M-shaped draft (1, 2 and 4 rows: a draft step over K
views), 616-token prefix, bf16, random weights built on the GPU.

    python benchmarks/bench_pdl.py [--out benchmarks/results/pdl.json]

"off" turns PDL off in every Triton launcher of the decoder (the kernels then wait for the
previous launch as usual); the draft rows also run with its projections on cuBLAS
(MIN_FEATURES above the draft's widths), the path before the draft took the Triton GEMVs.
Variants are captured once each and replayed in interleaved rounds (median of rounds, each
a median of CUDA-event timed replays); the weight-read floor uses the copy bandwidth
measured in the same run.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import copy_bandwidth_gbs, event_ms, provenance  # noqa: E402
from e2e import PRESETS, build_lvlm, lm_weight_bytes  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join("benchmarks", "results", "pdl.json"))
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    import tabed_engine.kernels.add_rms_norm as k_norm
    import tabed_engine.kernels.gemv as k_gemv
    import tabed_engine.kernels.rope_kv_write as k_rope
    import tabed_engine.kernels.silu_mul as k_silu
    import tabed_engine.kernels.tree_attention as k_attn
    import tabed_engine.ops.gemv as ops_gemv
    from tabed_engine.kernels._common import pdl
    from tabed_engine.models.decoder import KVCache

    launchers = (k_norm, k_gemv, k_rope, k_silu, k_attn)
    min_features = ops_gemv.MIN_FEATURES

    def configure(pdl_on: bool, cublas_draft: bool = False):
        for m in launchers:
            m.pdl = pdl if pdl_on else (lambda device: False)
        ops_gemv.MIN_FEATURES = 4096 if cublas_draft else min_features

    t0 = time.perf_counter()
    dev, dtype = torch.device("cuda"), torch.bfloat16
    pre = PRESETS["llava-1.5-7b"]
    bw = copy_bandwidth_gbs(dev, 1 << 30)
    report = {"provenance": provenance(dev), "command": " ".join(["python3"] + sys.argv), "copy_gbs": bw,
              "pdl_available": pdl(dev), "rows": []}
    print(f"{report['provenance']['device']}: copy {bw:.0f} GB/s, PDL available: {report['pdl_available']}")
    for name, text in (("target", pre.target), ("draft", pre.draft)):
        lv = build_lvlm(pre.vision, text, dev, dtype)
        lm = lv.lm
        floor_us = lm_weight_bytes(lv) / (bw * 1e9) * 1e6
        variants = {"pdl off": dict(pdl_on=False), "pdl on": dict(pdl_on=True)}
        if name == "draft":
            variants = {"cuBLAS, pdl off": dict(pdl_on=False, cublas_draft=True),
                        "cuBLAS, pdl on": dict(pdl_on=True, cublas_draft=True), **variants}
        for R, T in (((1, 1), (1, 6)) if name == "target" else ((1, 1), (2, 1), (4, 1))):
            cache = KVCache(lm.cfg, R, 2048, dev, dtype)
            cache.lengths.fill_(616)
            ids = torch.randint(0, 32000, (R, T), device=dev)
            pos = cache.lengths.long()[:, None] + torch.arange(T, device=dev)

            def step():
                with torch.inference_mode():
                    return lm(cache, pos, input_ids=ids)

            graphs, times, logits = {}, {}, {}
            for vname, kw in variants.items():
                configure(**kw)
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    for _ in range(2):
                        logits[vname] = step()
                torch.cuda.current_stream().wait_stream(side)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    step()
                graphs[vname] = g
            configure(True)
            for _ in range(args.rounds):
                for vname, g in graphs.items():
                    times.setdefault(vname, []).append(event_ms(g.replay, 50 if name == "target" else 300) * 1e3)
            ref = logits["pdl off"]
            for vname in graphs:
                us = statistics.median(times[vname])
                same = bool(torch.equal(logits[vname], ref))
                report["rows"].append(dict(model=name, rows=R, tokens=T, variant=vname, us=us, rounds_us=times[vname],
                                           floor_us=floor_us, x_floor=us / floor_us, logits_equal_pdl_off=same))
                print(f"{name:6s} rows={R} T={T} {vname:16s} {us:9.1f} us  {us / floor_us:6.3f} x floor  "
                      f"logits == pdl off: {same}")
            del graphs, cache
        del lv, lm
        torch.cuda.empty_cache()
    report["total_s"] = time.perf_counter() - t0
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"wrote {args.out} ({report['total_s']:.0f} s)")


if __name__ == "__main__":
    main()
