"""history_update: Triton kernel (CPU interpreter here, CUDA on a GPU) vs the PyTorch
reference, over a sequence of blocks, every policy, with and without a window. Every row has
its own write cursor: the rows start at different slots over a random prior history, and one
row is emptied and restarted at slot 0 mid-way (a request admitted into a running batch)."""
import itertools

import pytest
import torch

from tabed_engine.speculation.ensemble import EnsembleConfig, EnsembleState
from tabed_engine.kernels import history_update as _k
from tabed_engine.ops.history_update import (POLICY_DIV, POLICY_GRID, POLICY_HEDGE, history_update,
                                             history_update_reference)

NAMES = {POLICY_DIV: "kld", POLICY_GRID: "w-grid", POLICY_HEDGE: "hedge"}


def new_history(B, K, G, cap, device, start=None, gen=None, kl_step=0.0):
    """History tensors with every slot NaN-poisoned (valid all False): the kernel must
    write the slots it records and never read a slot it did not. With `start` ([B] cursors),
    row b holds a random prior history in slots [0, start[b]) (built on the CPU from `gen`,
    so both paths see the same) and stale valid flags over the NaNs past it: only a row's
    own slots before its cursor may be read."""
    nan = float("nan")
    h = dict(valid=torch.zeros(B, cap, dtype=torch.bool), div=torch.full((B, K, cap), nan),
             match=torch.full((B, G, cap), nan), gkl=torch.full((B, G, cap), nan))
    for b, c in enumerate(start or ()):
        h["valid"][b] = torch.rand(cap, generator=gen) < 0.7
        h["div"][b, :, :c] = torch.rand(K, c, generator=gen) * 2.5
        h["match"][b, :, :c] = (torch.rand(G, c, generator=gen) < 0.4).float()
        gkl = torch.rand(G, c, generator=gen) * 3
        h["gkl"][b, :, :c] = (gkl / kl_step).floor() * kl_step if kl_step else gkl
    return {k: v.to(device) for k, v in h.items()}


def run_blocks(fn, B, K, P, cap, policy, window, temperature, blocks, grid, device, seed, start, kl_step=0.0,
               reset_at=None, **kw):
    """`blocks` calls of `fn`, row b from cursor start[b] over a random prior history; at block
    `reset_at` the row of the largest start is emptied (valid cleared, cursor 0, as
    `EnsembleState.reset_rows`). kl_step > 0 rounds the grid's KL to its multiples (exact sums
    in any order, so KL ties are frequent)."""
    assert max(start) + 1 + (blocks - 1) * P <= cap and len(start) == B
    gen = torch.Generator().manual_seed(seed)
    G = grid.shape[0] if grid is not None else 0
    h = new_history(B, K, G, cap, device, start, gen, kl_step)
    cursor = torch.tensor(start, device=device)
    out = []
    for i in range(blocks):
        if i == reset_at:
            r = max(range(B), key=lambda b: start[b])
            h["valid"][r] = False
            cursor[r] = 0
        Pi = 1 if i == 0 else P                      # the prefill position first, as the engine does
        div_new = (torch.rand(B, K, Pi, generator=gen) * 2.5).to(device)
        match_new = (torch.rand(B, G, Pi, generator=gen) < 0.4).to(torch.uint8).to(device)
        gkl_new = torch.rand(B, G, Pi, generator=gen) * 3
        if kl_step:
            gkl_new = (gkl_new / kl_step).floor() * kl_step
        gkl_new = gkl_new.to(device)
        n_acc = torch.randint(0, Pi, (B,), generator=gen).to(device)
        w, cursor = fn(div_new, match_new if G else None, gkl_new if G else None, n_acc, cursor, h["valid"],
                       h["div"], h["match"], h["gkl"], grid, policy=policy, window=window,
                       temperature=temperature, clip=1.0, all_positions=policy == POLICY_HEDGE, **kw)
        out.append((w.clone(), cursor.clone()))
    return out, h


def poisoned(kernel_device, **plan_kw):
    """The Triton launcher writing into a NaN-filled `out` (unwritten weights are caught),
    with a `history_plan` built from `plan_kw` when given."""
    def kernel(*args, **kw):
        out = torch.full((args[0].shape[0], args[0].shape[1]), float("nan"), device=kernel_device)
        if plan_kw and kw["policy"] == POLICY_GRID:
            kw["plan"] = _k.history_plan(args[-1].shape[0], **plan_kw)
        return _k.history_update(*args, out=out, **kw)
    return kernel


def assert_same_history(h_got, h_ref):
    """Every slot, the untouched NaNs included: the same slots written with the same values."""
    for k in h_ref:
        torch.testing.assert_close(h_got[k].cpu(), h_ref[k], rtol=0, atol=0, equal_nan=True, msg=k)


# (B, K, P, capacity, start cursors): rows starting at different slots, one at 0
SHAPES = [(3, 2, 5, 48, (0, 7, 19)), (3, 3, 6, 50, (19, 0, 7)), (2, 4, 1, 23, (11, 0))]
CASES = [(*shape, policy, window, t)
         for shape, policy, window, t in itertools.product(
             SHAPES, (POLICY_DIV, POLICY_GRID, POLICY_HEDGE), (0, 4), (1.0, 0.7))
         if t == 1.0 or policy != POLICY_GRID]          # w-grid has no temperature


@pytest.mark.parametrize("B,K,P,cap,start,policy,window,temperature", CASES)
def test_kernel_matches_reference(B, K, P, cap, start, policy, window, temperature, kernel_device):
    step = 0.25 if K < 4 else 0.1
    grid = EnsembleConfig(policy="w-grid", num_views=K, grid_step=step).grid("cpu") if policy == POLICY_GRID else None
    blocks = 5
    seed = B * 100 + K * 10 + P + policy + window

    g_dev = None if grid is None else grid.to(kernel_device)
    got, h_got = run_blocks(poisoned(kernel_device), B, K, P, cap, policy, window, temperature, blocks, g_dev,
                            kernel_device, seed, start, reset_at=3)
    ref, h_ref = run_blocks(history_update_reference, B, K, P, cap, policy, window, temperature, blocks, grid,
                            "cpu", seed, start, reset_at=3)
    for i, ((w, c), (wr, cr)) in enumerate(zip(got, ref)):
        assert torch.isfinite(w).all(), (i, w)
        assert torch.allclose(w.cpu(), wr, atol=1e-5), (i, w, wr)
        assert torch.equal(c.cpu(), cr), (i, c, cr)
    # each row's cursor advanced by its own blocks (the reset row from 0)
    last = max(range(B), key=lambda b: start[b])
    expect = [s + 1 + (blocks - 1) * P for s in start]
    expect[last] = (blocks - 3) * P
    assert got[-1][1].tolist() == expect
    assert_same_history(h_got, h_ref)


def test_plan_from_grid_size():
    assert _k.history_plan(0) == _k.HistoryPlan(G=0, slices=1, gs=1, block_h=64)      # kld, tvd, hedge
    assert _k.history_plan(3) == _k.HistoryPlan(G=3, slices=1, gs=4, block_h=64)      # a grid within one slice
    assert _k.history_plan(11) == _k.HistoryPlan(G=11, slices=3, gs=4, block_h=1024)  # the engine's K = 2 grid
    assert _k.history_plan(286).slices == 72                                          # K = 4: 72 programs
    assert _k.history_plan(37, grid_slice=16, grid_tile=64) == _k.HistoryPlan(G=37, slices=3, gs=16, block_h=4)


# w-grid over several programs per request: G not a multiple of the slice, slices of 4 to 16
# vectors, [GS, BLOCK_H] tiles of 16 to 4096 elements (several loop steps), KL on a 0.5 grid
# (ties in both match count and KL sum, across slices)
SLICED = [(B, K, G, gs, tile, window) for (B, K, G, gs, tile), window in itertools.product(
    [(2, 3, 37, 16, 4096), (2, 2, 37, 4, 16), (2, 4, 70, 8, 64), (2, 4, 286, 16, 4096)], (0, 4))]


@pytest.mark.parametrize("B,K,G,gs,tile,window", SLICED)
def test_grid_slices_match_reference(B, K, G, gs, tile, window, kernel_device):
    P, cap, blocks, start = 4, 24, 5, (6, 0)
    grid = torch.rand(G, K, generator=torch.Generator().manual_seed(G))     # distinct rows
    seed = G + gs + window
    got, h_got = run_blocks(poisoned(kernel_device, grid_slice=gs, grid_tile=tile), B, K, P, cap, POLICY_GRID,
                            window, 1.0, blocks, grid.to(kernel_device), kernel_device, seed, start, kl_step=0.5,
                            reset_at=3)
    ref, h_ref = run_blocks(history_update_reference, B, K, P, cap, POLICY_GRID, window, 1.0, blocks, grid,
                            "cpu", seed, start, kl_step=0.5, reset_at=3)
    for i, ((w, c), (wr, cr)) in enumerate(zip(got, ref)):
        assert torch.equal(w.cpu(), wr), (i, w, wr)   # a grid row (or uniform): exact
        assert torch.equal(c.cpu(), cr), (i, c, cr)
    assert got[-1][1].tolist() == [2 * P, 1 + 4 * P]
    assert_same_history(h_got, h_ref)


def tie_state(kind, G=37, K=3, cap=16, cur=8, P=4):
    """Row 0: a history with 8 recorded slots (slot 2 invalid) and a block of 4 positions (3
    valid) whose best vectors fall in different slices (of 4 or 8): over all positions vectors
    9 and 27 have the most matches (7), vector 3 one fewer at a lower KL; over the last 3
    positions (the new ones) 20 and 33 have 3. Row 1: the same block on an empty history
    (cursor 0, the old slots NaN), so as row 0 over the last 3. kind: "index" equal KL sums
    (lowest index wins), "kl" the later one's KL lower, "inf" the best vectors' KL +inf (row 0
    of the grid, as torch's argmin)."""
    h = new_history(2, K, G, cap, "cpu")
    h["valid"][0, :cur] = True
    h["valid"][0, 2] = False
    h["div"][0, :, :cur] = 0.5
    h["match"][0, :, :cur] = 0.0
    h["gkl"][0, :, :cur] = 1.0
    h["match"][0, [9, 27], :cur] = 1.0
    h["match"][0, 3, 1:cur] = 1.0
    h["gkl"][0, 3, :cur] = 0.0
    match_new = torch.zeros(2, G, P, dtype=torch.uint8)
    match_new[:, [20, 33]] = 1
    gkl_new = torch.ones(2, G, P)
    if kind == "kl":
        h["gkl"][0, 27, :cur] = 0.5
        gkl_new[:, 33] = 0.5
    elif kind == "inf":
        h["gkl"][0, [9, 27], :cur] = float("inf")
        gkl_new[:, [20, 33]] = float("inf")
    new = (torch.full((2, K, P), 0.25), match_new, gkl_new, torch.tensor([2, 2]), torch.tensor([cur, 0]))
    return new, h


@pytest.mark.parametrize("gs", [4, 8])
@pytest.mark.parametrize("kind,window,expect", [("index", 0, [9, 20]), ("kl", 0, [27, 33]), ("inf", 0, [0, 0]),
                                                ("index", 3, [20, 20]), ("kl", 3, [33, 33]), ("inf", 3, [0, 0])])
def test_grid_slices_tie_rules(kind, window, expect, gs, kernel_device):
    new, h = tie_state(kind)
    G, K = h["match"].shape[1], h["div"].shape[1]
    grid = torch.rand(G, K, generator=torch.Generator().manual_seed(0))
    kw = dict(policy=POLICY_GRID, window=window, temperature=1.0, clip=1.0, all_positions=False)
    wr, _ = history_update_reference(*new, *(v.clone() for v in h.values()), grid, **kw)
    assert torch.equal(wr, grid[expect])                   # the case is what it claims
    dev = {k: v.to(kernel_device) for k, v in h.items()}
    args = (*(t.to(kernel_device) for t in new), *dev.values(), grid.to(kernel_device))
    kernel = poisoned(kernel_device, grid_slice=gs, grid_tile=4 * gs)   # BLOCK_H = 4: two steps over the 8 old slots
    for _ in range(3):   # repeated calls: the arrival counter is back at zero after each
        w, c = kernel(*args, **kw)
        assert torch.equal(w.cpu(), wr), (w, wr)
        assert c.tolist() == [12, 4]
    assert not _k.counters(torch.device(kernel_device), 2)[:2].any()


def test_kernel_is_idempotent(kernel_device):
    # a graph's warm-up runs the update for real before capture: calling twice with the same
    # cursors must give the same weights and history.
    B, K, P, cap = 3, 3, 4, 20
    h = new_history(B, K, 0, cap, kernel_device)
    start = [0, 5, 9]
    for b, c in enumerate(start):   # row b: c recorded slots, view k's divergence 0.1 (k + 1) each
        h["valid"][b, :c] = True
        h["div"][b, :, :c] = 0.1 * torch.arange(1, K + 1, device=kernel_device)[:, None]
    cursor = torch.tensor(start, device=kernel_device)
    div_new = torch.rand(B, K, P, generator=torch.Generator().manual_seed(1)).to(kernel_device)
    n_acc = torch.tensor([1, 3, 0], device=kernel_device)
    args = (div_new, None, None, n_acc, cursor, h["valid"], h["div"], h["match"], h["gkl"], None)
    kw = dict(policy=POLICY_DIV, window=0, temperature=1.0, clip=1.0, all_positions=False)
    w1, c1 = _k.history_update(*args, **kw)
    h1 = {k: v.clone() for k, v in h.items()}
    w2, c2 = _k.history_update(*args, **kw)
    assert torch.equal(w1, w2) and torch.equal(c1, c2) and c1.tolist() == [P, 5 + P, 9 + P]
    assert cursor.tolist() == start
    assert_same_history(h, {k: v.cpu() for k, v in h1.items()})
    d = div_new.cpu()
    prior = 0.1 * torch.arange(1, K + 1)
    expect = torch.stack([1 / (c * prior + d[b, :, :int(n) + 1].sum(-1)) for b, (c, n) in enumerate(zip(start, n_acc))])
    assert torch.allclose(w1.cpu(), expect / expect.sum(-1, keepdim=True), atol=1e-5)
    with pytest.raises(ValueError, match="at least one position"):
        _k.history_update(div_new[..., :0], *args[1:], policy=POLICY_DIV, window=0, temperature=1.0, clip=1.0,
                          all_positions=False)


def test_dispatch_rejects_bad_arguments():
    h = new_history(2, 2, 0, 8, "cpu")
    args = (torch.rand(2, 2, 3), None, None, torch.zeros(2, dtype=torch.long), torch.zeros(2, dtype=torch.long),
            h["valid"], h["div"], h["match"], h["gkl"], None)
    kw = dict(policy=POLICY_DIV, window=0, temperature=1.0, clip=1.0, all_positions=False)
    with pytest.raises(ValueError, match="policy"):
        history_update(*args, policy=7, window=0)
    with pytest.raises(ValueError, match="window"):
        history_update(*args, policy=POLICY_DIV, window=-1)
    with pytest.raises(ValueError, match="shapes"):
        _k.history_update(*args[:5], torch.zeros(2, 9, dtype=torch.bool), *args[6:], **kw)
    one = torch.zeros(1, dtype=torch.long)   # the old shared cursor: rejected, not broadcast
    with pytest.raises(ValueError, match="cursor"):
        history_update(*args[:4], one, *args[5:], policy=POLICY_DIV, window=0)
    with pytest.raises(ValueError, match="shapes"):
        _k.history_update(*args[:4], one, *args[5:], **kw)
    with pytest.raises(ValueError, match="int64"):
        _k.history_update(*args[:4], args[4].int(), *args[5:], **kw)


@pytest.mark.parametrize("policy", [POLICY_DIV, POLICY_GRID, POLICY_HEDGE])
def test_reset_rows_restarts_one_row(policy, kernel_device):
    """A request admitted into row 1 of a running batch: `EnsembleState.reset_rows` empties
    that row's history and cursor only. A block that records nothing for it (n_acc = -1, as a
    tree block whose first node was not fed) then gives it uniform weights, and the other rows
    exactly the weights they get without the reset."""
    B, K, P, cap, start = 3, 3, 4, 32, [0, 7, 19]
    cfg = EnsembleConfig(policy={POLICY_DIV: "kld", POLICY_GRID: "w-grid", POLICY_HEDGE: "hedge"}[policy],
                         num_views=K, grid_step=0.25)
    st = EnsembleState(cfg, B, cap, kernel_device)
    G = 0 if st.grid is None else st.grid.shape[0]
    gen = torch.Generator().manual_seed(policy)
    hist = new_history(B, K, G, cap, kernel_device, start, gen)
    for k, v in hist.items():
        getattr(st, k).copy_(v)
    st.cursor.copy_(torch.tensor(start))
    new = (torch.rand(B, K, P, generator=gen).to(kernel_device),
           (torch.rand(B, G, P, generator=gen) < 0.4).to(torch.uint8).to(kernel_device) if G else None,
           (torch.rand(B, G, P, generator=gen) * 3).to(kernel_device) if G else None,
           torch.tensor([2, -1, 1], device=kernel_device))
    kw = dict(policy=policy, window=0, temperature=1.0, clip=1.0, all_positions=False)

    def update(fn, state):
        hist = [getattr(state, k).clone() for k in ("valid", "div", "match", "gkl")]
        return fn(*new, state.cursor, *hist, state.grid, **kw)

    w_keep, _ = update(poisoned(kernel_device), st)
    st.reset_rows(slice(1, 2))
    assert st.cursor.tolist() == [0, 0, 19] and not st.valid[1].any()
    assert torch.equal(st.valid[[0, 2]].cpu(), hist["valid"][[0, 2]].cpu())
    w, c = update(poisoned(kernel_device), st)
    wr, cr = update(history_update_reference, st)
    assert not torch.allclose(w_keep[1], torch.full((K,), 1 / K, device=kernel_device))  # the old history counted
    assert torch.equal(w[1].cpu(), torch.full((K,), 1 / K))
    assert torch.equal(w[[0, 2]], w_keep[[0, 2]])
    assert torch.allclose(w.cpu(), wr.cpu(), atol=1e-5)
    assert c.tolist() == cr.tolist() == [P, P, 19 + P]


@pytest.mark.gpu
@pytest.mark.parametrize("K,step", [(2, 0.1), (4, 0.1)])
def test_gpu_engine_shapes(K, step):
    # the engine's shapes: gamma=5, capacity 5 * 129, a 0.1 grid (G = 11 or 286); two rows, one
    # admitted half way
    grid = EnsembleConfig(policy="w-grid", num_views=K, grid_step=step).grid("cpu")
    for policy, g in ((POLICY_GRID, grid), (POLICY_HEDGE, None), (POLICY_DIV, None)):
        got, _ = run_blocks(_k.history_update, 2, K, 5, 645, policy, 0, 1.0, 40, None if g is None else g.cuda(),
                            "cuda", seed=K, start=(300, 0), reset_at=20)
        ref, _ = run_blocks(history_update_reference, 2, K, 5, 645, policy, 0, 1.0, 40, g, "cpu", seed=K,
                            start=(300, 0), reset_at=20)
        for (w, _), (wr, _) in zip(got, ref):
            assert torch.allclose(w.cpu(), wr, atol=1e-5), (NAMES[policy], w, wr)
