"""Verification of a drafted chain: accepted prefix length and the next (bonus) token.

The vocabulary of each request is cut into S chunks, grid (B, S), with S from the shapes
and the device's SM count only (`verify_plan`; the launcher never syncs, so it can be
captured in a CUDA graph), and a one-program-per-request kernel combines the chunk partials:
  greedy    `_argmax_partial_kernel`: the gamma+1 target rows are read as [GP, BLOCK]
            tiles, so all their argmaxes come out of one sweep over the chunk; per
            (position, chunk) the best logit and its index ->
            `_greedy_accept_kernel`: best per position (lowest index on ties, as
            torch.argmax), then the accepted prefix and the next token.  One pass over
            the logits; the worst case (all accepted) reads what an early exit would.
            With `lse_out` (LSE) the same sweep also keeps a running sum-exp per element,
            and the combine merges the chunks' (max, sum) into each row's logsumexp.
  sampling  `_residual_partial_kernel`: each program redoes the gamma gathers of the
            acceptance test (p(x_i), q(x_i), a few loads) to know the row pair at the
            first rejection, then sums the residual max(p - q, 0) and p over each
            sub-block of its chunk (each warp walks its own contiguous part of the chunk;
            a part is a sub-block when chunks are long, else the chunk is one) ->
            `_residual_draw_kernel`: totals, prefix over the sub-block sums to find the
            sub-block holding u * total, and an inverse-CDF scan of that sub-block only
            (one tile).  Deterministic given the uniforms; only the summation order
            differs from the reference (sub-block sums, then in-block cumsum), which can
            move a draw across a CDF boundary when u * total is within rounding of it.
The sweeps keep element-wise running values (best and its step, sums) and reduce across
the tile once per program (see `_common`).
"""
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ._common import (LN2, LOG2E, NEG_BIG, ONE_STEP, best_combine, chunk_block, chunking, exp2, load_rows, log2,
                      lse_reduce, n_vsplit, pdl, pdl_wait, sm_count, tile_warps)

# Launch constants from H200 sweeps (benchmarks/results/ensemble_ops_chain_verify.json; the
# sweeps in benchmarks/results/kernels_backed_out.md). Greedy: [GP, BLOCK] tiles of
# _TILE_GREEDY elements (gamma + 1 <= 8 rows of 512), ~2 programs per SM; with lse_out the
# running sum is a third element-wise value: smaller tiles, more programs, fewer elements
# per thread.
_TILE_GREEDY = 4096
_GREEDY_PROGRAMS_PER_SM = 2
_TILE_GREEDY_LSE = 2048
_GREEDY_LSE_PROGRAMS_PER_SM = 4
_GREEDY_LSE_PER_THREAD = 8
# Sampling: each warp of a program sums the residual (and p) over its own contiguous part of
# the chunk, [RPT, 32, 4] fp32 groups per step; the part is a sub-block of the draw when
# chunks are longer than one step (many requests), else the chunk is one sub-block.
_SAMPLING_PROGRAMS_PER_SM = 16
_SAMPLING_WARPS = 4
_SAMPLING_PER_THREAD = 8
_DRAW_WARPS = 4


@dataclass(frozen=True)
class VerifyPlan:
    """How `chain_verify` launches for one shape (`verify_plan`)."""
    B: int
    gamma: int
    V: int
    greedy: bool
    lse: bool         # greedy: the target's log-normalisers from the same pass
    splits: int       # chunks per request
    chunk: int        # columns per chunk
    block: int        # greedy: columns per step
    warps: int        # greedy: warps of the split pass; sampling: parts per chunk (one warp each)
    subblocks: int    # sampling: sub-blocks of the draw per chunk (1 or `warps`)
    rpt: int          # sampling: [RPT, 32, 4] groups per warp and step


def verify_plan(B, gamma, V, *, greedy, lse=False, sms, splits=None, block=None, warps=_SAMPLING_WARPS,
                warp_subblocks=None):
    """The launch plan of `chain_verify` for B chains of gamma drafts over V columns on a
    device of `sms` SMs. Overrides (tests split small vocabularies with them): `splits`
    requested chunks, `block` greedy columns per step, `warps` sampling parts per chunk,
    `warp_subblocks` whether each part is a draw sub-block (default: chunks longer than one
    step)."""
    GP = triton.next_power_of_2(gamma + 1)
    if greedy:
        per_sm = _GREEDY_LSE_PROGRAMS_PER_SM if lse else _GREEDY_PROGRAMS_PER_SM
        S, chunk = chunking(V, splits or n_vsplit(B, V, per_sm * sms))
        block = block or chunk_block(chunk, (_TILE_GREEDY_LSE if lse else _TILE_GREEDY) // GP)
        return VerifyPlan(B=B, gamma=gamma, V=V, greedy=True, lse=bool(lse), splits=S, chunk=chunk, block=block,
                          warps=tile_warps(GP * block, _GREEDY_LSE_PER_THREAD if lse else 16), subblocks=1, rpt=1)
    # S chunks of `warps` parts of W columns (W a multiple of 16 when S > 1: aligned vector loads)
    S, chunk = chunking(V, splits or n_vsplit(B, V, _SAMPLING_PROGRAMS_PER_SM * sms), 16 * warps)
    W = triton.cdiv(chunk, warps)
    if warp_subblocks is None:
        warp_subblocks = chunk > ONE_STEP
    return VerifyPlan(B=B, gamma=gamma, V=V, greedy=False, lse=False, splits=S, chunk=chunk, block=W, warps=warps,
                      subblocks=warps if warp_subblocks else 1,
                      rpt=min(_SAMPLING_PER_THREAD // 4, triton.next_power_of_2(triton.cdiv(W, 128))))


@triton.jit
def _rows_argmax(p_ptr, b, gamma, start, end, stride_pb, stride_pt,
                 GP: tl.constexpr, BLOCK: tl.constexpr, LSE: tl.constexpr, FAST: tl.constexpr):
    """Max and its (lowest) index of the gamma + 1 rows of request b over [start, end),
    read as [GP, BLOCK] tiles so all rows' loads are in flight together.  With LSE also
    per row (m, s): the max (at least NEG_BIG) and the sum of exp2((x - m) * LOG2E)."""
    js = tl.arange(0, GP)
    cols = tl.arange(0, BLOCK)
    rows = p_ptr + b * stride_pb + js.to(tl.int64) * stride_pt
    best = tl.full([GP, BLOCK], float("-inf"), tl.float32)
    best_v0 = tl.zeros([GP, BLOCK], tl.int32) + start
    if LSE:
        s = tl.zeros([GP, BLOCK], tl.float32)
    for v0 in range(start, end, BLOCK):
        x = load_rows(rows, v0 + cols, js <= gamma, v0 + cols < end)
        take = x > best  # strict: the earlier step keeps ties
        if LSE:
            # running sum against the running max best (floored at NEG_BIG: finite, so a
            # -inf x adds exp2(-inf) = 0, never NaN); one exp2 per element: rescales s
            # when x is the new max, else is x's own term
            e = exp2(tl.abs(x - tl.maximum(best, NEG_BIG)) * -LOG2E, FAST)
            s = tl.where(take, s * e + 1.0, s + e)
        best = tl.where(take, x, best)
        best_v0 = tl.where(take, v0, best_v0)
    if LSE:
        m, s = lse_reduce(tl.maximum(best, NEG_BIG), s, LOG2E, 1, FAST)
    else:
        m, s = best, best  # unused
    best, idx, _ = best_combine(best, best_v0, best, cols[None, :], 1)
    return best, idx, m, s


@triton.jit
def _accept_prefix(draft, idx, js, gamma, GP: tl.constexpr):
    """Greedy: accepted prefix length and next token from the per-position argmax idx.
    Position gamma has no draft token: it always "misses" and yields the bonus."""
    miss = (draft != idx.to(tl.int64)) | (js >= gamma)
    n_acc = tl.min(tl.where(miss, js, GP), axis=0)
    return n_acc, tl.sum(tl.where(js == n_acc, idx, 0), axis=0)


@triton.jit
def _num_accepted(draft_ptr, q_ptr, p_ptr, u_ptr, b, gamma,
                  stride_db, stride_dt, stride_qb, stride_qt, stride_pb, stride_pt,
                  stride_ub, stride_ut, GP: tl.constexpr):
    """Accepted prefix length: token i passes when u_i * q(x_i) < p(x_i)."""
    js = tl.arange(0, GP)
    dmask = js < gamma
    draft = tl.load(draft_ptr + b * stride_db + js * stride_dt, mask=dmask, other=-1)
    x_safe = tl.where(dmask, draft, 0)
    px = tl.load(p_ptr + b * stride_pb + js * stride_pt + x_safe, mask=dmask, other=0.0)
    qx = tl.load(q_ptr + b * stride_qb + js * stride_qt + x_safe, mask=dmask, other=0.0)
    u = tl.load(u_ptr + b * stride_ub + js * stride_ut, mask=dmask, other=0.0)
    rejected = dmask & ~(u * qx < px)
    return tl.min(tl.where(rejected, js, gamma), axis=0)


@triton.jit
def _residual(p_row, q_row, offs, vmask, q_len):
    """p and the residual max(p - q, 0) at offs; q reads as 0 from q_len on (no q row)."""
    pv = tl.load(p_row + offs, mask=vmask, other=0.0)
    qv = tl.load(q_row + offs, mask=vmask & (offs < q_len), other=0.0)
    return pv, tl.maximum(pv - qv, 0.0)


@triton.jit
def _subblock_sums(p_row, q_row, sums_ptr, start, V, W, q_len, NW: tl.constexpr, RPT: tl.constexpr,
                   NSUB: tl.constexpr):
    """Sums of the residual and of p over the NW parts of W columns from start (the last cut
    at V), NW / NSUB consecutive parts to a sub-block j, stored at sums_ptr + 2 * j (+ 1 for
    p). Warp w walks part w alone: a step reads [RPT, NT, 4] thread-owned groups (NT = 32 *
    NW slots, see `_common`), slot t's r-th group at column lo_w + i + 4 * (32 r + t mod 32),
    w = t // 32; element-wise running sums, no other warp's data in the loop, one reduction
    after it."""
    NT: tl.constexpr = 32 * NW
    ts = tl.arange(0, NT)
    lo = start + (ts // 32) * W                                   # [NT] start of the slot's part
    hi = tl.minimum(lo + W, V)[None, :, None]
    cols = (lo + (ts % 32) * 4)[None, :, None] + tl.arange(0, RPT)[:, None, None] * 128 + tl.arange(0, 4)[None, None, :]
    tot_r = tl.zeros([RPT, NT, 4], tl.float32)
    tot_p = tl.zeros([RPT, NT, 4], tl.float32)
    for i in range(0, W, RPT * 128):
        offs = cols + i
        pv, r = _residual(p_row, q_row, offs, offs < hi, q_len)
        tot_r += r
        tot_p += pv
    # per slot, then per sub-block ([NT] -> [NSUB, NT / NSUB])
    s_r = tl.sum(tl.reshape(tl.sum(tl.sum(tot_r, axis=2), axis=0), [NSUB, NT // NSUB]), axis=1)
    s_p = tl.sum(tl.reshape(tl.sum(tl.sum(tot_p, axis=2), axis=0), [NSUB, NT // NSUB]), axis=1)
    out = sums_ptr + 2 * tl.arange(0, NSUB)
    tl.store(out, s_r)
    tl.store(out + 1, s_p)


@triton.jit
def _residual_search(p_row, q_row, start, end, q_len, run, target, V, BLOCK: tl.constexpr):
    """Inverse CDF over [start, end) with `run` mass before start: the first v whose
    cumulative residual exceeds target (-1 if none), and the last v with mass (-1 if none)."""
    cols = tl.arange(0, BLOCK)
    token = -1
    last = -1
    for v0 in range(start, end, BLOCK):
        offs = v0 + cols
        vmask = offs < end
        _, r = _residual(p_row, q_row, offs, vmask, q_len)
        cs = run + tl.cumsum(r, axis=0)
        first = tl.min(tl.where(vmask & (cs > target), offs, V), axis=0)
        token = tl.where((token < 0) & (first < V), first, token)
        last = tl.maximum(last, tl.max(tl.where(r > 0, offs, -1), axis=0))
        run += tl.sum(r, axis=0)
    return token, last


@triton.jit
def _argmax_partial_kernel(
    p_ptr, part_val_ptr, part_idx_ptr, gamma, V, S, CHUNK, stride_pb, stride_pt, part_lse_ptr,
    GP: tl.constexpr, BLOCK: tl.constexpr, LSE: tl.constexpr, FAST: tl.constexpr, PDL: tl.constexpr,
):
    """Greedy split pass: best logit and its (lowest) index per position in one chunk; with
    LSE also the chunk's (max, sum-exp) per position, at part_lse [B, S, 2, GP]."""
    pdl_wait(PDL)
    b = tl.program_id(0).to(tl.int64)
    sp = tl.program_id(1)
    start = sp * CHUNK
    best, idx, m, s = _rows_argmax(p_ptr, b, gamma, start, tl.minimum(start + CHUNK, V),
                                   stride_pb, stride_pt, GP, BLOCK, LSE, FAST)
    out = (b * S + sp) * GP + tl.arange(0, GP)
    tl.store(part_val_ptr + out, best)
    tl.store(part_idx_ptr + out, idx)
    if LSE:
        out_lse = (b * S + sp) * (2 * GP) + tl.arange(0, GP)
        tl.store(part_lse_ptr + out_lse, m)
        tl.store(part_lse_ptr + out_lse + GP, s)


@triton.jit
def _greedy_accept_kernel(
    draft_ptr, part_val_ptr, part_idx_ptr, num_acc_ptr, next_ptr,
    gamma, V, S, stride_db, stride_dt, part_lse_ptr, lse_ptr, stride_lb, stride_lt,
    GP: tl.constexpr, SP: tl.constexpr, LSE: tl.constexpr, FAST: tl.constexpr, PDL: tl.constexpr,
):
    """Greedy combine: per-position argmax over the chunks, accepted prefix, next token;
    with LSE the logsumexp (natural log) of each position's logits into lse [B, gamma + 1]."""
    pdl_wait(PDL)
    b = tl.program_id(0).to(tl.int64)
    js = tl.arange(0, GP)
    ss = tl.arange(0, SP)
    smask = ss < S
    ptrs = (b * S + ss)[:, None] * GP + js[None, :]  # [SP, GP]
    val = tl.load(part_val_ptr + ptrs, mask=smask[:, None], other=float("-inf"))
    pidx = tl.load(part_idx_ptr + ptrs, mask=smask[:, None], other=V)
    top = tl.max(val, axis=0)
    idx = tl.min(tl.where(val == top[None, :], pidx, V), axis=0)  # ties: lowest index
    draft = tl.load(draft_ptr + b * stride_db + js * stride_dt, mask=js < gamma, other=-1)
    n_acc, token = _accept_prefix(draft, idx, js, gamma, GP)
    tl.store(num_acc_ptr + b, n_acc.to(tl.int64))
    tl.store(next_ptr + b, token.to(tl.int64))
    if LSE:
        lse_ptrs = (b * S + ss)[:, None] * (2 * GP) + js[None, :]  # [SP, GP]
        m = tl.load(part_lse_ptr + lse_ptrs, mask=smask[:, None], other=NEG_BIG)
        s = tl.load(part_lse_ptr + lse_ptrs + GP, mask=smask[:, None], other=0.0)
        top, tot = lse_reduce(m, s, LOG2E, 0, FAST)
        # top + ln(tot); a row of -inf only: NEG_BIG + log2(0) = -inf
        tl.store(lse_ptr + b * stride_lb + js * stride_lt, top + log2(tot, FAST) * LN2, mask=js <= gamma)


@triton.jit
def _residual_partial_kernel(
    draft_ptr, q_ptr, p_ptr, u_ptr, sums_ptr,
    gamma, V, NSB, W, stride_db, stride_dt, stride_qb, stride_qt, stride_pb, stride_pt,
    stride_ub, stride_ut, GP: tl.constexpr, NW: tl.constexpr, RPT: tl.constexpr, NSUB: tl.constexpr,
    PDL: tl.constexpr,
):
    """Sampling pass: sub-block sums of max(p - q, 0) and of p over one chunk, for the row
    pair at the first rejection (p_gamma alone when all pass)."""
    pdl_wait(PDL)
    b = tl.program_id(0).to(tl.int64)
    sp = tl.program_id(1)
    n_acc = _num_accepted(draft_ptr, q_ptr, p_ptr, u_ptr, b, gamma, stride_db, stride_dt,
                          stride_qb, stride_qt, stride_pb, stride_pt, stride_ub, stride_ut, GP)
    p_row = p_ptr + b * stride_pb + n_acc * stride_pt
    q_row = q_ptr + b * stride_qb + n_acc * stride_qt
    q_len = tl.where(n_acc < gamma, V, 0)  # no q row for the bonus (q = 0)
    _subblock_sums(p_row, q_row, sums_ptr + (b * NSB + sp * NSUB) * 2, sp * NW * W, V, W, q_len, NW, RPT, NSUB)


@triton.jit
def _residual_draw_kernel(
    draft_ptr, q_ptr, p_ptr, u_ptr, sums_ptr, num_acc_ptr, next_ptr,
    gamma, V, NSB, SBW, stride_db, stride_dt, stride_qb, stride_qt, stride_pb, stride_pt,
    stride_ub, stride_ut, GP: tl.constexpr, NSBP: tl.constexpr, WP: tl.constexpr, PDL: tl.constexpr,
):
    """Sampling combine: totals, the sub-block (SBW columns, WP its power of two) holding
    u * total, inverse-CDF scan of it."""
    pdl_wait(PDL)
    b = tl.program_id(0).to(tl.int64)
    n_acc = _num_accepted(draft_ptr, q_ptr, p_ptr, u_ptr, b, gamma, stride_db, stride_dt,
                          stride_qb, stride_qt, stride_pb, stride_pt, stride_ub, stride_ut, GP)
    ss = tl.arange(0, NSBP)
    smask = ss < NSB
    sums_row = sums_ptr + (b * NSB + ss) * 2
    sum_r = tl.load(sums_row, mask=smask, other=0.0)
    sum_p = tl.load(sums_row + 1, mask=smask, other=0.0)
    # Sum r == 0 means p_i <= q_i everywhere, i.e. p_i == q_i (both sum to 1): then a
    # rejection has probability 0 and only rounding gets here; p_i is then the exact
    # conditional distribution, so sampling it cannot bias the output.
    use_p = tl.sum(sum_r, axis=0) <= 0.0
    sums = tl.where(use_p, sum_p, sum_r)
    target = tl.load(u_ptr + b * stride_ub + gamma * stride_ut) * tl.sum(sums, axis=0)
    # First sub-block whose cumulative mass exceeds u * total, and its exclusive prefix.
    # Rounding can leave every prefix short of u * total: then the last sub-block with
    # mass, whose last token with mass is what an exact sum would have hit.
    cs = tl.cumsum(sums, axis=0)
    hit = tl.min(tl.where(smask & (cs > target), ss, NSB), axis=0)
    hit = tl.where(hit < NSB, hit, tl.maximum(tl.max(tl.where(sums > 0, ss, -1), axis=0), 0))
    run = tl.sum(tl.where(ss < hit, sums, 0.0), axis=0)
    p_row = p_ptr + b * stride_pb + n_acc * stride_pt
    q_row = q_ptr + b * stride_qb + n_acc * stride_qt
    q_len = tl.where((n_acc < gamma) & ~use_p, V, 0)
    start = hit * SBW
    token, last_in = _residual_search(p_row, q_row, start, tl.minimum(start + SBW, V), q_len,
                                      run, target, V, WP)
    # Rounding can leave the in-block sum just short of u * total: the sub-block's last
    # token with mass (what an exact sum would have hit); an all-zero row gives 0.
    token = tl.where(token < 0, tl.maximum(last_in, 0), token)
    tl.store(num_acc_ptr + b, n_acc.to(tl.int64))
    tl.store(next_ptr + b, token.to(tl.int64))


def chain_verify(draft_tokens, q_probs, p, *, greedy, uniforms=None, lse_out=None, plan=None):
    """Triton launcher; see `tabed_engine.ops.chain_verify.chain_verify` for the contract.
    `plan`: a `verify_plan` for these shapes (default: the device's)."""
    if draft_tokens.dim() != 2 or draft_tokens.dtype != torch.int64:
        raise ValueError(f"draft_tokens must be int64 [B, gamma], got {draft_tokens.dtype} "
                         f"{tuple(draft_tokens.shape)}")
    B, gamma = draft_tokens.shape
    if p.dim() != 3 or p.shape[:2] != (B, gamma + 1):
        raise ValueError(f"p must be [B, gamma+1, V] = [{B}, {gamma + 1}, V], got {tuple(p.shape)}")
    V = p.shape[2]
    if p.stride(2) != 1 or p.device != draft_tokens.device:
        raise ValueError("p must have a contiguous last dimension, on the device of draft_tokens")
    if greedy:
        if p.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise TypeError(f"p dtype {p.dtype} not supported")
        q_probs = uniforms = p  # unused by the greedy kernel
    else:
        if q_probs is None or uniforms is None:
            raise ValueError("sampling needs q_probs and uniforms")
        if p.dtype != torch.float32 or q_probs.dtype != torch.float32 or uniforms.dtype != torch.float32:
            raise TypeError("sampling needs float32 p, q_probs and uniforms")
        if q_probs.shape != (B, gamma, V) or q_probs.stride(2) != 1:
            raise ValueError(f"q_probs must be [B, gamma, V] = [{B}, {gamma}, {V}] with unit last stride")
        if uniforms.shape != (B, gamma + 1):
            raise ValueError(f"uniforms must be [B, gamma+1] = [{B}, {gamma + 1}]")
        if q_probs.device != p.device or uniforms.device != p.device:
            raise ValueError("all inputs must be on one device")
    if lse_out is not None:
        if not greedy:
            raise ValueError("lse_out is greedy only (p holds target logits there)")
        if not isinstance(lse_out, torch.Tensor) or lse_out.dtype != torch.float32:
            raise TypeError(f"lse_out must be a float32 tensor, got {getattr(lse_out, 'dtype', type(lse_out))}")
        if lse_out.shape != (B, gamma + 1) or lse_out.device != p.device:
            raise ValueError(f"lse_out must be [B, gamma+1] = [{B}, {gamma + 1}] on {p.device}, got "
                             f"{tuple(lse_out.shape)} on {lse_out.device}")
    dev = p.device
    if plan is None:
        plan = verify_plan(B, gamma, V, greedy=greedy, lse=lse_out is not None, sms=sm_count(dev))
    elif (plan.B, plan.gamma, plan.V, plan.greedy, plan.lse) != (B, gamma, V, bool(greedy), lse_out is not None):
        raise ValueError(f"plan {plan} does not match these arguments")
    use_pdl = pdl(dev)  # programmatic dependent launches (see _common.pdl)
    num_acc = torch.empty(B, dtype=torch.int64, device=dev)
    next_token = torch.empty(B, dtype=torch.int64, device=dev)
    GP = triton.next_power_of_2(gamma + 1)
    if B == 0:
        return num_acc, next_token
    strides = (draft_tokens.stride(0), draft_tokens.stride(1), q_probs.stride(0), q_probs.stride(1),
               p.stride(0), p.stride(1), uniforms.stride(0), uniforms.stride(1))
    S = plan.splits
    if greedy:
        lse = plan.lse
        SP = triton.next_power_of_2(S)
        part_val = torch.empty(B * S * GP, dtype=torch.float32, device=dev)
        part_idx = torch.empty(B * S * GP, dtype=torch.int32, device=dev)
        # per (request, chunk): GP maxima then GP sums; unused pointers get part_val
        part_lse = torch.empty(B * S * 2 * GP, dtype=torch.float32, device=dev) if lse else part_val
        lse_dst, lse_strides = (lse_out, lse_out.stride()) if lse else (part_val, (0, 0))
        fast = dev.type == "cuda"
        _argmax_partial_kernel[(B, S)](
            p, part_val, part_idx, gamma, V, S, plan.chunk, p.stride(0), p.stride(1), part_lse,
            GP=GP, BLOCK=plan.block, LSE=lse, FAST=fast, PDL=use_pdl, launch_pdl=use_pdl, num_warps=plan.warps,
        )
        _greedy_accept_kernel[(B,)](
            draft_tokens, part_val, part_idx, num_acc, next_token, gamma, V, S,
            draft_tokens.stride(0), draft_tokens.stride(1), part_lse, lse_dst, *lse_strides, GP=GP, SP=SP,
            LSE=lse, FAST=fast, PDL=use_pdl, launch_pdl=use_pdl, num_warps=1 if SP * GP <= 256 else 4,
        )
    else:
        NW, NSUB, W = plan.warps, plan.subblocks, plan.block
        NSB = S * NSUB
        WD = W * (NW // NSUB)                  # the draw's block: one sub-block
        sums = torch.empty(B * NSB * 2, dtype=torch.float32, device=dev)
        _residual_partial_kernel[(B, S)](
            draft_tokens, q_probs, p, uniforms, sums, gamma, V, NSB, W, *strides,
            GP=GP, NW=NW, RPT=plan.rpt, NSUB=NSUB, PDL=use_pdl, launch_pdl=use_pdl, num_warps=NW,
        )
        _residual_draw_kernel[(B,)](
            draft_tokens, q_probs, p, uniforms, sums, num_acc, next_token,
            gamma, V, NSB, WD, *strides, GP=GP, NSBP=triton.next_power_of_2(NSB),
            WP=triton.next_power_of_2(WD),
            num_warps=_DRAW_WARPS, PDL=use_pdl, launch_pdl=use_pdl,
        )
    return num_acc, next_token
