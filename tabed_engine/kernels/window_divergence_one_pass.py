"""The one-pass kernels of `window_divergence` (see its module docstring), grid (B * P,
splits, view groups) from a `one_pass_plan`: KL alone (`_wd_kl_kernel`, launched by
`_kl_only`) and KL and TV from given normalisers (`_wd_given_kernel`, launched by
`_given_norms`). Each program streams its split of the target row and its views' rows once
in slot-major tiles (`_common.slot_cols`); the last program of each (row, view group) to
arrive folds the splits' partials in split order."""
import torch
import triton
import triton.language as tl

from ._common import LN2, LOG2E, NEG_BIG, counters, exp2, log2, lse_reduce, pdl, pdl_wait, slot_cols
from .window_divergence_plan import _KL_WARPS


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
