"""Kernel microbenchmarks at the engine's shapes (pytest-benchmark).

    pytest benchmarks/ --benchmark-only [--benchmark-json out.json]

Each case times the fast op inside a CUDA graph (as the engine runs it) and records in
`extra_info` the bytes it must move, the achieved GB/s and the copy ceiling of the same run
(benchmarks/conftest.py). Shapes: one request and 64 (the batched engine), K <= 4 views,
V = 32064, gamma = 5; the LLaVA-1.5-7B layer for the decoder kernels. Skipped without a GPU.
"""
import itertools

import pytest
import torch

V, GAMMA, P = 32064, 5, 6
BF = torch.bfloat16


def _rnd(*shape, dtype=BF, scale=2.0):
    return (torch.randn(*shape, device="cuda") * scale).to(dtype)


def _grid(K, steps=10):
    pts = [c for c in itertools.product(range(steps + 1), repeat=K) if sum(c) == steps]
    return torch.tensor(pts, dtype=torch.float32, device="cuda") / steps


@pytest.mark.parametrize("B", [1, 64])
@pytest.mark.parametrize("K, mode", [(1, "greedy"), (4, "greedy"), (4, "greedy agree"), (4, "sample+mixture")])
def test_ensemble_mix(bench, B, K, mode):
    from tabed_engine.kernels.ensemble_mix import ensemble_mix
    logits = _rnd(B * K, V)
    if mode == "greedy agree":   # views of one distribution: the certificate decides
        logits = (_rnd(B, 1, V) + 0.3 * _rnd(B, K, V, dtype=torch.float32)).reshape(B * K, V).to(BF)
    w = torch.full((B, K), 1.0 / K, device="cuda")
    seed = torch.zeros(1, dtype=torch.int64, device="cuda")
    sample = mode == "sample+mixture"
    nbytes = logits.numel() * 2 + (B * V * 4 if sample else 0)
    bench(lambda: ensemble_mix(logits, w, greedy=not sample, seed=seed, offset=seed, return_mixture=sample), nbytes)


@pytest.mark.parametrize("B", [1, 64])
@pytest.mark.parametrize("K, mode", [(4, "kl"), (4, "tv given"), (4, "tv"), (2, "grid"), (4, "grid")])
def test_window_divergence(bench, B, K, mode):
    from tabed_engine.kernels.window_divergence import window_divergence
    buf = _rnd(P, B, K + 1, V)                         # the engine's [P, B, K(+1), V] history rows
    p_l, q_l = buf[:, :, 0].permute(1, 0, 2), buf[:, :, 1:].permute(1, 2, 0, 3)
    kw = {"kl": dict(tv=False), "tv": {}, "grid": dict(grid=_grid(K))}.get(mode, {})
    if mode == "tv given":
        kw = dict(p_lse=torch.logsumexp(p_l.float(), -1), q_lse=torch.logsumexp(q_l.float(), -1))
    bench(lambda: window_divergence(p_l, q_l, **kw), buf.numel() * 2)


@pytest.mark.parametrize("B", [1, 64])
@pytest.mark.parametrize("mode", ["greedy", "greedy+lse", "sample"])
def test_chain_verify(bench, B, mode):
    from tabed_engine.kernels.chain_verify import chain_verify
    logits = _rnd(B, GAMMA + 1, V)
    draft = logits[:, :GAMMA].argmax(-1)               # all accepted: every row read
    if mode == "sample":                               # q == p: all accepted, the bonus row read
        p = torch.softmax(logits.float(), -1)
        q, u = p[:, :GAMMA].contiguous(), torch.rand(B, GAMMA + 1, device="cuda")
        bench(lambda: chain_verify(draft, q, p, greedy=False, uniforms=u), B * V * 4)
        return
    lse = torch.empty(B, GAMMA + 1, device="cuda") if mode == "greedy+lse" else None
    bench(lambda: chain_verify(draft, None, logits, greedy=True, lse_out=lse), logits.numel() * 2)


@pytest.mark.parametrize("B, K, G", [(1, 2, 0), (1, 4, 286), (64, 4, 286)])
def test_history_update(bench, B, K, G):
    from tabed_engine.kernels.history_update import POLICY_DIV, POLICY_GRID, history_update
    C = 512
    grid = _grid(K) if G else None
    args = (torch.rand(B, K, P, device="cuda"),
            torch.zeros(B, G, P, dtype=torch.bool, device="cuda") if G else None,
            torch.rand(B, G, P, device="cuda") if G else None,
            torch.full((B,), 2, device="cuda"), torch.zeros(B, dtype=torch.long, device="cuda"),
            torch.ones(B, C, dtype=torch.bool, device="cuda"), torch.rand(B, K, C, device="cuda"),
            torch.rand(B, G, C, device="cuda"), torch.rand(B, G, C, device="cuda"), grid)
    nbytes = B * C * (1 + 4 * K + 8 * G)              # the history it reads back
    bench(lambda: history_update(*args, policy=POLICY_GRID if G else POLICY_DIV, window=0, temperature=1.0,
                                 clip=1.0, all_positions=False), nbytes)


def _pages(R, S, shape, *, layers=None):
    """A paged pool [(L,) R * W + 1, *shape] of random pages and an [R, W] table in shuffled page
    order (as a busy engine's tables are), W = ceil(S / 64)."""
    W = -(-S // 64)
    pool = _rnd(*((layers,) if layers else ()), R * W + 1, shape[0], 64, shape[1], scale=1.0)
    table = (torch.randperm(R * W, device="cuda") + 1).int().view(R, W)
    return pool, table


@pytest.mark.parametrize("R, N, prefix", [(1, 6, 2000), (4, 6, 2000), (1, 32, 2000), (64, 6, 1000)])
def test_tree_attention(bench, R, N, prefix):
    from tabed_engine.kernels.tree_attention import tree_attention
    H, Hkv, D, S = 32, 32, 128, prefix + 64
    q = _rnd(R, N, H, D, scale=1.0)
    kc, table = _pages(R, S, (Hkv, D))
    vc, _ = _pages(R, S, (Hkv, D))
    lengths = torch.full((R,), prefix, dtype=torch.int32, device="cuda")
    mask = torch.tensor([(2 << i) - 1 for i in range(N)], device="cuda").repeat(R, 1)   # causal chain
    out = torch.empty_like(q)
    bench(lambda: tree_attention(q, kc, vc, table, lengths, mask, out=out), 2 * R * Hkv * (prefix + N) * D * 2,
          flops=4 * R * N * H * (prefix + N) * D)


@pytest.mark.parametrize("R, T", [(1, 1), (1, 6), (64, 6)])
def test_rope_kv_write(bench, R, T):
    from tabed_engine.kernels.rope_kv_write import rope_kv_write
    H = Hkv = 32
    D, S = 128, 2048
    qkv = _rnd(R, T, (H + 2 * Hkv) * D)
    cos, sin = torch.rand(R, T, D, device="cuda"), torch.rand(R, T, D, device="cuda")
    kc, table = _pages(R, S, (Hkv, D))
    vc, _ = _pages(R, S, (Hkv, D))
    lengths = torch.full((R,), 1000, dtype=torch.int32, device="cuda")
    bench(lambda: rope_kv_write(qkv, cos, sin, kc, vc, table, lengths, H, Hkv), qkv.numel() * 2 * 2)


@pytest.mark.parametrize("rows", [1, 6, 384])
def test_add_rms_norm(bench, rows):
    from tabed_engine.kernels.add_rms_norm import add_rms_norm
    x, d, w = _rnd(rows, 4096), _rnd(rows, 4096), _rnd(4096)
    bench(lambda: add_rms_norm(x, d, w, 1e-5), 4 * x.numel() * 2)


@pytest.mark.parametrize("rows", [1, 6, 384])
def test_silu_mul(bench, rows):
    from tabed_engine.kernels.silu_mul import silu_mul
    gate_up = _rnd(rows, 2 * 11008)
    bench(lambda: silu_mul(gate_up), gate_up.numel() * 2 * 3 // 2)


@pytest.mark.parametrize("rows, N, K", [(1, 4096, 4096), (1, 22016, 4096), (1, 4096, 11008), (6, 22016, 4096),
                                        (4, 6144, 768)])
def test_gemv(bench, rows, N, K):
    from tabed_engine.kernels.gemv import gemv, gemv_rows
    x, w = _rnd(rows, K, scale=0.1), _rnd(N, K, scale=0.05)
    fn = (lambda: gemv(x, w)) if rows == 1 else (lambda: gemv_rows(x, w))
    bench(fn, w.numel() * 2, flops=2 * rows * N * K)


@pytest.mark.parametrize("B, K, T, k", [(1, 2, 1, 3), (1, 2, 3, 2), (4, 2, 3, 2)])
@pytest.mark.parametrize("mode", ["greedy", "sample+mixture", "torch greedy", "torch sample+mixture"])
def test_mix_topk(bench, B, K, T, k, mode):
    """One tree depth's children (a 10x3x2 tree: the root's 3, then 2 for each of 3 nodes), the
    kernels beside the PyTorch ops they replace in the draft graph."""
    from tabed_engine.kernels.mix_topk import mix_topk
    from tabed_engine.ops.mix_topk import mix_topk_reference
    logits = _rnd(B * K, T + 1, V)[:, 1:]            # a slice of the forward's logits
    w = torch.full((B, K), 1.0 / K, device="cuda")
    kw = {}
    if "sample" in mode:
        seed = torch.zeros(1, dtype=torch.int64, device="cuda")
        kw = dict(seed=seed, offset=seed, mixture_out=torch.zeros(B, 61, V, device="cuda"),
                  out_rows=torch.arange(T, device="cuda").expand(B, T))
    fn = mix_topk_reference if mode.startswith("torch") else mix_topk
    bench(lambda: fn(logits, w, k, 0.9, **kw), logits.numel() * 2 + (B * T * V * 4 if kw else 0))


@pytest.mark.parametrize("B, K", [(1, 2), (4, 2)])
@pytest.mark.parametrize("impl", ["kernel", "torch"])
def test_tree_grow(bench, B, K, impl):
    """One depth's bookkeeping in the middle of a 10x3x2 tree (3 frontier nodes x 2 children)."""
    from tabed_engine import TreeConfig
    from tabed_engine.ops.tree_grow import TreeState, tree_grow, tree_start
    cfg = TreeConfig(10, 3, 2)
    st = TreeState.empty(B, K, cfg.nodes, cfg.fed, cfg.draft_rows, "cuda")
    tree_start(st, torch.ones(B * K, 2, dtype=torch.long, device="cuda"), torch.full((B * K,), 900, device="cuda"),
               pad=cfg.depth - 1, width=cfg.width)
    st.fed[:, 1:4] = torch.arange(1, 4, device="cuda")       # the root's children, fed at depth 1
    kids = torch.randint(0, V, (B, 3, 2), device="cuda")
    logq = -torch.rand(B, 3, 2, device="cuda")
    bench(lambda: tree_grow(st, kids, logq, pad=cfg.depth - 1, n_nodes=4, n_fed=4, width=3, last=False,
                            kernel=impl == "kernel"), st.ids.numel() * 8)


def _needs_ext():
    from tabed_engine.ops import _ext
    if not _ext.HAS_CUDA_KERNELS:
        pytest.skip("tabed_engine._C was built without its CUDA kernels")


@pytest.mark.parametrize("R, N", [(1, 6), (1, 32), (64, 6)])
def test_verify_tree(bench, R, N):
    _needs_ext()
    from tabed_engine.ops.verify_tree import verify_tree
    logits = _rnd(R, N, V)
    parents = torch.arange(-1, N - 1, device="cuda").repeat(R, 1)             # a chain, all accepted
    tokens = torch.cat([torch.zeros(R, 1, dtype=torch.long, device="cuda"), logits[:, :-1].argmax(-1)], 1)
    bench(lambda: verify_tree(tokens, parents, logits, greedy=True), logits.numel() * 2)


@pytest.mark.parametrize("R, N", [(1, 6), (1, 32), (64, 6)])
def test_compact_kv(bench, R, N):
    _needs_ext()
    from tabed_engine.ops.compact_kv import compact_kv
    L, Hkv, S, D = 32, 32, 1024 + N, 128          # the 7B cache, a 1000-token prefix (R = 64: 2 x 17 GB)
    k, table = _pages(R, S, (Hkv, D), layers=L)
    v, _ = _pages(R, S, (Hkv, D), layers=L)
    lengths = torch.full((R,), 1000, dtype=torch.int32, device="cuda")
    path = torch.cat([torch.zeros(R, 1, dtype=torch.long, device="cuda"),
                      torch.arange(N - 1, 0, -1, device="cuda").repeat(R, 1)], 1)   # every node moves
    n_acc = torch.full((R,), N - 1, device="cuda")
    bench(lambda: compact_kv(k, v, table, lengths, path, n_acc), 2 * 2 * L * R * Hkv * (N - 1) * D * 2)
