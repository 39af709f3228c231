"""One block's ensemble-history update and the next block's weights, in one launch.

The PyTorch path (`tabed_engine.ops.history_update.history_update_reference`) is ~20 small
kernels per block (index copies into the history, masked sums over it, the policy's
arithmetic); inside the block's CUDA graph each costs a dependent launch. Here one program
per request b (for `w-grid`, one per request and slice of GS weight vectors, see below):

1. writes the block's P positions into the history at the row's own slots cursor[b]..
   (valid flag, per-view divergence, and for `w-grid` the per-weight-vector match and KL) -
   the same slots with the same values on every call, so a replayed or warmed-up graph
   stays idempotent;
2. sums the divergences of the recorded positions that fall in the window (the last
   `window` valid positions, 0 = all): the row's old slots [0, cursor[b]) are read back from
   the history in BLOCK_H tiles (a row admitted at a later block reads only its own, shorter
   history), the new ones are still in registers;
3. turns the sums into weights [K] by the policy (kld/tvd: softmax(-log D / t); hedge:
   1/KL on a single position, else softmax(-sum min(KL, clip) / t); w-grid: the grid row
   with the most argmax matches, ties to the lowest summed KL, then the lowest index) and
   writes them; the row's program (slice 0 of it) writes its new cursor, cursor[b] + P.

`w-grid` with more than GRID_SLICE weight vectors runs on grid (B, NG): program (b, s)
records and sums the match and KL rows of vectors s*GS .. s*GS + GS - 1 (slice 0 also
writes the valid flags and divergences; every slice counts the window's positions itself),
takes its slice's best (match sum, KL sum, index) by the rule above and stores it; the last
of the row's NG programs to arrive (atomic counter, reset by it) folds the NG candidates by
the same rule and writes the weights. The fold is exact: every vector's sums are whole in
one program, only the choice is split. One program reading the whole grid's history is
latency bound at the engine's K = 4 grid (G = 286); the slice width was chosen by an H200
sweep (benchmarks/results/history_update.json, benchmarks/results/kernels_backed_out.md).
Grids of at most GRID_SLICE vectors and the other policies keep one program per request
(SPLIT off: no workspace, no atomic).

Everything in fp32.
"""
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ._common import counters, pdl, pdl_wait

POLICY_DIV, POLICY_GRID, POLICY_HEDGE = 0, 1, 2
_BIG_IDX = tl.constexpr(2147483647)
# w-grid: weight vectors per program when the grid has more (a power of two), and elements
# of a [GS, BLOCK_H] tile of one statistic
GRID_SLICE = 4
GRID_TILE = 4096


@dataclass(frozen=True)
class HistoryPlan:
    """How `history_update` launches (`history_plan`): grid (B, slices)."""
    G: int          # weight vectors (0: no w-grid)
    slices: int     # programs per request
    gs: int         # weight vectors per program (a power of two)
    block_h: int    # old history slots per step


def history_plan(G, *, grid_slice=GRID_SLICE, grid_tile=GRID_TILE):
    """The launch plan for a w-grid of G weight vectors (0 for the other policies);
    `grid_slice` and `grid_tile` override the constants (tests cover several slices on
    small grids with them)."""
    slices = triton.cdiv(G, grid_slice) if G else 1
    if slices > 1:
        return HistoryPlan(G=G, slices=slices, gs=grid_slice, block_h=max(2, grid_tile // grid_slice))
    gs = triton.next_power_of_2(max(G, 1))
    return HistoryPlan(G=G, slices=1, gs=gs, block_h=max(2, min(64, grid_tile // gs)) if G else 64)


@triton.jit
def _lex_best(matches, kl, idx, mask):
    """Among the `mask`ed entries: the most matches, then the lowest KL sum, then the lowest
    index. Returns (matches, KL sum, index) of the winner; the index is the lowest overall
    when every best entry's KL sum is +inf (callers decide that case)."""
    best = tl.max(tl.where(mask, matches, -1.0), axis=0)
    kl_best = tl.where(mask & (matches >= best), kl, float("inf"))
    kmin = tl.min(kl_best, axis=0)
    return best, kmin, tl.min(tl.where(kl_best == kmin, idx, _BIG_IDX), axis=0)


@triton.jit
def _history_kernel(
    div_new_ptr, match_new_ptr, gkl_new_ptr, n_acc_ptr, cursor_ptr,
    valid_ptr, div_ptr, match_ptr, gkl_ptr, grid_ptr, w_ptr, new_cursor_ptr,
    part_ptr, part_idx_ptr, cnt_ptr,
    K, P, G, CAP, WINDOW, inv_t, clip, NG,
    POLICY: tl.constexpr, ALL_POS: tl.constexpr, HAS_WINDOW: tl.constexpr,
    KP: tl.constexpr, PP: tl.constexpr, GS: tl.constexpr, NGP: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_H: tl.constexpr, PDL: tl.constexpr,
):
    pdl_wait(PDL)
    b = tl.program_id(0).to(tl.int64)
    sl = tl.program_id(1)  # slice of the grid's weight vectors (0 unless SPLIT)
    cur = tl.load(cursor_ptr + b)   # this row's first free slot
    n_acc = tl.load(n_acc_ptr + b)
    ks = tl.arange(0, KP)
    kmask = ks < K
    ps = tl.arange(0, PP)
    pmask = ps < P
    GRID: tl.constexpr = POLICY == 1

    # ---- 1. the new block: positions 0..n_acc (all P with ALL_POS), written at cur + p
    vnew = pmask & ((ps <= n_acc) | ALL_POS)
    vnew_i = vnew.to(tl.int32)
    n_new = tl.sum(vnew_i, axis=0)
    own = pmask  # the valid flags and divergences: written by slice 0 only
    if SPLIT:    # (not pmask & (sl == 0): the interpreter makes that mask int32)
        own = ps < tl.where(sl == 0, P, 0)
    kp_mask = kmask[:, None] & own[None, :]
    dnew = tl.load(div_new_ptr + (b * K + ks[:, None]) * P + ps[None, :], mask=kp_mask, other=0.0)
    tl.store(valid_ptr + b * CAP + cur + ps, vnew.to(tl.int8), mask=own)
    tl.store(div_ptr + (b * K + ks[:, None]) * CAP + cur + ps[None, :], dnew, mask=kp_mask)
    gs = sl * GS + tl.arange(0, GS)
    gmask = gs < G
    # window rank of a new position: valid new positions at or after it
    from_end_new = n_new - (tl.cumsum(vnew_i, axis=0) - vnew_i)
    inc_new = vnew
    if HAS_WINDOW:
        inc_new = vnew & (from_end_new <= WINDOW)
    npos = tl.sum(inc_new.to(tl.int32), axis=0)
    d = tl.zeros([KP], tl.float32)   # the divergence sums: div policies only
    dc = tl.zeros([KP], tl.float32)
    msum = tl.zeros([GS], tl.float32)
    ksum = tl.zeros([GS], tl.float32)
    if GRID:
        gp_mask = gmask[:, None] & pmask[None, :]
        gnew = (b * G + gs[:, None]) * P + ps[None, :]
        mnew = tl.load(match_new_ptr + gnew, mask=gp_mask, other=0).to(tl.float32)
        knew = tl.load(gkl_new_ptr + gnew, mask=gp_mask, other=0.0)
        gslot = (b * G + gs[:, None]) * CAP + cur + ps[None, :]
        tl.store(match_ptr + gslot, mnew, mask=gp_mask)
        tl.store(gkl_ptr + gslot, knew, mask=gp_mask)
        msum = tl.sum(tl.where(inc_new[None, :], mnew, 0.0), axis=1)
        ksum = tl.sum(tl.where(inc_new[None, :], knew, 0.0), axis=1)
    else:
        d = tl.sum(tl.where(inc_new[None, :], dnew, 0.0), axis=1)                   # [KP]
        dc = tl.sum(tl.where(inc_new[None, :], tl.minimum(dnew, clip), 0.0), axis=1)

    # ---- 2. the row's recorded positions before this block, [0, cur)
    n_old = 0
    if HAS_WINDOW:
        for h0 in range(0, cur, BLOCK_H):
            hs = h0 + tl.arange(0, BLOCK_H)
            v = tl.load(valid_ptr + b * CAP + hs, mask=hs < cur, other=0) != 0
            n_old += tl.sum(v.to(tl.int32), axis=0)
    seen = 0
    for h0 in range(0, cur, BLOCK_H):
        hs = h0 + tl.arange(0, BLOCK_H)
        hmask = hs < cur
        # the step's loads first: a load placed after the window's reductions (barriers)
        # waits for them, one more round trip per step
        v = tl.load(valid_ptr + b * CAP + hs, mask=hmask, other=0) != 0
        if GRID:
            gh = (b * G + gs[:, None]) * CAP + hs[None, :]
            gh_mask = gmask[:, None] & hmask[None, :]
            mh = tl.load(match_ptr + gh, mask=gh_mask, other=0.0)
            kh = tl.load(gkl_ptr + gh, mask=gh_mask, other=0.0)
        else:
            kh_mask = kmask[:, None] & hmask[None, :]
            dv = tl.load(div_ptr + (b * K + ks[:, None]) * CAP + hs[None, :], mask=kh_mask, other=0.0)
        inc = v
        if HAS_WINDOW:
            v_i = v.to(tl.int32)
            from_end = n_old - (tl.cumsum(v_i, axis=0) + seen) + 1 + n_new
            inc = v & (from_end <= WINDOW)
            seen += tl.sum(v_i, axis=0)
        npos += tl.sum(inc.to(tl.int32), axis=0)
        if GRID:
            msum += tl.sum(tl.where(inc[None, :], mh, 0.0), axis=1)
            ksum += tl.sum(tl.where(inc[None, :], kh, 0.0), axis=1)
        else:
            d += tl.sum(tl.where(inc[None, :], dv, 0.0), axis=1)
            dc += tl.sum(tl.where(inc[None, :], tl.minimum(dv, clip), 0.0), axis=1)

    # ---- 3. weights
    if GRID:
        best, kmin, g_star = _lex_best(msum, ksum, gs, gmask)   # this program's vectors
        if SPLIT:
            tl.store(part_ptr + (b * NG + sl) * 2, best)
            tl.store(part_ptr + (b * NG + sl) * 2 + 1, kmin)
            tl.store(part_idx_ptr + b * NG + sl, g_star)
            tl.debug_barrier()  # the slice's best is stored before the release below
            arrived = tl.atomic_add(cnt_ptr + b, 1, sem="acq_rel", scope="gpu")
            if arrived == NG - 1:  # the row's last slice: its NG bests -> the grid row, same rule
                ns = tl.arange(0, NGP)
                nmask = ns < NG
                bm = tl.load(part_ptr + (b * NG + ns) * 2, mask=nmask, other=-1.0, cache_modifier=".cg")
                bk = tl.load(part_ptr + (b * NG + ns) * 2 + 1, mask=nmask, other=float("inf"),
                             cache_modifier=".cg")
                bi = tl.load(part_idx_ptr + b * NG + ns, mask=nmask, other=_BIG_IDX, cache_modifier=".cg")
                _, kmin, g_star = _lex_best(bm, bk, bi, nmask)
                # every best vector's KL sum +inf: row 0, as one program (and the reference) picks
                g_star = tl.where(kmin < float("inf"), g_star, 0)
                _store_weights(w_ptr, b, _grid_row(grid_ptr, g_star, ks, kmask, K), ks, kmask, npos, K)
                tl.store(cnt_ptr + b, 0)  # every slice has arrived: ready for the next launch
        else:
            _store_weights(w_ptr, b, _grid_row(grid_ptr, g_star, ks, kmask, K), ks, kmask, npos, K)
    else:
        x = -tl.log(tl.maximum(d, 1e-12))
        if POLICY == 2:
            x = tl.where(npos <= 1, x, -dc * inv_t)
        else:
            x = x * inv_t
        x = tl.where(kmask, x, float("-inf"))
        e = tl.exp(x - tl.max(x, axis=0))
        _store_weights(w_ptr, b, e / tl.sum(e, axis=0), ks, kmask, npos, K)
    if sl == 0:
        tl.store(new_cursor_ptr + b, cur + P)


@triton.jit
def _grid_row(grid_ptr, g_star, ks, kmask, K):
    """Weight vector g_star of the grid, [KP]."""
    return tl.load(grid_ptr + g_star * K + ks, mask=kmask, other=0.0)


@triton.jit
def _store_weights(w_ptr, b, w, ks, kmask, npos, K):
    """Request b's weights w ([KP]); uniform before any position is recorded."""
    tl.store(w_ptr + b * K + ks, tl.where(npos > 0, w, 1.0 / K), mask=kmask)


def history_update(div_new, match_new, gkl_new, n_acc, cursor, valid, div, match, gkl, grid, *,
                   policy, window, temperature, clip, all_positions, out=None, plan=None):
    """Triton launcher; see `tabed_engine.ops.history_update.history_update` for the contract.
    out: optional [B, K] fp32 tensor for the weights (tests poison it); plan: a
    `history_plan` for this grid (default: the constants')."""
    B, K, P = div_new.shape
    CAP = valid.shape[1]
    has_grid = policy == POLICY_GRID
    G = grid.shape[0] if has_grid else 0
    dev = div_new.device
    use_pdl = pdl(dev)  # programmatic dependent launches (see _common.pdl)
    for name, t in (("div_new", div_new), ("div", div), ("valid", valid)):
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    if P < 1 or K < 1:
        raise ValueError(f"a block records at least one position of at least one view, got K={K}, P={P}")
    if div.shape != (B, K, CAP) or valid.dtype != torch.bool or n_acc.shape != (B,) or cursor.shape != (B,):
        raise ValueError(f"history shapes do not match: div_new {tuple(div_new.shape)}, div {tuple(div.shape)}, "
                         f"valid {tuple(valid.shape)} {valid.dtype}, n_acc {tuple(n_acc.shape)}, "
                         f"cursor {tuple(cursor.shape)}")
    if has_grid and (match_new.shape != (B, G, P) or gkl_new.shape != (B, G, P)
                     or match.shape != (B, G, CAP) or gkl.shape != (B, G, CAP)):
        raise ValueError("w-grid statistics do not match the grid and history shapes")
    w = torch.empty(B, K, device=dev, dtype=torch.float32) if out is None else out
    if w.shape != (B, K) or w.dtype != torch.float32 or not w.is_contiguous():
        raise ValueError(f"out must be contiguous fp32 [{B}, {K}], got {w.dtype} {tuple(w.shape)}")
    if cursor.dtype != torch.long or not cursor.is_contiguous():
        raise ValueError(f"cursor must be contiguous int64 [B], got {cursor.dtype}")
    new_cursor = torch.empty(B, device=dev, dtype=torch.long)
    if plan is None:
        plan = history_plan(G)
    elif plan.G != G:
        raise ValueError(f"plan {plan} is for {plan.G} weight vectors, not {G}")
    NG, GS, BLOCK_H = plan.slices, plan.gs, plan.block_h
    split = NG > 1
    dummy = div_new
    part = part_idx = cnt = dummy
    if split:  # per (request, slice): its best's (match sum, KL sum) and vector; arrival counters
        part = torch.empty(B * NG * 2, device=dev, dtype=torch.float32)
        part_idx = torch.empty(B * NG, device=dev, dtype=torch.int32)
        cnt = counters(dev, B)
    _history_kernel[(B, NG)](
        div_new, match_new.view(torch.uint8) if has_grid else dummy, gkl_new if has_grid else dummy,
        n_acc, cursor, valid.view(torch.int8), div, match if has_grid else dummy, gkl if has_grid else dummy,
        grid if has_grid else dummy, w, new_cursor, part, part_idx, cnt,
        K, P, G, CAP, window, 1.0 / temperature, clip, NG,
        POLICY=policy, ALL_POS=all_positions, HAS_WINDOW=window > 0,
        KP=triton.next_power_of_2(K), PP=triton.next_power_of_2(P), GS=GS, NGP=triton.next_power_of_2(NG),
        SPLIT=split, BLOCK_H=BLOCK_H, num_warps=4, PDL=use_pdl, launch_pdl=use_pdl,
    )
    return w, new_cursor
