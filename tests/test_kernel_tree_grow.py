"""tree_start / tree_grow: Triton kernels (CPU interpreter here, CUDA on a GPU) vs the PyTorch
references, over whole tree builds."""
import dataclasses

import pytest
import torch

from tabed_engine import TreeConfig
from tabed_engine.kernels import tree_grow as _k
from tabed_engine.models.decoder import bits_to_mask
from tabed_engine.ops.tree_grow import TreeState, tree_grow, tree_grow_reference, tree_start_reference

FIELDS = [f.name for f in dataclasses.fields(TreeState)]


def _poisoned(B, K, cfg, device):
    """A state whose every element is garbage (NaN score, -7 elsewhere): tree_start must write all."""
    st = TreeState.empty(B, K, cfg.nodes, cfg.fed, cfg.draft_rows, device)
    for name in FIELDS:
        t = getattr(st, name)
        t.fill_(float("nan") if t.is_floating_point() else -7)
    return st


def _start(st, inp2, lens, cfg, kernel):
    if kernel:
        _k.tree_start(*(getattr(st, n) for n in FIELDS), inp2, lens, pad=cfg.depth - 1, width=cfg.width)
    else:
        tree_start_reference(st, inp2, lens, pad=cfg.depth - 1, width=cfg.width)


def _grow(st, kids, logq, kernel, **kw):
    if kernel:
        _k.tree_grow(*(getattr(st, n) for n in FIELDS if n != "pos"), kids, logq, **kw)
    else:
        tree_grow_reference(st, kids, logq, **kw)


def _assert_same(a, b, where):
    for name in FIELDS:
        x, y = getattr(a, name), getattr(b, name)
        assert torch.equal(x.cpu(), y.cpu()), f"{name} differs {where}"


def _build(B, K, cfg, device, seed, ties=False):
    """Both implementations over a whole tree of random children (scores distinct unless `ties`);
    checks every state tensor after depth 0 and after each depth. Returns the kernel's state."""
    g = torch.Generator().manual_seed(seed)
    inp2 = torch.randint(0, 1000, (B * K, 2), generator=g).to(device)
    lens = torch.randint(3, 90, (B * K,), generator=g).to(device)
    ref, ker = _poisoned(B, K, cfg, device), _poisoned(B, K, cfg, device)
    _start(ref, inp2, lens, cfg, False)
    _start(ker, inp2, lens, cfg, True)
    _assert_same(ref, ker, "after tree_start")
    # each view row feeds its own previous token, then its request's root (view 0's last token)
    assert torch.equal(ker.ids[:, 0], inp2[:, 0])
    assert torch.equal(ker.ids[:, 1], inp2[0::K, 1].repeat_interleave(K))
    n_nodes, n_fed = 1, 1
    for depth in range(1, cfg.depth + 1):
        T = 1 if depth == 1 else cfg.width
        k = cfg.width if depth == 1 else cfg.branch
        kids = torch.randint(0, 1000, (B, T, k), generator=g).to(device)
        logq = (torch.full((B, T, k), -0.5) if ties else -3 * torch.rand(B, T, k, generator=g)).to(device)
        kw = dict(pad=cfg.depth - 1, n_nodes=n_nodes, n_fed=n_fed, width=cfg.width, last=depth == cfg.depth)
        _grow(ker, kids, logq, True, **kw)
        if not ties:
            _grow(ref, kids, logq, False, **kw)
            _assert_same(ref, ker, f"after depth {depth}")
        n_nodes += T * k
        if depth < cfg.depth:
            n_fed += cfg.width
    return ker


@pytest.mark.parametrize("shape, B, K", [
    ("3x2x2", 1, 1), ("5x3x2", 2, 2), ("4x1x3", 3, 1), ("2x4x1", 1, 3), ("6x3x3", 2, 2), ("1x5x1", 2, 2),
    ("32x1x1", 1, 2),    # 64 draft slots: the last slot's bit is the sign bit
])
def test_tree_build_matches_reference(shape, B, K, kernel_device):
    cfg = TreeConfig(*map(int, shape.split("x")))
    st = _build(B, K, cfg, kernel_device, seed=B * 10 + K)
    # sanity of the build itself: every node has a token, fed nodes map back and forth
    assert bool((st.parents[:, 1:] >= 0).all()) and bool((st.fedpos >= 0).sum(1).eq(cfg.fed).all())
    assert torch.equal(st.fedpos.gather(1, st.fed), torch.arange(cfg.fed, device=kernel_device).expand(B, -1))


def test_bits_are_each_fed_nodes_ancestors():
    """A frontier slot sees prev, the root's slot, its ancestors' slots and itself (the tree
    mask the draft attends with), the padding slots only themselves; view rows alike but for
    their own previous token in slot 0."""
    cfg, B, K = TreeConfig(4, 2, 2), 2, 2
    st = _build(B, K, cfg, "cpu", seed=3)
    P = cfg.depth - 1
    assert torch.equal(st.bits[0::K], st.bits[1::K]) and torch.equal(st.ids[0::K, 1:], st.ids[1::K, 1:])
    mask = bits_to_mask(st.bits)
    for b in range(B):
        for f in range(1, cfg.fed):
            node = int(st.fed[b, f])
            seen = {0, 1, 1 + P + f}
            a = int(st.parents[b, node])
            while a > 0:
                seen.add(1 + P + int(st.fedpos[b, a]))
                a = int(st.parents[b, a])
            assert set(torch.nonzero(mask[b * K, 1 + P + f])[:, 0].tolist()) == seen
            assert int(st.ids[b * K, 1 + P + f]) == int(st.tokens[b, node])
        for s in range(2, 2 + P):
            assert int(st.bits[b * K, s]) == 1 << s


def test_equal_scores_keep_the_lowest_node_ids(kernel_device):
    """Every child of the same log q: each depth's frontier is its first `width` new nodes."""
    cfg = TreeConfig(4, 3, 2)
    st = _build(2, 1, cfg, kernel_device, seed=0, ties=True)
    wb = cfg.width * cfg.branch
    for d in range(1, cfg.depth):
        first = 1 if d == 1 else 1 + cfg.width + (d - 2) * wb
        want = torch.arange(first, first + cfg.width, device=kernel_device)
        assert torch.equal(st.fed[:, 1 + (d - 1) * cfg.width:1 + d * cfg.width], want.expand(2, -1))


def test_dispatch_and_checks():
    cfg = TreeConfig(2, 2, 2)
    st = _poisoned(1, 1, cfg, "cpu")
    tree_start_reference(st, torch.tensor([[4, 5]]), torch.tensor([9]), pad=1, width=2)
    assert st.pos[0, :4].tolist() == [9, 10, 10, 11]
    with pytest.raises(ValueError, match="depth out of the tree"):
        _k.tree_grow(*(getattr(st, n) for n in FIELDS if n != "pos"), torch.zeros(1, 1, 9, dtype=torch.long),
                     torch.zeros(1, 1, 9), pad=1, n_nodes=1, n_fed=1, width=2, last=False)
    # CPU tensors: the reference, which raises nothing for the same shapes tree_draft makes
    tree_grow(st, torch.tensor([[[7, 8]]]), torch.tensor([[[-1.0, -2.0]]]), pad=1, n_nodes=1, n_fed=1, width=2,
              last=False)
    assert st.tokens[0, 1:3].tolist() == [7, 8] and st.fed[0].tolist() == [0, 1, 2]
