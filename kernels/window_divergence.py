"""Divergences between the target distribution and each draft view over a window.

For each request b, view k and window position p: KL(p || q_k) and TV(p, q_k), and with a
weight grid the `w-grid` statistics of each mixture sum_k g_k q_k. The engine calls this
once per speculative block (B requests, P = gamma positions, K <= 4 views, V ~ 32k): B * P
is small, so the vocabulary itself is split over programs. Three modes, each one path:

* KL alone (`kld`, `hedge`): `_wd_kl_kernel`, one launch and one pass. KL needs no
  normaliser up front: sum_v p_v (y_p - y_k) accumulates against the running max of the
  target and is rescaled with its sum-exp; the last program of each row folds the splits.
* KL and TV from given normalisers (`tvd`: the draft's mixing kernel returns the views'
  logsumexp, the greedy verification the target's): `_wd_given_kernel`, one launch and one
  pass, every term final when read.
* TV without normalisers, or a weight grid: two launches. `_wd_stats_kernel` computes per V
  split the max and sum-exp of the target and the views and the target's first argmax;
  `_wd_div_kernel` merges them and computes over its split the partial KL and sum |p - q_k|
  and, for the G_BLOCK weight vectors of its grid chunk, each mixture's partial (max, first
  argmax) and KL(p || mixture), so G x P x V is never stored. The last program of each
  (row, chunk) to arrive (atomic counter) reduces the partials in split order.

Streaming passes keep running values per thread over 16-byte groups that thread alone
loads (see `_common`); exponentials are exp2 with temperature and log2(e) folded into one
scale, divergences summed in log2 units and scaled by ln 2 once. Everything accumulates in
fp32; argmax ties resolve to the lowest index (torch.argmax); the split counts come from the
shapes and the SM count (`one_pass_plan`, `two_pass_plan`: no host sync, so the launcher
runs in graph capture); partial sums are reduced in a fixed order: results are
deterministic.
"""
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ._common import (_MAX_SPLITS, BIG_IDX, LN2, LOG2E, NEG_BIG, counters, exp2, group_best_cols, group_cols,
                      group_lse_step, log2, lse_reduce, pdl, pdl_wait, slot_cols, sm_count, tile_warps)

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# The mixture loop works on q * 2^_MIX_SHIFT so that flush-to-zero MUFU ops lose nothing
# that fp32 softmax keeps (q >= 2^-149); the shift is exact in log2 and cancels in argmax.
_MIX_SHIFT = tl.constexpr(24.0)
# Launch constants from H200 sweeps at the engine's shapes (benchmarks/results/ensemble_ops_wd.json;
# the sweeps in benchmarks/results/kernels_backed_out.md).
# With a weight grid, by the launch's mixture rows B * P * G: (most rows, vectors per
# [G_BLOCK, columns] tile, tile elements, programs per SM). Few mixture rows leave the launch
# latency bound (small tiles, more per SM); many share each column's loads among 16 mixtures.
_GRID_TILES = ((128, 4, 1024, 4), (512, 8, 1024, 8), (None, 16, 2048, 8))
# Two launches without a grid: programs per SM, [KP + 1, columns] elements per step, warps.
_TV_PROGRAMS_PER_SM = 8
_TV_TILE = 2048
_TV_DIV_WARPS = 4
# The one-pass kernels: elements per step over the target and its views, the shortest
# chunk, warps, programs per SM. Few rows (B * P <= _KL_SPLIT_ROWS, the engine's B = 1): one
# view per program, the target read once per view, at _KL_SPLIT_TILE // 2 columns per step.
_KL_TILE = 4096
_KL_MIN_CHUNK = 1024
_KL_WARPS = 4
_KL_PROGRAMS_PER_SM = 8
_KL_SPLIT_ROWS = 16
_KL_SPLIT_TILE = 2048


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


def _split(V, unit, rows, target, max_splits=_MAX_SPLITS):
    """(chunk length, number of chunks) of V: `rows * chunks` near `target` programs,
    chunks a multiple of `unit` elements and at most `max_splits` of them."""
    n_units = triton.cdiv(V, unit)
    per = max(1, (n_units * rows) // max(target, 1), triton.cdiv(n_units, max_splits))
    chunk = per * unit
    return chunk, triton.cdiv(V, chunk)


@dataclass(frozen=True)
class OnePassPlan:
    """Launch of the one-pass kernels (`_wd_kl_kernel`, `_wd_given_kernel`): grid
    (B * P, splits, groups)."""
    B: int
    K: int
    P: int
    V: int
    vec: int      # columns per 16-byte group
    kb: int       # views per program
    groups: int   # view groups per row
    chunk: int    # columns per split
    splits: int
    block: int    # columns per step
    rpt: int      # groups per thread slot and step


def one_pass_plan(B, K, P, V, *, itemsize, sms, programs=None, block=None, split_views=None):
    """`OnePassPlan` for B * P rows of K views over V columns of `itemsize`-byte logits (the
    larger of the two inputs) on `sms` SMs. Overrides: `programs` the launch's target
    program count, `block` the columns per step, `split_views` one view per program."""
    R = B * P
    if split_views is None:
        split_views = K > 1 and R <= _KL_SPLIT_ROWS
    kb = 1 if split_views else K
    groups = K // kb
    tile = _KL_SPLIT_TILE if split_views else _KL_TILE
    step = block or max(16, 1 << ((tile // (kb + 1)).bit_length() - 1))
    if programs is None:
        programs = _KL_PROGRAMS_PER_SM * sms
    chunk, ns = _split(V, max(step, _KL_MIN_CHUNK), R * groups, programs)
    block = max(16, min(step, triton.next_power_of_2(chunk)))
    vec = 16 // itemsize
    return OnePassPlan(B=B, K=K, P=P, V=V, vec=vec, kb=kb, groups=groups, chunk=chunk, splits=ns, block=block,
                       rpt=max(1, block // (vec * 32 * _KL_WARPS)))


@dataclass(frozen=True)
class TwoPassPlan:
    """Launch of the stats and divergence kernels: grids (B * P, splits1) and
    (B * P, splits2, g_chunks)."""
    B: int
    K: int
    P: int
    V: int
    G: int
    vec: int
    block1: int     # columns per step of both launches' view tiles
    chunk1: int
    splits1: int
    rpt1: int
    warps1: int
    g_block: int    # weight vectors per grid chunk
    block_g: int    # columns per step of the mixtures
    g_chunks: int
    chunk2: int
    splits2: int
    block2: int     # columns per step of the divergences
    warps2: int


def two_pass_plan(B, K, P, V, G, *, itemsize, sms, programs=None, max_splits=_MAX_SPLITS):
    """`TwoPassPlan` for B * P rows of K views over V columns and a grid of G weight vectors
    (0: none). Overrides: `programs` the launches' target program count, `max_splits`."""
    R = B * P
    has_grid = G > 0
    if has_grid:
        g_max, g_tile, per_sm = next(t[1:] for t in _GRID_TILES if t[0] is None or R * G <= t[0])
    else:
        per_sm = _TV_PROGRAMS_PER_SM
    if programs is None:
        programs = per_sm * sms
    KP = triton.next_power_of_2(K)
    # [KP, BLOCKV] tiles of the K views plus a BLOCKV target row: ~2-4K elements per step.
    block1 = max(16, min(triton.next_power_of_2(V), (2048 if has_grid else _TV_TILE) // KP))
    ch1, ns1 = _split(V, block1, R, programs, max_splits)
    if has_grid:
        # Each thread holds one V column of a [G_BLOCK, BLOCKG] tile for all G_BLOCK weight
        # vectors: the per-column work (K exps, loads) is shared by G_BLOCK mixtures.
        # Registers per thread ~ G_BLOCK * (K + 3): 16 rows up to K = 4.
        g_block = min(g_max, triton.next_power_of_2(G), 1 << (max(1, 96 // (K + 2)).bit_length() - 1))
        block_g = g_tile // g_block
        g_chunks = triton.cdiv(G, g_block)
        ch2, ns2 = _split(V, block_g, R * g_chunks, programs, max_splits)
    else:
        g_block, block_g, g_chunks = 1, 16, 1
        ch2, ns2 = _split(V, block1, R, programs, max_splits)
    vec = min(16 // itemsize, block1)
    warps1 = tile_warps((KP + 1) * block1)
    return TwoPassPlan(B=B, K=K, P=P, V=V, G=G, vec=vec, block1=block1, chunk1=ch1, splits1=ns1,
                       rpt1=max(1, block1 // (vec * 32 * warps1)), warps1=warps1, g_block=g_block, block_g=block_g,
                       g_chunks=g_chunks, chunk2=ch2, splits2=ns2,
                       block2=max(16, min(block1, triton.next_power_of_2(ch2))),
                       warps2=4 if has_grid else _TV_DIV_WARPS)


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
def _one_pass_program(p_ptr, q_ptr, P, V, CH, stride_pb, stride_pp, stride_qb, stride_qk, stride_qp, K: tl.constexpr):
    """A one-pass program of grid (B*P, NS, view groups): (its split, view group kg, (row,
    group) index, request b, position, target row pointer, pointer to the first of its K
    views' rows (views kg * K ..), the split's columns [v_start, v_end))."""
    split = tl.program_id(1)
    kg = tl.program_id(2)
    row64 = tl.program_id(0).to(tl.int64)
    b = row64 // P
    pos = row64 % P
    v_start = split * CH
    return (split, kg, row64 * tl.num_programs(2) + kg, b, pos, p_ptr + b * stride_pb + pos * stride_pp,
            q_ptr + b * stride_qb + pos * stride_qp + (kg * K) * stride_qk, v_start, tl.minimum(v_start + CH, V))


@triton.jit
def _slot_max(x):
    """Each slot's max over its groups of a [NT, RPT, VEC] (`slot_cols`) tile: [NT]."""
    return tl.max(tl.max(x, axis=2), axis=1)


@triton.jit
def _slot_sum(x):
    """Each slot's sum over its groups of a [NT, RPT, VEC] tile: [NT]."""
    return tl.sum(tl.sum(x, axis=2), axis=1)


@triton.jit
def _kl_partial(p_row, q_row, stride_qk, v_start, v_end, part, scale,
                K: tl.constexpr, BLOCK: tl.constexpr, VEC: tl.constexpr, RPT: tl.constexpr, FAST: tl.constexpr):
    """The KL pass over columns [v_start, v_end) of a target row and K view rows (q_row,
    q_row + stride_qk, ..): stores the partials [m, S, A_k | m_k, s_k] at `part`.

    KL(p || q_k) = sum_v p_v (y_p - y_k) - lse_p + lse_k (y = x * scale, log2 units), and
    sum_v p_v (y_p - y_k) = A_k / S with S = sum exp2(y_p - m) and A_k = sum exp2(y_p - m)
    (x_p - x_k): A_k is rescaled with S whenever the running max m moves, so neither
    normaliser is needed before the sums. Each step reads [NT, RPT, VEC] slot-major tiles of
    the target and of each view; every running value lives per thread slot ([NT])."""
    NT: tl.constexpr = BLOCK // (RPT * VEC)
    cols = slot_cols(RPT, NT, VEC)                       # the columns of a step
    mp = tl.full([NT], NEG_BIG, tl.float32)
    sp = tl.zeros([NT], tl.float32)
    mq = ()
    sq = ()
    acc = ()
    for k in tl.static_range(K):
        mq = mq + (tl.full([NT], NEG_BIG, tl.float32),)
        sq = sq + (tl.zeros([NT], tl.float32),)
        acc = acc + (tl.zeros([NT], tl.float32),)
    for v0 in tl.range(v_start, v_end, BLOCK, num_stages=1):
        offs = v0 + cols
        vmask = offs < v_end
        xp = tl.load(p_row + offs, mask=vmask, other=float("-inf")).to(tl.float32)
        mp_new = tl.maximum(mp, _slot_max(xp))
        rescale = exp2((mp - mp_new) * scale, FAST)                  # old sums move to the new max
        ep = exp2(xp * scale - tl.maximum(mp_new * scale, NEG_BIG)[:, None, None], FAST)  # 0 where p_v = 0
        sp = sp * rescale + _slot_sum(ep)
        mp = mp_new
        n_mq = ()
        n_sq = ()
        n_acc = ()
        for k in tl.static_range(K):
            xq = tl.load(q_row + k * stride_qk + offs, mask=vmask, other=float("-inf")).to(tl.float32)
            m_k = tl.maximum(mq[k], _slot_max(xq))
            eq = exp2(xq * scale - tl.maximum(m_k * scale, NEG_BIG)[:, None, None], FAST)
            n_sq = n_sq + (sq[k] * exp2((mq[k] - m_k) * scale, FAST) + _slot_sum(eq),)
            n_mq = n_mq + (m_k,)
            n_acc = n_acc + (acc[k] * rescale + _slot_sum(tl.where(ep > 0, ep * (xp - xq), 0.0)),)
        mq = n_mq
        sq = n_sq
        acc = n_acc
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
    RPT: tl.constexpr, FAST: tl.constexpr, PDL: tl.constexpr,
):
    """KL only (no TV, no grid): one pass over the logits (`_kl_partial`), grid (B*P, NS,
    KT // K): each program reads the target and K of the KT views (views kg * K .. kg * K +
    K - 1; with K < KT the target is read once per group of views). Partials per (row,
    group, split); the last program of a (row, group) to arrive folds them in split order
    (`_kl_fold`) and resets the counter."""
    pdl_wait(PDL)
    split, kg, grp, b, pos, p_row, q_row, v_start, v_end = _one_pass_program(
        p_ptr, q_ptr, P, V, CH, stride_pb, stride_pp, stride_qb, stride_qk, stride_qp, K)
    W: tl.constexpr = 2 + 3 * K
    _kl_partial(p_row, q_row, stride_qk, v_start, v_end, part_ptr + (grp * NS + split) * W, scale,
                K, BLOCK, VEC, RPT, FAST)
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
    cols = slot_cols(RPT, NT, VEC)                       # [NT, RPT, VEC] columns of a step
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
        sp += _slot_sum(pv)
        n_acc = ()
        n_tva = ()
        for k in tl.static_range(K):
            xq = tl.load(q_rows[k] + offs, mask=vmask, other=float("-inf")).to(tl.float32)
            qv = exp2(xq * scale - lse_q[k], FAST)
            n_acc = n_acc + (acc[k] + _slot_sum(tl.where(pv > 0, pv * (xp - xq), 0.0)),)
            n_tva = n_tva + (tva[k] + _slot_sum(tl.abs(pv - qv)),)
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


def _kl_only(p_logits, q_logits, kl, temperature, plan):
    """KL alone: one launch, one pass."""
    dev = p_logits.device
    use_pdl = pdl(dev)  # programmatic dependent launches (see _common.pdl)
    part = torch.empty(plan.B * plan.P * plan.splits * plan.groups * (2 + 3 * plan.kb), dtype=torch.float32,
                       device=dev)
    _wd_kl_kernel[(plan.B * plan.P, plan.splits, plan.groups)](
        p_logits, q_logits, part, counters(dev, plan.B * plan.P * plan.groups), kl,
        plan.P, plan.V, plan.chunk, plan.splits, plan.K, p_logits.stride(0), p_logits.stride(1),
        q_logits.stride(0), q_logits.stride(1), q_logits.stride(2), LOG2E.value / float(temperature),
        K=plan.kb, KP=triton.next_power_of_2(plan.kb), NSP=triton.next_power_of_2(plan.splits), BLOCK=plan.block,
        VEC=plan.vec, RPT=plan.rpt, FAST=dev.type == "cuda", PDL=use_pdl, launch_pdl=use_pdl, num_warps=_KL_WARPS,
    )


def _given_norms(p_logits, q_logits, p_lse, q_lse, kl, tv, temperature, plan):
    """KL and TV from the given normalisers: one launch, one pass."""
    dev = p_logits.device
    use_pdl = pdl(dev)
    part = torch.empty(plan.B * plan.P * plan.splits * plan.groups * (1 + 2 * plan.kb), dtype=torch.float32,
                       device=dev)
    _wd_given_kernel[(plan.B * plan.P, plan.splits, plan.groups)](
        p_logits, q_logits, p_lse, q_lse, part, counters(dev, plan.B * plan.P * plan.groups), kl, tv,
        plan.P, plan.V, plan.chunk, plan.splits, plan.K, p_logits.stride(0), p_logits.stride(1),
        q_logits.stride(0), q_logits.stride(1), q_logits.stride(2),
        p_lse.stride(0), p_lse.stride(1), q_lse.stride(0), q_lse.stride(1), q_lse.stride(2),
        LOG2E.value / float(temperature),
        K=plan.kb, NSP=triton.next_power_of_2(plan.splits), BLOCK=plan.block, VEC=plan.vec, RPT=plan.rpt,
        FAST=dev.type == "cuda", PDL=use_pdl, launch_pdl=use_pdl, num_warps=_KL_WARPS,
    )


def _two_pass(p_logits, q_logits, grid, kl, tv, match, gkl, temperature, plan):
    """KL and TV (and the grid's statistics) after the normalisers: two launches."""
    dev = p_logits.device
    use_pdl = pdl(dev)
    R, K, L = plan.B * plan.P, plan.K, plan
    KP = triton.next_power_of_2(K)
    has_grid = plan.G > 0
    # One workspace: stats (m, s, idx), counters, per-view and grid partials.
    n_stat = R * (K + 1) * L.splits1
    sizes = [n_stat, n_stat, R * L.splits1, R * L.g_chunks, R * L.splits2 * 2 * KP]
    if has_grid:
        sizes += [R * L.g_chunks * L.splits2 * L.g_block] * 3
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
    _wd_stats_kernel[(R, L.splits1)](
        p_logits, q_logits, m_ws, s_ws, idx_ws, cnt_ws,
        L.P, L.V, L.chunk1, L.splits1, L.g_chunks, p_logits.stride(0), p_logits.stride(1),
        q_logits.stride(0), q_logits.stride(1), q_logits.stride(2), scale,
        K=K, KP=KP, BLOCK=L.block1, VEC=L.vec, RPT=L.rpt1, FAST=fast, PDL=use_pdl, launch_pdl=use_pdl,
        num_warps=L.warps1,
    )
    _wd_div_kernel[(R, L.splits2, L.g_chunks)](
        p_logits, q_logits, grid if has_grid else kl, m_ws, s_ws, idx_ws, cnt_ws,
        vpart, gbest, gidx, gklp,
        kl, tv, match if has_grid else kl, gkl if has_grid else kl,
        L.P, L.V, L.G, L.splits1, L.chunk2, L.splits2, L.g_chunks,
        p_logits.stride(0), p_logits.stride(1),
        q_logits.stride(0), q_logits.stride(1), q_logits.stride(2),
        grid.stride(0) if has_grid else 0, grid.stride(1) if has_grid else 0, scale,
        K=K, KP=KP, NS1P=triton.next_power_of_2(L.splits1), NS2P=triton.next_power_of_2(L.splits2),
        BLOCKV=L.block2, G_BLOCK=L.g_block, BLOCKG=L.block_g,
        HAS_GRID=has_grid, FAST_MATH=fast, PDL=use_pdl, launch_pdl=use_pdl, num_warps=L.warps2,
    )


def window_divergence(p_logits, q_logits, *, temperature=1.0, grid=None, tv=True, p_lse=None, q_lse=None,
                      plan=None):
    """Triton launcher; see `tabed_engine.ops.window_divergence.window_divergence`.
    KL alone (tv=False, no grid) and TV without a grid from given normalisers (p_lse,
    q_lse) are one launch and one pass over the logits; otherwise (TV without normalisers, a
    grid) two launches. `plan`: a `one_pass_plan` or `two_pass_plan` for these shapes and
    this mode (default: the device's)."""
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
    if grid is not None and (grid.dim() != 2 or grid.shape[1] != K or grid.dtype != torch.float32
                             or grid.device != dev):
        raise ValueError(f"grid must be float32 [G, {K}] on {dev}, got {tuple(grid.shape)} {grid.dtype}")
    G = 0 if grid is None else grid.shape[0]
    one_pass = grid is None and (given or not tv)
    itemsize = max(p_logits.element_size(), q_logits.element_size())
    kind = OnePassPlan if one_pass else TwoPassPlan
    if plan is None:
        if one_pass:
            plan = one_pass_plan(B, K, P, V, itemsize=itemsize, sms=sm_count(dev))
        else:
            plan = two_pass_plan(B, K, P, V, G, itemsize=itemsize, sms=sm_count(dev))
    elif (not isinstance(plan, kind) or (plan.B, plan.K, plan.P, plan.V) != (B, K, P, V)
          or plan.vec != (16 // itemsize if one_pass else min(16 // itemsize, plan.block1))
          or (not one_pass and plan.G != G)):
        raise ValueError(f"plan {plan} does not match these arguments")
    kl = torch.empty(B, K, P, dtype=torch.float32, device=dev)
    tv = torch.empty(B, K, P, dtype=torch.float32, device=dev) if tv or grid is not None else None
    match = torch.empty(B, G, P, dtype=torch.uint8, device=dev) if grid is not None else None
    gkl = torch.empty(B, G, P, dtype=torch.float32, device=dev) if grid is not None else None
    if B * P and K and V:
        if one_pass and tv is not None:
            _given_norms(p_logits, q_logits, p_lse, q_lse, kl, tv, temperature, plan)
        elif one_pass:
            _kl_only(p_logits, q_logits, kl, temperature, plan)
        else:
            _two_pass(p_logits, q_logits, grid, kl, tv, match, gkl, temperature, plan)
    return kl, tv, (match.view(torch.bool) if match is not None else None), gkl
