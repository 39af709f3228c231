"""history_update: Triton kernel (CPU interpreter here, CUDA on a GPU) vs the PyTorch
reference, over a sequence of blocks, every policy, with and without a window."""
import itertools

import pytest
import torch

from tabed_engine.ensemble import EnsembleConfig
from tabed_engine.kernels import history_update as _k
from tabed_engine.ops.history_update import (POLICY_DIV, POLICY_GRID, POLICY_HEDGE, history_update,
                                             history_update_reference)

NAMES = {POLICY_DIV: "kld", POLICY_GRID: "w-grid", POLICY_HEDGE: "hedge"}


def new_history(B, K, G, cap, device):
    """History tensors with every slot NaN-poisoned (valid all False): the kernel must
    write the slots it records and never read a slot it did not."""
    nan = float("nan")
    return dict(valid=torch.zeros(B, cap, dtype=torch.bool, device=device),
                div=torch.full((B, K, cap), nan, device=device),
                match=torch.full((B, G, cap), nan, device=device),
                gkl=torch.full((B, G, cap), nan, device=device))


def run_blocks(fn, B, K, P, cap, policy, window, temperature, blocks, grid, device, seed, kl_step=0.0, **kw):
    """`blocks` calls of `fn` from an empty history; kl_step > 0 rounds the grid's KL to its
    multiples (exact sums in any order, so KL ties are frequent)."""
    gen = torch.Generator().manual_seed(seed)
    G = grid.shape[0] if grid is not None else 0
    h = new_history(B, K, G, cap, device)
    cursor = torch.zeros(1, dtype=torch.long, device=device)
    out = []
    for i in range(blocks):
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


CASES = [(B, K, P, cap, policy, window, t)
         for (B, K, P, cap), policy, window, t in itertools.product(
             [(1, 2, 5, 37), (3, 3, 6, 50), (2, 4, 1, 23)], (POLICY_DIV, POLICY_GRID, POLICY_HEDGE), (0, 4),
             (1.0, 0.7))]


@pytest.mark.parametrize("B,K,P,cap,policy,window,temperature", CASES)
def test_kernel_matches_reference(B, K, P, cap, policy, window, temperature, kernel_device):
    step = 0.25 if K < 4 else 0.1
    grid = EnsembleConfig(policy="w-grid", num_views=K, grid_step=step).grid("cpu") if policy == POLICY_GRID else None
    blocks = min(5, (cap - 1) // P + 1)
    seed = B * 100 + K * 10 + P + policy + window

    g_dev = None if grid is None else grid.to(kernel_device)
    got, h_got = run_blocks(poisoned(kernel_device), B, K, P, cap, policy, window, temperature, blocks, g_dev,
                            kernel_device, seed)
    ref, h_ref = run_blocks(history_update_reference, B, K, P, cap, policy, window, temperature, blocks, grid,
                            "cpu", seed)
    for i, ((w, c), (wr, cr)) in enumerate(zip(got, ref)):
        assert torch.isfinite(w).all(), (i, w)
        assert torch.allclose(w.cpu(), wr, atol=1e-5), (i, w, wr)
        assert int(c) == int(cr)
    assert torch.equal(h_got["valid"].cpu(), h_ref["valid"])
    n = int(got[-1][1])
    assert torch.equal(h_got["div"][..., :n].cpu(), h_ref["div"][..., :n])
    if grid is not None:
        assert torch.equal(h_got["match"][..., :n].cpu(), h_ref["match"][..., :n])
        assert torch.equal(h_got["gkl"][..., :n].cpu(), h_ref["gkl"][..., :n])


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
    [(2, 3, 37, 16, 4096), (1, 2, 37, 4, 16), (2, 4, 70, 8, 64), (1, 4, 286, 16, 4096)], (0, 4))]


@pytest.mark.parametrize("B,K,G,gs,tile,window", SLICED)
def test_grid_slices_match_reference(B, K, G, gs, tile, window, kernel_device):
    P, cap, blocks = 4, 18, 5
    grid = torch.rand(G, K, generator=torch.Generator().manual_seed(G))     # distinct rows
    seed = G + gs + window
    got, h_got = run_blocks(poisoned(kernel_device, grid_slice=gs, grid_tile=tile), B, K, P, cap, POLICY_GRID, window, 1.0, blocks,
                            grid.to(kernel_device), kernel_device, seed, kl_step=0.5)
    ref, h_ref = run_blocks(history_update_reference, B, K, P, cap, POLICY_GRID, window, 1.0, blocks, grid,
                            "cpu", seed, kl_step=0.5)
    for i, ((w, c), (wr, cr)) in enumerate(zip(got, ref)):
        assert torch.equal(w.cpu(), wr), (i, w, wr)   # a grid row (or uniform): exact
        assert int(c) == int(cr)
    n = int(got[-1][1])
    assert torch.equal(h_got["valid"].cpu(), h_ref["valid"])
    assert torch.equal(h_got["div"][..., :n].cpu(), h_ref["div"][..., :n])
    assert torch.equal(h_got["match"][..., :n].cpu(), h_ref["match"][..., :n])
    assert torch.equal(h_got["gkl"][..., :n].cpu(), h_ref["gkl"][..., :n])


def tie_state(kind, G=37, K=3, cap=16, cur=8, P=4):
    """A history with 8 recorded slots (slot 2 invalid) and a block of 4 positions (3 valid)
    whose best vectors fall in different slices (of 4 or 8): over all positions vectors 9 and
    27 have the most matches (7), vector 3 one fewer at a lower KL; over the last 3 positions
    (the new ones) 20 and 33 have 3. kind: "index" equal KL sums (lowest index wins), "kl" the
    later one's KL lower, "inf" the best vectors' KL +inf (row 0, as torch's argmin)."""
    h = new_history(1, K, G, cap, "cpu")
    h["valid"][0, :cur] = True
    h["valid"][0, 2] = False
    h["div"][..., :cur] = 0.5
    h["match"][..., :cur] = 0.0
    h["gkl"][..., :cur] = 1.0
    h["match"][0, [9, 27], :cur] = 1.0
    h["match"][0, 3, 1:cur] = 1.0
    h["gkl"][0, 3, :cur] = 0.0
    match_new = torch.zeros(1, G, P, dtype=torch.uint8)
    match_new[0, [20, 33]] = 1
    gkl_new = torch.ones(1, G, P)
    if kind == "kl":
        h["gkl"][0, 27, :cur] = 0.5
        gkl_new[0, 33] = 0.5
    elif kind == "inf":
        h["gkl"][0, [9, 27], :cur] = float("inf")
        gkl_new[0, [20, 33]] = float("inf")
    new = (torch.full((1, K, P), 0.25), match_new, gkl_new, torch.tensor([2]), torch.tensor([cur]))
    return new, h


@pytest.mark.parametrize("gs", [4, 8])
@pytest.mark.parametrize("kind,window,expect", [("index", 0, 9), ("kl", 0, 27), ("inf", 0, 0),
                                                ("index", 3, 20), ("kl", 3, 33), ("inf", 3, 0)])
def test_grid_slices_tie_rules(kind, window, expect, gs, kernel_device):
    new, h = tie_state(kind)
    G, K = h["match"].shape[1], h["div"].shape[1]
    grid = torch.rand(G, K, generator=torch.Generator().manual_seed(0))
    kw = dict(policy=POLICY_GRID, window=window, temperature=1.0, clip=1.0, all_positions=False)
    wr, _ = history_update_reference(*new, *(v.clone() for v in h.values()), grid, **kw)
    assert torch.equal(wr, grid[expect][None])             # the case is what it claims
    dev = {k: v.to(kernel_device) for k, v in h.items()}
    args = (*(t.to(kernel_device) for t in new), *dev.values(), grid.to(kernel_device))
    kernel = poisoned(kernel_device, grid_slice=gs, grid_tile=4 * gs)   # BLOCK_H = 4: two steps over the 8 old slots
    for _ in range(3):   # repeated calls: the arrival counter is back at zero after each
        w, c = kernel(*args, **kw)
        assert torch.equal(w.cpu(), wr), (w, wr)
        assert int(c) == 12
    assert int(_k.counters(torch.device(kernel_device), 1)[0]) == 0


def test_kernel_is_idempotent(kernel_device):
    # a graph's warm-up runs the update for real before capture: calling twice with the same
    # cursor must give the same weights and history.
    B, K, P, cap = 2, 3, 4, 20
    h = new_history(B, K, 0, cap, kernel_device)
    cursor = torch.zeros(1, dtype=torch.long, device=kernel_device)
    div_new = torch.rand(B, K, P, generator=torch.Generator().manual_seed(1)).to(kernel_device)
    n_acc = torch.tensor([1, 3], device=kernel_device)
    args = (div_new, None, None, n_acc, cursor, h["valid"], h["div"], h["match"], h["gkl"], None)
    w1, c1 = _k.history_update(*args, policy=POLICY_DIV, window=0, temperature=1.0, clip=1.0, all_positions=False)
    w2, c2 = _k.history_update(*args, policy=POLICY_DIV, window=0, temperature=1.0, clip=1.0, all_positions=False)
    assert torch.equal(w1, w2) and int(c1) == int(c2) == P
    d = div_new.cpu()
    expect = torch.stack([1 / d[0, :, :2].sum(-1), 1 / d[1, :, :4].sum(-1)])
    assert torch.allclose(w1.cpu(), expect / expect.sum(-1, keepdim=True), atol=1e-5)
    with pytest.raises(ValueError, match="at least one position"):
        _k.history_update(div_new[..., :0], *args[1:], policy=POLICY_DIV, window=0, temperature=1.0, clip=1.0,
                          all_positions=False)


def test_dispatch_rejects_bad_arguments():
    h = new_history(1, 2, 0, 8, "cpu")
    args = (torch.rand(1, 2, 3), None, None, torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long),
            h["valid"], h["div"], h["match"], h["gkl"], None)
    with pytest.raises(ValueError, match="policy"):
        history_update(*args, policy=7, window=0)
    with pytest.raises(ValueError, match="window"):
        history_update(*args, policy=POLICY_DIV, window=-1)
    with pytest.raises(ValueError, match="shapes"):
        _k.history_update(*args[:5], torch.zeros(1, 9, dtype=torch.bool), *args[6:], policy=POLICY_DIV, window=0,
                          temperature=1.0, clip=1.0, all_positions=False)


@pytest.mark.gpu
@pytest.mark.parametrize("K,step", [(2, 0.1), (4, 0.1)])
def test_gpu_engine_shapes(K, step):
    # the engine's shapes: B=1, gamma=5, capacity 5 * 129, a 0.1 grid (G = 11 or 286)
    grid = EnsembleConfig(policy="w-grid", num_views=K, grid_step=step).grid("cpu")
    for policy, g in ((POLICY_GRID, grid), (POLICY_HEDGE, None), (POLICY_DIV, None)):
        got, _ = run_blocks(_k.history_update, 1, K, 5, 645, policy, 0, 1.0, 40, None if g is None else g.cuda(),
                            "cuda", seed=K)
        ref, _ = run_blocks(history_update_reference, 1, K, 5, 645, policy, 0, 1.0, 40, g, "cpu", seed=K)
        for (w, _), (wr, _) in zip(got, ref):
            assert torch.allclose(w.cpu(), wr, atol=1e-5), (NAMES[policy], w, wr)
