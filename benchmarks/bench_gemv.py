"""Benchmark: few-row linear layers (Triton GEMV) vs cuBLAS and torch.compile at decode shapes.

    python benchmarks/bench_gemv.py [--out benchmarks/results/gemv.json]
    TRITON_INTERPRET=1 python benchmarks/bench_gemv.py --smoke   # CPU, tiny, no claims

Shapes: the LLaVA-1.5-7B target's projections at one row (an AR decode step; `gemv`) and
at six rows (verification of gamma + 1 = 6 tokens; `gemv_rows`, tensor cores): q/k/v
12288x4096, o 4096x4096, gate/up 22016x4096, down 4096x11008 with the SiLU gate (fused into
the one-row GEMV; a separate compiled kernel before the 6-row one), lm_head 32064x4096; bf16.
(The engine sends prefill and the draft's 768-wide matrices to cuBLAS.) Each timed call
runs the projection over
several copies of the weight (>= 400 MB in all), so every byte comes from HBM, not L2.
Columns (us per projection, medians):
  fused     tabed_engine.kernels.gemv (gemv_rows at 6 rows)
  eager     the reference: F.linear (cuBLAS), after an eager SiLU*up for the gated one
  model     what the decoder ran before: F.linear after the torch.compile'd SiLU*up
  compiled  torch.compile of the reference (static shapes)
GB/s counts the weight bytes over the graph time, next to a 1 GiB device-to-device copy
measured in the same run. The summary line adds up one decode step's projections (32
layers + lm_head) for the GEMV and for the cuBLAS path the decoder would otherwise run.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import copy_bandwidth_gbs, provenance  # noqa: E402
from bench_rope_kv_write import (add_common_args, compile_static, device_and_out, print_header,  # noqa: E402
                                 print_row, time_variants, write_result)
from tabed_engine.kernels import gemv as _k  # noqa: E402
from tabed_engine.model import silu_mul  # noqa: E402
from tabed_engine.ops.gemv import linear_reference  # noqa: E402

TARGET = [("qkv", 12288, 4096, False), ("o", 4096, 4096, False), ("gate_up", 22016, 4096, False),
          ("down", 4096, 11008, True), ("lm_head", 32064, 4096, False)]


def model_path(x, w, gated):
    return torch.nn.functional.linear(silu_mul(x) if gated else x, w)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_args(ap, "gemv")
    ap.set_defaults(inner=4, reps=15)
    ap.add_argument("--min-bytes", type=int, default=400 << 20, help="weight bytes per timed call")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 6], help="activation rows per projection")
    args = ap.parse_args(argv)
    t_start = time.perf_counter()

    device, out_path = device_and_out(args, "gemv")
    cases = [(n, N, K, g, M) for M in args.rows for (n, N, K, g) in TARGET]
    if args.smoke:
        cases = [(n, N, K, g, M) for M in args.rows for (n, N, K, g) in [("small", 96, 130, False),
                                                                         ("small_gated", 64, 70, True)]]
        args.no_compile, args.reps, args.inner, args.min_bytes = True, 3, 1, 0
    dtype = torch.bfloat16
    compiled = None if args.no_compile else compile_static(lambda x, w, g: linear_reference(x, w, gated=g))

    copy_gbs = copy_bandwidth_gbs(device, (1 << 20) if args.smoke else (1 << 30))
    print(f"device: {provenance(device)['device']}  copy bandwidth {copy_gbs:.0f} GB/s")
    print_header(f"{'shape':>22}")
    rows = []
    g = torch.Generator().manual_seed(0)
    for name, N, K, gated, M in cases:
        nbytes = N * K * 2
        copies = max(1, -(-args.min_bytes // nbytes))
        ws = [(torch.randn(N, K, generator=g) / K ** 0.5).to(device=device, dtype=dtype) for _ in range(copies)]
        x = torch.randn(M, 2 * K if gated else K, generator=g).to(device=device, dtype=dtype)
        out = torch.empty(M, N, device=device, dtype=dtype)

        def each(fn):
            def run():
                for w in ws:
                    fn(w)
            return run
        def fused(w):
            if M == 1:
                return _k.gemv(x, w, gated=gated, out=out)
            return _k.gemv_rows(silu_mul(x) if gated else x, w, out=out)
        fns = {"fused": each(fused),
               "eager": each(lambda w: linear_reference(x, w, gated=gated))}
        if gated and not args.smoke:
            fns["model"] = each(lambda w: model_path(x, w, gated))
        if compiled is not None:
            fns["compiled"] = each(lambda w: compiled(x, w, gated))

        fused(ws[0])
        err = (out.float() - linear_reference(x, ws[0], gated=gated).float()).abs().max().item()
        stream, graph = time_variants(fns, device, args)
        stream = {k: v / copies for k, v in stream.items()}
        graph = {k: v / copies for k, v in graph.items()}
        base = graph.get("fused", stream["fused"])
        gbs = nbytes / (base * 1e-6) / 1e9
        rows.append(dict(name=name, rows=M, N=N, K=K, gated=gated, dtype=str(dtype), weight_bytes=nbytes,
                         copies=copies, stream_us=stream, graph_us=graph, fused_gbs=gbs,
                         pct_copy=100 * gbs / copy_gbs, max_abs_err_vs_eager=err))
        print_row(f"{name + ' M=' + str(M):>22}", stream, graph, gbs, copy_gbs, err)
        del ws
        if device == "cuda":
            torch.cuda.empty_cache()

    summary = {}
    for M in args.rows:
        sel = [r for r in rows if r["rows"] == M and r["name"] in {n for n, *_ in TARGET}]
        if len(sel) == len(TARGET) and all("eager" in r["graph_us"] for r in sel):
            # the baseline is what the decoder ran before: cuBLAS, after the compiled SiLU*up
            # kernel for `down` ("model"), not the eager two-kernel gate
            base = {r["name"]: r["graph_us"].get("model", r["graph_us"]["eager"]) for r in sel}
            layers = lambda r: 1 if r["name"] == "lm_head" else 32  # noqa: E731
            step = {"fused": sum(r["graph_us"]["fused"] * layers(r) for r in sel) / 1e3,
                    "cublas": sum(base[r["name"]] * layers(r) for r in sel) / 1e3}
            summary[f"target_step_rows{M}_ms"] = step
            print(f"one target step at {M} row(s), 32 layers + lm_head: GEMV {step['fused']:.3f} ms, "
                  f"cuBLAS path {step['cublas']:.3f} ms ({step['cublas'] / step['fused']:.2f}x)")
    rows.append(dict(name="summary", **summary))
    write_result("gemv", args, device, copy_gbs, rows, out_path, t_start)


if __name__ == "__main__":
    main()
