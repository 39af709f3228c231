"""The k children of each draft-tree node from its ensemble mixture: the top k tokens (greedy) or
k draws without replacement (Gumbel-top-k), with log q.

Row r = (request b, node t): q = sum_k w_k 2^(x_k * scale - lse2_k) over the vocabulary,
x_k = logits[b*K + k, t]. The vocabulary is cut into S chunks of at most `_MAX_CHUNK`
columns (`topk_plan`: shapes and SM count only, no host sync, so the call can be captured in
a CUDA graph); each program reads its chunk in one tile:

  1. `_topk_stats_kernel`, grid (rows, S): each view's max and sum-exp over the chunk.
  2. `_topk_chunk_kernel`, grid (rows, S): folds the row's S partials into the views'
     normalisers, computes q over its chunk (and stores it into the mixture rows when asked),
     ranks its columns by q (greedy) or by log q + Gumbel noise (sampling) and keeps its k
     best; the row's last program to arrive (atomic counter) folds the S * k candidates into
     the row's k children. Equal ranks go to the lowest column, whatever the split.

The noise is `ops.mix_topk.hash_uniform` bit for bit (splitmix64 in uint64 of the seed and
counter offset + r * V + column, float64 uniforms, -log(-log u) in float64): the reference's
draw, up to the float rounding of log q (the mixture is summed in another order).
"""
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ._common import BIG_IDX, LOG2E, NEG_BIG, argmax_lowest, chunking, counters, exp2, n_vsplit, pdl, pdl_wait, sm_count
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
def hash_uniform(seed, counter):
    """Uniforms in (0, 1), float64, of int64 counters: splitmix64 of seed + counter * golden
    in uint64, as `tabed_engine.ops.mix_topk.hash_uniform`."""
    z = seed.to(tl.uint64, bitcast=True) + counter.to(tl.uint64, bitcast=True) * 0x9E3779B97F4A7C15
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB
    z = z ^ (z >> 31)
    return ((z >> 11).to(tl.float64) + 0.5) * 1.1102230246251565e-16     # 2^-53


@triton.jit
def _top(val, col, q, KK: tl.constexpr, KKP: tl.constexpr):
    """The KK largest `val` (ties: the lowest `col`) by KK rounds of max: their val, col and q,
    [KKP] each, in rank order (padding: -inf, BIG_IDX, 0)."""
    jj = tl.arange(0, KKP)
    top_v = tl.full([KKP], float("-inf"), val.dtype)
    top_c = tl.full([KKP], BIG_IDX, tl.int32)
    top_q = tl.zeros([KKP], tl.float32)
    for j in tl.static_range(KK):
        best, c = argmax_lowest(val, col, 0)
        hit = col == c
        top_v = tl.where(jj == j, best, top_v)
        top_c = tl.where(jj == j, c, top_c)
        top_q = tl.where(jj == j, tl.sum(tl.where(hit, q, 0.0), axis=0), top_q)
        val = tl.where(hit, float("-inf"), val)
        col = tl.where(hit, BIG_IDX, col)      # out of the later rounds, even among -inf values
    return top_v, top_c, top_q


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
def _topk_chunk_kernel(logits_ptr, w_ptr, part_ptr, seed_ptr, offset_ptr, mix_ptr, mix_rows_ptr,
                       cand_v_ptr, cand_c_ptr, cand_q_ptr, cnt_ptr, ids_ptr, logq_ptr,
                       T, V, S, CHUNK, stride_r, stride_t, stride_wb, stride_wt, stride_wk,
                       stride_mb, stride_mn, stride_rb, stride_rt, scale,
                       K: tl.constexpr, KP: tl.constexpr, SP: tl.constexpr, KK: tl.constexpr,
                       KKP: tl.constexpr, BLOCK: tl.constexpr, DRAW: tl.constexpr, WRITE_MIX: tl.constexpr,
                       FAST: tl.constexpr, PDL: tl.constexpr):
    """Chunk program_id(1) of row program_id(0) = b * T + t: q over the chunk (WRITE_MIX: into
    mixture row mix_rows[b, t] of request b), its KK best candidates (DRAW: by log q + Gumbel
    noise, else by q) into cand row (row, chunk); the row's last program folds the S rows into
    ids / logq row."""
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    sp = tl.program_id(1)
    b = row // T
    t = row % T
    ks = tl.arange(0, KP)
    kmask = ks < K
    ss = tl.arange(0, SP)
    smask = ss < S
    _pm, _ps, lse2 = _row_normalisers(part_ptr + (row * S + ss) * (2 * KP), ks, smask[:, None] & kmask[None, :],
                                  kmask, scale, KP, FAST)
    w = tl.load(w_ptr + b * stride_wb + t * stride_wt + ks * stride_wk, mask=kmask, other=0.0)
    start = sp * CHUNK
    offs = start + tl.arange(0, BLOCK)
    vmask = offs < tl.minimum(start + CHUNK, V)
    q = _tile_q(logits_ptr + t * stride_t, b, offs, vmask, w, lse2, ks, stride_r, scale, K, FAST)
    if WRITE_MIX:
        node = tl.load(mix_rows_ptr + b * stride_rb + t * stride_rt)
        tl.store(mix_ptr + b * stride_mb + node * stride_mn + offs, q, mask=vmask)
    if DRAW:
        u = hash_uniform(tl.load(seed_ptr), tl.load(offset_ptr) + row * V + offs)
        val = tl.log(q).to(tl.float64) - tl.log(-tl.log(u))
    else:
        val = q
    cv, cc, cq = _top(tl.where(vmask, val, float("-inf")), offs, q, KK, KKP)
    jj = tl.arange(0, KKP)
    cand = (row * S + sp) * KKP + jj
    tl.store(cand_v_ptr + cand, cv.to(tl.float64))
    tl.store(cand_c_ptr + cand, cc)
    tl.store(cand_q_ptr + cand, cq)
    tl.debug_barrier()  # the chunk's candidates are stored before the release below
    arrived = tl.atomic_add(cnt_ptr + row, 1, sem="acq_rel", scope="gpu")
    if arrived == S - 1:  # the row's last chunk: its S * KKP candidates -> the row's KK children
        i = row * S * KKP + tl.arange(0, SP * KKP)
        imask = i < (row + 1) * S * KKP
        _val, col, qv = _top(tl.load(cand_v_ptr + i, mask=imask, other=float("-inf"), cache_modifier=".cg"),
                          tl.load(cand_c_ptr + i, mask=imask, other=BIG_IDX, cache_modifier=".cg"),
                          tl.load(cand_q_ptr + i, mask=imask, other=0.0, cache_modifier=".cg"), KK, KKP)
        tl.store(ids_ptr + row * KK + jj, col.to(tl.int64), mask=jj < KK)
        tl.store(logq_ptr + row * KK + jj, tl.log(qv), mask=jj < KK)
        tl.store(cnt_ptr + row, 0)  # every chunk has arrived: ready for the next launch


def mix_topk(logits, w, k, temperature=1.0, *, seed=None, offset=None, mixture_out=None, out_rows=None,
             plan=None):
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
    dev = logits.device
    draw, write_mix = seed is not None, mixture_out is not None
    if draw != (offset is not None) or write_mix != (out_rows is not None):
        raise ValueError("seed comes with offset, mixture_out with out_rows")
    if draw and (seed.dtype != torch.int64 or offset.dtype != torch.int64):
        raise TypeError("seed and offset must be int64 tensors")
    if write_mix and (mixture_out.dim() != 3 or mixture_out.shape[0] != B or mixture_out.shape[2] != V
                      or mixture_out.dtype != torch.float32 or mixture_out.stride(2) != 1
                      or out_rows.shape != (B, T) or out_rows.dtype != torch.int64):
        raise ValueError(f"mixture_out must be float32 [{B}, N, {V}] with unit last stride and out_rows int64 "
                         f"[{B}, {T}]")
    if any(x.device != dev for x in (w, seed, offset, mixture_out, out_rows) if x is not None):
        raise ValueError("all tensors must be on the logits' device")
    rows = B * T
    if plan is None:
        plan = topk_plan(rows, V, sms=sm_count(dev))
    S = plan.splits
    KP, SP, KKP = triton.next_power_of_2(K), triton.next_power_of_2(S), triton.next_power_of_2(k)
    ids = torch.empty(B, T, k, dtype=torch.int64, device=dev)
    logq = torch.empty(B, T, k, dtype=torch.float32, device=dev)
    part = torch.empty(rows * S * 2 * KP, dtype=torch.float32, device=dev)
    cand_v = torch.empty(rows * S * KKP, dtype=torch.float64, device=dev)
    cand_c = torch.empty(rows * S * KKP, dtype=torch.int32, device=dev)
    cand_q = torch.empty(rows * S * KKP, dtype=torch.float32, device=dev)
    wb, wt, wk = (w.stride(0), 0, w.stride(1)) if w.dim() == 2 else w.stride()
    mb, mn = (mixture_out.stride(0), mixture_out.stride(1)) if write_mix else (0, 0)
    rb, rt = out_rows.stride() if write_mix else (0, 0)
    scale = LOG2E.value / float(temperature)   # exp(x / T) = exp2(x * scale)
    fast = dev.type == "cuda"
    use_pdl = pdl(dev)
    _topk_stats_kernel[(rows, S)](
        logits, part, T, V, S, plan.chunk, logits.stride(0), logits.stride(1), scale,
        K=K, KP=KP, BLOCK=plan.block, FAST=fast, PDL=use_pdl, launch_pdl=use_pdl, num_warps=plan.warps,
    )
    _topk_chunk_kernel[(rows, S)](
        logits, w, part, seed if draw else ids, offset if draw else ids, mixture_out if write_mix else logq,
        out_rows if write_mix else ids, cand_v, cand_c, cand_q, counters(dev, rows), ids, logq,
        T, V, S, plan.chunk, logits.stride(0), logits.stride(1), wb, wt, wk, mb, mn, rb, rt, scale,
        K=K, KP=KP, SP=SP, KK=k, KKP=KKP, BLOCK=plan.block, DRAW=draw, WRITE_MIX=write_mix, FAST=fast,
        PDL=use_pdl, launch_pdl=use_pdl, num_warps=plan.warps,
    )
    return ids, logq
