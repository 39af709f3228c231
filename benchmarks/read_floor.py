"""The read floor: how fast this device reads N bytes it has not read recently.

The copy bandwidth (1 GiB each way) is the ceiling a long stream reaches; an op that reads
33 MB runs for ~8 us, where the ramp of a launch and its tail are a large part, so even a
kernel that only reads and adds reaches less. `read_floor_us(nbytes)` times such a kernel
on bf16 buffers of `nbytes`, over rotating copies (256 MB or more read in turn, as the
benchmarks' cold timings) and CUDA-graph replays, the best of a few launch shapes: the
physical floor for a memory-bound op that must read those bytes once.

The probe: each program sums one contiguous chunk of a flat tensor (fp32 accumulation) and
stores its partial sum; `read_probe_reference` is the same in PyTorch.
"""
from __future__ import annotations

import itertools

import torch
import triton
import triton.language as tl
import triton.testing

from tabed_engine.kernels._common import target_programs


@triton.jit
def _read_probe_kernel(x_ptr, out_ptr, N, CHUNK, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    start = pid.to(tl.int64) * CHUNK
    end = tl.minimum(start + CHUNK, N)
    cols = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], tl.float32)
    for v0 in range(start, end, BLOCK):
        acc += tl.load(x_ptr + v0 + cols, mask=v0 + cols < end, other=0.0).to(tl.float32)
    tl.store(out_ptr + pid, tl.sum(acc, axis=0))


def probe_chunk(numel: int, programs: int, block: int) -> int:
    """Elements per program: numel over `programs`, rounded up to a multiple of `block`."""
    return triton.cdiv(triton.cdiv(numel, programs), block) * block


def read_probe(x: torch.Tensor, out: torch.Tensor, programs: int, num_warps: int = 4,
               per_thread: int = 8) -> torch.Tensor:
    """Partial sums of the contiguous tensor x (any float dtype) over `programs` chunks,
    written to out[:n] (n = the chunks actually used, returned as out[:n])."""
    if not x.is_contiguous():
        raise ValueError("read_probe: x must be contiguous")
    block = num_warps * 32 * per_thread
    chunk = probe_chunk(x.numel(), programs, block)
    n = triton.cdiv(x.numel(), chunk)
    if out.numel() < n or out.dtype != torch.float32:
        raise ValueError(f"read_probe: out needs >= {n} float32 elements")
    _read_probe_kernel[(n,)](x, out, x.numel(), chunk, BLOCK=block, num_warps=num_warps)
    return out[:n]


def read_probe_reference(x: torch.Tensor, programs: int, num_warps: int = 4, per_thread: int = 8) -> torch.Tensor:
    """PyTorch reference of `read_probe`: the fp32 sum of each chunk."""
    chunk = probe_chunk(x.numel(), programs, num_warps * 32 * per_thread)
    return torch.stack([c.float().sum() for c in x.reshape(-1).split(chunk)])


# (programs per SM, warps, elements per thread): H200, 33 MB of bf16 read cold, a sweep of
# 2-16 programs per SM, 4-8 warps, 8-32 elements: these two were the best (78.6% and 77.7%
# of the copy bandwidth), the next ones within 2 points.
_SHAPES = ((16, 4, 8), (8, 8, 16))


def read_floor_us(nbytes: int, device, min_bytes: int = 256 << 20) -> float:
    """Microseconds to read `nbytes` of bf16 not read recently (CUDA-graph replays over
    rotating copies, the best of `_SHAPES`)."""
    numel = max(1, nbytes // 2)
    copies = [torch.empty(numel, dtype=torch.bfloat16, device=device).normal_()
              for _ in range(max(2, triton.cdiv(min_bytes, numel * 2)))]
    out = torch.empty(target_programs(device, max(s[0] for s in _SHAPES)), dtype=torch.float32, device=device)
    best = float("inf")
    for per_sm, warps, per_thread in _SHAPES:
        turn = itertools.count()
        programs = target_programs(device, per_sm)

        def call():
            return read_probe(copies[next(turn) % len(copies)], out, programs, warps, per_thread)
        best = min(best, triton.testing.do_bench_cudagraph(call, rep=60, return_mode="median") * 1e3)
    del copies
    return best
