"""The two launches of `window_divergence` (see its module docstring) for TV without
normalisers, or a weight grid, from a `two_pass_plan`: `_wd_stats_kernel` (per V split, the
max and sum-exp of the target and the views and the target's first argmax) and
`_wd_div_kernel` (the merged normalisers, per-view KL and TV, and the grid's mixture
statistics), launched by `_two_pass`."""
import torch
import triton
import triton.language as tl

from ._common import (BIG_IDX, LN2, LOG2E, NEG_BIG, exp2, group_best_cols, group_cols, group_lse_step, log2,
                      lse_reduce, pdl, pdl_wait)

# The mixture loop works on q * 2^_MIX_SHIFT so that flush-to-zero MUFU ops lose nothing
# that fp32 softmax keeps (q >= 2^-149); the shift is exact in log2 and cancels in argmax.
_MIX_SHIFT = tl.constexpr(24.0)
# the least positive fp32 probability (2^-149) in the shifted units: a mixture with no mass
# where p has some gets a large finite KL (as ops.window_divergence.MIX_FLOOR), not inf
_MIX_FLOOR = tl.constexpr(2.0 ** -125)


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
            g_kl += pv * (c - log2(tl.where(ppos, tl.maximum(mix, _MIX_FLOOR), 1.0), FAST_MATH))
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
