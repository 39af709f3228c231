"""Benchmark: few-row linear layers (Triton GEMV) vs cuBLAS and torch.compile at decode shapes.

    python benchmarks/bench_gemv.py [--out benchmarks/results/gemv.json]
    TRITON_INTERPRET=1 python benchmarks/bench_gemv.py --smoke   # CPU, tiny, no claims

Shapes: the LLaVA-1.5-7B target's projections at one row (an AR decode step; `gemv`) and
at six rows (verification of gamma + 1 = 6 tokens; `gemv_rows`, tensor cores): q/k/v
12288x4096, o 4096x4096, gate/up 22016x4096, down 4096x11008 with the SiLU gate (fused into
the one-row GEMV; a separate `silu_mul` launch before the 6-row one), lm_head 32064x4096;
and the LLaVA-68M-shape draft's at one row and at 4 (a draft step over 4 views): q/k/v
2304x768, o 768x768, gate/up 6144x768 (at 4 rows with the SiLU gate in the GEMV's epilogue,
`glu`), down 768x3072 (the gate fused at one row), lm_head 32064x768; bf16. Each timed call
runs the projection over several copies of the weight (>= 400 MB in all), so every byte
comes from HBM, not L2.
Columns (us per projection, medians):
  fused     tabed_engine.kernels.gemv (gemv_rows at 6 rows)
  eager     the reference: F.linear (cuBLAS), after (gated) or before (glu) an eager SiLU*up
  model     what the decoder ran before: F.linear after the torch.compile'd SiLU*up
  compiled  torch.compile of the reference (static shapes)
GB/s counts the weight bytes over the graph time, next to a 1 GiB device-to-device copy
measured in the same run. The summary lines add up one decode step's projections (32
layers + lm_head; the draft: 2 layers + lm_head) for the GEMV and for the cuBLAS path the
decoder would otherwise run.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_rope_kv_write import (add_common_args, begin_table, compile_static, device_and_out,  # noqa: E402
                                 print_row, time_variants, write_result)
from tabed_engine.kernels import gemv as _k  # noqa: E402
from tabed_engine.model import silu_mul  # noqa: E402
from tabed_engine.ops.gemv import linear_reference  # noqa: E402

# (name, N, K, SiLU gate on the input ("in", the one-row down projection; a silu_mul launch
# first at several rows) or on the output ("out", glu), layers per step)
TARGET = [("qkv", 12288, 4096, None, 32), ("o", 4096, 4096, None, 32), ("gate_up", 22016, 4096, None, 32),
          ("down", 4096, 11008, "in", 32), ("lm_head", 32064, 4096, None, 1)]
DRAFT_ONE = [("draft_qkv", 2304, 768, None, 2), ("draft_o", 768, 768, None, 2), ("draft_gate_up", 6144, 768, None, 2),
             ("draft_down", 768, 3072, "in", 2), ("draft_lm_head", 32064, 768, None, 1)]
DRAFT_ROWS = [("draft_qkv", 2304, 768, None, 2), ("draft_o", 768, 768, None, 2),
              ("draft_gate_up", 6144, 768, "out", 2), ("draft_down", 768, 3072, None, 2),
              ("draft_lm_head", 32064, 768, None, 1)]


def model_path(x, w, gate):
    """The cuBLAS path the decoder would run: F.linear with the compiled SiLU*up around it."""
    y = torch.nn.functional.linear(silu_mul(x) if gate == "in" else x, w)
    return silu_mul(y) if gate == "out" else y


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_args(ap, "gemv")
    ap.set_defaults(inner=4, reps=15)
    ap.add_argument("--min-bytes", type=int, default=400 << 20, help="weight bytes per timed call")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 6], help="activation rows per target projection")
    ap.add_argument("--draft-rows", type=int, nargs="*", default=[1, 4], help="activation rows per draft projection")
    args = ap.parse_args(argv)
    t_start = time.perf_counter()

    device, out_path = device_and_out(args, "gemv")
    cases = [(*c, M) for M in args.rows for c in TARGET]
    cases += [(*c, M) for M in args.draft_rows for c in (DRAFT_ONE if M == 1 else DRAFT_ROWS)]
    if args.smoke:
        cases = [(*c, M) for M in args.rows for c in [("small", 96, 130, None, 1), ("small_gated", 64, 70, "in", 1),
                                                      ("small_glu", 64, 70, "out", 1)]]
        cases = [c for c in cases if not (c[3] == "out" and c[-1] == 1)]
        args.no_compile, args.reps, args.inner, args.min_bytes = True, 3, 1, 0
    dtype = torch.bfloat16
    compiled = None if args.no_compile else compile_static(
        lambda x, w, gi, go: linear_reference(x, w, gated=gi, glu=go))

    copy_gbs = begin_table(device, args, f"{'shape':>22}", 1 << 30)
    rows = []
    g = torch.Generator().manual_seed(0)
    for name, N, K, gate, layers, M in cases:
        gated, glu = gate == "in", gate == "out"
        nbytes = N * K * 2
        copies = max(1, -(-args.min_bytes // nbytes))
        ws = [(torch.randn(N, K, generator=g) / K ** 0.5).to(device=device, dtype=dtype) for _ in range(copies)]
        x = torch.randn(M, 2 * K if gated else K, generator=g).to(device=device, dtype=dtype)
        out = torch.empty(M, N // 2 if glu else N, device=device, dtype=dtype)

        def each(fn):
            def run():
                for w in ws:
                    fn(w)
            return run
        def fused(w):
            if M == 1:
                return _k.gemv(x, w, gated=gated, out=out)
            return _k.gemv_rows(silu_mul(x) if gated else x, w, glu=glu, out=out)
        fns = {"fused": each(fused),
               "eager": each(lambda w: linear_reference(x, w, gated=gated, glu=glu))}
        if gate and not args.smoke:
            fns["model"] = each(lambda w: model_path(x, w, gate))
        if compiled is not None:
            fns["compiled"] = each(lambda w: compiled(x, w, gated, glu))

        fused(ws[0])
        err = (out.float() - linear_reference(x, ws[0], gated=gated, glu=glu).float()).abs().max().item()
        stream, graph = time_variants(fns, device, args)
        stream = {k: v / copies for k, v in stream.items()}
        graph = {k: v / copies for k, v in graph.items()}
        base = graph.get("fused", stream["fused"])
        gbs = nbytes / (base * 1e-6) / 1e9
        rows.append(dict(name=name, rows=M, N=N, K=K, gate=gate, layers=layers, dtype=str(dtype), weight_bytes=nbytes,
                         copies=copies, stream_us=stream, graph_us=graph, fused_gbs=gbs,
                         pct_copy=100 * gbs / copy_gbs, max_abs_err_vs_eager=err))
        print_row(f"{name + ' M=' + str(M):>22}", stream, graph, gbs, copy_gbs, err)
        del ws
        if device == "cuda":
            torch.cuda.empty_cache()

    summary = {}
    for model, M, shapes in ([("target", M, TARGET) for M in args.rows]
                             + [("draft", M, DRAFT_ONE if M == 1 else DRAFT_ROWS) for M in args.draft_rows]):
        sel = [r for r in rows if r["rows"] == M and r["name"] in {n for n, *_ in shapes}]
        if len(sel) == len(shapes) and all("eager" in r["graph_us"] for r in sel):
            # the baseline is what the decoder would run on cuBLAS: with the compiled SiLU*up
            # kernel for the gated one ("model"), not the eager two-kernel gate
            base = {r["name"]: r["graph_us"].get("model", r["graph_us"]["eager"]) for r in sel}
            step = {"fused": sum(r["graph_us"]["fused"] * r["layers"] for r in sel) / 1e3,
                    "cublas": sum(base[r["name"]] * r["layers"] for r in sel) / 1e3}
            summary[f"{model}_step_rows{M}_ms"] = step
            print(f"one {model} step's projections at {M} row(s): GEMV {step['fused']:.4f} ms, "
                  f"cuBLAS path {step['cublas']:.4f} ms ({step['cublas'] / step['fused']:.2f}x)")
    rows.append(dict(name="summary", **summary))
    write_result("gemv", args, device, copy_gbs, rows, out_path, t_start)


if __name__ == "__main__":
    main()
