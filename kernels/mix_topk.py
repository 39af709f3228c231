"""Top k tokens of the ensemble mixture of each draft-tree node, with log q.

Row r = (request b, node t): q = sum_k w_k 2^(x_k * scale - lse2_k) over the vocabulary,
x_k = logits[b*K + k, t]. The vocabulary is cut into S chunks of at most `_MAX_CHUNK`
columns (`topk_plan`: shapes and SM count only, no host sync, so the call can be captured in
a CUDA graph); each program reads its chunk in one tile:

  1. `_topk_stats_kernel`, grid (rows, S): each view's max and sum-exp over the chunk.
  2. `_topk_chunk_kernel`, grid (rows, S): folds the row's S partials into the views'
     normalisers, computes q over its chunk and keeps its k best as 64-bit keys (q's float
     bits above, BIG_IDX - column below: q >= 0, so one integer max ranks by q, then by the
     lowest column); the row's last program to arrive (atomic counter) folds the S * k
     keys into the row's k tokens and log q.

NaN q (NaN logits) ranks above every number, as in torch.topk.
"""
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ._common import BIG_IDX, LOG2E, NEG_BIG, chunking, counters, exp2, n_vsplit, pdl, pdl_wait, sm_count
from .ensemble_mix import _row_normalisers, _tile_q

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_MAX_K = 8
_MAX_CHUNK = 2048          # columns per program, read in one tile
_PROGRAMS_PER_SM = 4


@dataclass(frozen=True)
class TopkPlan:
    """How `mix_topk` launches for one shape (`topk_plan`)."""
    splits: int   # S, chunks per row
    chunk: int    # columns per chunk
    block: int    # the chunk's tile (a power of two)
    warps: int


def topk_plan(rows, V, *, sms, splits=None):
    """The launch plan of `mix_topk` for `rows` (request, node) rows over V columns on a device of
    `sms` SMs; `splits` overrides the number of chunks (tests split small vocabularies)."""
    if splits is None:
        splits = n_vsplit(rows, V, _PROGRAMS_PER_SM * sms)
    S, chunk = chunking(V, max(splits, triton.cdiv(V, _MAX_CHUNK)))
    block = triton.next_power_of_2(chunk)
    return TopkPlan(splits=S, chunk=chunk, block=block, warps=max(4, min(16, block // 256)))


@triton.jit
def _topk_stats_kernel(logits_ptr, part_ptr, T, V, S, CHUNK, stride_r, stride_t, scale,
                       K: tl.constexpr, KP: tl.constexpr, BLOCK: tl.constexpr, FAST: tl.constexpr,
                       PDL: tl.constexpr):
    """Chunk program_id(1) of row program_id(0) = b * T + t: each view's max and sum of
    exp2((x - max) * scale) over the chunk, into part row (row, chunk) [max_k | sumexp_k]."""
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    sp = tl.program_id(1)
    b = row // T
    start = sp * CHUNK
    offs = start + tl.arange(0, BLOCK)
    vmask = offs < tl.minimum(start + CHUNK, V)
    base = logits_ptr + (row % T) * stride_t
    out = part_ptr + (row * S + sp) * (2 * KP)
    for k in tl.static_range(K):
        x = tl.load(base + (b * K + k) * stride_r + offs, mask=vmask, other=float("-inf")).to(tl.float32)
        m = tl.maximum(tl.max(x, axis=0), NEG_BIG)   # finite: (x - m) is never NaN
        tl.store(out + k, m)
        tl.store(out + KP + k, tl.sum(exp2((x - m) * scale, FAST), axis=0))


@triton.jit
def _topk_chunk_kernel(logits_ptr, w_ptr, part_ptr, cand_ptr, cnt_ptr, ids_ptr, logq_ptr,
                       T, V, S, CHUNK, stride_r, stride_t, stride_wb, stride_wt, stride_wk, scale,
                       K: tl.constexpr, KP: tl.constexpr, SP: tl.constexpr, KK: tl.constexpr,
                       KKP: tl.constexpr, BLOCK: tl.constexpr, FAST: tl.constexpr, PDL: tl.constexpr):
    """Chunk program_id(1) of row program_id(0) = b * T + t: q over the chunk, its KK best keys
    into cand row (row, chunk); the row's last program folds the S rows into ids / logq row."""
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    sp = tl.program_id(1)
    b = row // T
    t = row % T
    ks = tl.arange(0, KP)
    kmask = ks < K
    ss = tl.arange(0, SP)
    smask = ss < S
    _, _, lse2 = _row_normalisers(part_ptr + (row * S + ss) * (2 * KP), ks, smask[:, None] & kmask[None, :],
                                  kmask, scale, KP, FAST)
    w = tl.load(w_ptr + b * stride_wb + t * stride_wt + ks * stride_wk, mask=kmask, other=0.0)
    start = sp * CHUNK
    offs = start + tl.arange(0, BLOCK)
    vmask = offs < tl.minimum(start + CHUNK, V)
    q = _tile_q(logits_ptr + t * stride_t, b, offs, vmask, w, lse2, ks, stride_r, scale, K, FAST)
    key = (q.to(tl.int32, bitcast=True).to(tl.int64) << 32) | (tl.full([BLOCK], BIG_IDX, tl.int64) - offs)
    key = tl.where(vmask, key, -1)
    jj = tl.arange(0, KKP)
    best = tl.full([KKP], -1, tl.int64)
    for j in tl.static_range(KK):        # KK times: the best key, then drop it (keys are distinct)
        top = tl.max(key, axis=0)
        best = tl.where(jj == j, top, best)
        key = tl.where(key == top, -1, key)
    tl.store(cand_ptr + (row * S + sp) * KKP + jj, best)
    tl.debug_barrier()  # the chunk's keys are stored before the release below
    arrived = tl.atomic_add(cnt_ptr + row, 1, sem="acq_rel", scope="gpu")
    if arrived == S - 1:  # the row's last chunk: its S * KK keys -> the row's KK best
        cols = tl.arange(0, SP * KKP)
        keys = tl.load(cand_ptr + row * S * KKP + cols, mask=cols < S * KKP, other=-1, cache_modifier=".cg")
        top_k = tl.full([KKP], -1, tl.int64)
        for j in tl.static_range(KK):
            top = tl.max(keys, axis=0)
            top_k = tl.where(jj == j, top, top_k)
            keys = tl.where(keys == top, -1, keys)
        hi = top_k >> 32
        qv = hi.to(tl.int32).to(tl.float32, bitcast=True)
        tl.store(ids_ptr + row * KK + jj, tl.full([KKP], BIG_IDX, tl.int64) - (top_k - (hi << 32)), mask=jj < KK)
        tl.store(logq_ptr + row * KK + jj, tl.log(qv), mask=jj < KK)
        tl.store(cnt_ptr + row, 0)  # every chunk has arrived: ready for the next launch


def mix_topk(logits, w, k, temperature=1.0, *, plan=None):
    """Triton launcher; see `tabed_engine.ops.mix_topk.mix_topk` for the contract. `plan`: a
    `topk_plan` for these shapes (default: the device's). No host synchronisation."""
    if logits.dim() != 3 or w.dim() not in (2, 3):
        raise ValueError(f"logits must be [B*K, T, V] and w [B, K] or [B, T, K], got {tuple(logits.shape)} "
                         f"and {tuple(w.shape)}")
    if logits.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"logits dtype {logits.dtype} not supported")
    if w.dtype != torch.float32:
        raise TypeError(f"w must be float32, got {w.dtype}")
    R, T, V = logits.shape
    B, K = w.shape[0], w.shape[-1]
    if B == 0 or R != B * K or (w.dim() == 3 and w.shape[1] != T):
        raise ValueError(f"logits {tuple(logits.shape)} do not match w {tuple(w.shape)}")
    if not 1 <= k <= min(_MAX_K, V):
        raise ValueError(f"k must be in 1..{min(_MAX_K, V)}, got {k}")
    if logits.stride(2) != 1:
        raise ValueError("logits must have a contiguous last dimension")
    if w.device != logits.device:
        raise ValueError("logits and w must be on one device")
    dev = logits.device
    rows = B * T
    if plan is None:
        plan = topk_plan(rows, V, sms=sm_count(dev))
    S = plan.splits
    KP, SP, KKP = triton.next_power_of_2(K), triton.next_power_of_2(S), triton.next_power_of_2(k)
    ids = torch.empty(B, T, k, dtype=torch.int64, device=dev)
    logq = torch.empty(B, T, k, dtype=torch.float32, device=dev)
    part = torch.empty(rows * S * 2 * KP, dtype=torch.float32, device=dev)
    cand = torch.empty(rows * S * KKP, dtype=torch.int64, device=dev)
    wb, wt, wk = (w.stride(0), 0, w.stride(1)) if w.dim() == 2 else w.stride()
    scale = LOG2E.value / float(temperature)   # exp(x / T) = exp2(x * scale)
    fast = dev.type == "cuda"
    use_pdl = pdl(dev)
    _topk_stats_kernel[(rows, S)](
        logits, part, T, V, S, plan.chunk, logits.stride(0), logits.stride(1), scale,
        K=K, KP=KP, BLOCK=plan.block, FAST=fast, PDL=use_pdl, launch_pdl=use_pdl, num_warps=plan.warps,
    )
    _topk_chunk_kernel[(rows, S)](
        logits, w, part, cand, counters(dev, rows), ids, logq,
        T, V, S, plan.chunk, logits.stride(0), logits.stride(1), wb, wt, wk, scale,
        K=K, KP=KP, SP=SP, KK=k, KKP=KKP, BLOCK=plan.block, FAST=fast, PDL=use_pdl, launch_pdl=use_pdl,
        num_warps=plan.warps,
    )
    return ids, logq
