"""Row-count-invariant decode arithmetic (`Engine(..., invariant=True)`).

Kernels (interpreter on the CPU, the GPU under -m gpu): the invariant product and attention
against their references, a row's output compared bit for bit alone and among 2..130 others
(and a chain node's against an AR step at its length), and the launches themselves: their
configs must not follow the number of rows or nodes (the test an M-dependent split or tile
choice fails). Engine: the option's validation and the CLI flag on the CPU; on the GPU, greedy
bf16 speculative output bitwise equal to AR's, alone and batched.
"""
import pytest
import torch

from tabed_engine.kernels import gemv as _g
from tabed_engine.kernels import tree_attention as _t
from tabed_engine.ops import gemv as ops

from test_kernel_gemv import check, check_glu, make_case as gemv_case
from paging import to_pages
from test_kernel_tree_attention import make_case as attn_case, random_tree_masks

DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class _Recorder:
    """Stands in for a Triton kernel: records each launch's grid and keyword (constexpr and
    launch) arguments instead of running it."""

    def __init__(self):
        self.launches = []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append((grid, kwargs))
        return launch


@pytest.mark.parametrize("M,N,K", [(1, 173, 1031), (3, 1000, 517), (17, 61, 77), (70, 96, 2048)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_invariant_product_matches_reference(M, N, K, dtype, kernel_device):
    x, w, b = gemv_case(M, N, K, dtype, kernel_device, bias=True, seed=M + N)
    out = torch.full((M, N), float("nan"), device=kernel_device, dtype=dtype)
    assert _g.gemv_rows(x, w, b, out=out, invariant=True) is out
    check(out, x, w, b, False)
    xg, wg, _ = gemv_case(M, 2 * N, K, dtype, kernel_device, seed=M + K)
    outg = torch.full((M, N), float("nan"), device=kernel_device, dtype=dtype)
    check_glu(_g.gemv_rows(xg, wg, glu=True, out=outg, invariant=True), xg, wg, None)


@pytest.mark.parametrize("dtype", DTYPES)
def test_invariant_product_rows_do_not_depend_on_the_others(dtype, kernel_device):
    """Row r's bits alone == among M others (random companions, r at several positions),
    plain and with the GLU gate. The interpreter's dots are numpy products, whose bits may
    follow a row's place in the tile: on the CPU the row keeps place 0 of its tile (the tiling
    is what is checked there), on the GPU it goes anywhere."""
    gen = torch.Generator().manual_seed(5)
    for N, K, glu in ((237, 300, False), (2 * 61, 517, True)):
        x, w, b = gemv_case(1, N, K, dtype, kernel_device, bias=not glu, seed=N)
        alone = _g.gemv_rows(x, w, b, glu=glu, invariant=True)
        for M in (2, 7, 16, 33, 64, 130):
            others = torch.randn(M, K, generator=gen).to(device=kernel_device, dtype=dtype)
            at = int(torch.randint(0, M, (1,), generator=gen))
            if kernel_device == "cpu":
                at -= at % _g.INVARIANT_BLOCK_M
            others[at] = x[0]
            y = _g.gemv_rows(others, w, b, glu=glu, invariant=True)
            assert torch.equal(y[at], alone[0]), (N, K, glu, M, at)


def test_invariant_launch_does_not_follow_the_rows(monkeypatch):
    """One launch config (tiles, warps, stages, no K split) for every row count; the grid grows
    by row tiles only. Fails if the invariant path picks anything from M."""
    rec = _Recorder()
    monkeypatch.setattr(_g, "_gemv_dot_kernel", rec)
    for N, K in ((4096, 4096), (22016, 4096), (4096, 11008), (32064, 4096), (6144, 768)):
        w = torch.zeros(N, K, dtype=torch.bfloat16)
        for M in (1, 2, 5, 6, 16, 17, 33, 64, 65, 192, 384, 517):
            _g.gemv_rows(torch.zeros(M, K, dtype=torch.bfloat16), w, invariant=True)
        configs = {tuple(sorted(kw.items())) for _, kw in rec.launches}
        assert len(configs) == 1, configs
        cfg = dict(configs.pop())
        assert cfg["SPLIT"] is False and cfg["BLOCK_M"] == _g.INVARIANT_BLOCK_M
        tiles = {grid[0] // -(-M // cfg["BLOCK_M"]) for grid, M in zip(
            (g for g, _ in rec.launches), (1, 2, 5, 6, 16, 17, 33, 64, 65, 192, 384, 517))}
        assert len(tiles) == 1                     # the weight's tiles times the row tiles
        rec.launches.clear()
    with pytest.raises(ValueError, match="config"):
        _g.gemv_rows(torch.zeros(3, 64, dtype=torch.bfloat16), torch.zeros(64, 64, dtype=torch.bfloat16),
                     config=(32, 64, 4, 2), invariant=True)


def test_dispatch_invariant(monkeypatch):
    """`linear(..., invariant=True)` takes the invariant product on CUDA for any row count and
    dtype (also below MIN_FEATURES and above 64 rows), and the reference on the CPU."""
    x, w = torch.randn(3, 40), torch.randn(24, 40)
    assert ops.gemv_kind(x, w, invariant=True) is None
    assert torch.equal(ops.linear(x, w, invariant=True), ops.linear_reference(x, w))
    calls = []
    monkeypatch.setattr(_g, "gemv_rows", lambda x, w, b=None, **kw: calls.append((x.shape, kw)) or x)

    class FakeCuda(torch.Tensor):
        is_cuda = True

    for M, K, dtype in ((1, 40, torch.float32), (200, 4096, torch.bfloat16), (7, 16, torch.float16)):
        xf = torch.zeros(M, K, dtype=dtype).as_subclass(FakeCuda)
        wf = torch.zeros(8, K, dtype=dtype)
        assert ops.gemv_kind(xf, wf, invariant=True) == "invariant"
        ops.linear(xf, wf, invariant=True)
        assert calls[-1][1]["invariant"] is True


def _chain_vs_ar(R, N, H, Hkv, D, dtype, device, seed):
    """(chain outputs [R, N, H, D], AR outputs of each node at its own length) over one cache."""
    q, k, v, lengths, _ = attn_case(R, N, H, Hkv, D, dtype, device, chain=True, seed=seed)
    k, v, table = to_pages(k, v, seed=seed)       # (shuffled pages)
    chain = random_tree_masks(R, N, torch.Generator().manual_seed(seed), chain=True).to(device)
    out = _t.tree_attention(q, k, v, table, lengths, chain, invariant=True)
    ar = torch.empty_like(out)
    one = torch.ones(R, 1, dtype=torch.int64, device=device)
    for j in range(N):   # node j is an AR step at length lengths + j: its own K/V at that slot
        ar[:, j:j + 1] = _t.tree_attention(q[:, j:j + 1].contiguous(), k, v, table, (lengths + j).int(), one,
                                           invariant=True)
    return q, k, v, table, lengths, chain, out, ar


@pytest.mark.parametrize("dtype", DTYPES)
def test_invariant_attention_chain_node_equals_ar_step(dtype, kernel_device):
    """A chain's node j (a verification row) has the bits of an AR step at length L + j, for
    lengths around key-block edges; and a row's bits do not depend on the other rows. On the
    CPU the interpreter's numpy dots may round by a query's place in its tile (node j sits at
    place j, the AR step at place 0): there chain vs AR is checked to float32 rounding and the
    row alone vs among others (same places) bit for bit."""
    for R, N, H, Hkv, D, seed in ((3, 6, 4, 2, 64, 1), (2, 3, 2, 2, 80, 2)):
        q, k, v, table, lengths, chain, out, ar = _chain_vs_ar(R, N, H, Hkv, D, dtype, kernel_device, seed)
        assert not out.isnan().any()
        if kernel_device == "cuda":
            assert torch.equal(out, ar), (out - ar).abs().max()
        else:
            torch.testing.assert_close(out, ar, rtol=0, atol=1e-5 if dtype == torch.float32 else 2e-2)
        for r in range(R):   # the row alone
            alone = _t.tree_attention(q[r:r + 1], k, v, table[r:r + 1], lengths[r:r + 1], chain[r:r + 1],
                                      invariant=True)
            assert torch.equal(alone[0], out[r])


def _tree_vs_ar(R, N, H, Hkv, D, dtype, device, seed, lengths=None):
    """(tree outputs with `paths`, without, each node's AR step over a cache whose slots after
    the prefix hold the node's path, in depth order) [R, N, H, D] each, and the inputs."""
    q, k, v, lengths, _ = attn_case(R, N, H, Hkv, D, dtype, device, seed=seed, lengths=lengths)
    masks = random_tree_masks(R, N, torch.Generator().manual_seed(seed + 1)).to(device)
    kp, vp, table = to_pages(k, v, seed=seed)
    tree = _t.tree_attention(q, kp, vp, table, lengths, masks, invariant=True, paths=True)
    plain = _t.tree_attention(q, kp, vp, table, lengths, masks, invariant=True)
    ar = torch.full_like(tree, float("nan"))
    one = torch.ones(1, 1, dtype=torch.int64, device=device)
    for r in range(R):
        L = int(lengths[r])
        for i in range(N):
            path = [j for j in range(N) if (int(masks[r, i]) >> j) & 1]
            k2, v2 = k[r:r + 1].clone(), v[r:r + 1].clone()
            k2[:, :, L:L + len(path)] = k[r:r + 1, :, [L + j for j in path]]
            v2[:, :, L:L + len(path)] = v[r:r + 1, :, [L + j for j in path]]
            k2p, v2p, t2 = to_pages(k2, v2, seed=seed + i)
            ar[r:r + 1, i:i + 1] = _t.tree_attention(q[r:r + 1, i:i + 1].contiguous(), k2p, v2p, t2,
                                                     torch.tensor([L + len(path) - 1], dtype=torch.int32,
                                                                  device=device), one, invariant=True)
    return q, kp, vp, table, lengths, masks, tree, plain, ar


@pytest.mark.parametrize("dtype", DTYPES)
def test_invariant_attention_tree_node_equals_ar_step(dtype, kernel_device):
    """With `paths`, a tree node (random trees, branches hanging off the prefix too) has the
    bits of an AR step at length + depth over a cache holding its path after the prefix, for
    prefixes ending around key-block edges (the path straddles one), MHA and GQA; the keys
    are the reference's either way. On the CPU (numpy dots) checked to float32 rounding."""
    from test_kernel_tree_attention import check

    for R, N, H, Hkv, D, seed, lengths in ((3, 9, 4, 2, 64, 3, [60, 127, 5]), (2, 6, 2, 2, 80, 4, [62, 0]),
                                           (1, 17, 3, 1, 64, 5, [120])):
        q, k, v, table, lengths, masks, tree, plain, ar = _tree_vs_ar(R, N, H, Hkv, D, dtype, kernel_device,
                                                                       seed, lengths)
        assert not tree.isnan().any()
        if kernel_device == "cuda":
            assert torch.equal(tree, ar), (tree - ar).abs().max()
        else:
            torch.testing.assert_close(tree, ar, rtol=0, atol=1e-5 if dtype == torch.float32 else 2e-2)
        torch.testing.assert_close(tree, plain, rtol=0, atol=1e-5 if dtype == torch.float32 else 2e-2)
        for r in range(R):   # the row alone: the same bits
            alone = _t.tree_attention(q[r:r + 1], k, v, table[r:r + 1], lengths[r:r + 1], masks[r:r + 1],
                                      invariant=True, paths=True)
            assert torch.equal(alone[0], tree[r])


@pytest.mark.gpu
def test_gpu_tree_without_paths_is_not_ar():
    """The broken variant: without `paths` a branching tree's nodes sum their path's keys where
    the tree put them, and some node's bits differ from its AR step's (bf16)."""
    _, _, _, _, _, masks, tree, plain, ar = _tree_vs_ar(4, 24, 32, 32, 128, torch.bfloat16, "cuda", 7,
                                                       [60, 100, 203, 7])
    assert torch.equal(tree, ar)
    assert not torch.equal(plain, ar)


def test_invariant_attention_launch_does_not_follow_rows_or_nodes(monkeypatch):
    """Every invariant call launches the tensor-core kernel with one config (16-query tiles, a
    split count from the cache length only), never the one-query kernel; causal calls too."""
    rec, dec = _Recorder(), _Recorder()
    monkeypatch.setattr(_t, "_tree_attention_kernel", rec)
    monkeypatch.setattr(_t, "_decode_attention_kernel", dec)
    monkeypatch.setattr(_t, "_counters", lambda device, n: torch.zeros(n, dtype=torch.int32))
    for S in (100, 700, 4096):
        W = -(-S // 64)
        k = torch.zeros(2, 8, 64, 128, dtype=torch.bfloat16)             # pages
        table = torch.zeros(64, W, dtype=torch.int32)
        for R in (1, 4, 16, 64):
            for N in (1, 2, 6, 11, 64):
                q = torch.zeros(R, N, 32, 128, dtype=torch.bfloat16)
                _t.tree_attention(q, k, k, table[:R], torch.full((R,), 5, dtype=torch.int32),
                                  torch.ones(R, N, dtype=torch.int64), invariant=True)
            for N in (1, 6, 100):  # prompt chunks (causal): the same config
                q = torch.zeros(R, N, 32, 128, dtype=torch.bfloat16)
                _t.tree_attention(q, k, k, table[:R], torch.full((R,), 5, dtype=torch.int32), causal=True,
                                  invariant=True)
        configs = {(grid[2], kw["BLOCK_M"], kw["BLOCK_N"], kw["SPLITS"], kw["num_warps"], kw["num_stages"])
                   for grid, kw in rec.launches}
        assert len(configs) == 1, configs
        rec.launches.clear()
    assert not dec.launches
    with pytest.raises(ValueError, match="invariant"):
        _t.tree_attention(q, k, k, table, torch.full((64,), 5, dtype=torch.int32),
                          torch.ones(64, 64, dtype=torch.int64), num_splits=2, invariant=True)


def test_engine_option_and_cli(tmp_path):
    """`invariant` must be a bool, sets the models' flag, takes trees (float32 on the CPU: tree
    SD gives AR's tokens), and `--invariant` reaches the engine."""
    from models import model_dir
    from tabed_engine import Engine, SamplingParams
    from tabed_engine.models.tiny import random_image
    from tabed_engine.serving.cli import build_parser, engine_kwargs

    with pytest.raises(TypeError, match="invariant"):
        Engine.from_pretrained(model_dir("mha"), model_dir("mha", perturb=0.6), invariant=1)
    eng = Engine.from_pretrained(model_dir("mha"), model_dir("mha", perturb=0.6), invariant=True, max_batch=2)
    assert eng.invariant and eng.target.lm.invariant and eng.draft.lm.invariant
    assert eng.view_tree                              # trees too: a node reads its path as AR does
    eng.configure(tree="5x2x2")
    eng.configure(tree=None, gamma=3)
    tree = Engine.from_pretrained(model_dir("mha"), model_dir("mha", perturb=0.6), invariant=True, tree="4x2x2",
                                  max_batch=2, device="cpu", dtype=torch.float32)
    prompt, sp = "<image>\n w1 w2 w3", SamplingParams(max_new_tokens=12)
    img = [random_image(3)]
    ar = tree.generate(prompt, images=img, sampling=sp, speculative=False).token_ids
    assert tree.generate(prompt, images=img, sampling=sp).token_ids == ar
    args = build_parser().parse_args(["generate", "--target", "t", "--invariant", "--prompt", "p"])
    assert engine_kwargs(args)["invariant"] is True
    args = build_parser().parse_args(["generate", "--target", "t", "--prompt", "p"])
    assert "invariant" not in engine_kwargs(args)


@pytest.mark.gpu
def test_gpu_bf16_sd_equals_ar_bitwise():
    """bf16 on the GPU with `invariant=True`: greedy SD tokens == AR tokens bit for bit, every
    request alone and the same requests batched (AR and SD, chains and trees), 48 requests of
    48 tokens, with a small prefill budget (chunks cut anywhere) and with the block kind switching
    between AR and chains of every length; seeded sampled requests batched with SD == alone with AR."""
    from models import model_dir
    from tabed_engine import Engine, SamplingParams
    from test_prefill_graphs import _prompt

    # (prefix cache on: the repeated prompts hit it, and a hit must not change the bits either)
    eng = Engine.from_pretrained(model_dir("mha"), model_dir("mha", perturb=0.6), device="cuda",
                                 dtype=torch.bfloat16, invariant=True, max_batch=16, max_len=512,
                                 adaptive=False)
    cases = [_prompt(i % 3, 3 + (7 * i) % 61) for i in range(48)]
    texts, imgs = [c[0] for c in cases], [c[1] for c in cases]
    sp = SamplingParams(max_new_tokens=48)
    alone_ar = [eng.generate(t, images=im, sampling=sp, speculative=False).token_ids for t, im in cases]
    alone_sd = [eng.generate(t, images=im, sampling=sp).token_ids for t, im in cases]
    batch_ar = [o.token_ids for o in eng.generate(texts, images=imgs, sampling=sp, speculative=False)]
    batch_sd = [o.token_ids for o in eng.generate(texts, images=imgs, sampling=sp)]
    eng.prefill_chunk = 23
    chunked_sd = [o.token_ids for o in eng.generate(texts, images=imgs, sampling=sp)]
    assert alone_sd == alone_ar
    assert batch_ar == alone_ar
    assert batch_sd == alone_ar
    assert chunked_sd == alone_ar
    # the cost model's choices switching freely between AR steps and chains of every length
    from test_batch import Scripted

    eng.scheduler.cost = Scripted(("ar", 2, "sd", 1, "ar", "ar", 3), gamma=eng.gamma)
    switched = [o.token_ids for o in eng.generate(texts, images=imgs, sampling=sp)]
    assert switched == alone_ar
    # seeded sampling (the coupling): its draws read the logits' bits too
    seeded = [SamplingParams(max_new_tokens=48, temperature=0.8, top_p=0.95, seed=100 + i) for i in range(16)]
    few = cases[:16]
    s_ar = [eng.generate(t, images=im, sampling=p, speculative=False).token_ids for (t, im), p in zip(few, seeded)]
    s_batch = [o.token_ids for o in eng.generate([c[0] for c in few], images=[c[1] for c in few], sampling=seeded)]
    assert s_batch == s_ar
    # trees: the tree's nodes read their paths as AR steps do (and the first block, the views'
    # tree, too: view_tree is on above)
    eng.configure(tree="4x2x2")
    tree_alone = [eng.generate(t, images=im, sampling=sp).token_ids for t, im in cases[:24]]
    tree_batch = [o.token_ids for o in eng.generate(texts, images=imgs, sampling=sp)]
    assert tree_alone == alone_ar[:24]
    assert tree_batch == alone_ar


@pytest.mark.parametrize("graphs", [False, True])
def test_invariant_prefill_any_cut_same_tokens(monkeypatch, graphs):
    """`prefill_invariant` (the GPU path of an invariant engine, forced here on the CPU): a
    prompt prefilled through forwards of at most 64 new tokens, after a prefix-cache hit or in a
    chunked prefill, gives the greedy tokens of the plain prefill (float32); `graphs`: with the
    CUDA graphs' buffers emulated (the padded suffix graphs, image tokens inside them)."""
    from models import model_dir
    from tabed_engine import Engine, SamplingParams
    from tabed_engine.engine.runner import Runner
    from test_prefill_graphs import _prompt

    sp = SamplingParams(max_new_tokens=12)
    cases = [_prompt(2, 40), _prompt(1, 90), _prompt(0, 5)]
    plain = Engine.from_pretrained(model_dir("mha"), model_dir("mha", perturb=0.6), max_batch=2, prefix_cache=False)
    want = [plain.generate(t, images=im, sampling=sp).token_ids for t, im in cases]
    calls = []
    real = Runner.prefill_invariant
    monkeypatch.setattr(Runner, "invariant_prefill", property(lambda self: True))
    monkeypatch.setattr(Runner, "prefill_invariant", lambda self, *a: calls.append(a[3:5]) or real(self, *a))
    eng = Engine.from_pretrained(model_dir("mha"), model_dir("mha", perturb=0.6), max_batch=2)
    if graphs:
        from test_batch import emulated_graphs

        emulated_graphs(eng)
    for budget in (None, 29):
        eng.prefill_chunk = budget
        for (t, im), w in zip(cases, want):
            assert eng.generate(t, images=im, sampling=sp).token_ids == w
    assert calls and any(start > 0 for start, _ in calls)
    if graphs:
        assert any(k[0] == "suffix" for k in eng.runner.graphs.graphs)
