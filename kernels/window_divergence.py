"""Divergences between the target distribution and each draft view over a window.

The engine calls this once per speculative block at B=1, P=gamma (5-6), K in {2, 4},
V=32064: B*P is tiny, so the vocabulary itself is split over programs.  Two launches:

1. `_wd_stats_kernel`, grid (B*P, NS1): per V split, the running max and sum-exp of the
   target row and of the K view rows (logits / temperature), and the target's first
   argmax.  It also zeroes the per-(row, grid chunk) arrival counters used by launch 2.
2. `_wd_div_kernel`, grid (B*P, NS2, n_chunks): every program merges the NS1 partial
   normalisers of its row (a few hundred bytes from L2), then over its V split computes
   (chunk 0) the partial KL(p||q_k) and sum |p - q_k|, and, with a weight grid, for the
   G_BLOCK weight vectors of its chunk the mixtures sum_k g_k q_k: partial (max, first
   argmax) and partial KL(p||mixture), so G x P x V is never stored.  Partials go to a
   workspace; the last program of each (row, chunk) to arrive (atomic counter, the
   "last block" pattern) reduces the NS2 partials in split order and writes the outputs.

Two passes over the logits: TV needs both normalisers before any |p - q_k| term, unless
the caller has them (the engine does: the draft's mixing kernel returns the views', the
greedy verification the target's): then `_wd_given_kernel` is one launch and one pass
for KL and TV, every term final when read. KL alone (the kld and hedge policies) needs
no normaliser up front: `_wd_kl_kernel` is one launch and one pass,
sum_v p_v (y_p - y_k) accumulated against the running max of the target and rescaled
with its sum-exp, the last program of each row folding the splits (with few rows, as at
the engine's B = 1, each program takes one view and the target is read once per view).
Without normalisers and without a grid, where the logits exceed half of L2, TV is one
launch too (`_wd_tv_fused_kernel`): each program runs the KL pass over its split (which
yields the normalisers' partials), waits for the other splits of its (row, view group),
and reads its split again for TV while it is still in L2.
The stats launch and the KL pass keep running max / sum-exp per thread over 16-byte
groups that thread alone loads (as `ensemble_mix` pass 1, see `_common`; the KL-only and
given-normaliser kernels lay their tiles out slot-major, `slot_cols`, so that a slot's
groups stay in one thread), the divergence launch element-wise running partial KL and TV;
all reduce across the tile once per program; exponentials are exp2 with temperature and
log2(e) folded into one scale, and the divergences are summed in log2 units and scaled by
ln 2 once.

Everything accumulates in fp32; argmax ties resolve to the lowest index (torch.argmax);
split counts depend on shapes and the SM count only (no host sync: the launcher runs in
graph capture); the partial sums are reduced in a fixed order, so results are
deterministic.
"""
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ._common import (_MAX_SPLITS, BIG_IDX, LN2, LOG2E, NEG_BIG, counters, exp2, group_best_cols, group_cols,
                      group_items, group_lse_step, l2_cache_bytes, log2, lse_reduce, pdl, pdl_wait, slot_cols,
                      target_programs, ticket, tile_warps)

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# The mixture loop works on q * 2^_MIX_SHIFT so that flush-to-zero MUFU ops lose nothing
# that fp32 softmax keeps (q >= 2^-149); the shift is exact in log2 and cancels in argmax.
_MIX_SHIFT = tl.constexpr(24.0)
_target_programs = target_programs
# With a weight grid, by the launch's mixture rows R * G (R = B * P positions): (most
# vectors per [G_BLOCK, columns] tile, tile elements, programs per SM). Few mixture rows
# leave the launch latency bound: small tiles, more of them per SM. Many rows make it
# throughput bound: 16-row tiles share each column's loads and K exps among 16 mixtures.
# H200 (graph replays, V = 32064; sweep of G_BLOCK 4 / 8 / 16 x tiles of 1024 / 2048 / 4096
# x 4 / 8 warps x 4 / 8 / 16 programs per SM at B = 1, 4 warps always best): B = 1, P = 5, G = 11
# (R * G = 55) 14.6 -> 9.9 us with (4, 1024, 4); B = 1, G = 66 (396) 31.0 -> 24.7 with
# (8, 1024, 8); B = 1, G = 286 (1716) fastest with (16, 2048, 8), 62.9 us; B = 16, G = 11
# (880) 47.1 us with (16, 2048, 8), 67.6 with (4, 1024, 4).
_GRID_TILES = ((128, 4, 1024, 4), (512, 8, 1024, 8), (None, 16, 2048, 8))
# Without a grid: programs per SM of both launches, [KP + 1, columns] elements per step and
# the divergence launch's warps. H200 sweep (cold, graph replays, one process; 9 settings of
# 4 / 8 / 16 per SM x 1024 / 2048 / 4096 x 4 / 8 warps, B = 16, K = 4 and B = 64, K = 1 at
# P = 6, B = 1): these were within 1-3% of the best (8 warps: 27.9 -> 27.6 us, 34.6 -> 33.5);
# 4 per SM or 4096-column tiles up to 34% slower. TV reads the logits twice (26-35% of copy).
_TV_PROGRAMS_PER_SM = 8
_TV_TILE = 2048
_TV_DIV_WARPS = 4


# TV (and KL) without a grid from normalisers the caller has (p_lse, q_lse): one pass, the
# layout of the KL-only pass, wide steps past L2 (see _KL_WIDE_PAST_L2). H200, cold bf16
# inputs, graph replays (two-pass TV -> this): B = 1, K = 2, P = 5 6.68 -> 3.61 us, B = 1,
# K = 4, P = 6 8.25 -> 4.26, B = 16, K = 4 (31 MB) 27.8 -> 15.8 (26% -> 46% of copy; wide
# steps there 17.9), B = 64, K = 1 (49 MB) 34.6 -> 15.9 (73%), B = 64, K = 4 (123 MB) 102.8
# -> 40.5 (72%; 512-column steps 52.7), B = 256, K = 1 (197 MB) 112.0 -> 52.4 (88%). KL alone
# stays on the online pass (it needs no normalisers, so the caller need not produce them):
# from given ones 3.31 vs 3.64 us at B = 1, K = 2, 14.2 vs 17.6 at B = 16, K = 4, but 21.1 vs
# 17.4 at B = 64, K = 1. (The numbers behind `_wd_given_kernel` and its launcher.)


def check_normalisers(p_lse, q_lse, B, K, P, device):
    """Validate optional given log-normalisers: both or neither, float32 [B, P] and
    [B, K, P] on `device`. Returns whether they are given."""
    if p_lse is None and q_lse is None:
        return False
    if p_lse is None or q_lse is None:
        raise ValueError("p_lse and q_lse are given together or not at all")
    for name, t, shape in (("p_lse", p_lse, (B, P)), ("q_lse", q_lse, (B, K, P))):
        if tuple(t.shape) != shape or t.dtype != torch.float32 or t.device != device:
            raise ValueError(f"{name} must be float32 {list(shape)} on {device}, got {t.dtype} "
                             f"{list(t.shape)} on {t.device}")
    return True


def _split(V, unit, rows, target):
    """(chunk length, number of chunks) of V: `rows * chunks` near `target` programs,
    chunks a multiple of `unit` elements and at most _MAX_SPLITS of them."""
    n_units = triton.cdiv(V, unit)
    per = max(1, (n_units * rows) // max(target, 1), triton.cdiv(n_units, _MAX_SPLITS))
    chunk = per * unit
    return chunk, triton.cdiv(V, chunk)


@triton.jit
def _target_block(p_row, v0, cols, v_end, scale, lse_p, rows, FAST: tl.constexpr):
    """Target log2-probabilities and probabilities at columns v0 + cols (below v_end),
    the row repeated for each of `rows`: a [R, BLOCK] tile laid out like the [KP, BLOCK]
    view tiles (R = KP) costs R - 1 extra L1 hits and exp2s per column, where a [BLOCK]
    vector broadcast over the views took a shared-memory layout change (6 barriers) per
    step."""
    offs = v0 + cols
    vmask = offs < v_end
    x = tl.load(p_row + offs[None, :] + 0 * rows[:, None], mask=vmask[None, :],
                other=float("-inf")).to(tl.float32)
    logp = x * scale - lse_p
    return logp, exp2(logp, FAST), offs, vmask


@triton.jit
def _wd_stats_kernel(
    p_ptr, q_ptr, m_ptr, s_ptr, idx_ptr, cnt_ptr,
    P, V, CH, NS, NCNT, stride_pb, stride_pp, stride_qb, stride_qk, stride_qp, scale,
    K: tl.constexpr, KP: tl.constexpr, BLOCK: tl.constexpr, VEC: tl.constexpr, RPT: tl.constexpr,
    FAST: tl.constexpr, PDL: tl.constexpr,
):
    """Launch 1: per (row, V split) max and sum-exp of the target and the K views, and the
    target's first argmax. Thread-owned groups (see `_common`): [1, RPT, NT, VEC] target and
    [KP, RPT, NT, VEC] view tiles per step, running values per slot, in logit units (the
    target argmax is taken on the logits, as torch.argmax)."""
    pdl_wait(PDL)
    row = tl.program_id(0)
    split = tl.program_id(1)
    b = row.to(tl.int64) // P
    pos = row.to(tl.int64) % P
    ks = tl.arange(0, KP)
    kmask = ks < K
    one = tl.arange(0, 1)
    p_rows = (p_ptr + b * stride_pb + pos * stride_pp + one.to(tl.int64))[:, None, None, None]
    q_rows = (q_ptr + b * stride_qb + pos * stride_qp + ks.to(tl.int64) * stride_qk)[:, None, None, None]
    v_start = split * CH
    v_end = tl.minimum(v_start + CH, V)
    NT: tl.constexpr = BLOCK // (RPT * VEC)
    cols = group_cols(RPT, NT, VEC)
    mp = tl.full([1, NT], NEG_BIG, tl.float32)
    sp = tl.zeros([1, NT], tl.float32)
    bx = tl.full([1, RPT, NT, VEC], NEG_BIG, tl.float32)   # each slot's best step of the target
    b_v0 = tl.zeros([1, NT], tl.int32) + v_start
    mq = tl.full([KP, NT], NEG_BIG, tl.float32)
    sq = tl.zeros([KP, NT], tl.float32)
    for v0 in range(v_start, v_end, BLOCK):
        offs = (v0 + cols)[None]
        vmask = offs < v_end
        xp = tl.load(p_rows + offs, mask=vmask, other=float("-inf")).to(tl.float32)
        xq = tl.load(q_rows + offs, mask=kmask[:, None, None, None] & vmask, other=float("-inf")).to(tl.float32)
        mp, sp, take, _ = group_lse_step(xp, mp, sp, scale, FAST)
        bx = tl.where(take[:, None, :, None], xp, bx)
        b_v0 = tl.where(take, v0, b_v0)
        mq, sq, _, _ = group_lse_step(xq, mq, sq, scale, FAST)
    p_col = group_best_cols(bx, mp, b_v0, cols)                # [1, NT]
    p_idx = tl.min(tl.where(mp == tl.max(mp, axis=1)[:, None], p_col, BIG_IDX), axis=1)
    mp, sp = lse_reduce(mp, sp, scale, 1, FAST)
    mq, sq = lse_reduce(mq, sq, scale, 1, FAST)
    # stats layout [rows, K + 1, NS]: entry 0 is the target, 1 + k view k
    base = row.to(tl.int64) * (K + 1) * NS + split
    tl.store(m_ptr + base + one, mp)
    tl.store(s_ptr + base + one, sp)
    tl.store(m_ptr + base + (1 + ks) * NS, mq, mask=kmask)
    tl.store(s_ptr + base + (1 + ks) * NS, sq, mask=kmask)
    tl.store(idx_ptr + row.to(tl.int64) * NS + split + one, p_idx)
    for c in range(split, NCNT, NS):  # arrival counters of launch 2 (graph replays reuse none)
        tl.store(cnt_ptr + row.to(tl.int64) * NCNT + c, 0)


@triton.jit
def _wd_div_kernel(
    p_ptr, q_ptr, grid_ptr, m_ptr, s_ptr, idx_ptr, cnt_ptr,
    vpart_ptr, gbest_ptr, gidx_ptr, gklp_ptr,
    kl_ptr, tv_ptr, match_ptr, gkl_ptr,
    P, V, G, NS1, CH, NS2, NCH,
    stride_pb, stride_pp, stride_qb, stride_qk, stride_qp, stride_gg, stride_gk, scale,
    K: tl.constexpr, KP: tl.constexpr, NS1P: tl.constexpr, NS2P: tl.constexpr,
    BLOCKV: tl.constexpr, G_BLOCK: tl.constexpr, BLOCKG: tl.constexpr,
    HAS_GRID: tl.constexpr, FAST_MATH: tl.constexpr, PDL: tl.constexpr,
):
    pdl_wait(PDL)
    # Rows and splits in the reverse of launch 1's order: what it read last, the likeliest
    # to be still in L2 when the logits exceed it, is read first.
    row = tl.num_programs(0) - 1 - tl.program_id(0)
    split = tl.num_programs(1) - 1 - tl.program_id(1)
    chunk = tl.program_id(2)
    row64 = row.to(tl.int64)
    b = row64 // P
    pos = row64 % P
    ks = tl.arange(0, KP)
    kmask = ks < K
    p_row = p_ptr + b * stride_pb + pos * stride_pp
    q_row = q_ptr + b * stride_qb + pos * stride_qp
    v_start = split * CH
    v_end = tl.minimum(v_start + CH, V)

    # Merge the NS1 partial normalisers of this row: log2-sum-exp2 of x * scale.
    ss = tl.arange(0, NS1P)
    smask = ss < NS1
    stat = row64 * (K + 1) * NS1
    top, tot = lse_reduce(tl.load(m_ptr + stat + ss, mask=smask, other=NEG_BIG),
                          tl.load(s_ptr + stat + ss, mask=smask, other=0.0), scale, 0, FAST_MATH)
    lse_p = top * scale + log2(tot, FAST_MATH)
    qoff = stat + (1 + ks[:, None]) * NS1 + ss[None, :]
    qmask = kmask[:, None] & smask[None, :]
    top, tot = lse_reduce(tl.load(m_ptr + qoff, mask=qmask, other=NEG_BIG),
                          tl.load(s_ptr + qoff, mask=qmask, other=0.0), scale, 1, FAST_MATH)
    lse_q = tl.where(kmask, top * scale + log2(tl.where(kmask, tot, 1.0), FAST_MATH), 0.0)

    # Per-view partial KL and TV over this split (first grid chunk only), in log2 units.
    vpart = vpart_ptr + (row64 * NS2 + split) * 2 * KP
    if chunk == 0:
        cols = tl.arange(0, BLOCKV)
        kl_acc = tl.zeros([KP, BLOCKV], tl.float32)
        tv_acc = tl.zeros([KP, BLOCKV], tl.float32)
        for v0 in range(v_start, v_end, BLOCKV):
            logp, pv, offs, vmask = _target_block(p_row, v0, cols, v_end, scale, lse_p, ks, FAST_MATH)
            logq = tl.load(q_row + ks.to(tl.int64)[:, None] * stride_qk + offs[None, :],
                           mask=kmask[:, None] & vmask[None, :],
                           other=float("-inf")).to(tl.float32) * scale - lse_q[:, None]
            kl_acc += tl.where(pv > 0, pv * (logp - logq), 0.0)
            tv_acc += tl.abs(pv - exp2(logq, FAST_MATH))
        tl.store(vpart + ks, tl.sum(kl_acc, axis=1) * LN2)
        tl.store(vpart + KP + ks, tl.sum(tv_acc, axis=1))

    # Grid mixtures of this chunk: elementwise running (max, first index, KL) over the split.
    if HAS_GRID:
        gs = chunk * G_BLOCK + tl.arange(0, G_BLOCK)
        gmask = gs < G
        gw = ()  # weight columns, hoisted out of the V loop
        lq = ()  # log2 normalisers of the views, less the shift
        for k in tl.static_range(K):
            gw = gw + (tl.load(grid_ptr + gs * stride_gg + k * stride_gk, mask=gmask, other=0.0),)
            lq = lq + (tl.sum(tl.where(ks == k, lse_q, 0.0), axis=0) - _MIX_SHIFT,)
        cols = tl.arange(0, BLOCKG)
        best = tl.full([G_BLOCK, BLOCKG], float("-inf"), tl.float32)
        bidx = tl.zeros([G_BLOCK, BLOCKG], tl.int32)
        g_kl = tl.zeros([G_BLOCK, BLOCKG], tl.float32)
        for v0 in range(v_start, v_end, BLOCKG):
            logp, pv, offs, vmask = _target_block(p_row, v0, cols, v_end, scale, lse_p,
                                                  tl.arange(0, 1), FAST_MATH)
            ppos = pv > 0
            # p * (log2 p - log2 mix) = p * (c - log2(mix * 2^shift)), c = 0 where p = 0
            c = tl.where(ppos, logp + _MIX_SHIFT, 0.0)
            # -inf outside the split: never an argmax; the first FMA absorbs it
            mix = tl.where(vmask, 0.0, float("-inf"))[None, :]
            for k in tl.static_range(K):
                xq = tl.load(q_row + k * stride_qk + offs, mask=vmask, other=float("-inf")).to(tl.float32)
                qv = exp2(xq * scale - lq[k], FAST_MATH)  # q_k * 2^shift
                mix = mix + gw[k][:, None] * qv[None, :]
            take = mix > best  # strict: the earlier position wins ties
            best = tl.where(take, mix, best)
            bidx = tl.where(take, offs[None, :], bidx)
            g_kl += pv * (c - log2(tl.where(ppos, mix, 1.0), FAST_MATH))
        blk_best = tl.max(best, axis=1)
        blk_idx = tl.min(tl.where(best == blk_best[:, None], bidx, BIG_IDX), axis=1)
        gl = tl.arange(0, G_BLOCK)
        gpart = ((row64 * NCH + chunk) * NS2 + split) * G_BLOCK + gl
        tl.store(gbest_ptr + gpart, blk_best)
        tl.store(gidx_ptr + gpart, blk_idx)
        tl.store(gklp_ptr + gpart, tl.sum(g_kl, axis=1) * LN2)

    # Last program of (row, chunk) to arrive reduces the NS2 partials in split order.
    tl.debug_barrier()  # every thread's partial stores precede the release below
    arrived = tl.atomic_add(cnt_ptr + row64 * NCH + chunk, 1, sem="acq_rel", scope="gpu")
    if arrived == NS2 - 1:
        sp_ = tl.arange(0, NS2P)
        spmask = sp_ < NS2
        if chunk == 0:
            voff = (row64 * NS2 + sp_[:, None]) * 2 * KP + ks[None, :]
            vm = spmask[:, None] & kmask[None, :]
            kl = tl.sum(tl.load(vpart_ptr + voff, mask=vm, other=0.0, cache_modifier=".cg"), axis=0)
            tv = tl.sum(tl.load(vpart_ptr + voff + KP, mask=vm, other=0.0, cache_modifier=".cg"), axis=0)
            out = (b * K + ks) * P + pos
            tl.store(kl_ptr + out, kl, mask=kmask)
            tl.store(tv_ptr + out, 0.5 * tv, mask=kmask)
        if HAS_GRID:
            # target argmax: first split holding the maximum, its first index
            pm = tl.load(m_ptr + stat + ss, mask=smask, other=NEG_BIG)
            pi = tl.load(idx_ptr + row64 * NS1 + ss, mask=smask, other=BIG_IDX)
            p_arg = tl.min(tl.where(smask & (pm == tl.max(pm, axis=0)), pi, BIG_IDX), axis=0)
            gl = tl.arange(0, G_BLOCK)
            goff = ((row64 * NCH + chunk) * NS2 + sp_[:, None]) * G_BLOCK + gl[None, :]
            gm = spmask[:, None] & (gs < G)[None, :]
            vbest = tl.load(gbest_ptr + goff, mask=gm, other=float("-inf"), cache_modifier=".cg")
            vidx = tl.load(gidx_ptr + goff, mask=gm, other=BIG_IDX, cache_modifier=".cg")
            vkl = tl.load(gklp_ptr + goff, mask=gm, other=0.0, cache_modifier=".cg")
            top_g = tl.max(vbest, axis=0)
            arg_g = tl.min(tl.where(spmask[:, None] & (vbest == top_g[None, :]), vidx, BIG_IDX), axis=0)
            gout = (b * G + gs) * P + pos
            tl.store(match_ptr + gout, (arg_g == p_arg).to(tl.int8), mask=gs < G)
            tl.store(gkl_ptr + gout, tl.sum(vkl, axis=0), mask=gs < G)


@triton.jit
def _one_pass_place(p_ptr, q_ptr, row64, split, kg, P, V, CH, stride_pb, stride_pp, stride_qb, stride_qk, stride_qp,
                    K: tl.constexpr):
    """A one-pass program's place: (request b, position, target row pointer, pointer to the
    first of its K views' rows, the split's columns [v_start, v_end)), for row `row64`
    (int64, b * P + position), V split `split` and view group `kg` (views kg * K ..)."""
    b = row64 // P
    pos = row64 % P
    v_start = split * CH
    return (b, pos, p_ptr + b * stride_pb + pos * stride_pp, q_ptr + b * stride_qb + pos * stride_qp
            + (kg * K) * stride_qk, v_start, tl.minimum(v_start + CH, V))


@triton.jit
def _one_pass_program(p_ptr, q_ptr, P, V, CH, stride_pb, stride_pp, stride_qb, stride_qk, stride_qp, K: tl.constexpr):
    """`_one_pass_place` of a program of grid (B*P, NS, view groups), with its split, view
    group and (row, group) index first."""
    split = tl.program_id(1)
    kg = tl.program_id(2)
    row64 = tl.program_id(0).to(tl.int64)
    b, pos, p_row, q_row, v_start, v_end = _one_pass_place(
        p_ptr, q_ptr, row64, split, kg, P, V, CH, stride_pb, stride_pp, stride_qb, stride_qk, stride_qp, K)
    return split, kg, row64 * tl.num_programs(2) + kg, b, pos, p_row, q_row, v_start, v_end


@triton.jit
def _step_cols(RPT: tl.constexpr, NT: tl.constexpr, VEC: tl.constexpr, SLOT_MAJOR: tl.constexpr):
    """A one-pass step's columns: [NT, RPT, VEC] (`slot_cols`) or [RPT, NT, VEC] (`group_cols`)."""
    if SLOT_MAJOR:
        cols = slot_cols(RPT, NT, VEC)
    else:
        cols = group_cols(RPT, NT, VEC)
    return cols


@triton.jit
def _slot_max(x, SLOT_MAJOR: tl.constexpr):
    """Each slot's max over its groups of a `_step_cols` tile: [NT]."""
    return tl.max(tl.max(x, axis=2), axis=1 if SLOT_MAJOR else 0)


@triton.jit
def _slot_sum(x, SLOT_MAJOR: tl.constexpr):
    """Each slot's sum over its groups of a `_step_cols` tile: [NT]."""
    return tl.sum(tl.sum(x, axis=2), axis=1 if SLOT_MAJOR else 0)


@triton.jit
def _per_slot(v, SLOT_MAJOR: tl.constexpr):
    """A per-slot value [NT] broadcast against a `_step_cols` tile."""
    if SLOT_MAJOR:
        r = v[:, None, None]
    else:
        r = v[None, :, None]
    return r


@triton.jit
def _kl_partial(p_row, q_row, stride_qk, v_start, v_end, part, scale,
                K: tl.constexpr, BLOCK: tl.constexpr, VEC: tl.constexpr, RPT: tl.constexpr, STAGES: tl.constexpr,
                FAST: tl.constexpr, EVICT: tl.constexpr, RS: tl.constexpr, SLOT_MAJOR: tl.constexpr):
    """The KL pass over columns [v_start, v_end) of a target row and K view rows (q_row,
    q_row + stride_qk, ..): stores the partials [m, S, A_k | m_k, s_k] at `part`.

    KL(p || q_k) = sum_v p_v (y_p - y_k) - lse_p + lse_k (y = x * scale, log2 units), and
    sum_v p_v (y_p - y_k) = A_k / S with S = sum exp2(y_p - m) and A_k = sum exp2(y_p - m)
    (x_p - x_k): A_k is rescaled with S whenever the running max m moves, so neither
    normaliser is needed before the sums.  Each step reads [RPT, BLOCK // (RPT * VEC), VEC]
    tiles of the target and of each view (a static loop): VEC contiguous columns (16 bytes)
    form a group that one thread loads and reduces alone, so every running value lives per
    thread slot ([BLOCK // (RPT * VEC)]): the slot's max, one exp2 per element against the
    new max, one per slot and step to rescale the sums (as in `ensemble_mix` pass 1).
    EVICT: the loads' eviction policy; RS: 0, or the partials' tile fold stacked in RS rows
    (`_kl_fold_stacked`); SLOT_MAJOR: the tiles' layout (`_step_cols`)."""
    NT: tl.constexpr = BLOCK // (RPT * VEC)
    cols = _step_cols(RPT, NT, VEC, SLOT_MAJOR)          # the columns of a step
    mp = tl.full([NT], NEG_BIG, tl.float32)
    sp = tl.zeros([NT], tl.float32)
    mq = ()
    sq = ()
    acc = ()
    for k in tl.static_range(K):
        mq = mq + (tl.full([NT], NEG_BIG, tl.float32),)
        sq = sq + (tl.zeros([NT], tl.float32),)
        acc = acc + (tl.zeros([NT], tl.float32),)
    for v0 in tl.range(v_start, v_end, BLOCK, num_stages=STAGES):
        offs = v0 + cols
        vmask = offs < v_end
        xp = tl.load(p_row + offs, mask=vmask, other=float("-inf"), eviction_policy=EVICT).to(tl.float32)
        mp_new = tl.maximum(mp, _slot_max(xp, SLOT_MAJOR))
        rescale = exp2((mp - mp_new) * scale, FAST)                  # old sums move to the new max
        ep = exp2(xp * scale - _per_slot(tl.maximum(mp_new * scale, NEG_BIG), SLOT_MAJOR), FAST)  # 0 where p_v = 0
        sp = sp * rescale + _slot_sum(ep, SLOT_MAJOR)
        mp = mp_new
        n_mq = ()
        n_sq = ()
        n_acc = ()
        for k in tl.static_range(K):
            xq = tl.load(q_row + k * stride_qk + offs, mask=vmask, other=float("-inf"),
                         eviction_policy=EVICT).to(tl.float32)
            # `group_lse_step` on 3D tiles: through it (as xq[None]) the loop took 2x as long
            m_k = tl.maximum(mq[k], _slot_max(xq, SLOT_MAJOR))
            eq = exp2(xq * scale - _per_slot(tl.maximum(m_k * scale, NEG_BIG), SLOT_MAJOR), FAST)
            n_sq = n_sq + (sq[k] * exp2((mq[k] - m_k) * scale, FAST) + _slot_sum(eq, SLOT_MAJOR),)
            n_mq = n_mq + (m_k,)
            n_acc = n_acc + (acc[k] * rescale + _slot_sum(tl.where(ep > 0, ep * (xp - xq), 0.0), SLOT_MAJOR),)
        mq = n_mq
        sq = n_sq
        acc = n_acc
    if RS > 0:
        _kl_fold_stacked(mp, sp, mq, sq, acc, part, scale, K, RS, FAST)
    else:
        # fold the tile: factors exp2((m - top) * scale) per element
        top = tl.max(mp, axis=0)
        f = exp2((mp - top) * scale, FAST)
        tl.store(part, top)
        tl.store(part + 1, tl.sum(sp * f, axis=0))
        for k in tl.static_range(K):
            tl.store(part + 2 + k, tl.sum(acc[k] * f, axis=0))
            top_k, tot_k = lse_reduce(mq[k], sq[k], scale, 0, FAST)
            tl.store(part + 2 + K + k, top_k)
            tl.store(part + 2 + 2 * K + k, tot_k)


@triton.jit
def _kl_fold_stacked(mp, sp, mq, sq, acc, part, scale, K: tl.constexpr, RS: tl.constexpr, FAST: tl.constexpr):
    """`_kl_partial`'s tile fold with the per-slot values ([NT]) stacked as rows of one
    [RS, NT] tile (RS >= 2K + 1): one cross-thread max for the target's and the views' maxima
    and one sum for the 2K + 1 sums, instead of one reduction (two barriers) per partial.
    Rows: 0 the target (max / S), 1 + k view k's A_k, 1 + K + k view k (max / sum-exp)."""
    r = tl.arange(0, RS)
    rows = r[:, None]
    m = tl.where(rows == 0, mp[None, :], NEG_BIG)
    for k in tl.static_range(K):
        m = tl.where(rows == 1 + K + k, mq[k][None, :], m)
    tops = tl.max(m, axis=1)                                     # [RS] the rows' maxima
    f = exp2((m - tops[:, None]) * scale, FAST)                  # per slot: its row's factor
    f_p = tl.sum(tl.where(rows == 0, f, 0.0), axis=0)            # the target's factors [NT]
    t = tl.where(rows == 0, (sp * f_p)[None, :], 0.0)
    for k in tl.static_range(K):
        t = tl.where(rows == 1 + k, (acc[k] * f_p)[None, :], t)
        t = tl.where(rows == 1 + K + k, sq[k][None, :] * f, t)
    sums = tl.sum(t, axis=1)
    # part: [m, S, A_k | m_k, s_k]
    tl.store(part + tl.where(r == 0, 1, tl.where(r <= K, 1 + r, K + 1 + r)), sums, mask=r <= 2 * K)
    tl.store(part + tl.where(r == 0, 0, r + 1), tops, mask=(r == 0) | ((r > K) & (r <= 2 * K)))


@triton.jit
def _kl_fold(prow, smask, scale, K: tl.constexpr, KP: tl.constexpr, FAST: tl.constexpr):
    """Fold a (row, view group)'s KL partials (`_kl_partial`; prow [NSP] pointers to its
    splits' rows in split order, smask the splits present): (lse_p, lse_q [KP]) in log2
    units of x * scale and KL(p || q_k) [KP] in nats. The partials come from other programs
    of the launch: loaded past L1 (.cg)."""
    ks = tl.arange(0, KP)
    kmask = ks < K
    pm = tl.load(prow, mask=smask, other=NEG_BIG, cache_modifier=".cg")
    g_top = tl.max(pm, axis=0)
    g_f = exp2((pm - g_top) * scale, FAST)
    g_tot = tl.sum(tl.load(prow + 1, mask=smask, other=0.0, cache_modifier=".cg") * g_f, axis=0)
    lse_p = g_top * scale + log2(g_tot, FAST)
    qrow = prow[:, None] + ks[None, :]
    qmask = smask[:, None] & kmask[None, :]
    a = tl.sum(tl.load(qrow + 2, mask=qmask, other=0.0, cache_modifier=".cg") * g_f[:, None], axis=0)
    top_k, tot_k = lse_reduce(tl.load(qrow + 2 + K, mask=qmask, other=NEG_BIG, cache_modifier=".cg"),
                              tl.load(qrow + 2 + 2 * K, mask=qmask, other=0.0, cache_modifier=".cg"), scale, 0, FAST)
    lse_q = tl.where(kmask, top_k * scale + log2(tl.where(kmask, tot_k, 1.0), FAST), 0.0)
    return lse_p, lse_q, (a * scale / g_tot - lse_p + lse_q) * LN2


@triton.jit
def _wd_kl_kernel(
    p_ptr, q_ptr, part_ptr, cnt_ptr, kl_ptr,
    P, V, CH, NS, KT, stride_pb, stride_pp, stride_qb, stride_qk, stride_qp, scale,
    K: tl.constexpr, KP: tl.constexpr, NSP: tl.constexpr, BLOCK: tl.constexpr, VEC: tl.constexpr,
    RPT: tl.constexpr, STAGES: tl.constexpr, FAST: tl.constexpr, PDL: tl.constexpr,
):
    """KL only (no TV, no grid): one pass over the logits (`_kl_partial`), grid (B*P, NS,
    KT // K): each program reads the target and K of the KT views (views kg * K .. kg * K +
    K - 1, kg the third program index; with K < KT the target is read once per group of
    views). Partials per (row, group, split); the last program of a (row, group) to arrive
    folds them in split order (`_kl_fold`) and resets the counter."""
    pdl_wait(PDL)
    split, kg, grp, b, pos, p_row, q_row, v_start, v_end = _one_pass_program(
        p_ptr, q_ptr, P, V, CH, stride_pb, stride_pp, stride_qb, stride_qk, stride_qp, K)
    W: tl.constexpr = 2 + 3 * K
    _kl_partial(p_row, q_row, stride_qk, v_start, v_end, part_ptr + (grp * NS + split) * W, scale,
                K, BLOCK, VEC, RPT, STAGES, FAST, "", 0, True)   # slot-major tiles (see _KL_WIDE_PAST_L2)
    tl.debug_barrier()  # every thread's partial stores precede the release below
    arrived = tl.atomic_add(cnt_ptr + grp, 1, sem="acq_rel", scope="gpu")
    if arrived == NS - 1:
        ss = tl.arange(0, NSP)
        ks = tl.arange(0, KP)
        _, _, kl = _kl_fold(part_ptr + (grp * NS + ss) * W, ss < NS, scale, K, KP, FAST)
        tl.store(kl_ptr + (b * KT + kg * K + ks) * P + pos, kl, mask=ks < K)
        tl.store(cnt_ptr + grp, 0)  # every split has arrived: ready for the next launch


@triton.jit
def _wd_given_kernel(
    p_ptr, q_ptr, plse_ptr, qlse_ptr, part_ptr, cnt_ptr, kl_ptr, tv_ptr,
    P, V, CH, NS, KT, stride_pb, stride_pp, stride_qb, stride_qk, stride_qp,
    stride_lb, stride_lp, stride_mb, stride_mk, stride_mp, scale,
    K: tl.constexpr, NSP: tl.constexpr, BLOCK: tl.constexpr, VEC: tl.constexpr, RPT: tl.constexpr,
    FAST: tl.constexpr, PDL: tl.constexpr,
):
    """KL and TV with the normalisers given: one pass over the logits, grid (B*P, NS,
    KT // K), the program layout of `_wd_kl_kernel`. With lse_p and lse_k known up front
    (log2 units: the natural-log inputs times log2(e)) every term is final when read:
    p_v = 2^(y_p - lse_p), q_v = 2^(y_k - lse_k) (y = x * scale), TV sums |p_v - q_v|, and
    KL(p || q_k) = sum_v p_v (y_p - y_k) + (lse_k - lse_p) sum_v p_v, so no running max and
    no rescaling. Partials per (row, group, split): [sum p, A_k | T_k]; the last program of a
    (row, group) to arrive folds them in split order and resets the counter."""
    pdl_wait(PDL)
    split, kg, grp, b, pos, p_row, _, v_start, v_end = _one_pass_program(
        p_ptr, q_ptr, P, V, CH, stride_pb, stride_pp, stride_qb, stride_qk, stride_qp, K)
    lse_p = tl.load(plse_ptr + b * stride_lb + pos * stride_lp) * LOG2E
    NT: tl.constexpr = BLOCK // (RPT * VEC)
    cols = _step_cols(RPT, NT, VEC, True)                # slot-major: [NT, RPT, VEC] columns of a step
    sp = tl.zeros([NT], tl.float32)
    q_rows = ()
    lse_q = ()
    acc = ()
    tva = ()
    for k in tl.static_range(K):
        q_rows = q_rows + (q_ptr + b * stride_qb + pos * stride_qp + (kg * K + k) * stride_qk,)
        lse_q = lse_q + (tl.load(qlse_ptr + b * stride_mb + pos * stride_mp + (kg * K + k) * stride_mk) * LOG2E,)
        acc = acc + (tl.zeros([NT], tl.float32),)
        tva = tva + (tl.zeros([NT], tl.float32),)
    for v0 in range(v_start, v_end, BLOCK):
        offs = v0 + cols
        vmask = offs < v_end
        xp = tl.load(p_row + offs, mask=vmask, other=float("-inf")).to(tl.float32)
        pv = exp2(xp * scale - lse_p, FAST)                          # 0 where x_p = -inf
        sp += _slot_sum(pv, True)
        n_acc = ()
        n_tva = ()
        for k in tl.static_range(K):
            xq = tl.load(q_rows[k] + offs, mask=vmask, other=float("-inf")).to(tl.float32)
            qv = exp2(xq * scale - lse_q[k], FAST)
            n_acc = n_acc + (acc[k] + _slot_sum(tl.where(pv > 0, pv * (xp - xq), 0.0), True),)
            n_tva = n_tva + (tva[k] + _slot_sum(tl.abs(pv - qv), True),)
        acc = n_acc
        tva = n_tva
    W: tl.constexpr = 1 + 2 * K
    part = part_ptr + (grp * NS + split) * W
    tl.store(part, tl.sum(sp, axis=0))
    for k in tl.static_range(K):
        tl.store(part + 1 + k, tl.sum(acc[k], axis=0))
        tl.store(part + 1 + K + k, tl.sum(tva[k], axis=0))

    tl.debug_barrier()  # every thread's partial stores precede the release below
    arrived = tl.atomic_add(cnt_ptr + grp, 1, sem="acq_rel", scope="gpu")
    if arrived == NS - 1:
        ss = tl.arange(0, NSP)
        smask = ss < NS
        prow = part_ptr + (grp * NS + ss) * W
        s_p = tl.sum(tl.load(prow, mask=smask, other=0.0, cache_modifier=".cg"), axis=0)
        for k in tl.static_range(K):
            a = tl.sum(tl.load(prow + 1 + k, mask=smask, other=0.0, cache_modifier=".cg"), axis=0)
            out = (b * KT + kg * K + k) * P + pos
            t = tl.sum(tl.load(prow + 1 + K + k, mask=smask, other=0.0, cache_modifier=".cg"), axis=0)
            tl.store(kl_ptr + out, (a * scale + (lse_q[k] - lse_p) * s_p) * LN2)
            tl.store(tv_ptr + out, 0.5 * t)
        tl.store(cnt_ptr + grp, 0)  # every split has arrived: ready for the next launch


@triton.jit
def _tv_partial(p_row, q_row, stride_qk, lse_p, lse_ptr, v_start, v_end, part, scale,
                K: tl.constexpr, KP: tl.constexpr, BLOCK: tl.constexpr, VEC: tl.constexpr, RPT: tl.constexpr,
                FAST: tl.constexpr, EVICT: tl.constexpr):
    """TV sums over columns [v_start, v_end) of a target row and K view rows (q_row,
    q_row + stride_qk, ..) from their normalisers (lse_p; view k's at lse_ptr + k; log2
    units of x * scale): p_v = 2^(y_p - lse_p), q_v = 2^(y_k - lse_k) (y = x * scale), every
    term |p_v - q_v| final when read; stores sum_v |p_v - q_v| of view k at part + k (the K
    sums as rows of one [KP, NT] tile: one cross-thread reduction). The tiles of `_kl_partial`;
    EVICT: the loads' eviction policy."""
    NT: tl.constexpr = BLOCK // (RPT * VEC)
    cols = group_cols(RPT, NT, VEC)                      # [RPT, NT, VEC] columns of a step
    lse_k = ()
    tva = ()
    for k in tl.static_range(K):
        lse_k = lse_k + (tl.load(lse_ptr + k),)
        tva = tva + (tl.zeros([NT], tl.float32),)
    for v0 in range(v_start, v_end, BLOCK):
        offs = v0 + cols
        vmask = offs < v_end
        xp = tl.load(p_row + offs, mask=vmask, other=float("-inf"), eviction_policy=EVICT).to(tl.float32)
        pv = exp2(xp * scale - lse_p, FAST)                          # 0 where x_p = -inf
        n_tva = ()
        for k in tl.static_range(K):
            xq = tl.load(q_row + k * stride_qk + offs, mask=vmask, other=float("-inf"),
                         eviction_policy=EVICT).to(tl.float32)
            n_tva = n_tva + (tva[k] + tl.sum(tl.sum(tl.abs(pv - exp2(xq * scale - lse_k[k], FAST)), axis=2), axis=0),)
        tva = n_tva
    r = tl.arange(0, KP)
    t = tl.zeros([KP, NT], tl.float32)
    for k in tl.static_range(K):
        t = tl.where(r[:, None] == k, tva[k][None, :], t)
    tl.store(part + r, tl.sum(t, axis=1), mask=r < K)


@triton.jit
def _wd_tv_fused_kernel(
    p_ptr, q_ptr, part_ptr, part2_ptr, cnt_ptr, kl_ptr, tv_ptr,
    NG, P, V, CH, NS, KT, stride_pb, stride_pp, stride_qb, stride_qk, stride_qp, scale,
    K: tl.constexpr, KP: tl.constexpr, NSP: tl.constexpr, BLOCK: tl.constexpr, VEC: tl.constexpr,
    RPT: tl.constexpr, STAGES: tl.constexpr, WAIT: tl.constexpr, EVICT: tl.constexpr, EVICT2: tl.constexpr,
    RS: tl.constexpr, FAST: tl.constexpr, PDL: tl.constexpr,
):
    """KL and TV without given normalisers in one launch, past L2: the program that read a
    split for the normalisers reads it again for TV right after (from L2).

    NG * NS programs, one per ((row, view group), split), NG = B * P * KT // K. A program
    takes a ticket (atomic counter: tickets follow the order programs start in) and runs
    split t % NS of group t // NS: the KL pass (`_kl_partial`, which yields the normalisers'
    partials too; loads `EVICT`), then it counts itself in at the group's counter. With WAIT
    it spins until the group's NS programs have arrived, folds the normalisers
    (`_kl_fold`) and runs the TV pass over its own split (`_tv_partial`,
    loads `EVICT2`); the group's splits hold consecutive tickets, so they are running or
    done whenever NS programs fit on the device at once (the launcher's condition) and the
    wait ends. Without WAIT (the CPU interpreter, which runs programs one after another)
    the group's last to arrive runs the TV pass over every split. The last program of the
    group to finish folds KL and TV in split order.

    Counters (cnt_ptr): [0] the ticket, [1 + g] group g's arrivals, [1 + NG + g] its
    programs done; the last ticket and each group's last program reset theirs, so every
    launch leaves them zero."""
    pdl_wait(PDL)
    t = ticket(cnt_ptr, NG * NS)
    grp = (t // NS).to(tl.int64)
    split = t % NS
    b, pos, p_row, q_row, v_start, v_end = _one_pass_place(
        p_ptr, q_ptr, grp // (KT // K), split, grp % (KT // K), P, V, CH, stride_pb, stride_pp, stride_qb, stride_qk,
        stride_qp, K)
    W: tl.constexpr = 2 + 3 * K
    W2: tl.constexpr = 2 * K   # a split's TV row: the views' log2 normalisers, then their sums
    _kl_partial(p_row, q_row, stride_qk, v_start, v_end, part_ptr + (grp * NS + split) * W, scale,
                K, BLOCK, VEC, RPT, STAGES, FAST, EVICT, RS, False)   # group-major: measured faster here
    tl.debug_barrier()  # every thread's partials are stored before the release
    arrived = tl.atomic_add(cnt_ptr + 1 + grp, 1, sem="acq_rel", scope="gpu")
    c_lo, c_hi = group_items(cnt_ptr + 1 + grp, arrived, NS, split, WAIT)   # its own split, or all (no WAIT)
    ss = tl.arange(0, NSP)
    ks = tl.arange(0, KP)
    kmask = ks < K
    if c_lo < c_hi:
        lse_p, lse_q, _ = _kl_fold(part_ptr + (grp * NS + ss) * W, ss < NS, scale, K, KP, FAST)
        for c in range(c_lo, c_hi):
            c_start = c * CH
            row2 = part2_ptr + (grp * NS + c) * W2
            tl.store(row2 + ks, lse_q, mask=kmask)   # read back as scalars (uniform values)
            tl.debug_barrier()
            _tv_partial(p_row, q_row, stride_qk, lse_p, row2, c_start, tl.minimum(c_start + CH, V), row2 + K, scale,
                        K, KP, BLOCK, VEC, RPT, FAST, EVICT2)
    tl.debug_barrier()  # every thread's TV partials are stored before the release
    done = tl.atomic_add(cnt_ptr + 1 + NG + grp, 1, sem="acq_rel", scope="gpu")
    if done == NS - 1:  # the group's last program: every split's TV is stored
        _, _, kl = _kl_fold(part_ptr + (grp * NS + ss) * W, ss < NS, scale, K, KP, FAST)
        t_k = tl.sum(tl.load((part2_ptr + (grp * NS + ss) * W2 + K)[:, None] + ks[None, :],
                             mask=(ss < NS)[:, None] & kmask[None, :], other=0.0, cache_modifier=".cg"), axis=0)
        out = (b * KT + (grp % (KT // K)) * K + ks) * P + pos
        tl.store(kl_ptr + out, kl, mask=kmask)
        tl.store(tv_ptr + out, 0.5 * t_k, mask=kmask)
        tl.store(cnt_ptr + 1 + grp, 0)
        tl.store(cnt_ptr + 1 + NG + grp, 0)


def window_divergence(p_logits, q_logits, *, temperature=1.0, grid=None, tv=True, p_lse=None, q_lse=None):
    """Triton launcher; see `tabed_engine.ops.window_divergence.window_divergence`.
    KL alone (tv=False, no grid) is one launch and one pass over the logits, and so is TV
    without a grid when the normalisers are given (p_lse, q_lse); otherwise TV or a grid
    needs both normalisers first: two passes, in two launches, or for TV without a grid
    where the logits exceed half of L2 in one (`_wd_tv_fused_kernel`)."""
    if p_logits.dim() != 3 or q_logits.dim() != 4:
        raise ValueError(f"p_logits must be [B, P, V] and q_logits [B, K, P, V], got "
                         f"{tuple(p_logits.shape)} and {tuple(q_logits.shape)}")
    B, P, V = p_logits.shape
    Bq, K, Pq, Vq = q_logits.shape
    if (Bq, Pq, Vq) != (B, P, V):
        raise ValueError(f"q_logits {tuple(q_logits.shape)} does not match p_logits {tuple(p_logits.shape)}")
    for name, t in (("p_logits", p_logits), ("q_logits", q_logits)):
        if t.dtype not in _FLOAT_DTYPES:
            raise TypeError(f"{name} dtype {t.dtype} not supported")
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dimension")
    if q_logits.device != p_logits.device:
        raise ValueError("p_logits and q_logits must be on the same device")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    given = check_normalisers(p_lse, q_lse, B, K, P, p_logits.device)
    dev = p_logits.device
    use_pdl = pdl(dev)  # programmatic dependent launches (see _common.pdl)
    kl = torch.empty(B, K, P, dtype=torch.float32, device=dev)
    if given and grid is None and tv:
        tv = torch.empty(B, K, P, dtype=torch.float32, device=dev)
        if B * P and K and V:
            _given_norms(p_logits, q_logits, p_lse, q_lse, kl, tv, temperature)
        return kl, tv, None, None
    if grid is None and not tv:
        if B * P and K and V:
            _kl_only(p_logits, q_logits, kl, temperature)
        return kl, None, None, None
    if grid is None and B * P and K and V and _tv_fused_taken(p_logits, q_logits):
        tv = torch.empty(B, K, P, dtype=torch.float32, device=dev)
        _tv_fused(p_logits, q_logits, kl, tv, temperature)
        return kl, tv, None, None
    tv = torch.empty(B, K, P, dtype=torch.float32, device=dev)
    if grid is not None:
        if grid.dim() != 2 or grid.shape[1] != K or grid.dtype != torch.float32 or grid.device != dev:
            raise ValueError(f"grid must be float32 [G, {K}] on {dev}, got {tuple(grid.shape)} {grid.dtype}")
        G = grid.shape[0]
        match = torch.empty(B, G, P, dtype=torch.uint8, device=dev)
        gkl = torch.empty(B, G, P, dtype=torch.float32, device=dev)
    else:
        G = 0
        match = gkl = None
    R = B * P
    has_grid = grid is not None and G > 0
    if R == 0 or K == 0 or V == 0:  # degenerate shapes: nothing to launch
        return kl, tv, (match.view(torch.bool) if match is not None else None), gkl
    if has_grid:
        g_max, g_tile, per_sm = next(t[1:] for t in _GRID_TILES if t[0] is None or B * P * G <= t[0])
        target = _target_programs(dev, per_sm)
    else:
        target = _target_programs(dev, _TV_PROGRAMS_PER_SM)
    KP = triton.next_power_of_2(K)
    # [KP, BLOCKV] tiles of the K views plus a BLOCKV target row: ~2-4K elements per step.
    BLOCKV = max(16, min(triton.next_power_of_2(V), (2048 if has_grid else _TV_TILE) // KP))

    # Launch 1: normalisers per V split.
    ch1, ns1 = _split(V, BLOCKV, R, target)
    if has_grid:
        # Each thread holds one V column of a [G_BLOCK, BLOCKG] tile for all G_BLOCK weight
        # vectors: the per-column work (K exps, loads) is shared by G_BLOCK mixtures.
        # Registers per thread ~ G_BLOCK * (K + 3): 16 rows up to K = 4 (168 at K = 4).
        G_BLOCK = min(g_max, triton.next_power_of_2(G), 1 << (max(1, 96 // (K + 2)).bit_length() - 1))
        BLOCKG = g_tile // G_BLOCK
        n_chunks = triton.cdiv(G, G_BLOCK)
        ch2, ns2 = _split(V, BLOCKG, R * n_chunks, target)
    else:
        G_BLOCK, BLOCKG, n_chunks = 1, 16, 1
        ch2, ns2 = _split(V, BLOCKV, R, target)
    BLOCKV2 = max(16, min(BLOCKV, triton.next_power_of_2(ch2)))

    # One workspace: stats (m, s, idx), counters, per-view and grid partials.
    n_stat = R * (K + 1) * ns1
    sizes = [n_stat, n_stat, R * ns1, R * n_chunks, R * ns2 * 2 * KP]
    if has_grid:
        sizes += [R * n_chunks * ns2 * G_BLOCK] * 3
    ws = torch.empty(sum(sizes), dtype=torch.float32, device=dev)
    parts, o = [], 0
    for n in sizes:
        parts.append(ws[o:o + n])
        o += n
    m_ws, s_ws, idx_ws, cnt_ws, vpart = parts[:5]
    idx_ws, cnt_ws = idx_ws.view(torch.int32), cnt_ws.view(torch.int32)
    if has_grid:
        gbest, gidx, gklp = parts[5], parts[6].view(torch.int32), parts[7]
    else:
        gbest = gklp = vpart
        gidx = idx_ws
    scale = LOG2E.value / float(temperature)  # exp(x / T) = exp2(x * scale)
    fast = dev.type == "cuda"
    vec = min(16 // max(p_logits.element_size(), q_logits.element_size()), BLOCKV)
    warps1 = tile_warps((KP + 1) * BLOCKV)
    rpt1 = max(1, BLOCKV // (vec * 32 * warps1))
    _wd_stats_kernel[(R, ns1)](
        p_logits, q_logits, m_ws, s_ws, idx_ws, cnt_ws,
        P, V, ch1, ns1, n_chunks, p_logits.stride(0), p_logits.stride(1),
        q_logits.stride(0), q_logits.stride(1), q_logits.stride(2), scale,
        K=K, KP=KP, BLOCK=BLOCKV, VEC=vec, RPT=rpt1, FAST=fast, PDL=use_pdl, launch_pdl=use_pdl, num_warps=warps1,
    )
    _wd_div_kernel[(R, ns2, n_chunks)](
        p_logits, q_logits, grid if has_grid else kl, m_ws, s_ws, idx_ws, cnt_ws,
        vpart, gbest, gidx, gklp,
        kl, tv, match if has_grid else kl, gkl if has_grid else kl,
        P, V, G, ns1, ch2, ns2, n_chunks,
        p_logits.stride(0), p_logits.stride(1),
        q_logits.stride(0), q_logits.stride(1), q_logits.stride(2),
        grid.stride(0) if has_grid else 0, grid.stride(1) if has_grid else 0, scale,
        K=K, KP=KP, NS1P=triton.next_power_of_2(ns1), NS2P=triton.next_power_of_2(ns2),
        BLOCKV=BLOCKV2, G_BLOCK=G_BLOCK, BLOCKG=BLOCKG,
        HAS_GRID=has_grid, FAST_MATH=fast, PDL=use_pdl, launch_pdl=use_pdl,
        num_warps=4 if has_grid else _TV_DIV_WARPS,
    )
    if match is not None:
        match = match.view(torch.bool)
    return kl, tv, match, gkl


# The KL-only pass: columns per step _KL_TILE // (K + 1) rounded down to a power of two
# (the target and K views share the step; _KL_BLOCK, when set, overrides it), 4 warps, the
# V split aiming at ~8 programs per SM. H200, cold bf16 inputs, P = 6, V = 32064 (graph
# replays; element-wise running values of HEAD vs thread-owned groups, 2 rounds): B = 64,
# K = 1 36.1 -> 17.2 us (2048 columns; 1024: 23.7), B = 32, K = 2 19.3 -> 16.4 (1024; 2048:
# 17.0), B = 16, K = 4 20.3 -> 16.8 (512; 1024: 18.5); B = 1, K = 2, P = 5 5.6 -> 4.0 and
# B = 1, K = 4 9.5 -> 6.3-6.4. 8 warps at 2048 columns or 2 pipelining stages: no better
# where they are not worse (B = 16, K = 4: 23.9 / 18.3 vs 16.8). Chunks of at least
# _KL_MIN_CHUNK columns: B = 1, K = 4 took 8.5 us with 512-column chunks (63 per row, as many
# partials for the last program to fold) against 6.4 with 1024.
_KL_TILE = 4096
_KL_MIN_CHUNK = 1024
_KL_BLOCK = None
_KL_STAGES = 1
_KL_WARPS = 4
# Few rows (B * P <= _KL_SPLIT_ROWS, the engine's B = 1): one view per program, the target
# read once per view (from L2 after the first), so that the launch has K times the programs,
# at _KL_SPLIT_TILE // 2 columns per step. H200, cold bf16 inputs, graph replays: B = 1, K = 4,
# P = 6 6.69 -> 4.42 us; B = 1, K = 2, P = 5 4.40 -> 3.65 (4096-column tiles: 4.56, 4.14). At
# B = 16, K = 4 (96 rows) 17.65 -> 18.42, B = 32, K = 2 16.36 -> 18.33: not split there.
_KL_SPLIT_ROWS = 16
_KL_SPLIT_TILE = 2048
# With the logits larger than L2, at least one 16-byte group per thread and step (1024 bf16
# columns at 4 warps; at K = 4 the tile gave 512, half the threads holding copies). H200,
# cold bf16 inputs, graph replays, P = 6: B = 64, K = 4 (123 MB) 50.3 -> 39.0 us (58% -> 74%
# of copy), B = 48, K = 4 38.5 -> 30.5; K = 1, 2 have 1024+ columns already (same times); at
# 31 MB (B = 16, K = 4) it is not taken: 17.7 either way.
_KL_WIDE_PAST_L2 = True
# The KL-only and given-normaliser kernels index each step slot-major ([NT, RPT, VEC],
# `_common.slot_cols`): at K = 1 (RPT = 2) the group-major tile had a slot's two groups on two
# lanes. H200, cold bf16 inputs, P = 6, graph replays, one process (group- -> slot-major): KL
# only B = 512 114.2 -> 102.5 us, B = 256 68.4 -> 59.5, B = 64 17.2 -> 16.2, B = 1, P = 5 4.10 ->
# 3.40; TV from given normalisers 109.8 -> 107.3, 65.0 -> 63.5, 16.0 -> 15.6, 3.78 -> 3.71.
# The one-launch TV's KL pass stays group-major (slot-major: B = 256 / 64 / 512, K = 1 -1.6% /
# +4.0% / -1.4%).


class _OnePassLayout(NamedTuple):
    """Launch layout of the one-pass kernels (`_one_pass_layout`)."""
    kb: int       # views per program
    groups: int   # view groups per row: the grid's third dimension
    chunk: int    # columns per split
    ns: int       # splits per row
    block: int    # columns per step
    vec: int      # columns per 16-byte group
    rpt: int      # groups per thread slot and step
    P: int
    V: int
    K: int
    R: int        # rows, B * P
    es: int       # the larger element size of the two inputs


def _one_pass_layout(p_logits, q_logits, wide_past_l2):
    """Launch layout of the one-pass kernels (`_wd_kl_kernel`, `_wd_given_kernel`, and the
    steps of `_wd_tv_fused_kernel`), with the shapes the launchers pass on.
    wide_past_l2: with logits larger than L2, at least one 16-byte group per thread and step."""
    B, P, V = p_logits.shape
    K = q_logits.shape[1]
    R = B * P
    es = max(p_logits.element_size(), q_logits.element_size())
    past_l2 = R * (K + 1) * V * es > l2_cache_bytes(p_logits.device)
    min_step = (16 // es) * 32 * _KL_WARPS if wide_past_l2 and past_l2 else 16
    split_views = K > 1 and R <= _KL_SPLIT_ROWS
    kb = 1 if split_views else K
    groups = K // kb
    tile = _KL_SPLIT_TILE if split_views else _KL_TILE
    step = _KL_BLOCK or max(min_step, 1 << ((tile // (kb + 1)).bit_length() - 1))
    chunk, ns = _split(V, max(step, _KL_MIN_CHUNK), R * groups, _target_programs(p_logits.device))
    block = max(16, min(step, triton.next_power_of_2(chunk)))
    vec = 16 // es  # groups of <= 16 bytes in both inputs
    rpt = max(1, block // (vec * 32 * _KL_WARPS))
    return _OnePassLayout(kb, groups, chunk, ns, block, vec, rpt, P, V, K, R, es)


def _kl_only(p_logits, q_logits, kl, temperature):
    """KL alone: one launch, one pass."""
    L = _one_pass_layout(p_logits, q_logits, _KL_WIDE_PAST_L2)
    dev = p_logits.device
    use_pdl = pdl(dev)  # programmatic dependent launches (see _common.pdl)
    part = torch.empty(L.R * L.ns * L.groups * (2 + 3 * L.kb), dtype=torch.float32, device=dev)
    _wd_kl_kernel[(L.R, L.ns, L.groups)](
        p_logits, q_logits, part, counters(dev, L.R * L.groups), kl,
        L.P, L.V, L.chunk, L.ns, L.K, p_logits.stride(0), p_logits.stride(1),
        q_logits.stride(0), q_logits.stride(1), q_logits.stride(2), LOG2E.value / float(temperature),
        K=L.kb, KP=triton.next_power_of_2(L.kb), NSP=triton.next_power_of_2(L.ns), BLOCK=L.block, VEC=L.vec,
        RPT=L.rpt, STAGES=_KL_STAGES, FAST=dev.type == "cuda", PDL=use_pdl, launch_pdl=use_pdl, num_warps=_KL_WARPS,
    )


def _given_norms(p_logits, q_logits, p_lse, q_lse, kl, tv, temperature):
    """KL and TV from the given normalisers: one launch, one pass."""
    L = _one_pass_layout(p_logits, q_logits, _KL_WIDE_PAST_L2)
    dev = p_logits.device
    use_pdl = pdl(dev)
    part = torch.empty(L.R * L.ns * L.groups * (1 + 2 * L.kb), dtype=torch.float32, device=dev)
    _wd_given_kernel[(L.R, L.ns, L.groups)](
        p_logits, q_logits, p_lse, q_lse, part, counters(dev, L.R * L.groups), kl, tv,
        L.P, L.V, L.chunk, L.ns, L.K, p_logits.stride(0), p_logits.stride(1),
        q_logits.stride(0), q_logits.stride(1), q_logits.stride(2),
        p_lse.stride(0), p_lse.stride(1), q_lse.stride(0), q_lse.stride(1), q_lse.stride(2),
        LOG2E.value / float(temperature),
        K=L.kb, NSP=triton.next_power_of_2(L.ns), BLOCK=L.block, VEC=L.vec, RPT=L.rpt, FAST=dev.type == "cuda",
        PDL=use_pdl, launch_pdl=use_pdl, num_warps=_KL_WARPS,
    )


# TV without given normalisers and without a grid, logits larger than L2 times _TV_FUSED_L2:
# one launch (`_wd_tv_fused_kernel`) whose programs read their split twice, the second time
# from L2, in splits of about _TV_FUSED_TASK_BYTES of logits (whole steps of the one-pass
# layout); the first read's loads _TV_FUSED_EVICT, the second's _TV_FUSED_EVICT2.
# _TV_FUSED_WAIT: each program runs the TV pass over its own split (False: the group's last
# program runs it over all of them, as under the interpreter). H200, cold bf16 inputs, P = 6,
# graph replays, one process (two launches -> one): B = 64, K = 4 (123 MB) 102.8 -> 75.4 us,
# B = 128, K = 2 (148 MB) 100.5 -> 76.2, B = 256, K = 1 (197 MB) 112.1 -> 91.4; B = 16, K = 4
# (31 MB) 27.9 -> 26.7, B = 32, K = 2 (37 MB) 27.8 -> 27.7, B = 64, K = 1 (49 MB) 34.7 -> 30.4
# (a first version of the TV pass with 32 KB tasks, before the stacked folds below).
# Then: 64 KB tasks within 3% either way (16 KB: up to 27% slower), no eviction hints within 3%,
# 8 warps 0-45% slower, programs looping over tickets (2-8 per SM) 10-130% slower, a register
# cap of 64-96 -3% to +35%, TV as 1 - sum min(p, q) (no exp2 of the target) 0.4-4.5% faster
# (not kept: an identical view's TV is then ~1e-6 instead of 0).
# _TV_FUSED_STACKED: each program folds its partials as rows of one tile (`_kl_fold_stacked`,
# the TV pass likewise), 2 cross-thread reductions instead of 2K + 2 with two barriers each
# (sm_90 SASS at K = 4: 61 -> 22 barriers). The program's fixed costs (its ticket, the
# folds, two atomics at gpu scope) are paid per task while the one-pass KL kernel pays them
# once per ~11 steps: at K = 4 the launch without the TV pass took 58.6 us against the KL
# kernel's 38.1 (no wait: 58.3; no ticket: 71.7 with the TV pass against 76.2). A/B, H200,
# graph replays, one process (32 KB unstacked -> stacked -> stacked 48 KB tasks): B = 64,
# K = 4 76.2 -> 71.3 -> 65.6 us, B = 256, K = 1 92.5 -> 90.7 -> 90.6, B = 128, K = 2 77.1 ->
# 74.8 -> 72.9 (64 KB: 65.4, 92.6, 78.0). Tried and not kept: the split's logits kept in
# registers across the wait (no second read; 1-3 steps per task: 109-146 us at K = 4), the TV
# pass's loads all issued before its exp2s (83.5), release-only arrivals (within 0.5%), 2 / 3
# pipelining stages in the KL pass (B = 64, K = 4 64.8 -> 66.1 / 66.8; B = 256, K = 1 88.9 ->
# 92.9 / 94.8). Profile: benchmarks/results/two_pass_profile.md.
# Since (H200, graph replays, one process; B = 64, K = 4 / B = 128, K = 2 / B = 256, K = 1,
# P = 6; HEAD 67.1 / 73.0 / 91.5 us): TV as 1 - sum min(p, q) 66.5 / 70.8 / 85.5 (see above);
# KL's sum as sum p x_p - sum p x_k 68.2 / 75.2 / 93.0; each running max fixed at its task's
# first step (unsafe: overflow) 62.6 / 73.9 / 89.0; all three 61.3 / 73.0 / 84.5; one program
# per (row, view group), no ticket or wait (8-32 warps) 73.4-89.7 / 73.7-104.1 / 94.4-152.3.
# This design in CUDA C++ with 36% fewer instructions (word pairs, shuffle folds, pass 1 against
# a fixed max with an exact redo on overflow): 66.4-67.9 / 78.5-81.0 / 104.6-106.5 against this
# kernel's 66.4-68.0 / 72.8-74.8 / 90.2-92.9, its pass 1 alone 45.7 at K = 4: not issue-bound
# (benchmarks/results/README.md, "TV without normalisers in CUDA C++"). This schedule's data
# movement alone (benchmarks/read_floor.py, the two-read floor) takes 51.1-51.4 / 59.6 / 75.1 us:
# the kernel is at 79-83% of it. Also measured: exp2 of chosen rows as an FMA polynomial instead
# of the MUFU op, 3-76% slower; the group's last task running the TV pass (no wait), 8-63% slower.
_TV_FUSED = True
_TV_FUSED_L2 = 0.5
_TV_FUSED_WAIT = True
_TV_FUSED_TASK_BYTES = 49152
_TV_FUSED_STACKED = True
_TV_FUSED_EVICT = "evict_last"
_TV_FUSED_EVICT2 = "evict_first"


def _tv_fused_taken(p_logits, q_logits):
    """Whether TV without normalisers and without a grid takes the one-launch kernel."""
    B, P, V = p_logits.shape
    K = q_logits.shape[1]
    es = max(p_logits.element_size(), q_logits.element_size())
    return _TV_FUSED and B * P * (K + 1) * V * es > l2_cache_bytes(p_logits.device) * _TV_FUSED_L2


def _tv_fused(p_logits, q_logits, kl, tv, temperature):
    """KL and TV without given normalisers in one launch (`_wd_tv_fused_kernel`)."""
    L = _one_pass_layout(p_logits, q_logits, _KL_WIDE_PAST_L2)
    dev = p_logits.device
    use_pdl = pdl(dev)
    kb, block = L.kb, L.block
    # whole steps, about _TV_FUSED_TASK_BYTES of logits, at most _MAX_SPLITS splits per row
    chunk = block * max(1, _TV_FUSED_TASK_BYTES // ((kb + 1) * L.es * block),
                        triton.cdiv(triton.cdiv(L.V, _MAX_SPLITS), block))
    ns = triton.cdiv(L.V, chunk)
    ng = L.R * L.groups
    part = torch.empty(ng * ns * (2 + 3 * kb), dtype=torch.float32, device=dev)
    part2 = torch.empty(ng * ns * 2 * kb, dtype=torch.float32, device=dev)
    fast = dev.type == "cuda"
    _wd_tv_fused_kernel[(ng * ns,)](
        p_logits, q_logits, part, part2, counters(dev, 1 + 2 * ng), kl, tv,
        ng, L.P, L.V, chunk, ns, L.K, p_logits.stride(0), p_logits.stride(1),
        q_logits.stride(0), q_logits.stride(1), q_logits.stride(2), LOG2E.value / float(temperature),
        K=kb, KP=triton.next_power_of_2(kb), NSP=triton.next_power_of_2(ns), BLOCK=block, VEC=L.vec, RPT=L.rpt,
        STAGES=_KL_STAGES, WAIT=_TV_FUSED_WAIT and fast and ns <= _target_programs(dev, 1),
        EVICT=_TV_FUSED_EVICT, EVICT2=_TV_FUSED_EVICT2, FAST=fast, PDL=use_pdl, launch_pdl=use_pdl,
        RS=triton.next_power_of_2(2 * kb + 1) if _TV_FUSED_STACKED else 0,
        num_warps=_KL_WARPS,
    )
