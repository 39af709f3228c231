"""Device helpers of `ensemble_mix`'s kernels: folding per-split bests into a token, the
sampling draw over slot masses (`_slot_draw`) and the per-tile mixture probabilities."""

import triton
import triton.language as tl

from ._common import BIG_IDX, NEG_BIG, exp2, log2, lse_reduce, uniforms


@triton.jit
def _fold_bests(prow, idx_row, ss, smask, KP: tl.constexpr, V):
    """The row's S chunk bests (part rows `prow` [SP]: best score at 2 * KP, its value at
    2 * KP + 1; indices at idx_row + s) -> (token, its value): the highest score, lowest
    index on ties (as torch.argmax). Loaded past L1: other programs of the same launch may
    have written them."""
    bv = tl.load(prow + 2 * KP, mask=smask, other=float("-inf"), cache_modifier=".cg")
    by = tl.load(prow + 2 * KP + 1, mask=smask, other=0.0, cache_modifier=".cg")
    bi = tl.load(idx_row + ss, mask=smask, other=V, cache_modifier=".cg")
    top = tl.max(bv, axis=0)
    tok = tl.min(tl.where(bv == top, bi, V), axis=0)
    return tok, tl.sum(tl.where(smask & (bi == tok), by, 0.0), axis=0)


@triton.jit
def _fold_token(prow, part_idx_ptr, token_ptr, token_prob_ptr, b, S, ss, smask, ks, KP: tl.constexpr, V,
                TOK_K: tl.constexpr):
    """Greedy, K > 1: row b's S chunk bests (`_fold_bests`) -> its token and probability."""
    tok, q_tok = _fold_bests(prow, part_idx_ptr + b * S, ss, smask, KP, V)
    _store_token(token_ptr, b, tok, ks, TOK_K)
    tl.store(token_prob_ptr + b, q_tok)


@triton.jit
def _store_token(token_ptr, b, tok, ks, TOK_K: tl.constexpr):
    """Request b's token: stored once (TOK_K = 1), or into each of its TOK_K view rows
    (token_ptr + b * TOK_K + k), the next draft step's input ids. ks: arange(KP), KP >= TOK_K."""
    tl.store(token_ptr + b * TOK_K + ks, (tok + 0 * ks).to(tl.int64), mask=ks < TOK_K)


@triton.jit
def _row_normalisers(prow, ks, pmask, kmask, scale, KP: tl.constexpr, FAST: tl.constexpr):
    """Row b's S pass-1 partials ([SP] row pointers `prow`) -> (chunk maxima pm and sum-exps
    ps, [SP, KP]; each view's log2-normaliser lse2, [KP], 0 for padded views)."""
    pm = tl.load(prow[:, None] + ks[None, :], mask=pmask, other=NEG_BIG)
    ps = tl.load(prow[:, None] + KP + ks[None, :], mask=pmask, other=0.0)
    top, tot = lse_reduce(pm, ps, scale, 0, FAST)
    lse2 = tl.where(kmask, top * scale + log2(tl.where(kmask, tot, 1.0), FAST), 0.0)  # log2 units
    return pm, ps, lse2


@triton.jit
def _slot_draw(logits_ptr, part_ptr, slot_ptr, seed_ptr, offset_ptr, token_ptr, token_prob_ptr,
               b, w, lse2, pm, pmask, d_pre, ks, kmask, V, S, stride_logits, scale,
               K: tl.constexpr, KP: tl.constexpr, SP: tl.constexpr, P: tl.constexpr, SW: tl.constexpr,
               SB: tl.constexpr, NB: tl.constexpr, TOK_K: tl.constexpr,
               FAST: tl.constexpr):
    """Draw request b's token by inverse CDF in the draw order (slot T = (c mod P) // SW
    first, then column): slot T's mixture mass M_T = sum_{s,k} w_k 2^(max_s,k * scale -
    lse2_k) sumexp_s,k,T over pass 1's partials (chunks s, SB at a time); the row's uniform
    u (Philox output 0 at counter offset + b * V) picks the first slot whose cumulative mass
    exceeds r = u * sum_T M_T (never one of zero mass), and its columns (SW per period of P,
    NB periods per step: 1/(P/SW) of the row) are re-read and walked in order to the first
    whose prefix sum of q passes what is left of r. A sum that falls short (float rounding)
    takes the slot's last column with q > 0. The order depends on P and SW only, not on the
    split, so any split draws the same token from the same uniform (up to rounding at a
    boundary). Stores the token and q(token).

    When every chunk's slot sums fit one tile (SB >= SP: V = 32064 at any B, K <= 4) the
    caller loaded them (d_pre, [SP, KP, P // SW]) beside the chunk partials (pm, [SP, KP]),
    so they arrive with them rather than after the normalisers' reductions."""
    NSS: tl.constexpr = P // SW
    tt = tl.arange(0, NSS)
    sb = tl.arange(0, SB)
    if SB >= SP:
        mass = _slot_mass(pm, d_pre, pmask, w, lse2, scale, FAST)
    else:
        mass = tl.zeros([NSS], tl.float32)
        for s0 in tl.range(0, S, SB, num_stages=1):
            smask = (s0 + sb) < S
            dmask = smask[:, None] & kmask[None, :]
            pm_b = tl.load(part_ptr + (b * S + s0 + sb[:, None]) * (2 * KP + 2) + ks[None, :], mask=dmask,
                           other=NEG_BIG)   # chunk max per view, [SB, KP]
            d_s = tl.load(slot_ptr + _slot_offsets(b, S, s0 + sb, ks, KP, NSS), mask=dmask[:, :, None], other=0.0)
            mass += _slot_mass(pm_b, d_s, dmask, w, lse2, scale, FAST)
    cum = tl.cumsum(mass, 0)                                          # non-decreasing
    u = tl.sum(tl.where(tl.arange(0, 4) == 0,
                        uniforms(tl.load(seed_ptr), tl.load(offset_ptr) + b * V, 0, 4), 0.0), axis=0)
    r = u * tl.max(cum, axis=0)
    slot = tl.sum((cum <= r).to(tl.int32), axis=0)
    slot = tl.minimum(slot, tl.max(tl.where(mass > 0, tt, 0), axis=0))
    r_in = r - tl.sum(tl.where(tt < slot, mass, 0.0), axis=0)
    ii = tl.arange(0, NB * SW)
    run = 0.0                       # q summed over the slot's earlier steps
    hit = BIG_IDX                   # first column whose prefix sum passes r_in, and its q
    q_hit = 0.0
    last = slot * SW                # last column with q > 0 (the fallback), and its q
    q_last = 0.0
    for n0 in tl.range(0, tl.cdiv(V, P), NB, num_stages=1):
        offs = (n0 + ii // SW) * P + slot * SW + ii % SW   # NB periods' SW columns: the draw order
        vmask = offs < V
        q = _tile_q(logits_ptr, b, offs, vmask, w, lse2, ks, stride_logits, scale, K, FAST)
        pos = vmask & (q > 0)       # never a zero-probability token
        cs = tl.cumsum(q, 0) + run
        # one reduction: the first column passing r_in and the last with q > 0, with their q
        h, q_h, lst, q_l = tl.reduce((tl.where(pos & (cs > r_in), offs, BIG_IDX), q, tl.where(pos, offs, -1), q),
                                     0, _first_last)
        q_hit = tl.where(hit == BIG_IDX, q_h, q_hit)
        hit = tl.minimum(hit, h)
        q_last = tl.where(lst >= 0, q_l, q_last)
        last = tl.maximum(last, lst)
        run += tl.sum(q, axis=0)
    tok = tl.where(hit < BIG_IDX, hit, last)
    _store_token(token_ptr, b, tok, ks, TOK_K)
    tl.store(token_prob_ptr + b, tl.where(hit < BIG_IDX, q_hit, q_last))


@triton.jit
def _slot_offsets(b, S, chunks, ks, KP: tl.constexpr, NSS: tl.constexpr):
    """Offsets of pass 1's draw-slot sums of row b, [len(chunks), KP, NSS]: rows (b, s, k)."""
    return ((b * S + chunks[:, None, None]) * KP + ks[None, :, None]) * NSS + tl.arange(0, NSS)[None, None, :]


@triton.jit
def _slot_mass(pm, d, mask, w, lse2, scale, FAST: tl.constexpr):
    """Slot masses [NSS] of a tile of chunks: sum over chunks s and views k of
    w_k 2^(pm_s,k * scale - lse2_k) d_s,k,T, with pm [SB, KP] the chunk maxima, d
    [SB, KP, NSS] the slot sums and mask [SB, KP] the valid (chunk, view) pairs."""
    coef = tl.where(mask, w[None, :] * exp2(pm * scale - lse2[None, :], FAST), 0.0)
    return tl.sum(tl.sum(coef[:, :, None] * d, axis=1), axis=0)


@triton.jit
def _first_last(h0, qh0, l0, ql0, h1, qh1, l1, ql1):
    """Combine for `_slot_draw`'s scan: the lower first index and the higher last index, each
    with its value."""
    take_h = h1 < h0
    take_l = l1 > l0
    return tl.where(take_h, h1, h0), tl.where(take_h, qh1, qh0), tl.where(take_l, l1, l0), tl.where(take_l, ql1, ql0)


@triton.jit
def _tile_q(logits_ptr, b, offs, vmask, w, lse2, ks, stride_logits, scale, K: tl.constexpr, FAST: tl.constexpr):
    """Mixture q = sum_k w_k 2^(x_k * scale - lse2_k) at columns `offs` (any shape) of row b.
    The views one tile at a time (K is a constexpr): the sum over views stays inside each
    thread, where a [KP, ...] tile would exchange through shared memory every step."""
    q = tl.zeros(offs.shape, tl.float32)
    for k in tl.static_range(K):
        x = tl.load(logits_ptr + (b * K + k) * stride_logits + offs, mask=vmask, other=float("-inf")).to(tl.float32)
        q += _view_scalar(w, ks, k) * exp2(x * scale - _view_scalar(lse2, ks, k), FAST)
    return q


@triton.jit
def _view_scalar(v, ks, k: tl.constexpr):
    """Element k of a per-view vector v ([KP])."""
    return tl.sum(tl.where(ks == k, v, 0.0), axis=0)
