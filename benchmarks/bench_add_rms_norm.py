"""Benchmark: residual add fused into RMSNorm (one Triton launch) vs the unfused decode path.

    python benchmarks/bench_add_rms_norm.py [--out benchmarks/results/add_rms_norm.json]
    TRITON_INTERPRET=1 python benchmarks/bench_add_rms_norm.py --smoke   # CPU, tiny, no claims

Shape: LLaVA-1.5-7B hidden 4096, rows R * T in {1, 6} (decode, chain verification), bf16.
Columns (per call, medians):
  fused     tabed_engine.kernels.add_rms_norm
  eager     x + delta, then the eager RMSNorm reference
  model     what DecoderLayer ran before: the eager add, then the torch.compile'd rms_norm
  compiled  torch.compile of add + norm (static shapes)
`stream` and `graph` timings as in bench_rope_kv_write.py. GB/s counts x, delta and weight
read, the sum and the output written, over the graph time, next to a 256 MiB
device-to-device copy measured in the same run.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_rope_kv_write import (add_common_args, begin_table, compile_static, device_and_out,  # noqa: E402
                                 measured_row, write_result)
from tabed_engine.kernels import add_rms_norm as _k  # noqa: E402
from tabed_engine.models.layers import rms_norm  # noqa: E402
from tabed_engine.ops.add_rms_norm import add_rms_norm_reference  # noqa: E402

EPS = 1e-5


def model_path(x, delta, weight):
    s = x + delta
    return s, rms_norm(s, weight, EPS)


def eager_path(x, delta, weight):
    return add_rms_norm_reference(x, delta, weight, EPS)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 6])
    ap.add_argument("--hidden", type=int, default=4096)
    add_common_args(ap, "add_rms_norm")
    args = ap.parse_args(argv)
    t_start = time.perf_counter()

    device, out_path = device_and_out(args, "add_rms_norm")
    if args.smoke:
        args.hidden, args.rows, args.no_compile, args.reps = 96, [1, 3], True, 3
    N, dtype = args.hidden, torch.bfloat16
    compiled = None if args.no_compile else compile_static(eager_path)  # one static graph per row count

    copy_gbs = begin_table(device, args, f"{'rows':>4}")
    rows = []
    g = torch.Generator().manual_seed(0)
    for M in args.rows:
        x, delta = (torch.randn(1, M, N, generator=g).to(device=device, dtype=dtype) for _ in range(2))
        weight = (1 + 0.1 * torch.randn(N, generator=g)).to(device=device, dtype=dtype)
        s_out, out = torch.empty_like(x), torch.empty_like(x)
        fns = {"fused": lambda: _k.add_rms_norm(x, delta, weight, EPS, out=out, sum_out=s_out),
               "eager": lambda: eager_path(x, delta, weight)}
        if not args.smoke:
            fns["model"] = lambda: model_path(x, delta, weight)
        if compiled is not None:
            fns["compiled"] = lambda: compiled(x, delta, weight)

        fns["fused"]()
        s_ref, out_ref = eager_path(x, delta, weight)
        err = max((s_out.float() - s_ref.float()).abs().max().item(),
                  (out.float() - out_ref.float()).abs().max().item())

        rows.append(measured_row(f"{M:>4}", fns, device, args, (4 * M * N + N) * x.element_size(), copy_gbs, err,
                                 rows=M, hidden=N, dtype=str(dtype)))

    write_result("add_rms_norm", args, device, copy_gbs, rows, out_path, t_start)


if __name__ == "__main__":
    main()
