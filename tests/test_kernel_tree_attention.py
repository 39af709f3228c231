"""Tree attention: Triton kernel (interpreter on CPU) and PyTorch reference vs a brute-force loop.

The ground truth gathers each node's visible slots one by one (no dense mask) in float64 from
contiguous per-row caches; the kernel and the reference read the same K/V as a paged pool with a
shuffled block table (`paging.to_pages`), so ignoring the table reads NaN pages.
Low-precision kernels must stay within ~2x the error of the same-precision PyTorch
computation (flash-attention style). Cache slots past each row's tree, the other layer of
the cache and the output buffer are NaN-poisoned.
"""
import pytest
import torch

from paging import to_pages
from tabed_engine.kernels import _common
from tabed_engine.kernels import tree_attention as _k
from tabed_engine.ops.tree_attention import (causal_attention_mask, tree_attention, tree_attention_mask,
                                             tree_attention_reference)

ATOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 4e-3}


def _paged(fn, q, k, v, *args, **kw):
    kp, vp, table = to_pages(k, v, seed=k.shape[0] * 7 + k.shape[2])
    return fn(q, kp, vp, table.to(q.device), *args, **kw)


def kernel(q, k, v, *args, **kw):
    """The Triton kernel over k, v [R, Hkv, S, D] laid out as shuffled pages."""
    return _paged(_k.tree_attention, q, k, v, *args, **kw)


def reference(q, k, v, *args, **kw):
    return _paged(tree_attention_reference, q, k, v, *args, **kw)


def dispatch(q, k, v, *args, **kw):
    return _paged(tree_attention, q, k, v, *args, **kw)


def _signed(word):
    return word - (1 << 64) if word >= 1 << 63 else word


def random_tree_masks(R, N, gen, chain=False):
    """[R, N] int64 masks: random parent < child (or -1 = hangs off the prefix), mask = ancestors | self."""
    rows = []
    for _ in range(R):
        words = []
        for i in range(N):
            parent = i - 1 if chain else int(torch.randint(-1, i, (1,), generator=gen)) if i else -1
            words.append((words[parent] if parent >= 0 else 0) | (1 << i))
        rows.append([_signed(w) for w in words])
    return torch.tensor(rows, dtype=torch.int64)


def bruteforce(q, k_cache, v_cache, lengths, tree_mask, scale, dtype):
    """Visible slots listed node by node from the mask bits, or causally when tree_mask is None
    (no shared code with the kernel or `tree_attention_mask`). float64 = ground truth;
    bf16/fp16 = the same-precision baseline (scores and P rounded to dtype, softmax in fp32)."""
    R, N, H, D = q.shape
    group = H // k_cache.shape[1]
    out = torch.empty(R, N, H, D, dtype=dtype)
    for r in range(R):
        length = int(lengths[r])
        vis = torch.zeros(N, length + N, dtype=torch.bool)
        for i in range(N):
            vis[i, :length] = True
            if tree_mask is None:  # causal: the nodes up to itself
                vis[i, length:length + i + 1] = True
                continue
            word = int(tree_mask[r, i]) & ((1 << 64) - 1)
            vis[i, [length + j for j in range(N) if word >> j & 1]] = True
        k = k_cache[r][:, : length + N].to(dtype).repeat_interleave(group, 0)  # [H, L, D]
        v = v_cache[r][:, : length + N].to(dtype).repeat_interleave(group, 0)
        s = torch.einsum("nhd,hld->hnl", q[r].to(dtype), k).double() * scale
        p = torch.softmax(s.masked_fill(~vis, float("-inf")), -1)
        p = p.to(dtype if dtype == torch.float64 else torch.float32).to(dtype)
        out[r] = torch.einsum("hnl,hld->nhd", p, v)
    return out


def make_case(R, N, H, Hkv, D, dtype, device, *, chain=False, seed=0, S=None, lengths=None, causal=False):
    """(q, k, v, lengths, masks) of R rows of N nodes; masks None when `causal` (any N)."""
    gen = torch.Generator().manual_seed(seed)
    S = S or 200 + N + 3  # > 3 key blocks of 64, not a multiple of anything
    if lengths is None:
        lengths = torch.randint(0, S - N + 1, (R,), generator=gen)
        lengths[0] = 0
        if R > 1:
            lengths[1] = S - N  # tree ends on the last slot
        if R > 2:
            lengths[2] = 7
    lengths = torch.as_tensor(lengths, dtype=torch.int32)
    # Layer 1 of a two-layer K/V cache stored [L, R, S, Hkv, D] and viewed [L, R, Hkv, S, D]
    # (non-trivial strides); the other layer and the slots past each row's tree are NaN.
    cache = torch.full((2, 2, R, S, Hkv, D), float("nan"))
    live = torch.randn(2, R, S, Hkv, D, generator=gen)
    for r in range(R):
        n_live = int(lengths[r]) + N
        cache[:, 1, r, :n_live] = live[:, r, :n_live]
    cache = cache.to(device=device, dtype=dtype).transpose(3, 4)
    # q as a slice of a fused [R, N, H + 2 Hkv, D] projection output: non-contiguous.
    qkv = torch.randn(R, N, H + 2 * Hkv, D, generator=gen).to(device=device, dtype=dtype)
    masks = None if causal else random_tree_masks(R, N, gen, chain=chain).to(device)
    return qkv[:, :, :H], cache[0, 1], cache[1, 1], lengths.to(device), masks


def check(q, k, v, lengths, masks, out, scale=None):
    """Assert out (kernel result) is within 2x the same-precision baseline error of the truth."""
    D = q.shape[-1]
    scale = D ** -0.5 if scale is None else scale
    args = [None if t is None else t.cpu() for t in (q, k, v, lengths, masks)]
    truth = bruteforce(*args, scale, torch.float64)
    out = out.cpu().double()
    assert torch.isfinite(out).all(), "kernel left NaN/inf (unwritten output or read a poisoned slot)"
    err = (out - truth).abs().max().item()
    base_dtype = q.dtype if q.dtype != torch.float32 else torch.float32
    base_err = (bruteforce(*args, scale, base_dtype).double() - truth).abs().max().item()
    assert err <= 2 * base_err + ATOL[q.dtype], f"max err {err:.3g} vs same-precision baseline {base_err:.3g}"


HEADS = [(4, 4), (8, 2), (6, 1)]
CASES = [
    (R, N, H, Hkv, D, dtype, chain, splits)
    for i, (N, (H, Hkv), dtype) in enumerate(
        (N, hh, dt) for N in (1, 5, 17, 64) for hh in HEADS for dt in (torch.bfloat16, torch.float16, torch.float32))
    for R, D, chain in [((1, 4, 9, 3)[i % 4], (64, 80)[i % 2], i % 3 == 1)]
    for splits in [{1: 3, 3: 3, 4: 2, 9: 1}[R]]  # the interpreter pays per program: split small R
]


@pytest.mark.parametrize("R,N,H,Hkv,D,dtype,chain,splits", CASES)
def test_kernel_matches_bruteforce(R, N, H, Hkv, D, dtype, chain, splits, kernel_device):
    q, k, v, lengths, masks = make_case(R, N, H, Hkv, D, dtype, kernel_device, chain=chain, seed=R * 100 + N)
    out = torch.full_like(q, float("nan"), memory_format=torch.contiguous_format)
    res = kernel(q, k, v, lengths, masks, out=out, num_splits=splits)
    assert res is out
    check(q, k, v, lengths, masks, out)


@pytest.mark.parametrize("R,M,W,dtype,splits", [(3, 20, 3, torch.bfloat16, 2), (1, 64, 1, torch.float32, 3),
                                                  (4, 38, 6, torch.float16, 1), (2, 9, 9, torch.float32, 2)])
def test_kernel_last_queries_of_a_longer_tree(R, M, W, dtype, splits, kernel_device):
    # the W queries are the last of M tree slots (a tree drafted depth by depth: the nodes fed
    # by earlier calls already in the cache): the full tree's last W rows, for the kernel (one
    # query too: not the one-query kernel, which sees only its own slot) and the reference
    q, k, v, lengths, masks = make_case(R, M, 4, 2, 64, dtype, kernel_device, seed=M + W)
    args = [t.cpu() for t in (q, k, v, lengths, masks)]
    truth = bruteforce(*args, 64 ** -0.5, torch.float64)[:, M - W:]
    base = (bruteforce(*args, 64 ** -0.5, dtype).double()[:, M - W:] - truth).abs().max().item()
    qw, mw = q[:, M - W:], masks[:, M - W:]
    out = torch.full_like(qw, float("nan"), memory_format=torch.contiguous_format)
    assert kernel(qw, k, v, lengths, mw, out=out, num_splits=splits, tree_slots=M) is out
    ref = reference(qw.cpu(), k.cpu(), v.cpu(), lengths.cpu(), mw.cpu(), tree_slots=M)
    for res in (out, ref):
        res = res.cpu().double()
        assert torch.isfinite(res).all()
        assert (res - truth).abs().max().item() <= 2 * base + ATOL[dtype]
    if W < M:   # without tree_slots the earlier nodes are not seen
        short = kernel(qw, k, v, lengths, mw, num_splits=splits)
        assert not torch.allclose(short.cpu().double(), truth, atol=1e-2)
    with pytest.raises(ValueError, match="tree_slots"):
        kernel(qw, k, v, lengths, mw, tree_slots=W - 1 if W > 1 else 65)


@pytest.mark.parametrize("D", [96, 128, 160])
@pytest.mark.parametrize("splits", [1, 2])
def test_kernel_padded_head_dims_and_scale(D, splits, kernel_device):
    q, k, v, lengths, masks = make_case(3, 9, 4, 2, D, torch.bfloat16, kernel_device, seed=D + splits)
    out = kernel(q, k, v, lengths, masks, scale=0.3, num_splits=splits)
    check(q, k, v, lengths, masks, out, scale=0.3)


@pytest.mark.parametrize("config", [{"block_m": 16, "splits": 3, "num_warps": 8}, {"block_m": 32, "splits": 1}])
def test_kernel_launch_config_override(config, kernel_device):
    # A swept launch config: several query tiles per (row, kv head), each with its own splits.
    q, k, v, lengths, masks = make_case(2, 37, 4, 2, 64, torch.bfloat16, kernel_device, seed=37)
    out = torch.full_like(q, float("nan"), memory_format=torch.contiguous_format)
    kernel(q, k, v, lengths, masks, out=out, config=config)
    check(q, k, v, lengths, masks, out)


def test_kernel_more_splits_than_blocks(kernel_device):
    # Rows of length 0 and 7: most splits get no key block and must drop out of the combine.
    q, k, v, lengths, masks = make_case(2, 5, 4, 4, 64, torch.float32, kernel_device, lengths=[0, 7], S=80)
    out = kernel(q, k, v, lengths, masks, num_splits=6)
    check(q, k, v, lengths, masks, out)


def test_split_combine_counters_reset_between_launches(kernel_device):
    # The last split of a tile combines and zeroes its arrival counter: back-to-back launches
    # with different split counts (and a different tile grid) must each combine exactly once.
    q, k, v, lengths, masks = make_case(3, 9, 8, 2, 64, torch.float32, kernel_device, seed=5)
    for splits in (3, 3, 2, 5):
        out = torch.full_like(q, float("nan"), memory_format=torch.contiguous_format)
        kernel(q, k, v, lengths, masks, out=out, num_splits=splits)
        check(q, k, v, lengths, masks, out)
        assert int(_common.counters(q.device, 1).abs().sum()) == 0


@pytest.mark.parametrize("splits", [1, 3, 5, 8])
def test_one_query_kernel_splits_own_slot_bit_and_counters(splits, kernel_device):
    # N = 1 runs the one-query kernel: ragged rows (length 0 included), GQA, a padded head
    # dim, any split count (not a power of two, more than the row's blocks); with bit 0
    # cleared the query must not see its own slot (poisoned here: NaN if read)
    q, k, v, lengths, masks = make_case(4, 1, 6, 2, 80, torch.bfloat16, kernel_device, seed=splits,
                                        lengths=[0, 70, 130, 200], S=202)
    out = torch.full_like(q, float("nan"), memory_format=torch.contiguous_format)
    kernel(q, k, v, lengths, masks, out=out, num_splits=splits)
    check(q, k, v, lengths, masks, out)
    assert int(_common.counters(q.device, 1).abs().sum()) == 0
    k2, v2 = k.clone(), v.clone()
    for r, n in enumerate(lengths.tolist()):
        k2[r, :, n], v2[r, :, n] = float("nan"), float("nan")
    hidden = torch.zeros_like(masks)
    live = slice(1, None)  # row 0 (length 0) would see nothing at all
    got = kernel(q[live], k2[live], v2[live], lengths[live], hidden[live], num_splits=splits)
    check(q[live], k[live], v[live], lengths[live], hidden[live], got)   # the truth from unpoisoned K/V


def test_mask_changes_result(kernel_device):
    # Guards against a kernel that ignores the tree: a chain and a star give different outputs.
    q, k, v, lengths, _ = make_case(2, 6, 4, 4, 64, torch.float32, kernel_device, lengths=[0, 30])
    chain = random_tree_masks(2, 6, None, chain=True).to(kernel_device)
    star = torch.tensor([[1 << i for i in range(6)]] * 2, device=kernel_device)
    a = kernel(q, k, v, lengths, chain)
    b = kernel(q, k, v, lengths, star)
    assert (a[:, 1:] - b[:, 1:]).abs().amax() > 1e-2
    torch.testing.assert_close(a[:, 0], b[:, 0])  # node 0 sees the same slots in both
    check(q, k, v, lengths, star, b)


@pytest.mark.parametrize("dtype,upcast", [(torch.float32, True), (torch.bfloat16, True), (torch.bfloat16, False)])
def test_reference_matches_bruteforce(dtype, upcast):
    q, k, v, lengths, masks = make_case(4, 17, 8, 2, 80, dtype, "cpu", seed=5)
    out = reference(q, k, v, lengths, masks, upcast=upcast)
    assert out.dtype == dtype and out.shape == q.shape
    if upcast:
        check(q, k, v, lengths, masks, out)
    else:  # bf16 SDPA: same order of error as the bf16 baseline
        truth = bruteforce(q, k, v, lengths, masks, 80 ** -0.5, torch.float64)
        assert (out.double() - truth).abs().max() < 3e-2


def test_reference_span_and_mask_helper():
    lengths = torch.tensor([0, 3], dtype=torch.int32)
    masks = torch.tensor([[1, 3], [1, 2]])  # row 1 node 1 does not see node 0
    m = tree_attention_mask(lengths, masks, 6)
    expect = torch.tensor([[[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0]],
                           [[1, 1, 1, 1, 0, 0], [1, 1, 1, 0, 1, 0]]], dtype=torch.bool)
    assert torch.equal(m, expect)
    q, k, v, lengths, masks = make_case(2, 5, 4, 4, 64, torch.float32, "cpu", lengths=[4, 20], S=40)
    full = reference(q, k, v, lengths, masks)
    torch.testing.assert_close(reference(q, k, v, lengths, masks, span=40), full)


def test_bit63_and_dispatch_on_cpu(kernel_device):
    # N = 64 uses the sign bit of the int64 word; the CPU dispatcher must give the reference.
    q, k, v, lengths, _ = make_case(2, 64, 4, 2, 64, torch.float32, "cpu", lengths=[0, 11], S=80)
    masks = random_tree_masks(2, 64, None, chain=True)
    assert (masks[:, 63] < 0).all()
    out = torch.full_like(q, float("nan"), memory_format=torch.contiguous_format)
    assert dispatch(q, k, v, lengths, masks, out=out) is out
    check(q, k, v, lengths, masks, out)
    dev = [t.to(kernel_device) for t in (q, k, v, lengths, masks)]
    torch.testing.assert_close(kernel(*dev).cpu(), out, atol=1e-5, rtol=1e-5)


def test_launcher_rejects_bad_input():
    q, k, v, lengths, masks = make_case(2, 5, 4, 2, 64, torch.float32, "cpu", lengths=[0, 7], S=40)
    with pytest.raises(ValueError, match="int32"):
        kernel(q, k, v, lengths.long(), masks)
    with pytest.raises(ValueError, match="multiple"):
        kernel(q[:, :, :3], k, v, lengths, masks)
    with pytest.raises(ValueError, match="tree_mask"):
        kernel(q, k, v, lengths, masks[:, :4])
    with pytest.raises(ValueError, match="contiguous last"):
        kernel(q.transpose(2, 3).contiguous().transpose(2, 3), k, v, lengths, masks)
    with pytest.raises(TypeError, match="dtypes differ"):
        kernel(q, k.half(), v, lengths, masks)
    big = torch.zeros(1, 65, 4, 64)
    with pytest.raises(ValueError, match="N=65"):
        kernel(big, k[:1], v[:1], lengths[:1], torch.ones(1, 65, dtype=torch.int64))


# ---- causal mode: prompt chunks of any length over a cached prefix ------------------------

# (R, N, H, Hkv, D, dtype, splits, lengths, S): N past 64 and not a multiple of the query tile
# (64-query tiles; 16-query ones at N * group <= 32), lengths 0 / mid-block / ending on the
# last slot, GQA and not, a padded head dim (40)
CAUSAL_CASES = [
    (3, 37, 4, 2, 40, torch.float32, 1, [0, 100, 163], 200),
    (2, 70, 2, 2, 64, torch.bfloat16, 2, [130, 0], 200),
    (3, 13, 4, 2, 64, torch.bfloat16, 3, [0, 187, 61], 200),
]


@pytest.mark.parametrize("R,N,H,Hkv,D,dtype,splits,lengths,S", CAUSAL_CASES)
def test_causal_kernel_matches_bruteforce(R, N, H, Hkv, D, dtype, splits, lengths, S, kernel_device):
    # slots past lengths + N and the output are NaN: a tile that read past its last node's
    # slot, or left a query unwritten, shows NaN
    q, k, v, lengths, _ = make_case(R, N, H, Hkv, D, dtype, kernel_device, seed=N, S=S, lengths=lengths,
                                    causal=True)
    out = torch.full_like(q, float("nan"), memory_format=torch.contiguous_format)
    assert kernel(q, k, v, lengths, None, out=out, num_splits=splits, causal=True) is out
    check(q, k, v, lengths, None, out)
    ref = reference(q.cpu(), k.cpu(), v.cpu(), lengths.cpu(), causal=True)
    check(q, k, v, lengths, None, ref)


def test_causal_equals_chain_mask(kernel_device):
    # N <= 64: the causal call is the chain mask's (lower-triangular bits) call, bit for bit
    # (the same tiles and splits; causal takes more blocks unmasked, which must not change a bit)
    q, k, v, lengths, chain = make_case(2, 29, 2, 1, 64, torch.float32, kernel_device, chain=True, seed=3,
                                        lengths=[50, 0], S=200)
    for splits in (1, 3):
        a = kernel(q, k, v, lengths, chain, num_splits=splits)
        b = kernel(q, k, v, lengths, None, num_splits=splits, causal=True)
        assert torch.equal(a, b), (a - b).abs().max()
    torch.testing.assert_close(reference(q.cpu(), k.cpu(), v.cpu(), lengths.cpu(), causal=True),
                               reference(q.cpu(), k.cpu(), v.cpu(), lengths.cpu(), chain.cpu()), rtol=0, atol=0)


def _causal_vs_ar(q, k, v, table, lengths, nodes):
    """Invariant causal outputs [R, N, H, D] and, for each node i in `nodes`, the invariant AR
    step (one query, mask 1) at lengths + i over the same cache."""
    out = _k.tree_attention(q, k, v, table, lengths, causal=True, invariant=True)
    one = torch.ones(q.shape[0], 1, dtype=torch.int64, device=q.device)
    ar = {i: _k.tree_attention(q[:, i:i + 1].contiguous(), k, v, table, (lengths + i).int(), one, invariant=True)[:, 0]
          for i in nodes}
    return out, ar


@pytest.mark.parametrize("H,Hkv", [(2, 1), (1, 1)])
def test_causal_invariant_node_equals_ar_step(H, Hkv, kernel_device):
    """With invariant=True a causal node's output has the bits of an AR step at its length,
    and of the same token in a chunk split elsewhere. Chunks of 20 nodes cross a key-block
    edge (from 180, and from 63 - 16 / group: a node's blocks go through the masked loop where
    its AR step takes them unmasked, and the reverse for the second tile's first node, whose
    tile takes block 0 unmasked and its AR step at 63 masked); the cache spans 4 key blocks,
    so each node's keys are dealt to 4 splits and a tile of early nodes walks blocks it sees
    none of.
    The interpreter's numpy dot rounds a row by its place in the 16-row tile (a GPU's
    tensor-core rows do not): on the CPU a node is compared bit for bit with the AR step where
    both sit at the same place (node i * group a multiple of 16) and to float32 rounding
    elsewhere; the chunk split at 16 / group nodes (the same places) bit for bit."""
    R, N, D, dtype = 2, 20, 32, torch.float32
    group = H // Hkv
    q, k, v, lengths, _ = make_case(R, N, H, Hkv, D, dtype, kernel_device, seed=H, S=256,
                                    lengths=[63 - 16 // group, 180], causal=True)
    k, v, table = to_pages(k, v, seed=H)
    nodes = sorted({0, 5, 16 // group, 16, 19})
    out, ar = _causal_vs_ar(q, k, v, table, lengths, nodes)
    assert not out.isnan().any()
    for i in nodes:
        if kernel_device == "cuda" or (i * group) % 16 == 0:
            assert torch.equal(out[:, i], ar[i]), (i, (out[:, i] - ar[i]).abs().max())
        else:
            torch.testing.assert_close(out[:, i], ar[i], rtol=0, atol=1e-6)
    a = 16 // group if kernel_device != "cuda" else 7
    head = _k.tree_attention(q[:, :a], k, v, table, lengths, causal=True, invariant=True)
    tail = _k.tree_attention(q[:, a:], k, v, table, (lengths + a).int(), causal=True, invariant=True)
    assert torch.equal(torch.cat([head, tail], 1), out)
    # the check can fail: the invariant launch's config by hand gives the same bits, another
    # deal of the key blocks (one split, or three: block 3 joins block 0) moves some
    same = _k.tree_attention(q, k, v, table, lengths, causal=True, config={"block_m": 16, "splits": 4})
    assert torch.equal(same, out)
    for splits in (1, 3):
        other = _k.tree_attention(q, k, v, table, lengths, causal=True, config={"block_m": 16, "splits": splits})
        torch.testing.assert_close(other, out, rtol=0, atol=1e-5)
        assert not torch.equal(other, out), splits


def test_causal_reference_and_mask_helper():
    m = causal_attention_mask(torch.tensor([0, 2], dtype=torch.int32), 2, 5)
    expect = torch.tensor([[[1, 0, 0, 0, 0], [1, 1, 0, 0, 0]],
                           [[1, 1, 1, 0, 0], [1, 1, 1, 1, 0]]], dtype=torch.bool)
    assert torch.equal(m, expect)
    q, k, v, lengths, _ = make_case(3, 70, 4, 1, 40, torch.bfloat16, "cpu", seed=9, S=160, lengths=[0, 90, 33],
                                    causal=True)
    out = torch.full_like(q, float("nan"))
    assert dispatch(q, k, v, lengths, None, out=out, causal=True) is out  # CPU: the reference
    check(q, k, v, lengths, None, out)
    torch.testing.assert_close(reference(q, k, v, lengths, causal=True, span=160), out, rtol=0, atol=0)


def test_causal_rejects_bad_input():
    q, k, v, lengths, masks = make_case(2, 5, 4, 2, 64, torch.float32, "cpu", lengths=[0, 7], S=40)
    with pytest.raises(ValueError, match="causal calls take no tree_mask"):
        kernel(q, k, v, lengths, masks, causal=True)
    with pytest.raises(ValueError, match="causal calls take no tree_mask / tree_slots"):
        kernel(q, k, v, lengths, None, causal=True, tree_slots=5)
    with pytest.raises(ValueError, match="tree_mask is required"):
        kernel(q, k, v, lengths, None)
    with pytest.raises(ValueError, match="causal calls take no tree_mask"):
        reference(q, k, v, lengths, masks, causal=True)
    with pytest.raises(ValueError, match="tree_mask is required"):
        reference(q, k, v, lengths, None)
    big = torch.zeros(1, 65, 4, 64)   # the cache spans 64 slots: N = 65 does not fit
    with pytest.raises(ValueError, match="N=65 causal"):
        kernel(big, k[:1], v[:1], lengths[:1], None, causal=True)


# ---- GPU only: real cache sizes, default split heuristic ------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("R,H,Hkv,N,lengths", [
    (1, 32, 32, 1, [1999]), (1, 32, 32, 64, [600]), (1, 32, 8, 17, [4000]),
    (5, 32, 8, 64, [0, 7, 600, 1999, 4031]), (8, 32, 32, 6, [5, 900, 1000, 1100, 2000, 3000, 3500, 4090]),
])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_long_prefix_default_splits(R, H, Hkv, N, lengths, dtype):
    q, k, v, lengths, masks = make_case(R, N, H, Hkv, 128, dtype, "cuda", S=4096 + 1, lengths=lengths, seed=N)
    out = torch.full_like(q, float("nan"), memory_format=torch.contiguous_format)
    kernel(q, k, v, lengths, masks, out=out)
    check(q, k, v, lengths, masks, out)

@pytest.mark.gpu
def test_gpu_split_heuristic_fills_sms():
    dev = torch.device("cuda")
    sms = _k._sm_count(dev)
    assert _k._pick_splits(dev, 32, 1, 64) * 32 >= sms  # R=1, Hkv=32 decode keeps every SM busy
    assert _k._pick_splits(dev, 32, 64, 64) >= 2
    assert _k._pick_splits(dev, 4 * sms, 1, 64) == 1
    assert _k._decode_splits(dev, 32, 64) * 32 >= 2 * sms      # one query: ~4 programs per SM
    assert _k._decode_splits(dev, 32, 3) == 3                  # never more splits than key blocks


@pytest.mark.gpu
@pytest.mark.parametrize("Hkv", [32, 8])
def test_gpu_causal_prompt_chunk_and_invariance(Hkv):
    # a prompt chunk of 512 tokens over a 1000-slot prefix (and one from 0), bf16, 32 heads of
    # 128: against float64 truth; the invariant call's nodes bit for bit the AR steps at their
    # lengths (blocks the chunk's tiles take masked, the AR steps unmasked), the chunk split at
    # an odd place bit for bit the whole, and a chain's nodes too
    R, N, H, D = 2, 512, 32, 128
    q, kc, vc, lengths, _ = make_case(R, N, H, Hkv, D, torch.bfloat16, "cuda", S=1539, lengths=[1000, 0],
                                      seed=Hkv, causal=True)
    out = torch.full_like(q, float("nan"), memory_format=torch.contiguous_format)
    kernel(q, kc, vc, lengths, None, out=out, causal=True)
    check(q, kc, vc, lengths, None, out)
    k, v, table = to_pages(kc, vc, seed=Hkv)
    nodes = [0, 1, 23, 24, 63, 64, 100, 255, 511]
    inv, ar = _causal_vs_ar(q, k, v, table, lengths, nodes)
    check(q, kc, vc, lengths, None, inv)
    for i in nodes:
        assert torch.equal(inv[:, i], ar[i]), (i, (inv[:, i].float() - ar[i].float()).abs().max())
    head = _k.tree_attention(q[:, :137], k, v, table, lengths, causal=True, invariant=True)
    tail = _k.tree_attention(q[:, 137:], k, v, table, (lengths + 137).int(), causal=True, invariant=True)
    assert torch.equal(torch.cat([head, tail], 1), inv)
    # a 64-node chain over slots 1000..1063 (across the key-block edge at 1024): the same bits
    chain = random_tree_masks(R, 64, None, chain=True).cuda()
    assert torch.equal(_k.tree_attention(q[:, :64], k, v, table, lengths, chain, invariant=True), inv[:, :64])

def test_counters_workspace_outgrown_is_kept():
    # a CUDA graph bakes the workspace's address in: growing it must not free the old one
    # (its memory handed to another tensor would take the graph's atomic counts)
    from tabed_engine.kernels import _common

    dev = torch.device("cpu")
    old = _common.counters(dev, 16)
    ptr, size = old.data_ptr(), old.numel()
    del old
    new = _common.counters(dev, size + 1)
    assert new.numel() >= max(size + 1, 2 * size) and not new.any()
    assert any(t.data_ptr() == ptr for t in _common._OUTGROWN)
    assert _common.counters(dev, 8) is new
