"""ensemble_mix: Triton kernel (CPU interpreter here, CUDA on a GPU) vs the PyTorch reference."""
import pytest
import torch
from scipy import stats

import triton
import triton.language as tl
from tabed_engine.kernels import _common
from tabed_engine.kernels import ensemble_mix as _k
from tabed_engine.ops.ensemble_mix import ensemble_mix, ensemble_mix_reference
from graphs import replayed

DTYPES = [  # (dtype, atol, rtol): both sides upcast the same inputs, only fp32 rounding differs
    (torch.float32, 1e-6, 1e-5),
    (torch.float16, 1e-6, 1e-5),
    (torch.bfloat16, 1e-6, 1e-5),
]


def _inputs(B, K, V, dtype, device, pad=37, scale=3.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    # Rows of a wider buffer: row stride V + pad, unit last stride.
    buf = (torch.randn(B * K, V + pad, generator=g) * scale).to(dtype)
    w = torch.rand(B, K, generator=g) + 0.05
    w = w / w.sum(dim=1, keepdim=True)
    return buf[:, :V].to(device), w.to(device)


def _check_token(token, token_prob, ref_mix, atol):
    """Kernel token must be a (near-)argmax of the reference mixture, with its probability."""
    q_tok = ref_mix.gather(1, token[:, None]).squeeze(1)
    assert torch.all(q_tok >= ref_mix.max(dim=1).values - 1e-6)
    torch.testing.assert_close(token_prob, q_tok, atol=atol, rtol=1e-5)


@pytest.mark.parametrize("dtype, atol, rtol", DTYPES)
@pytest.mark.parametrize("B, K, V, temperature, return_mixture", [
    (1, 1, 1000, 1.0, False), (3, 3, 1000, 0.7, True), (9, 1, 1000, 1.3, True),
    (2, 4, 1000, 1.0, False), (1, 4, 32064, 0.8, True), (2, 2, 32064, 1.0, False),
    (1, 2, 151936, 1.0, True), (1, 1, 151936, 0.6, False),
])
def test_greedy_matches_reference(B, K, V, temperature, return_mixture, dtype, atol, rtol, kernel_device):
    logits, w = _inputs(B, K, V, dtype, kernel_device)
    ref = ensemble_mix_reference(logits, w, greedy=True, temperature=temperature, return_mixture=True)
    out_mix = None
    if return_mixture:  # a strided slice of a [B, gamma, V] buffer, poisoned
        out_mix = torch.full((B, 3, V), float("nan"), device=kernel_device)[:, 1]
    token, token_prob, mixture, lse = _k.ensemble_mix(
        logits, w, greedy=True, temperature=temperature, mixture_out=out_mix)
    assert token.dtype == torch.int64 and token.shape == (B,)
    torch.testing.assert_close(lse, ref[3], atol=atol * 10, rtol=rtol)
    _check_token(token, token_prob, ref[2], atol)
    # Where the top-2 gap is clear the choice must be identical.
    top2 = ref[2].topk(2, dim=1).values
    clear = (top2[:, 0] - top2[:, 1]) > 1e-5
    assert torch.equal(token[clear], ref[0][clear])
    if return_mixture:
        assert mixture.data_ptr() == out_mix.data_ptr()
        torch.testing.assert_close(mixture, ref[2], atol=atol, rtol=rtol)
    else:
        assert mixture is None


def test_return_mixture_allocates(kernel_device):
    logits, w = _inputs(2, 3, 1000, torch.float32, kernel_device)
    _, _, mixture, _ = _k.ensemble_mix(logits, w, greedy=True, return_mixture=True)
    ref = ensemble_mix_reference(logits, w, greedy=True, return_mixture=True)
    torch.testing.assert_close(mixture, ref[2], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(mixture.sum(dim=1), torch.ones(2, device=kernel_device))


@pytest.mark.parametrize("K", [1, 2])
def test_greedy_ties_pick_lowest_index(K, kernel_device):
    V = 20000  # several V blocks: ties inside a block and across blocks
    logits = torch.full((K, V), -5.0)
    for v in (17000, 9000, 4000):
        logits[:, v] = 3.0
    w = torch.full((1, K), 1.0 / K)
    token, *_ = _k.ensemble_mix(logits.to(kernel_device), w.to(kernel_device), greedy=True)
    assert token.item() == 4000


def test_weights_decide_the_mix(kernel_device):
    # View 0 prefers token 5, view 1 token 9: the weights choose the winner.
    logits = torch.zeros(4, 1000)
    logits[0::2, 5] = 4.0
    logits[1::2, 9] = 3.0
    w = torch.tensor([[0.7, 0.3], [0.2, 0.8]])
    token, prob, _, _ = _k.ensemble_mix(logits.to(kernel_device), w.to(kernel_device), greedy=True)
    assert token.tolist() == [5, 9]
    ref = ensemble_mix_reference(logits, w, greedy=True)
    torch.testing.assert_close(prob.cpu(), ref[1])


def _mixture_case(N, K, V, device):
    g = torch.Generator().manual_seed(1)
    base = torch.randn(K, V, generator=g) * 1.5
    if K > 1:  # views with disjoint favourites, so a single view is far from the mixture
        base[0, :10] += 3.0
        base[1, 10:20] += 3.0
    w = torch.tensor([0.5, 0.3, 0.2, 0.1][:K])
    w = w / w.sum()
    logits = base.repeat(N, 1).to(device)                      # [N*K, V]
    weights = w.repeat(N, 1).to(device)                        # [N, K]
    mix = ensemble_mix_reference(base, w[None], greedy=True, temperature=0.8, return_mixture=True)[2][0]
    return logits, weights, mix


def _chisq_pvalue(tokens, probs):
    V = probs.numel()
    counts = torch.bincount(tokens.cpu(), minlength=V).double()
    expected = probs.double().cpu() * tokens.numel()
    # Merge bins with small expectation into one so the chi-square approximation holds.
    small = expected < 5
    obs = torch.cat([counts[~small], counts[small].sum()[None]])
    exp = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = exp > 0
    exp = exp * (obs.sum() / exp[keep].sum())
    return stats.chisquare(obs[keep].numpy(), exp[keep].numpy()).pvalue


@pytest.mark.parametrize("K", [1, 3])
def test_sampling_follows_mixture(K, kernel_device):
    # One batched call: N requests with identical views; Philox counters offset + b*V
    # make the N draws independent.  400 draws (~8 expected per token) keep the
    # interpreter near 15 s; the single-view and uniform checks below show the power.
    N, V = 400, 50
    logits, weights, mix = _mixture_case(N, K, V, kernel_device)
    seed = torch.tensor([1234], device=kernel_device)
    offset = torch.tensor([99], device=kernel_device)
    token, prob, _, lse = _k.ensemble_mix(logits, weights, greedy=False, seed=seed, offset=offset,
                                          temperature=0.8)
    assert token.min() >= 0 and token.max() < V
    torch.testing.assert_close(prob.cpu(), mix[token.cpu()], atol=1e-6, rtol=1e-5)
    assert torch.isfinite(lse).all()
    p = _chisq_pvalue(token, mix)
    assert p > 1e-3, f"sampled tokens do not follow the mixture (p={p:.2e})"
    if K > 1:  # the same draws must be far from any single view: the test has power
        for k in range(K):
            q_k = torch.softmax(logits[k].float().cpu() / 0.8, dim=0)
            assert _chisq_pvalue(token, q_k) < 1e-6
    assert _chisq_pvalue(token, torch.full((V,), 1.0 / V)) < 1e-6


def _mix(logits, w, *, greedy, plan_kw=None, **kw):
    """The launcher with a plan built from `plan_kw` (`mix_plan`'s overrides, e.g. `splits`,
    `tile` with `one_step=1` for chunks of several loop steps, the draw order's `period` and
    `width`); None: the device's default plan."""
    if plan_kw is not None:
        B, K = w.shape
        write_mix = kw.get("return_mixture", False) or kw.get("mixture_out") is not None
        kw["plan"] = _k.mix_plan(B, K, logits.shape[1], itemsize=logits.element_size(), greedy=greedy,
                                 write_mix=write_mix, sms=_common.sm_count(logits.device), **plan_kw)
    return _k.ensemble_mix(logits, w, greedy=greedy, **kw)


def _tiles(width):
    """Plan overrides for chunks of more than one loop step of `width` elements."""
    return dict(tile=width, one_step=1)


def _draw_order_reference(q, u, period, width):
    """The kernel's draw in PyTorch: inverse CDF of q ([V]) at u in the order slot
    (c mod period) // width first, then column (the first token whose prefix sum exceeds
    u * total, never one with q = 0)."""
    order = sorted(range(q.numel()), key=lambda c: ((c % period) // width, c))
    cs = torch.cumsum(q[order].double(), 0)
    pos = torch.nonzero((cs > u * cs[-1]) & (q[order] > 0))[0, 0]
    return order[pos]


@pytest.mark.parametrize("return_mixture, tiled", [(False, False), (True, False), (False, True), (True, True)])
def test_split_sampling_follows_mixture_and_skips_empty_chunks(return_mixture, tiled, kernel_device):
    # Draws across 4 chunks of 16 (tiled: 2 chunks of two 16-column steps) in the draw order
    # of period 16, slots of 8 (fp32: 4-column groups): a 16-column block with no mass (all
    # -inf: a chunk, or a step) and single zero-probability tokens next to chunk, step and
    # slot edges are never drawn; the rest follows q.
    # tiled: 16 columns per view and step (K views per program with the mixture row, else one)
    plan_kw = dict(splits=2 if tiled else 4, period=16, width=8,
                   **(_tiles(32 if return_mixture else 16) if tiled else {}))
    N, K, V = 200, 2, 64
    g = torch.Generator().manual_seed(3)
    base = torch.randn(K, V, generator=g)
    base[0, :8] += 2.0
    base[1, 40:48] += 2.0
    zero = [7, 8, 15, 32, 47, 48, 55, 63] + list(range(16, 32))
    base[:, zero] = float("-inf")
    w = torch.tensor([[0.35, 0.65]])
    mix = ensemble_mix_reference(base, w, greedy=True, temperature=0.8, return_mixture=True)[2][0]
    token, prob, mixture, _ = _mix(
        base.repeat(N, 1).to(kernel_device), w.repeat(N, 1).to(kernel_device), greedy=False, plan_kw=plan_kw,
        seed=torch.tensor([42], device=kernel_device), offset=torch.tensor([7], device=kernel_device),
        temperature=0.8, return_mixture=return_mixture)
    assert not any(t in zero for t in token.tolist())
    torch.testing.assert_close(prob.cpu(), mix[token.cpu()], atol=1e-6, rtol=1e-5)
    p = _chisq_pvalue(token, mix)
    assert p > 1e-3, f"sampled tokens do not follow the mixture (p={p:.2e})"
    if return_mixture:
        torch.testing.assert_close(mixture[0].cpu(), mix, atol=1e-6, rtol=1e-5)


@triton.jit
def _first_uniform_kernel(seed_ptr, out_ptr, base):
    u = _common.uniforms(tl.load(seed_ptr), base, 0, 4)
    tl.store(out_ptr + tl.arange(0, 4), u)


def _row_uniform(seed, base, device):
    """The uniform the kernel draws request b with: Philox output 0 at counter `base`."""
    out = torch.full((4,), float("nan"), device=device)
    _first_uniform_kernel[(1,)](seed, out, base)
    return float(out[0])


@pytest.mark.parametrize("n_split, return_mixture, tile", [(1, False, None), (3, True, None), (4, False, None),
                                                           (4, True, 16), (3, False, 8)])
def test_draw_takes_the_documented_order(n_split, return_mixture, tile, kernel_device):
    """Each token is the inverse CDF of the row's mixture at the row's uniform in the draw
    order (slot (c mod P) // SW, then column), here P = 32 and slots of 8 over V = 200 (7
    periods, the last cut short), computed in PyTorch. tile: the slot sums folded one or
    two chunks at a time (as at large V) instead of in one tile."""
    B, K, V, P, SW = 6, 2, 200, 32, 8
    plan_kw = dict(splits=n_split, period=P, width=SW, **({"draw_tile": tile} if tile else {}))
    logits, w = _inputs(B, K, V, torch.float32, kernel_device, seed=5, scale=1.0)
    seed = torch.tensor([2024], device=kernel_device)
    offset = torch.tensor([555], device=kernel_device)
    token, prob, _, _ = _mix(logits, w, greedy=False, seed=seed, offset=offset, temperature=0.7,
                             return_mixture=return_mixture, plan_kw=plan_kw)
    mix = ensemble_mix_reference(logits.cpu(), w.cpu(), greedy=True, temperature=0.7, return_mixture=True)[2]
    want = [_draw_order_reference(mix[b], _row_uniform(seed, 555 + b * V, kernel_device), P, SW)
            for b in range(B)]
    assert token.tolist() == want
    assert len(set(want)) > 3
    torch.testing.assert_close(prob.cpu(), mix.gather(1, token.cpu()[:, None]).squeeze(1), atol=1e-6, rtol=1e-5)


def test_sampling_is_deterministic_in_seed_and_offset(kernel_device):
    N, V = 24, 50
    logits, weights, _ = _mixture_case(N, 2, V, kernel_device)

    def draw(s, o):
        return _k.ensemble_mix(logits, weights, greedy=False, temperature=0.8,
                               seed=torch.tensor([s], device=kernel_device),
                               offset=torch.tensor([o], device=kernel_device))[0]

    a = draw(7, 0)
    assert torch.equal(a, draw(7, 0))
    assert not torch.equal(a, draw(7, N * V))  # next call's counters
    assert not torch.equal(a, draw(8, 0))
    assert len(set(a.tolist())) > 6             # per-row counters: rows differ


def test_dispatch_cpu_uses_reference():
    logits, w = _inputs(2, 3, 1000, torch.float32, "cpu")
    out = ensemble_mix(logits, w, greedy=True, return_mixture=True)
    ref = ensemble_mix_reference(logits, w, greedy=True, return_mixture=True)
    for a, b in zip(out, ref):
        assert torch.equal(a, b)


def test_bad_inputs_raise(kernel_device):
    logits, w = _inputs(2, 2, 100, torch.float32, kernel_device)
    with pytest.raises(ValueError):
        _k.ensemble_mix(logits[:3], w, greedy=True)
    with pytest.raises(TypeError):
        _k.ensemble_mix(logits, w.double(), greedy=True)
    with pytest.raises(ValueError):
        _k.ensemble_mix(logits.t().contiguous().t(), w, greedy=True)
    with pytest.raises(ValueError):
        _k.ensemble_mix(logits, w, greedy=False)  # no seed / offset
    with pytest.raises(ValueError):
        _k.ensemble_mix(logits, w, greedy=True, temperature=0.0)


@pytest.mark.gpu
@pytest.mark.parametrize("B, K, V", [(1, 4, 32064), (16, 4, 151936), (64, 1, 32064), (128, 4, 32064),
                                     (512, 1, 32064)])
def test_gpu_full_size_bf16(B, K, V):
    logits, w = _inputs(B, K, V, torch.bfloat16, "cuda")
    ref = ensemble_mix_reference(logits, w, greedy=True, return_mixture=True)
    token, prob, mixture, lse = ensemble_mix(logits, w, greedy=True, return_mixture=True)
    _check_token(token, prob, ref[2], 1e-6)
    torch.testing.assert_close(mixture, ref[2], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(lse, ref[3], atol=1e-5, rtol=1e-5)
    for kw in (dict(return_mixture=True), {}):   # CUDA-graph replays store the same bits
        run = lambda: ensemble_mix(logits, w, greedy=True, **kw)
        eager, captured = run(), replayed(run)
        for x, y in zip(eager, captured):
            assert (x is None and y is None) or torch.equal(x, y)


@pytest.mark.gpu
def test_gpu_sampling_many_draws_and_graph_capture():
    N, V = 100_000, 50
    logits, weights, mix = _mixture_case(N, 3, V, "cuda")
    seed = torch.tensor([5], device="cuda")
    offset = torch.tensor([0], device="cuda")
    token, *_ = ensemble_mix(logits, weights, greedy=False, seed=seed, offset=offset, temperature=0.8)
    assert _chisq_pvalue(token, mix) > 1e-3
    # CUDA-graph safe: seed/offset are read on the device; replays follow offset updates.
    small_l, small_w = logits[:300], weights[:100]
    ensemble_mix(small_l, small_w, greedy=False, seed=seed, offset=offset)  # compile first
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        tok, *_ = ensemble_mix(small_l, small_w, greedy=False, seed=seed, offset=offset, temperature=0.8)
    graph.replay()
    first = tok.clone()
    graph.replay()
    assert torch.equal(first, tok)
    offset += 100 * V
    graph.replay()
    assert not torch.equal(first, tok)


# ---- V split (few requests): forced chunk counts on small and odd vocabularies.

def _plan(B, K, V=32064, greedy=True, write_mix=False, **kw):
    return _k.mix_plan(B, K, V, itemsize=2, greedy=greedy, write_mix=write_mix, sms=132, **kw)  # an H100 / H200


def test_plan_from_shapes():
    # the engine's draft step, one request: 32 chunks of 1008 columns, each read in one step
    p = _plan(1, 4)
    assert (p.rowwise, p.cert, p.picked, p.rows1, p.splits, p.chunk, p.block1, p.n_prog) == \
        (True, True, False, 4, 32, 1008, 1024, 32)
    p = _plan(1, 1)
    assert (p.rowwise, p.cert, p.picked, p.splits, p.n_prog, p.evict1) == (False, False, True, 32, 1, "")
    p = _plan(1, 4, greedy=False, write_mix=True)   # sampling with the mixture row: S + 1 programs, one draws
    assert (p.rowwise, p.cert, p.splits, p.chunk, p.period, p.n_prog) == (False, False, 32, 1024, 512, 33)
    assert p.chunk % p.period == 0 and p.block1 % p.period == 0
    p = _plan(64, 4)                                 # 256 view rows: 3 chunks each, 2048-column steps
    assert (p.rows1, p.splits, p.chunk, p.block1) == (256, 3, 10688, 2048)
    p = _plan(1, 1, V=151936)                       # at most 128 chunks
    assert (p.splits, p.chunk) == (127, 1200)
    assert _plan(4096, 1).splits == 1
    assert _plan(1, 1, V=173).splits == 1
    assert not _plan(1, 4, certify=False).cert
    assert _plan(2, 3, V=1000, splits=7).splits == 7 and _plan(2, 3, V=1000, splits=7).chunk == 144


def test_plan_must_match_the_call(kernel_device):
    logits, w = _inputs(2, 3, 1000, torch.float32, kernel_device)
    with pytest.raises(ValueError):   # a plan for another vocabulary
        _k.ensemble_mix(logits, w, greedy=True, plan=_k.mix_plan(2, 3, 999, itemsize=4, greedy=True, write_mix=False,
                                                                  sms=4))
    with pytest.raises(ValueError):   # a plan without the mixture row
        _k.ensemble_mix(logits, w, greedy=True, return_mixture=True,
                        plan=_k.mix_plan(2, 3, 1000, itemsize=4, greedy=True, write_mix=False, sms=4))


@pytest.mark.parametrize("n_split", [2, 7, 24])
@pytest.mark.parametrize("B, K, V, temperature, return_mixture, dtype", [
    (1, 1, 173, 1.0, False, torch.float32), (2, 1, 1000, 0.7, True, torch.bfloat16),
    (3, 3, 173, 1.3, True, torch.float16), (1, 4, 1000, 1.0, False, torch.bfloat16),
    (2, 2, 1000, 0.9, True, torch.float32),
])
def test_split_greedy_matches_reference(B, K, V, temperature, return_mixture, dtype, n_split, kernel_device):
    logits, w = _inputs(B, K, V, dtype, kernel_device, seed=n_split)
    ref = ensemble_mix_reference(logits, w, greedy=True, temperature=temperature, return_mixture=True)
    out_mix = torch.full((B, 3, V), float("nan"), device=kernel_device)[:, 2] if return_mixture else None
    token, token_prob, mixture, lse = _mix(
        logits, w, greedy=True, temperature=temperature, mixture_out=out_mix, plan_kw=dict(splits=n_split))
    assert not torch.isnan(token_prob).any()
    torch.testing.assert_close(lse, ref[3], atol=1e-5, rtol=1e-5)
    _check_token(token, token_prob, ref[2], 1e-6)
    top2 = ref[2].topk(2, dim=1).values
    clear = (top2[:, 0] - top2[:, 1]) > 1e-5
    assert torch.equal(token[clear], ref[0][clear])
    if return_mixture:
        torch.testing.assert_close(mixture, ref[2], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("K", [1, 2])
def test_split_ties_pick_lowest_index(K, kernel_device):
    # V = 173 in 7 chunks of 32: ties at a chunk boundary (31 | 32), inside a chunk, later.
    logits = torch.full((K, 173), -5.0)
    for v in (160, 40, 32, 31):
        logits[:, v] = 3.0
    w = torch.full((1, K), 1.0 / K)
    token, *_ = _mix(logits.to(kernel_device), w.to(kernel_device), greedy=True, plan_kw=dict(splits=7))
    assert token.item() == 31


@pytest.mark.parametrize("K, V, return_mixture", [(1, 173, False), (1, 1000, True), (3, 173, True),
                                                  (2, 1000, False)])
def test_split_sampling_draws_match_unsplit(K, V, return_mixture, kernel_device):
    """The same uniform per request (counter offset + b*V) whatever the split: the same
    tokens (a draw within float rounding of a chunk boundary could differ; none here)."""
    B = 6
    logits, w = _inputs(B, K, V, torch.bfloat16, kernel_device, seed=K)
    seed = torch.tensor([77], device=kernel_device)
    offset = torch.tensor([12345], device=kernel_device)
    outs = []
    for n_split in (1, 5):  # 5 requested chunks of a period of 64: 3 of 64 columns at V = 173, 4 of 256 at 1000
        outs.append(_mix(logits, w, greedy=False, seed=seed, offset=offset, temperature=0.9,
                         return_mixture=return_mixture, plan_kw=dict(splits=n_split, period=64)))
    (t1, p1, m1, l1), (t5, p5, m5, l5) = outs
    assert torch.equal(t1, t5)
    torch.testing.assert_close(p5, p1, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(l5, l1, atol=1e-5, rtol=1e-5)
    ref = ensemble_mix_reference(logits, w, greedy=True, temperature=0.9, return_mixture=True)
    torch.testing.assert_close(p5, ref[2].gather(1, t5[:, None]).squeeze(1), atol=1e-6, rtol=1e-5)
    if return_mixture:
        torch.testing.assert_close(m5, ref[2], atol=1e-6, rtol=1e-5)
    assert len(set(t5.tolist())) > 1


@pytest.mark.parametrize("K, n_split", [(2, 1), (3, 4)])
def test_sampling_draws_do_not_depend_on_the_pass1_layout(K, n_split, kernel_device):
    """Without the mixture row pass 1 reads one view row per program, with it K views per
    program: the same partials, so the same draws (the draw order depends on P and SW only)."""
    logits, w = _inputs(5, K, 1000, torch.bfloat16, kernel_device, seed=K)
    seed = torch.tensor([3], device=kernel_device)
    outs = [_mix(logits, w, greedy=False, seed=seed, offset=seed, return_mixture=mix,
                 plan_kw=dict(splits=n_split, period=64)) for mix in (False, True)]
    assert _k.mix_plan(5, K, 1000, itemsize=2, greedy=False, write_mix=False, sms=4).rowwise
    assert torch.equal(outs[0][0], outs[1][0])
    torch.testing.assert_close(outs[0][1], outs[1][1], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(outs[0][3], outs[1][3], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("K, V, n_split, width", [(1, 1000, 1, 64), (3, 1000, 2, 128), (2, 173, 1, 32),
                                                  (4, 1000, 3, 256)])
def test_tiled_sampling_draws_match_untiled(K, V, n_split, width, kernel_device):
    """Sampling without the mixture row over chunks of several pass-1 steps: the same
    uniform per request, the same tokens as one step per chunk, q(token) and the
    normalisers as the reference. Two calls in a row (no state is left behind)."""
    B = 7
    logits, w = _inputs(B, K, V, torch.bfloat16, kernel_device, seed=K + 10)
    seed = torch.tensor([5], device=kernel_device)
    offset = torch.tensor([321], device=kernel_device)
    def draw(**plan_kw):
        token = torch.full((B,), -1, dtype=torch.int64, device=kernel_device)
        prob = torch.full((B,), float("nan"), device=kernel_device)
        t, p, _, lse = _mix(logits, w, greedy=False, seed=seed, offset=offset, temperature=0.9,
                            plan_kw=dict(splits=n_split, period=32, **plan_kw))
        token.copy_(t), prob.copy_(p)
        return token, prob, lse

    t_one, p_one, l_one = draw()          # chunks of at most 1000 columns: one loop step each
    plan = _k.mix_plan(B, K, V, itemsize=2, greedy=False, write_mix=False, sms=4, splits=n_split, period=32,
                       **_tiles(width))
    assert plan.chunk > plan.block1       # several steps per chunk
    for _ in range(2):
        t, p, lse = draw(**_tiles(width))
        assert torch.equal(t, t_one)
        torch.testing.assert_close(p, p_one, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(lse, l_one, atol=1e-5, rtol=1e-5)
    ref = ensemble_mix_reference(logits, w, greedy=True, temperature=0.9, return_mixture=True)
    torch.testing.assert_close(p, ref[2].gather(1, t[:, None]).squeeze(1), atol=1e-6, rtol=1e-5)
    assert len(set(t.tolist())) > 1


# ---- greedy K > 1: the argmax certified from pass 1's per-view top-2 (second pass skipped)

def _agreeing(B, K, V, dtype, device, noise, seed):
    """Views of one distribution plus per-view noise: with small noise the views share their
    argmax (the draft's usual case), with large noise they disagree."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(B, 1, V, generator=g) * 3.0
    logits = (base + noise * torch.randn(B, K, V, generator=g)).reshape(B * K, V).to(dtype)
    w = torch.rand(B, K, generator=g) + 0.05
    return logits.to(device), (w / w.sum(1, keepdim=True)).to(device)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("B, K, V", [(1, 2, 32064), (1, 4, 32064), (16, 4, 151936), (64, 4, 32064)])
def test_gpu_greedy_views_full_size(B, K, V, dtype):
    """Greedy K > 1 without the mixture row at the engine's sizes: certified rows (agreeing
    views) and rows decided by pass 2 (independent views), both against the reference and
    against the plan without the certificate."""
    for agree in (True, False):
        if agree:
            logits, w = _agreeing(B, K, V, dtype, "cuda", 0.05, seed=B + K)
        else:
            logits, w = _inputs(B, K, V, dtype, "cuda", scale=2.0, seed=B + K)
        ref = ensemble_mix_reference(logits, w, greedy=True, return_mixture=True)
        certified = torch.full((B,), -1, dtype=torch.int32, device="cuda")
        token, token_prob, _, lse = _k.ensemble_mix(logits, w, greedy=True, certified_out=certified)
        _check_token(token, token_prob, ref[2], 1e-6)
        top2 = ref[2].topk(2, dim=1).values
        clear = (top2[:, 0] - top2[:, 1]) > 1e-5
        assert torch.equal(token[clear], ref[0][clear])
        torch.testing.assert_close(lse, ref[3], atol=1e-5, rtol=1e-5)
        assert set(certified.tolist()) <= {0, 1}
        if not agree and B >= 16:
            assert (certified == 0).any()                    # pass 2 decided some rows
        full = _mix(logits, w, greedy=True, plan_kw=dict(certify=False))
        assert torch.equal(token, full[0])
        torch.testing.assert_close(token_prob, full[1], atol=1e-7, rtol=1e-6)


@pytest.mark.gpu
def test_gpu_engine_call_many_draft_rows():
    """The call the draft loop makes (`ops.ensemble_mix`: one request, two views, the
    Qwen2.5-VL vocabulary, bf16, the next step's ids written into the view rows, no
    certificate report) on 1,500 random rows of a draft's spread: every token a real
    argmax of the mixture. A certificate that compared q at the candidates with their
    recomputed maximum returned the 2^31 - 1 sentinel for a few rows in a thousand."""
    V, rows = 152064, 1500
    g = torch.Generator(device="cuda").manual_seed(0)
    bad = []
    for i in range(rows):
        base = torch.randn(1, V, device="cuda", generator=g) * 0.9
        noise = (0.9, 0.5, 0.2)[i % 3]
        logits = (base * (1 - noise) + noise * torch.randn(2, V, device="cuda", generator=g)).to(torch.bfloat16)
        w = torch.tensor([[0.5, 0.5]], device="cuda") + 0.02 * torch.randn(1, 2, device="cuda", generator=g)
        w = w / w.sum()
        ids = torch.full((2,), -1, dtype=torch.long, device="cuda")
        token, prob, _, _ = ensemble_mix(logits, w, greedy=True, view_tokens_out=ids)
        q = (w[0, :, None] * torch.softmax(logits.float(), -1)).sum(0)
        t = token[0]
        ok = (t >= 0) & (t < V) & (ids[0] == t) & (ids[1] == t) & (q[t.clamp(0, V - 1)] >= q.max() - 1e-6)
        bad.append(~ok)
    assert not torch.stack(bad).any(), int(torch.stack(bad).sum())


@pytest.mark.parametrize("n_split", [1, 7])
@pytest.mark.parametrize("B, K, V, dtype", [
    # the large vocabulary at one request (3 requests: 3x the interpreter time, 16 s of CPU)
    (5, 2, 1000, torch.float32), (1, 4, 32064, torch.bfloat16), (4, 3, 173, torch.float16),
])
def test_certified_greedy_matches_reference(B, K, V, dtype, n_split, kernel_device):
    for noise in (0.05, 0.6, 3.0):  # agreeing views (certified) .. disagreeing (second pass)
        logits, w = _agreeing(B, K, V, dtype, kernel_device, noise, seed=B * K + n_split)
        ref = ensemble_mix_reference(logits, w, greedy=True, return_mixture=True)
        outs = {}
        for certify in (True, False):
            outs[certify] = _mix(logits, w, greedy=True, plan_kw=dict(splits=n_split, certify=certify))
        token, token_prob, _, lse = outs[True]
        _check_token(token, token_prob, ref[2], 1e-6)
        top2 = ref[2].topk(2, dim=1).values
        clear = (top2[:, 0] - top2[:, 1]) > 1e-5
        assert torch.equal(token[clear], ref[0][clear])
        assert torch.equal(token, outs[False][0])
        # the two paths sum q's terms in different orders (on a GPU with one-instruction exp2s)
        torch.testing.assert_close(token_prob, outs[False][1], atol=1e-7, rtol=1e-5)
        torch.testing.assert_close(lse, ref[3], atol=1e-5, rtol=1e-5)


def test_certificate_skips_the_second_pass_only_when_it_holds(kernel_device):
    certified = torch.full((3,), -1, dtype=torch.int32, device=kernel_device)
    logits, w = _agreeing(3, 4, 1000, torch.float32, kernel_device, 0.05, seed=1)
    token, *_ = _mix(logits, w, greedy=True, certified_out=certified, plan_kw=dict(splits=4))
    assert certified.tolist() == [1, 1, 1]                   # agreeing views: one pass
    assert torch.equal(token, ensemble_mix_reference(logits, w, greedy=True)[0])
    # two views, each with a near-tie at the top: q(10) = 0.6 p(10) + ..., while a token that
    # is no view's argmax may reach 0.6 p(11) + 0.4 p(21) > q(10): not certified
    logits = torch.full((6, 1000), -3.0)
    for b in range(3):
        logits[2 * b, [10, 11]] = torch.tensor([4.0, 3.9])
        logits[2 * b + 1, [20, 21]] = torch.tensor([4.0, 3.9])
    logits = logits.to(kernel_device)
    w = torch.tensor([[0.6, 0.4]] * 3, device=kernel_device)
    token, *_ = _mix(logits, w, greedy=True, certified_out=certified, plan_kw=dict(splits=4))
    assert certified.tolist() == [0, 0, 0]                   # the chunk pass decided
    assert token.tolist() == [10, 10, 10]
    assert torch.equal(token, ensemble_mix_reference(logits, w, greedy=True)[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n_split, width", [(1, None), (3, None), (2, 256)])
def test_uncertified_pass_finds_an_argmax_no_view_has(dtype, n_split, width, kernel_device):
    """The argmax of q is a column no view ranks first (both views put 3.0 there, their own
    maxima 3.5 elsewhere): not certified, and the chunk pass finds it, with one or several
    chunks and steps per chunk (width); every other column low."""
    plan_kw = dict(splits=n_split, **(_tiles(width) if width else {}))
    B, K, V = 4, 2, 3000
    g = torch.Generator().manual_seed(11)
    logits = -5.0 + 0.5 * torch.randn(B * K, V, generator=g)
    want = []
    for b in range(B):
        c0, c1, c = (torch.randperm(V, generator=g)[:3]).tolist()
        logits[b * K, c0] = 3.5
        logits[b * K + 1, c1] = 3.5
        logits[b * K:b * K + 2, c] = 3.0
        want.append(c)
    logits = logits.to(dtype).to(kernel_device)
    w = torch.full((B, K), 0.5, device=kernel_device)
    certified = torch.full((B,), -1, dtype=torch.int32, device=kernel_device)
    token, prob, _, _ = _mix(logits, w, greedy=True, certified_out=certified, plan_kw=plan_kw)
    assert certified.tolist() == [0] * B
    assert token.tolist() == want
    ref = ensemble_mix_reference(logits, w, greedy=True, return_mixture=True)
    assert torch.equal(token, ref[0])
    torch.testing.assert_close(prob, ref[1], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("fill", [float("nan"), float("-inf")])
@pytest.mark.parametrize("K, n_split, width", [(2, 1, None), (4, 3, None), (2, 2, 256)])
def test_greedy_views_with_an_undefined_view(fill, K, n_split, width, kernel_device):
    """A view of NaN logits, or of -inf everywhere, makes its request's mixture NaN: the
    certificate must not hold on a NaN (the chunk pass decides, one or several steps per
    chunk), and the token is the reference's (torch.argmax: the first NaN, 0), never an index
    outside the vocabulary (a NaN certificate taken as holding gives BIG_IDX, 2^31 - 1); the
    other request is unaffected."""
    plan_kw = dict(splits=n_split, **(_tiles(width) if width else {}))
    B, V = 2, 3000
    logits = torch.randn(B * K, V, generator=torch.Generator().manual_seed(5))
    logits[K - 1] = fill                                     # request 0's last view
    logits = logits.to(kernel_device)
    w = torch.full((B, K), 1.0 / K, device=kernel_device)
    certified = torch.full((B,), -1, dtype=torch.int32, device=kernel_device)
    token, *_ = _mix(logits, w, greedy=True, certified_out=certified, plan_kw=plan_kw)
    assert certified[0].item() == 0
    assert token.tolist() == ensemble_mix_reference(logits, w, greedy=True)[0].tolist()
    assert token[0].item() == 0
    seed, offset = (torch.tensor([t], device=kernel_device) for t in (3, 0))
    token, *_ = _mix(logits, w, greedy=False, seed=seed, offset=offset, plan_kw=plan_kw)   # sampling: in range too
    assert ((token >= 0) & (token < V)).all()


@pytest.mark.parametrize("n_split", [1, 5])
def test_certified_tie_between_candidates_takes_the_lower_index(n_split, kernel_device):
    # Two views peaked at different tokens with equal weights: q(20) == q(50), both far
    # above any other token's bound, so the certificate holds and the lower index wins.
    logits = torch.full((2, 300), -4.0)
    logits[0, 50], logits[1, 20] = 6.0, 6.0
    logits[0, 20], logits[1, 50] = 1.0, 1.0
    w = torch.full((1, 2), 0.5)
    certified = torch.zeros(1, dtype=torch.int32, device=kernel_device)
    token, prob, *_ = _mix(logits.to(kernel_device), w.to(kernel_device), greedy=True, certified_out=certified,
                           plan_kw=dict(splits=n_split))
    assert token.item() == 20 and certified.item() == 1
    ref = ensemble_mix_reference(logits, w, greedy=True, return_mixture=True)
    torch.testing.assert_close(prob.cpu(), ref[1], atol=1e-7, rtol=1e-6)


# ---- pass 1's bookkeeping: each thread keeps the best of its 16-byte groups over the steps

# One chunk of 20000 columns read in steps of 2048 columns per view: a thread's slot holds
# groups of 8 (bf16) or 4 (fp32) columns, 2 or 4 of them per step (1024 or 512 columns
# apart), so an argmax at column 5004 shares its group, its slot in the same step, its slot
# in another step, or nothing with the positions below.
_SLOT_CASES = {"same group, lower": 5001, "same group, higher": 5006, "same slot, next group of the step": 5004 + 1024,
               "same slot, earlier step": 5004 - 2048, "same slot, later step": 5004 + 3 * 2048,
               "other slot": 5100}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("where", list(_SLOT_CASES))
def test_pass1_argmax_ties_across_groups_slots_and_steps(where, dtype, kernel_device):
    other = _SLOT_CASES[where]
    logits = torch.full((1, 20000), -5.0)
    logits[0, [5004, other]] = 3.0
    token, prob, _, lse = _mix(logits.to(dtype).to(kernel_device), torch.ones(1, 1, device=kernel_device),
                               greedy=True, plan_kw=dict(splits=1, tile=2048))
    assert token.item() == min(5004, other)
    ref = ensemble_mix_reference(logits.to(dtype), torch.ones(1, 1), greedy=True)
    torch.testing.assert_close(prob.cpu(), ref[1], atol=1e-7, rtol=1e-5)
    torch.testing.assert_close(lse.cpu(), ref[3], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("where", list(_SLOT_CASES))
def test_certificate_sees_the_second_largest_anywhere(where, dtype, kernel_device):
    # Each view's argmax (4.0) and, at one shared token, its second-largest logit (3.9): that
    # token is the mixture's argmax, above both candidates. Missing the second-largest of
    # either view (wherever pass 1 met it) would certify a candidate: the wrong token.
    plan_kw = dict(splits=1, tile=2048)              # one view row per program: 2048 columns per step
    second = _SLOT_CASES[where]
    logits = torch.full((2, 20000), -3.0)
    logits[0, 5004], logits[1, 15000] = 4.0, 4.0
    logits[:, second] = 3.9
    w = torch.tensor([[0.6, 0.4]])
    certified = torch.full((1,), -1, dtype=torch.int32, device=kernel_device)
    token, *_ = _mix(logits.to(dtype).to(kernel_device), w.to(kernel_device), greedy=True,
                     certified_out=certified, plan_kw=plan_kw)
    assert token.item() == second and certified.item() == 0
    assert token.item() == ensemble_mix_reference(logits.to(dtype), w, greedy=True)[0].item()
    logits[:, second] = 2.0                          # far below: now the certificate holds
    token, *_ = _mix(logits.to(dtype).to(kernel_device), w.to(kernel_device), greedy=True,
                     certified_out=certified, plan_kw=plan_kw)
    assert token.item() == 5004 and certified.item() == 1


# ---- the token written into every view row (the draft loop's next input ids)

@pytest.mark.parametrize("case", ["greedy K=1", "greedy certified", "greedy folded", "sample+mixture",
                                  "sample tiled"])
def test_view_tokens_out_fills_every_view_row(case, kernel_device):
    """Each path that stores the token (pass 2's pick, the certificate, the last-arriving
    fold, the draw with and without the mixture row) writes it into all K rows of its request
    when asked; the returned token is the same as without, and so are the other outputs."""
    B, V = 5, 1000
    K = {"greedy K=1": 1, "greedy certified": 3, "greedy folded": 3, "sample+mixture": 2, "sample tiled": 4}[case]
    greedy = case.startswith("greedy")
    if case == "greedy certified":
        logits, w = _agreeing(B, K, V, torch.bfloat16, kernel_device, noise=0.05, seed=3)
    else:
        logits, w = _inputs(B, K, V, torch.bfloat16, kernel_device, seed=K + 20)
    plan_kw = dict(splits=3, **(dict(period=32, **_tiles(128)) if case == "sample tiled" else {}))
    seed = torch.tensor([9], device=kernel_device)
    offset = torch.tensor([77], device=kernel_device)
    kw = dict(greedy=greedy, seed=seed, offset=offset, temperature=0.8, return_mixture=case == "sample+mixture")
    cert = torch.full((B,), -1, dtype=torch.int32, device=kernel_device)
    plain = _mix(logits, w, certified_out=cert, plan_kw=plan_kw, **kw)
    if case == "greedy certified":
        assert bool((cert == 1).all())
    if case == "greedy folded":
        assert bool((cert == 0).any())
    rows = torch.full((B * K,), -1, dtype=torch.int64, device=kernel_device)
    out = _mix(logits, w, view_tokens_out=rows, plan_kw=plan_kw, **kw)
    assert torch.equal(out[0], plain[0])
    assert torch.equal(rows, plain[0].repeat_interleave(K))
    for a, b in zip(out[1:], plain[1:]):
        assert (a is None and b is None) or torch.equal(a, b)
    ref_rows = torch.full((B * K,), -1, dtype=torch.int64)
    ref = ensemble_mix_reference(logits.cpu(), w.cpu(), greedy=True, temperature=0.8, view_tokens_out=ref_rows)
    assert torch.equal(ref_rows, ref[0].repeat_interleave(K))
    if greedy:
        assert torch.equal(ref[0], plain[0].cpu())
    with pytest.raises(ValueError):
        _k.ensemble_mix(logits, w, view_tokens_out=rows[:-1], **kw)
    with pytest.raises(ValueError):
        _k.ensemble_mix(logits, w, view_tokens_out=rows.int(), **kw)


@pytest.mark.parametrize("noise", [0.05, 3.0])
def test_greedy_views_with_masked_columns(noise, kernel_device):
    """Columns at -inf (a masked vocabulary): whole chunks and steps of one view, scattered
    columns of the others. The certified pass (agreeing views) and the chunk pass (noise
    3.0) match the reference and each other."""
    B, K, V = 3, 3, 2900
    logits, w = _agreeing(B, K, V, torch.float32, "cpu", noise, seed=5)
    logits = logits.clone()
    logits[1::K, :1500] = float("-inf")        # view 1: its first chunk and a half, every step
    g = torch.Generator().manual_seed(3)
    logits[torch.rand(logits.shape, generator=g) < 0.2] = float("-inf")
    logits[:, 2000] = torch.maximum(logits[:, 2000], torch.zeros(()))   # no view wholly masked
    logits, w = logits.to(kernel_device), w.to(kernel_device)
    ref = ensemble_mix_reference(logits, w, greedy=True, return_mixture=True)
    outs = {}
    certified = torch.full((B,), -1, dtype=torch.int32, device=kernel_device)
    for certify in (True, False):
        outs[certify] = _mix(logits, w, greedy=True, certified_out=certified if certify else None,
                             plan_kw=dict(splits=3, certify=certify, **_tiles(256)))
    assert certified.tolist() == [1] * B if noise < 1 else 0 in certified.tolist()   # both paths ran
    _check_token(outs[True][0], outs[True][1], ref[2], 1e-6)
    assert torch.equal(outs[True][0], ref[0]) and torch.equal(outs[False][0], ref[0])
    torch.testing.assert_close(outs[True][3], ref[3], atol=1e-5, rtol=1e-5)


