"""Ensemble history: record one block's divergences and compute the next block's weights.

The history of B requests holds `capacity` slots: valid [B, C] bool, the per-view
divergence div [B, K, C] (KL, or TV for `tvd`), and for `w-grid` per weight vector of the
grid [G, K] whether the mixture's argmax matched the target's, match [B, G, C], and the
mixture's KL, gkl [B, G, C]. Every row has its own write cursor, cursor [B] (the row's first
free slot; requests of a continuously batched step joined at different blocks): row b's P
positions go to slots cursor[b] .. cursor[b] + P - 1, and positions 0..n_acc[b] are valid
(all P with `all_positions`; none when n_acc[b] = -1). Only a row's slots before
cursor[b] + P count: a request admitted into a row starts it at slot 0 (`valid[b]` cleared,
see `EnsembleState.reset_rows`), whatever the row held beyond. The weights use the row's
last `window` valid positions (0 = all):

* div policies (kld, tvd): w = softmax(-log D / t), D the summed divergence;
* hedge: on a single recorded position w = softmax(-log D) (1/KL), after that
  w = softmax(-sum min(div, clip) / t);
* w-grid: the grid row with the most matches, ties to the lowest summed gkl, then the
  lowest row;

uniform before any position is recorded.
"""
import torch

POLICY_DIV, POLICY_GRID, POLICY_HEDGE = 0, 1, 2


def history_update_reference(div_new, match_new, gkl_new, n_acc, cursor, valid, div, match, gkl, grid, *,
                             policy, window, temperature, clip, all_positions):
    """Plain-PyTorch history update (ground truth for tests; CPU path of the engine)."""
    B, K, P = div_new.shape
    C = valid.shape[1]
    idx = cursor[:, None] + torch.arange(P, device=cursor.device)        # [B, P]: each row's slots
    new_valid = torch.arange(P, device=n_acc.device)[None] <= n_acc[:, None]
    if all_positions:
        new_valid = torch.ones_like(new_valid)
    valid.scatter_(1, idx, new_valid)
    div.scatter_(2, idx[:, None].expand(B, K, P), div_new.float())
    if policy == POLICY_GRID:
        gidx = idx[:, None].expand(B, grid.shape[0], P)
        match.scatter_(2, gidx, match_new.float())
        gkl.scatter_(2, gidx, gkl_new.float())
    # a row's recorded slots end at its new cursor; of them the last `window` valid (all when 0)
    m = valid & (torch.arange(C, device=valid.device) < (cursor + P)[:, None])
    if window:
        from_end = m.flip(-1).cumsum(-1).flip(-1)                            # valid at or after each slot
        m = m & (from_end <= window)
    m = m[:, None]                                                         # [B, 1, C]
    npos = m.flatten(1).sum(-1, keepdim=True)                              # [B, 1]
    if policy == POLICY_GRID:
        msum = torch.where(m, match, 0.0).sum(-1)                           # [B, G]
        ksum = torch.where(m, gkl, 0.0).sum(-1)
        best = msum.max(-1, keepdim=True).values
        ksum = ksum.masked_fill(msum < best, float("inf"))
        w = grid[ksum.argmin(-1)]                                           # [B, K]
    else:
        d = torch.where(m, div, 0.0).sum(-1)                                # [B, K]
        x = -torch.log(d.clamp_min(1e-12))
        if policy == POLICY_HEDGE:
            dc = torch.where(m, div.clamp_max(clip), 0.0).sum(-1)
            x = torch.where(npos <= 1, x, -dc / temperature)
        else:
            x = x / temperature
        w = torch.softmax(x, dim=-1)
    w = torch.where(npos > 0, w, torch.full_like(w, 1.0 / K))
    return w, cursor + P


def history_update(div_new, match_new, gkl_new, n_acc, cursor, valid, div, match, gkl, grid, *,
                   policy, window, temperature=1.0, clip=1.0, all_positions=False):
    """Record one block in the history (in place) and return (weights [B, K] fp32, cursor + P [B]).

    div_new [B, K, P] fp32 divergences of the block; match_new [B, G, P] bool/uint8 and
    gkl_new [B, G, P] fp32 (w-grid only, else None); n_acc [B] int64 accepted drafts (the
    positions 0..n_acc are recorded); cursor [B] int64 each row's first free slot (the caller
    guarantees cursor[b] + P <= capacity). History tensors as in the module docstring
    (contiguous); grid [G, K] fp32 (w-grid only). policy: POLICY_DIV, POLICY_GRID or
    POLICY_HEDGE. No host sync: capturable in a CUDA graph, and idempotent in its inputs
    (rewrites the same slots).
    """
    if policy not in (POLICY_DIV, POLICY_GRID, POLICY_HEDGE):
        raise ValueError(f"unknown history policy {policy!r}")
    if window < 0 or temperature <= 0:
        raise ValueError(f"window must be >= 0 and temperature > 0, got {window}, {temperature}")
    if cursor.shape != n_acc.shape or cursor.shape != div_new.shape[:1]:   # a [1] cursor would broadcast
        raise ValueError(f"cursor must be [B] (one per row), got {tuple(cursor.shape)} for B = {div_new.shape[0]}")
    # every policy and grid size: a large w-grid (K = 4 on a 0.1 grid: 286 vectors) is split
    # over several programs per request (see tabed_engine.kernels.history_update)
    if div_new.is_cuda:
        from tabed_engine.kernels.history_update import history_update as fn
    else:
        fn = history_update_reference
    return fn(div_new, match_new, gkl_new, n_acc, cursor, valid, div, match, gkl, grid, policy=policy,
              window=window, temperature=temperature, clip=clip, all_positions=all_positions)
