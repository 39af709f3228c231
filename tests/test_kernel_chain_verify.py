"""chain_verify: Triton kernel (CPU interpreter here, CUDA on a GPU) vs the PyTorch reference,
and losslessness of the sampling path (the emitted tokens follow the target exactly)."""
import pytest
import torch
from scipy import stats

from tabed_engine.kernels import _common
from tabed_engine.kernels import chain_verify as _k
from tabed_engine.ops.chain_verify import chain_verify, chain_verify_reference

# Outputs are integers: kernel and reference must agree exactly for every dtype.
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _greedy_case(B, gamma, V, dtype, device, seed=0):
    """Target logits (strided rows) and drafts whose accepted length is known per row."""
    g = torch.Generator().manual_seed(seed)
    buf = torch.randn(B, gamma + 1, V + 29, generator=g).to(dtype)
    logits = buf[..., :V]
    target = logits.argmax(dim=-1)
    want = torch.randint(0, gamma + 1, (B,), generator=g)
    want[0] = gamma                 # all accepted
    if B > 1:
        want[1] = 0                 # first token rejected
    draft = target[:, :gamma].clone()
    for b in range(B):
        if want[b] < gamma:
            draft[b, want[b]] = (draft[b, want[b]] + 1 + b) % V
    return draft.to(device), logits.to(device), want, target


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B, gamma, V", [
    (1, 1, 1000), (5, 5, 1000), (9, 6, 1000), (4, 0, 1000),
    (3, 4, 32064), (2, 6, 32064), (1, 3, 151936),
])
def test_greedy_matches_reference(B, gamma, V, dtype, kernel_device):
    draft, logits, want, target = _greedy_case(B, gamma, V, dtype, kernel_device)
    n_acc, nxt = _k.chain_verify(draft, None, logits, greedy=True)
    ref = chain_verify_reference(draft, None, logits, greedy=True)
    assert n_acc.dtype == torch.int64 and nxt.dtype == torch.int64
    assert torch.equal(n_acc.cpu(), want)
    assert torch.equal(nxt.cpu(), target.gather(1, want[:, None]).squeeze(1))
    assert torch.equal(n_acc, ref[0]) and torch.equal(nxt, ref[1])


def test_greedy_ties_pick_lowest_index(kernel_device):
    V = 20000  # ties inside one block and across blocks
    logits = torch.zeros(1, 2, V)
    logits[0, 0, [15000, 700, 9000]] = 5.0
    logits[0, 1, [19999, 12345]] = 5.0
    draft = torch.tensor([[700]])
    n_acc, nxt = _k.chain_verify(draft.to(kernel_device), None, logits.to(kernel_device), greedy=True)
    assert n_acc.item() == 1 and nxt.item() == 12345


def _sampling_case(B, gamma, V, device, seed=0, sharp=2.0):
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(B, gamma + 1, V, generator=g) * sharp, dim=-1)
    # Draft = target + perturbation, so that accepts, rejects and bonuses all occur.
    q = torch.softmax(torch.log(p[:, :gamma]) + torch.randn(B, gamma, V, generator=g) * 0.7, dim=-1)
    draft = torch.multinomial(q.reshape(-1, V), 1, generator=g).view(B, gamma)
    u = torch.rand(B, gamma + 1, generator=g)
    return draft.to(device), q.to(device), p.to(device), u.to(device)


def _agree(out, ref):
    """num_accepted must match exactly (same fp32 comparison on both sides).  next_token may
    differ only where u * total falls within rounding of a CDF boundary: the kernel sums
    blocks in tree order, torch.cumsum sequentially.  That takes u within ~1e-6 of a
    boundary, so more than 1% disagreement (or any at small V) means a bug."""
    assert torch.equal(out[0].cpu(), ref[0].cpu())
    return (out[1].cpu() != ref[1].cpu()).sum().item()


@pytest.mark.parametrize("B, gamma, V", [(9, 5, 1000), (4, 6, 32064), (2, 2, 151936), (3, 0, 1000)])
def test_sampling_matches_reference(B, gamma, V, kernel_device):
    draft, q, p, u = _sampling_case(B, gamma, V, kernel_device)
    # Strided p and q: slices of wider buffers.
    p_wide = torch.zeros(B, gamma + 1, V + 3, device=kernel_device)
    p_wide[..., :V] = p
    out = _k.chain_verify(draft, q, p_wide[..., :V], greedy=False, uniforms=u)
    ref = chain_verify_reference(draft, q, p, greedy=False, uniforms=u)
    assert _agree(out, ref) <= max(0, B // 100)
    assert (out[0] <= gamma).all()


# Small-vocabulary scenario for the exactness test: q != p, q has mass where p has none
# and p where q is small, so accepts, residual draws and bonus draws all matter.
P_ROWS = torch.tensor([
    [0.30, 0.25, 0.20, 0.15, 0.10, 0.00],
    [0.05, 0.05, 0.40, 0.10, 0.20, 0.20],
    [0.10, 0.10, 0.10, 0.30, 0.30, 0.10],
])
Q_ROWS = torch.tensor([
    [0.05, 0.40, 0.20, 0.05, 0.10, 0.20],
    [0.30, 0.10, 0.10, 0.10, 0.20, 0.20],
])


def _scenario(N, seed):
    g = torch.Generator().manual_seed(seed)
    gamma, V = Q_ROWS.shape
    p = P_ROWS.expand(N, gamma + 1, V).contiguous()
    q = Q_ROWS.expand(N, gamma, V).contiguous()
    draft = torch.multinomial(Q_ROWS, N, replacement=True, generator=g).t().contiguous()  # x_i ~ q_i
    u = torch.rand(N, gamma + 1, generator=g)
    return draft, q, p, u


def _emitted(draft, n_acc, nxt, j):
    """Token emitted at block position j, for the rows that reach position j."""
    reach = n_acc >= j
    tok = torch.where(n_acc[reach] > j, draft[reach, j] if j < draft.shape[1] else nxt[reach], nxt[reach])
    return tok


def _pvalue(tokens, probs):
    counts = torch.bincount(tokens, minlength=probs.numel()).double()
    expected = probs.double() * tokens.numel()
    if (counts[expected == 0] > 0).any():
        return 0.0  # a token the target never emits
    keep = expected > 0
    expected = expected[keep] * (counts.sum() / expected[keep].sum())  # exact totals for scipy
    return stats.chisquare(counts[keep].numpy(), expected.numpy()).pvalue


def _check_lossless(draft, n_acc, nxt):
    for j in range(draft.shape[1] + 1):
        tok = _emitted(draft, n_acc, nxt, j)
        assert tok.numel() > 1000
        p = _pvalue(tok, P_ROWS[j])
        assert p > 1e-4, f"position {j}: emitted tokens do not follow p (p-value {p:.1e})"


def test_sampling_is_lossless_reference():
    """200k blocks through the reference: each emitted position follows the target row.

    The same draws shifted by 2 points of probability (TV 0.02) must be rejected, so the
    test can see a 2% error; the kernel is tied to the reference by the exact-agreement
    test below (and by test_gpu_sampling_is_lossless on the kernel itself).
    """
    draft, q, p, u = _scenario(200_000, seed=3)
    n_acc, nxt = chain_verify_reference(draft, q, p, greedy=False, uniforms=u)
    _check_lossless(draft, n_acc, nxt)
    tok = _emitted(draft, n_acc, nxt, 0)
    moved = tok.clone()
    ones = (tok == 0).nonzero().squeeze(1)
    moved[ones[: int(0.02 * tok.numel())]] = 4  # move 2% of the mass from token 0 to token 4
    assert _pvalue(moved, P_ROWS[0]) < 1e-6
    # A classic bug, resampling from p instead of the residual, is also caught.
    bad = torch.where(n_acc == 0, torch.multinomial(P_ROWS[0], tok.numel(), replacement=True), tok)
    assert _pvalue(bad, P_ROWS[0]) < 1e-6


def test_sampling_scenario_kernel_agrees_with_reference(kernel_device):
    # 300 blocks (~6 s in the interpreter); all three branches occur many times.
    draft, q, p, u = _scenario(300, seed=4)
    out = _k.chain_verify(draft.to(kernel_device), q.to(kernel_device), p.to(kernel_device),
                          greedy=False, uniforms=u.to(kernel_device))
    ref = chain_verify_reference(draft, q, p, greedy=False, uniforms=u)
    assert _agree(out, ref) == 0
    counts = torch.bincount(ref[0], minlength=3)
    assert (counts > 30).all()  # rejections at 0, at 1 and full acceptance all exercised


def test_zero_residual_falls_back_to_p(kernel_device):
    # p_0 == q_0 and the draft token has p = q = 0: rejected, residual is 0, so the
    # token comes from p_0 by inverse CDF with u = 0.5 -> token 2 (CDF .2, .5, .8, 1).
    p = torch.tensor([[[0.2, 0.3, 0.3, 0.2, 0.0], [0.0, 0.0, 0.0, 0.0, 1.0]]])
    q = p[:, :1].clone()
    draft = torch.tensor([[4]])
    u = torch.tensor([[0.1, 0.5]])
    dev = kernel_device
    out = _k.chain_verify(draft.to(dev), q.to(dev), p.to(dev), greedy=False, uniforms=u.to(dev))
    ref = chain_verify_reference(draft, q, p, greedy=False, uniforms=u)
    assert out[0].item() == ref[0].item() == 0
    assert out[1].item() == ref[1].item() == 2


def test_dispatch_cpu_uses_reference():
    draft, q, p, u = _sampling_case(3, 4, 100, "cpu")
    for a, b in zip(chain_verify(draft, q, p, greedy=False, uniforms=u),
                    chain_verify_reference(draft, q, p, greedy=False, uniforms=u)):
        assert torch.equal(a, b)


def test_bad_inputs_raise(kernel_device):
    draft, q, p, u = _sampling_case(2, 3, 100, kernel_device)
    with pytest.raises(ValueError):
        _k.chain_verify(draft, q, p[:, :3], greedy=True)
    with pytest.raises(ValueError):
        _k.chain_verify(draft, None, p, greedy=False, uniforms=u)
    with pytest.raises(TypeError):
        _k.chain_verify(draft, q.double(), p, greedy=False, uniforms=u)
    with pytest.raises(ValueError):
        _k.chain_verify(draft.int(), q, p, greedy=True)


@pytest.mark.gpu
@pytest.mark.parametrize("B, gamma, V", [(64, 5, 32064), (16, 6, 151936), (256, 6, 32064)])
def test_gpu_full_size_bf16(B, gamma, V):
    draft, logits, want, _ = _greedy_case(B, gamma, V, torch.bfloat16, "cuda")
    out = chain_verify(draft, None, logits, greedy=True)
    assert torch.equal(out[0].cpu(), want)
    ref = chain_verify_reference(draft, None, logits, greedy=True)
    assert torch.equal(out[1], ref[1])
    draft, q, p, u = _sampling_case(B, gamma, V, "cuda")
    out = chain_verify(draft, q, p, greedy=False, uniforms=u)
    assert _agree(out, chain_verify_reference(draft, q, p, greedy=False, uniforms=u)) <= max(1, B // 100)


@pytest.mark.gpu
def test_gpu_sampling_is_lossless():
    draft, q, p, u = _scenario(200_000, seed=5)
    n_acc, nxt = chain_verify(draft.cuda(), q.cuda(), p.cuda(), greedy=False, uniforms=u.cuda())
    _check_lossless(draft, n_acc.cpu(), nxt.cpu())


# ---- V split (few requests): forced chunk counts on small and odd vocabularies.

def test_plan_from_shapes():
    plan = lambda B, **kw: _k.verify_plan(B, 5, 32064, sms=132, **kw)   # an H100 / H200
    p = plan(1, greedy=True)                 # the engine's verify: 32 chunks of ~1K, one step each
    assert (p.splits, p.chunk, p.block) == (32, 1008, 1024)
    assert plan(64, greedy=True).splits == 5             # ~2 programs per SM
    assert plan(64, greedy=True, lse=True).splits == 9   # ~4 with the normalisers
    p = plan(1, greedy=False)
    assert (p.splits, p.subblocks) == (32, 1)            # ~16 programs per SM, a chunk of one step
    p = plan(256, greedy=False)
    assert (p.splits, p.subblocks) == (9, 4)             # long chunks: one draw sub-block per warp
    assert _k.verify_plan(1, 5, 173, greedy=True, sms=132).splits == 1


def _plan_kw(draft, p, greedy, lse_out=None, **kw):
    B, gamma = draft.shape
    return dict(plan=_k.verify_plan(B, gamma, p.shape[-1], greedy=greedy, lse=lse_out is not None,
                                    sms=_common.sm_count(p.device), **kw))


@pytest.mark.parametrize("n_split", [2, 5, 24])
@pytest.mark.parametrize("B, gamma, V, dtype", [
    (1, 5, 173, torch.bfloat16), (3, 0, 173, torch.float32), (5, 6, 1000, torch.float16),
    (2, 3, 1000, torch.bfloat16),
])
def test_split_greedy_matches_reference(B, gamma, V, dtype, n_split, kernel_device):
    draft, logits, want, target = _greedy_case(B, gamma, V, dtype, kernel_device, seed=n_split)
    n_acc, nxt = _k.chain_verify(draft, None, logits, greedy=True, **_plan_kw(draft, logits, True, splits=n_split))
    assert torch.equal(n_acc.cpu(), want)
    assert torch.equal(nxt.cpu(), target.gather(1, want[:, None]).squeeze(1))


def test_split_greedy_ties_pick_lowest_index(kernel_device):
    logits = torch.zeros(1, 3, 173)
    logits[0, 0, [150, 64, 40]] = 5.0                        # across chunks -> 40
    logits[0, 1, [33, 63, 32]] = 5.0                         # one chunk -> 32
    logits[0, 2, [172, 96, 95]] = 5.0                        # a chunk boundary (95 | 96) -> 95
    draft = torch.tensor([[40, 32]])
    n_acc, nxt = _k.chain_verify(draft.to(kernel_device), None, logits.to(kernel_device), greedy=True,
                                 **_plan_kw(draft, logits, True, splits=7))   # V = 173: chunks of 32
    assert n_acc.item() == 2 and nxt.item() == 95


@pytest.mark.parametrize("n_split", [3, 24])
@pytest.mark.parametrize("B, gamma, V, sharp", [(8, 4, 173, 2.0), (6, 2, 1000, 2.0),
                                                (4, 0, 1000, 2.0), (8, 3, 173, 6.0)])
@pytest.mark.parametrize("warps, warp_blocks", [(1, True), (4, True), (4, False)])
def test_split_sampling_matches_reference(B, gamma, V, sharp, n_split, warps, warp_blocks, kernel_device):
    """Chunks of one sub-block, or of `warps` (one per warp): the draw's sub-block prefix and
    in-block scan against the reference's cumsum over the whole row."""
    draft, q, p, u = _sampling_case(B, gamma, V, kernel_device, seed=n_split, sharp=sharp)
    q_wide = torch.zeros(B, gamma, V + 5, device=kernel_device)
    q_wide[..., :V] = q
    out = _k.chain_verify(draft, q_wide[..., :V], p, greedy=False, uniforms=u,
                          **_plan_kw(draft, p, False, splits=n_split, warps=warps, warp_subblocks=warp_blocks))
    ref = chain_verify_reference(draft, q, p, greedy=False, uniforms=u)
    assert _agree(out, ref) == 0


def test_split_sampling_scenario_agrees_with_reference(kernel_device):
    """The 6-token scenario spread over V = 173 (one token per chunk of 32), extreme
    uniforms included: sub-block prefix + in-block scan must pick what the reference picks."""
    plan_kw = dict(splits=6, warps=2, warp_subblocks=True)   # chunks of 32, sub-blocks of 16
    draft, q6, p6, u = _scenario(60, seed=6)
    u[:4, -1] = torch.tensor([0.0, 1.0 - 2 ** -24, 0.5, 0.25])
    spots = torch.arange(6) * 32 + 5
    N, gamma = draft.shape
    p = torch.zeros(N, gamma + 1, 173)
    q = torch.zeros(N, gamma, 173)
    p[..., spots], q[..., spots] = p6, q6
    draft = spots[draft]
    dev = kernel_device
    out = _k.chain_verify(draft.to(dev), q.to(dev), p.to(dev), greedy=False, uniforms=u.to(dev),
                          **_plan_kw(draft, p, False, **plan_kw))
    ref = chain_verify_reference(draft, q, p, greedy=False, uniforms=u)
    assert _agree(out, ref) == 0
    assert (torch.bincount(ref[0], minlength=3) >= 3).all()  # all three branches
    # The zero-residual fallback to p, split: p_0 == q_0 -> inverse CDF of p_0.
    p1 = torch.zeros(1, 2, 173)
    p1[0, 0, spots[:4]] = torch.tensor([0.2, 0.3, 0.3, 0.2])
    p1[0, 1, 7] = 1.0
    out = _k.chain_verify(torch.tensor([[9]]).to(dev), p1[:, :1].clone().to(dev), p1.to(dev),
                          greedy=False, uniforms=torch.tensor([[0.1, 0.5]]).to(dev),
                          **_plan_kw(torch.tensor([[9]]), p1, False, **plan_kw))
    assert out[0].item() == 0 and out[1].item() == spots[2].item()


# ---- The target's log-normaliser (greedy lse_out) from the same pass.

def _lse_case(B, gamma, V, dtype, device, seed=0):
    """`_greedy_case` with masked vocabulary: row (0, 0) -inf on a random 40% of V,
    row (B-1, gamma) on its first half (whole chunks of -inf), row (1, gamma) entirely
    (logsumexp -inf) and row (0, gamma) with its max in the last column (the last chunk);
    row (B-1, 0) is shifted to about -300 (all its exp underflow against a max of 0).
    Drafts that matched the target argmax still do."""
    draft, logits, _, target = _greedy_case(B, gamma, V, dtype, "cpu", seed)
    g = torch.Generator().manual_seed(seed + 1)
    logits[-1, 0] -= 300.0
    logits[0, 0, torch.rand(V, generator=g) < 0.4] = float("-inf")
    logits[-1, -1, : V // 2] = float("-inf")
    if B > 1:
        logits[1, -1] = float("-inf")
    logits[0, -1, V - 1] = 8.0
    draft = torch.where(draft == target[:, :gamma], logits[:, :gamma].argmax(dim=-1), draft)
    return draft.to(device), logits.to(device)


def _check_lse(draft, logits, lse_out, **plan_kw):
    """(num_accepted, next_token) from the kernel with lse_out (plan overrides `plan_kw`),
    against the reference and torch.logsumexp; lse_out holds NaN before the call."""
    out = _k.chain_verify(draft, None, logits, greedy=True, lse_out=lse_out,
                          **_plan_kw(draft, logits, True, lse_out, **plan_kw))
    ref = chain_verify_reference(draft, None, logits, greedy=True)
    assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])
    torch.testing.assert_close(lse_out, torch.logsumexp(logits.float(), dim=-1), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("B, gamma, V, dtype, n_split, block", [
    (1, 1, 1000, torch.float32, 1, None), (3, 4, 1000, torch.bfloat16, 3, None),
    (7, 6, 1000, torch.float32, 24, None), (3, 6, 1000, torch.bfloat16, 3, 64),
    (7, 1, 1000, torch.float32, 24, 16), (7, 4, 32064, torch.bfloat16, 3, None),
    (1, 6, 32064, torch.float32, 24, None), (3, 1, 32064, torch.float32, 1, None),
    (1, 4, 151936, torch.bfloat16, 24, None),
])
def test_greedy_lse_matches_reference(B, gamma, V, dtype, n_split, block, kernel_device):
    """Forced chunk counts; `block` columns per step (several steps per chunk) when given."""
    draft, logits = _lse_case(B, gamma, V, dtype, kernel_device, seed=n_split)
    _check_lse(draft, logits, torch.full((B, gamma + 1), float("nan"), device=kernel_device), splits=n_split,
               block=block)


def test_greedy_lse_strided_out(kernel_device):
    """lse_out as a transposed slice of a wider NaN buffer: written there, the rest untouched."""
    B, gamma = 3, 4
    draft, logits = _lse_case(B, gamma, 1000, torch.bfloat16, kernel_device)
    buf = torch.full((gamma + 3, B + 2), float("nan"), device=kernel_device)
    lse_out = buf[1:gamma + 2, 1:B + 1].t()
    _check_lse(draft, logits, lse_out, splits=3)
    rest = torch.ones_like(buf, dtype=torch.bool)
    rest[1:gamma + 2, 1:B + 1] = False
    assert buf[rest].isnan().all()


def test_lse_out_reference_and_dispatch():
    draft, logits = _lse_case(3, 4, 100, torch.bfloat16, "cpu")
    lse_out = torch.full((3, 5), float("nan"))
    out = chain_verify(draft, None, logits, greedy=True, lse_out=lse_out)   # CPU: the reference
    ref = chain_verify_reference(draft, None, logits, greedy=True)
    assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])
    assert torch.equal(lse_out, torch.logsumexp(logits.float(), dim=-1))


def test_lse_out_bad_inputs_raise(kernel_device):
    draft, q, p, u = _sampling_case(2, 3, 100, kernel_device)
    good = torch.empty(2, 4, device=kernel_device)
    for fn in (_k.chain_verify, chain_verify_reference):
        with pytest.raises(ValueError, match="greedy only"):
            fn(draft, q, p, greedy=False, uniforms=u, lse_out=good)
        with pytest.raises(ValueError, match="lse_out must be"):
            fn(draft, None, p, greedy=True, lse_out=good[:, :3])
        with pytest.raises(ValueError, match="lse_out must be"):
            fn(draft, None, p, greedy=True, lse_out=torch.empty(2, 4, device="meta"))
        with pytest.raises(TypeError, match="float32"):
            fn(draft, None, p, greedy=True, lse_out=good.double())
    assert good.shape == (2, 4)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_greedy_lse_full_size(dtype):
    draft, logits = _lse_case(4, 5, 32064, dtype, "cuda")
    lse_out = torch.full((4, 6), float("nan"), device="cuda")
    out = chain_verify(draft, None, logits, greedy=True, lse_out=lse_out)
    ref = chain_verify_reference(draft, None, logits, greedy=True)
    assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])
    torch.testing.assert_close(lse_out, torch.logsumexp(logits.float(), dim=-1), atol=1e-5, rtol=1e-5)
