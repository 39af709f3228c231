"""Benchmark: the SwiGLU activation silu(gate) * up as one Triton launch vs the reference paths.

    python benchmarks/bench_silu_mul.py [--out benchmarks/results/silu_mul.json]
    TRITON_INTERPRET=1 python benchmarks/bench_silu_mul.py --smoke   # CPU, tiny, no claims

Shapes: rows 6, 1 and 616 at the LLaVA-1.5-7B MLP width 11008 (verification, a decode row, a
one-image prompt's prefill), 4 rows at the LLaVA-68M draft's 3072 (a 4-view draft step); bf16.
Columns (per call, medians):
  fused     tabed_engine.kernels.silu_mul (Triton)
  eager     the PyTorch reference (silu in float32, one rounding)
  model     what the decoder ran before: the torch.compile'd reference (dynamic shapes;
            prefill rows ran it until it was replaced by the kernel)
  compiled  torch.compile of the reference with static shapes
`stream` and `graph` timings as in bench_rope_kv_write.py. GB/s counts the [gate | up] rows
read and the activations written, over the graph time, next to a 256 MiB device-to-device
copy measured in the same run. With one launch per benchmarked call there is no preceding
kernel to overlap, so programmatic dependent launch does not show here.
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
from tabed_engine.kernels import silu_mul as _k  # noqa: E402
from tabed_engine.models.layers import fused_on_cuda  # noqa: E402
from tabed_engine.ops.gemv import silu_mul_reference  # noqa: E402

model_silu_mul = fused_on_cuda(silu_mul_reference)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", nargs="+", default=["6x11008", "1x11008", "4x3072", "616x11008"], help="ROWSxWIDTH")
    add_common_args(ap, "silu_mul")
    args = ap.parse_args(argv)
    t_start = time.perf_counter()

    device, out_path = device_and_out(args, "silu_mul")
    if args.smoke:
        args.shapes, args.no_compile, args.reps = ["3x100", "1x37"], True, 3
    dtype = torch.bfloat16
    compiled = None if args.no_compile else compile_static(silu_mul_reference)

    copy_gbs = begin_table(device, args, f"{'shape':>8}")
    rows = []
    g = torch.Generator().manual_seed(0)
    for shape in args.shapes:
        M, K = (int(v) for v in shape.split("x"))
        x = (torch.randn(M, 2 * K, generator=g) * 3).to(device=device, dtype=dtype)
        out = torch.empty(M, K, device=device, dtype=dtype)
        fns = {"fused": lambda: _k.silu_mul(x, out=out), "eager": lambda: silu_mul_reference(x)}
        if not args.smoke:
            fns["model"] = lambda: model_silu_mul(x)
        if compiled is not None:
            fns["compiled"] = lambda: compiled(x)

        fns["fused"]()
        err = (out.float() - silu_mul_reference(x).float()).abs().max().item()
        rows.append(measured_row(f"{shape:>8}", fns, device, args, 3 * M * K * x.element_size(), copy_gbs, err,
                                 rows=M, width=K, dtype=str(dtype)))

    write_result("silu_mul", args, device, copy_gbs, rows, out_path, t_start)


if __name__ == "__main__":
    main()
