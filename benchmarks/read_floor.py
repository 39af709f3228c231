"""The read floor: how fast this device reads N bytes it has not read recently.

The copy bandwidth (1 GiB each way) is the ceiling a long stream reaches; an op that reads
33 MB runs for ~8 us, where the ramp of a launch and its tail are a large part, so even a
kernel that only reads and adds reaches less. `read_floor_us(nbytes)` times such a kernel
on bf16 buffers of `nbytes`, over rotating copies (256 MB or more read in turn, as the
benchmarks' cold timings) and CUDA-graph replays, the best of a few launch shapes: the
physical floor for a memory-bound op that must read those bytes once.

The probe: each program sums one contiguous chunk of a flat tensor (fp32 accumulation) and
stores its partial sum; `read_probe_reference` is the same in PyTorch.

The two-read floor: an op whose every term needs a reduction over a whole group of its input
first (TV without given normalisers: both normalisers of a position's target and view rows
before any |p - q| term) reads each group twice, and past L2 it can read it from DRAM once
only by reading it again from L2 after the group's reduction is complete. `two_read_probe`
is that data movement and nothing else, in the one-launch schedule of `window_divergence`'s
`_wd_tv_fused_kernel`: a program takes a ticket, sums one task (a contiguous slice) of a
group, counts itself in at the group's counter, waits until the group's tasks have all
arrived and sums its slice again (from L2). `two_read_floor_us` times it as `read_floor_us`
does: how fast that schedule moves an op's bytes with no arithmetic beside the sums.
"""
from __future__ import annotations

import itertools

import torch
import triton
import triton.language as tl
import triton.testing

from tabed_engine.kernels._common import counters, group_items, target_programs, ticket


@triton.jit
def _slice_sum(x_ptr, start, end, BLOCK: tl.constexpr, EVICT: tl.constexpr):
    """fp32 sum of x[start:end], read in [BLOCK] steps with eviction policy EVICT."""
    cols = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], tl.float32)
    for v0 in range(start, end, BLOCK):
        acc += tl.load(x_ptr + v0 + cols, mask=v0 + cols < end, other=0.0, eviction_policy=EVICT).to(tl.float32)
    return tl.sum(acc, axis=0)


@triton.jit
def _read_probe_kernel(x_ptr, out_ptr, N, CHUNK, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    start = pid.to(tl.int64) * CHUNK
    tl.store(out_ptr + pid, _slice_sum(x_ptr, start, tl.minimum(start + CHUNK, N), BLOCK, ""))


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


@triton.jit
def _two_read_probe_kernel(x_ptr, out_ptr, cnt_ptr, NG, NS, G_LEN, CH, BLOCK: tl.constexpr, WAIT: tl.constexpr):
    # NG * NS programs; ticket t reads task t % NS of group t // NS: its sum (first read) at
    # out[2 t], then, once the group's NS tasks have arrived, its sum again (second read) at
    # out[2 t + 1]. Without WAIT (the interpreter) the group's last to arrive re-reads all.
    # Counters: [0] the ticket, [1 + g] group g's arrivals, [1 + NG + g] its tasks done.
    t = ticket(cnt_ptr, NG * NS)
    grp = t // NS
    split = t % NS
    g0 = grp.to(tl.int64) * G_LEN
    start = g0 + split * CH
    tl.store(out_ptr + 2 * t, _slice_sum(x_ptr, start, tl.minimum(start + CH, g0 + G_LEN), BLOCK, "evict_last"))
    tl.debug_barrier()
    arrived = tl.atomic_add(cnt_ptr + 1 + grp, 1, sem="acq_rel", scope="gpu")
    c_lo, c_hi = group_items(cnt_ptr + 1 + grp, arrived, NS, split, WAIT)
    for c in range(c_lo, c_hi):
        s2 = g0 + c * CH
        tl.store(out_ptr + 2 * (grp * NS + c) + 1,
                 _slice_sum(x_ptr, s2, tl.minimum(s2 + CH, g0 + G_LEN), BLOCK, "evict_first"))
    tl.debug_barrier()
    done = tl.atomic_add(cnt_ptr + 1 + NG + grp, 1, sem="acq_rel", scope="gpu")
    if done == NS - 1:  # the group's last task: ready for the next launch
        tl.store(cnt_ptr + 1 + grp, 0)
        tl.store(cnt_ptr + 1 + NG + grp, 0)


def _two_read_layout(numel: int, group_len: int, task_len: int, block: int):
    """(groups, tasks per group, elements per task) of `two_read_probe`."""
    if group_len < 1 or numel % group_len:
        raise ValueError(f"two_read_probe: {numel} elements are not whole groups of {group_len}")
    if task_len < 1:
        raise ValueError("two_read_probe: task_len must be positive")
    ch = triton.cdiv(min(task_len, group_len), block) * block
    return numel // group_len, triton.cdiv(group_len, ch), ch


def two_read_probe(x: torch.Tensor, out: torch.Tensor, group_len: int, task_len: int, num_warps: int = 4,
                   per_thread: int = 8) -> torch.Tensor:
    """Each task's sum read twice, [tasks, 2] (first read, second read) in out[:2 * tasks]:
    x (contiguous) as groups of `group_len` elements, each split into tasks of `task_len`
    elements rounded up to whole steps (num_warps * 32 * per_thread); the second read of a
    task starts once every task of its group has finished its first (see the module doc)."""
    if not x.is_contiguous():
        raise ValueError("two_read_probe: x must be contiguous")
    block = num_warps * 32 * per_thread
    ng, ns, ch = _two_read_layout(x.numel(), group_len, task_len, block)
    if out.numel() < 2 * ng * ns or out.dtype != torch.float32:
        raise ValueError(f"two_read_probe: out needs >= {2 * ng * ns} float32 elements")
    # the wait is deadlock-free when a group's tasks (consecutive tickets) fit on the device at once
    wait = x.is_cuda and ns <= target_programs(x.device, 1)
    _two_read_probe_kernel[(ng * ns,)](x, out, counters(x.device, 1 + 2 * ng), ng, ns, group_len, ch, BLOCK=block,
                                       WAIT=wait, num_warps=num_warps)
    return out[:2 * ng * ns].view(ng * ns, 2)


def two_read_probe_reference(x: torch.Tensor, group_len: int, task_len: int, num_warps: int = 4,
                             per_thread: int = 8) -> torch.Tensor:
    """PyTorch reference of `two_read_probe`: each task's fp32 sum, twice."""
    _, _, ch = _two_read_layout(x.numel(), group_len, task_len, num_warps * 32 * per_thread)
    sums = torch.stack([c.float().sum() for g in x.reshape(-1, group_len) for c in g.split(ch)])
    return torch.stack([sums, sums], dim=1)


# (task bytes, warps, elements per thread): H200, 123-197 MB of bf16 in groups of 2-5 rows of
# 32064, a sweep of 12-96 KB tasks and 2-8 warps: the best at each size was one of these.
_TWO_READ_SHAPES = tuple(itertools.product((16 << 10, 32 << 10, 48 << 10), ((4, 16), (8, 16))))


def two_read_floor_us(nbytes: int, group_bytes: int, device, min_bytes: int = 256 << 20) -> float:
    """Microseconds for `two_read_probe` over `nbytes` of bf16 in groups of `group_bytes` not
    read recently (CUDA-graph replays over rotating copies, the best of `_TWO_READ_SHAPES`)."""
    numel, group_len = max(1, nbytes // 2), max(1, group_bytes // 2)
    numel -= numel % group_len
    copies = [torch.empty(numel, dtype=torch.bfloat16, device=device).normal_()
              for _ in range(max(2, triton.cdiv(min_bytes, numel * 2)))]
    best = float("inf")
    for task_bytes, (warps, per_thread) in _TWO_READ_SHAPES:
        turn = itertools.count()
        ng, ns, _ = _two_read_layout(numel, group_len, task_bytes // 2, warps * 32 * per_thread)
        out = torch.empty(2 * ng * ns, dtype=torch.float32, device=device)

        def call():
            return two_read_probe(copies[next(turn) % len(copies)], out, group_len, task_bytes // 2, warps,
                                  per_thread)
        best = min(best, triton.testing.do_bench_cudagraph(call, rep=60, return_mode="median") * 1e3)
    del copies
    return best
