"""window_divergence: Triton kernel (CPU interpreter here, CUDA on a GPU) vs the PyTorch reference."""
import itertools

import pytest
import torch

from tabed_engine.kernels import _common
from tabed_engine.kernels import window_divergence as _k
from tabed_engine.ops.window_divergence import window_divergence, window_divergence_reference
from graphs import replayed

DTYPES = [  # (dtype, atol, rtol): same low-precision inputs on both sides, fp32 math
    (torch.float32, 2e-5, 1e-4),
    (torch.float16, 2e-5, 1e-4),
    (torch.bfloat16, 2e-5, 1e-4),
]


def simplex_grid(K, steps):
    """All weight vectors on the simplex with coordinates in multiples of 1/steps."""
    pts = [c for c in itertools.product(range(steps + 1), repeat=K) if sum(c) == steps]
    return torch.tensor(pts, dtype=torch.float32) / steps


def _inputs(B, K, P, V, dtype, device, noise=1.0, seed=0):
    """Permuted views of a [P, B, K+1, V] buffer, like the engine's history buffer.

    Views are the target plus noise, so mixtures' argmaxes sometimes match the target's.
    """
    g = torch.Generator().manual_seed(seed)
    target = torch.randn(P, B, 1, V, generator=g) * 2.0
    views = target + noise * torch.randn(P, B, K, V, generator=g)
    buf = torch.cat([target, views], dim=2).to(dtype).to(device)
    return buf[:, :, 0].permute(1, 0, 2), buf[:, :, 1:].permute(1, 2, 0, 3)


def _check_match(match, ref_match, p_logits, q_logits, grid, temperature):
    """Exact agreement wherever the reference decision is not a near-tie.

    Exact ties (frequent with bf16 logits) count as clear: both sides take the lowest
    index, and equal inputs give equal values on both sides.
    """
    def clear_gap(x):
        top2 = x.topk(2, dim=-1).values
        gap = top2[..., 0] - top2[..., 1]
        return (gap > 1e-6) | (gap == 0)

    q = torch.softmax(q_logits.float() / temperature, dim=-1)
    mix = torch.einsum("gk,bkpv->bgpv", grid.float(), q)
    clear = clear_gap(mix) & clear_gap(p_logits.float())[:, None]
    assert clear.float().mean() > 0.9
    assert torch.equal(match[clear], ref_match[clear])


def _plan(p_logits, q_logits, *, grid=None, tv=True, given=False, **plan_kw):
    """The launch plan `window_divergence` takes for these arguments, with `plan_kw`
    overrides (e.g. `programs`: the launch's target program count)."""
    B, K, P, V = q_logits.shape
    itemsize = max(p_logits.element_size(), q_logits.element_size())
    sms = _common.sm_count(p_logits.device)
    if grid is None and (given or not tv):
        return _k.one_pass_plan(B, K, P, V, itemsize=itemsize, sms=sms, **plan_kw)
    return _k.two_pass_plan(B, K, P, V, 0 if grid is None else grid.shape[0], itemsize=itemsize, sms=sms, **plan_kw)


def _wd(p_logits, q_logits, plan_kw=None, **kw):
    """The launcher with a plan built from `plan_kw` (None: the device's default plan)."""
    if plan_kw is not None:
        kw["plan"] = _plan(p_logits, q_logits, grid=kw.get("grid"), tv=kw.get("tv", True),
                           given=kw.get("p_lse") is not None, **plan_kw)
    return _k.window_divergence(p_logits, q_logits, **kw)


@pytest.mark.parametrize("dtype, atol, rtol", DTYPES)
@pytest.mark.parametrize("B, K, P, V, temperature", [
    (1, 1, 1, 1000, 1.0), (2, 3, 5, 1000, 0.7), (3, 4, 2, 1000, 1.0),
    # V = 12011: the launches of V = 32064 at K = 4 (3 one-pass splits of 4 blocks, two-pass chunks
    # of 2 blocks) at a third of the interpreter's time; the engine's vocabularies at K = 2 and 1
    (1, 4, 3, 12011, 1.0), (2, 2, 2, 32064, 0.8), (1, 2, 1, 151936, 1.0),
])
def test_divergences_match_reference(B, K, P, V, temperature, dtype, atol, rtol, kernel_device):
    p_logits, q_logits = _inputs(B, K, P, V, dtype, kernel_device)
    kl, tv, match, gkl = _k.window_divergence(p_logits, q_logits, temperature=temperature)
    ref = window_divergence_reference(p_logits, q_logits, temperature=temperature)
    assert match is None and gkl is None
    assert kl.shape == (B, K, P) and tv.shape == (B, K, P)
    torch.testing.assert_close(kl, ref[0], atol=atol, rtol=rtol)
    torch.testing.assert_close(tv, ref[1], atol=atol, rtol=rtol)
    assert (kl > 0).all() and (tv > 0).all() and (tv < 1).all()
    # KL alone: the one-pass kernel
    kl1, tv1, match1, gkl1 = _k.window_divergence(p_logits, q_logits, temperature=temperature, tv=False)
    assert tv1 is None and match1 is None and gkl1 is None
    torch.testing.assert_close(kl1, ref[0], atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype, atol, rtol", DTYPES)
@pytest.mark.parametrize("B, K, P, V, steps, temperature", [
    (2, 2, 3, 1000, 10, 1.0),   # G = 11            (B*P*G = 66: 4-vector tiles)
    (1, 3, 2, 1000, 5, 0.8),    # G = 21            (42)
    (1, 4, 1, 1000, 10, 1.0),   # G = 286, the engine's K=4 grid (286: 8-vector tiles)
    (1, 4, 2, 1000, 10, 1.0),   # G = 286           (572: 16-vector tiles)
    (1, 4, 2, 5003, 2, 1.0),    # G = 10
])
def test_grid_matches_reference(B, K, P, V, steps, temperature, dtype, atol, rtol, kernel_device):
    p_logits, q_logits = _inputs(B, K, P, V, dtype, kernel_device, noise=0.6, seed=1)
    grid = simplex_grid(K, steps).to(kernel_device)
    kl, tv, match, gkl = _k.window_divergence(p_logits, q_logits, temperature=temperature, grid=grid)
    ref = window_divergence_reference(p_logits, q_logits, temperature=temperature, grid=grid)
    G = grid.shape[0]
    assert match.dtype == torch.bool and match.shape == (B, G, P) and gkl.shape == (B, G, P)
    torch.testing.assert_close(kl, ref[0], atol=atol, rtol=rtol)
    torch.testing.assert_close(tv, ref[1], atol=atol, rtol=rtol)
    torch.testing.assert_close(gkl, ref[3], atol=atol, rtol=rtol)
    _check_match(match, ref[2], p_logits, q_logits, grid, temperature)
    assert ref[2].any() and not ref[2].all()  # the case discriminates


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mixture_without_mass_where_p_has_some(dtype, kernel_device):
    """A draft fitted to a larger padded vocabulary (models/vocab.py): its views give the last
    columns MISSING_LOGIT (probability exactly 0) where the target has mass. Every mixture's KL
    is finite (its probability floored at float32's least positive value, as the reference's),
    not inf for every weight vector."""
    from tabed_engine.models.vocab import MISSING_LOGIT

    B, K, P, V = 2, 3, 3, 300
    p_logits, q_logits = _inputs(B, K, P, V, torch.float32, "cpu", noise=0.6, seed=4)
    q_logits = q_logits.clone()
    q_logits[..., V - 20:] = MISSING_LOGIT
    p_logits, q_logits = p_logits.to(dtype).to(kernel_device), q_logits.to(dtype).to(kernel_device)
    grid = simplex_grid(K, 2).to(kernel_device)
    kl, tv, match, gkl = _k.window_divergence(p_logits, q_logits, grid=grid)
    ref = window_divergence_reference(p_logits, q_logits, grid=grid)
    assert torch.isfinite(gkl).all() and torch.isfinite(kl).all()
    torch.testing.assert_close(gkl, ref[3], atol=1e-3, rtol=1e-4)
    torch.testing.assert_close(kl, ref[0], atol=1e-3, rtol=1e-4)


def _engine_inputs(B, K, P, V, dtype, device, noise=0.6, seed=2):
    """The engine's layout: views in a [P, B*K, V] buffer seen as [B, K, P, V], the
    target a [P, B, V] buffer seen as [B, P, V]."""
    g = torch.Generator().manual_seed(seed)
    target = torch.randn(P, B, V, generator=g) * 2.0
    views = target[:, :, None] + noise * torch.randn(P, B, K, V, generator=g)
    q_buf = views.reshape(P, B * K, V).to(dtype).to(device)
    p_buf = target.to(dtype).to(device)
    return p_buf.permute(1, 0, 2), q_buf.view(P, B, K, V).permute(1, 2, 0, 3)


@pytest.mark.parametrize("many_splits", [False, True])
@pytest.mark.parametrize("B, K, P, V, steps, dtype", [
    (1, 2, 5, 173, 10, torch.float32),    # V below one block: a single, partial split
    (2, 4, 3, 173, 2, torch.bfloat16),
    (1, 2, 5, 1000, 10, torch.bfloat16),  # the engine's K=2 grid, G = 11
    (1, 4, 2, 1000, 3, torch.float16),    # G = 20: two grid chunks, the second partial
])
def test_small_vocab_engine_layout(B, K, P, V, steps, dtype, many_splits, kernel_device):
    plan_kw = dict(programs=1 << 20) if many_splits else None   # one block per split
    p_logits, q_logits = _engine_inputs(B, K, P, V, dtype, kernel_device)
    assert not q_logits.is_contiguous() and q_logits.stride(2) == B * K * V
    grid = simplex_grid(K, steps).to(kernel_device)
    for gr in (None, grid):
        kl, tv, match, gkl = _wd(p_logits, q_logits, plan_kw, temperature=0.9, grid=gr)
        ref = window_divergence_reference(p_logits, q_logits, temperature=0.9, grid=gr)
        torch.testing.assert_close(kl, ref[0], atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(tv, ref[1], atol=2e-5, rtol=1e-4)
        if gr is None:
            assert match is None and gkl is None
            kl1, tv1, _, _ = _wd(p_logits, q_logits, plan_kw, temperature=0.9, tv=False)
            assert tv1 is None
            torch.testing.assert_close(kl1, ref[0], atol=2e-5, rtol=1e-4)
        else:
            torch.testing.assert_close(gkl, ref[3], atol=2e-5, rtol=1e-4)
            _check_match(match, ref[2], p_logits, q_logits, grid, 0.9)


def test_split_cap_and_repeat_calls(kernel_device):
    # At most max_splits splits, so each split runs several blocks.  A second call (as a
    # graph replay, counters re-zeroed by the first launch) agrees bitwise.
    p_logits, q_logits = _engine_inputs(1, 2, 2, 5000, torch.bfloat16, kernel_device)
    grid = simplex_grid(2, 2).to(kernel_device)
    plan_kw = dict(programs=1 << 20, max_splits=3)
    plan = _plan(p_logits, q_logits, grid=grid, **plan_kw)
    assert plan.splits1 == 3 and plan.splits2 == 3 and plan.chunk2 > plan.block_g
    out1 = _wd(p_logits, q_logits, plan_kw, grid=grid)
    out2 = _wd(p_logits, q_logits, plan_kw, grid=grid)
    ref = window_divergence_reference(p_logits, q_logits, grid=grid)
    for a, b in zip(out1, out2):
        assert torch.equal(a, b)
    torch.testing.assert_close(out1[0], ref[0], atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(out1[1], ref[1], atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(out1[3], ref[3], atol=2e-5, rtol=1e-4)
    _check_match(out1[2], ref[2], p_logits, q_logits, grid, 1.0)


@pytest.mark.parametrize("many_splits", [False, True])
def test_exact_ties_take_the_lowest_index(kernel_device, many_splits):
    # Equal maxima far apart (in different splits when split): both argmaxes are the first.
    V = 3000
    p_logits = torch.zeros(1, 2, V)
    q_logits = torch.zeros(1, 2, 2, V)
    p_logits[0, 0, [700, 2900]] = 5.0     # target ties: argmax 700
    p_logits[0, 1, [100, 2800]] = 5.0     # target ties: argmax 100
    q_logits[0, :, 0, [700, 2900]] = 4.0  # mixture ties at 700 / 2900: 700, a match
    q_logits[0, :, 1, [300, 2800]] = 4.0  # mixture ties at 300 / 2800: 300, no match
    p_logits, q_logits = p_logits.to(kernel_device), q_logits.to(kernel_device)
    grid = simplex_grid(2, 4).to(kernel_device)
    _, _, match, _ = _wd(p_logits, q_logits, dict(programs=1 << 20) if many_splits else None, grid=grid)
    ref = window_divergence_reference(p_logits, q_logits, grid=grid)
    assert torch.equal(match, ref[2])
    assert match[0, :, 0].all() and not match[0, :, 1].any()


# Target ties against the argmax at column 5004, read in one split of 2048-column steps: in
# its 16-byte group, its thread's other group of the step (fp32), another step, another thread.
_TIE_CASES = {"same group, lower": 5001, "same group, higher": 5006, "same slot, next group": 5004 + 1024,
              "earlier step": 5004 - 2048, "later step": 5004 + 3 * 2048, "other slot": 5100}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("where", list(_TIE_CASES))
def test_target_argmax_ties_across_groups_slots_and_steps(where, dtype, kernel_device):
    other = _TIE_CASES[where]
    first, last = min(5004, other), max(5004, other)
    p_logits = torch.full((1, 2, 20000), -5.0)
    p_logits[0, :, [5004, other]] = 3.0
    q_logits = torch.full((1, 1, 2, 20000), -5.0)
    q_logits[0, 0, 0, first] = 3.0        # the view's argmax is the target's first tie: a match
    q_logits[0, 0, 1, last] = 3.0         # the later tie: no match
    grid = torch.ones(1, 1, device=kernel_device)
    _, _, match, _ = _wd(p_logits.to(dtype).to(kernel_device), q_logits.to(dtype).to(kernel_device),
                         dict(programs=1), grid=grid)   # one split per row
    assert match[0, 0].tolist() == [True, False]


def test_unit_grid_vectors_reproduce_per_view_kl(kernel_device):
    # g = e_k makes the mixture q_k: grid_kl must equal kl[:, k], an internal cross-check.
    B, K, P, V = 2, 3, 2, 1000
    p_logits, q_logits = _inputs(B, K, P, V, torch.float32, kernel_device, noise=0.5)
    grid = torch.eye(K, device=kernel_device)
    kl, _, match, gkl = _k.window_divergence(p_logits, q_logits, grid=grid)
    torch.testing.assert_close(gkl, kl, atol=1e-5, rtol=1e-4)
    want = q_logits.argmax(-1) == p_logits.argmax(-1)[:, None]
    assert torch.equal(match, want)


def test_identical_distributions_give_zero(kernel_device):
    p_logits, _ = _inputs(1, 1, 3, 1000, torch.float32, kernel_device)
    q_logits = p_logits[:, None].expand(1, 2, 3, 1000)  # stride 0 over views
    kl, tv, match, gkl = _k.window_divergence(p_logits, q_logits, grid=simplex_grid(2, 4).to(kernel_device))
    assert kl.abs().max() < 1e-5 and tv.max() < 1e-5 and gkl.abs().max() < 1e-5
    assert match.all()


def test_neg_inf_logits_are_masked_vocabulary(kernel_device):
    p_logits, q_logits = _inputs(1, 2, 2, 5000, torch.float32, kernel_device)
    p_logits, q_logits = p_logits.clone(), q_logits.clone()
    p_logits[..., :2100] = float("-inf")  # the whole first pass-1 block (2048) is masked
    kl, tv, _, gkl = _k.window_divergence(p_logits, q_logits, grid=simplex_grid(2, 2).to(kernel_device))
    ref = window_divergence_reference(p_logits, q_logits, grid=simplex_grid(2, 2).to(kernel_device))
    torch.testing.assert_close(kl, ref[0], atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(tv, ref[1], atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(gkl, ref[3], atol=2e-5, rtol=1e-4)
    kl1, _, _, _ = _k.window_divergence(p_logits, q_logits, tv=False)
    torch.testing.assert_close(kl1, ref[0], atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("dtype, block", [(torch.float32, 1024), (torch.bfloat16, 1024), (torch.bfloat16, 2048)])
@pytest.mark.parametrize("splits", ["one", "default", "many"])
@pytest.mark.parametrize("split_views", [False, True])
def test_kl_only_one_pass(kernel_device, splits, dtype, block, split_views):
    # The one-pass KL: outputs NaN-poisoned, large logit ranges (the running sums are
    # rescaled many times), a masked column range, identical rows giving 0, repeat calls
    # bitwise equal, and the arrival counters left at zero for the next launch. Steps of
    # 1024 / 2048 columns: 1, 2 or 4 groups (of 4 fp32 / 8 bf16 columns) per thread and step;
    # one split per row: 3-5 steps per program (the running sums rescaled between steps).
    # Views all in one program or one per program (the target re-read for each).
    plan_kw = dict(block=block, split_views=split_views)   # one view per program or all
    if splits != "default":
        plan_kw["programs"] = 1 << 20 if splits == "many" else 1
    B, K, P, V = 2, 3, 3, 4099
    p_logits, q_logits = _inputs(B, K, P, V, torch.float32, kernel_device, noise=0.8, seed=5)
    p_logits = (p_logits * 6.0).to(dtype).contiguous()  # logits over a ~100-nat range
    q_logits = q_logits.to(dtype)
    p_logits[0, 1, 1000:3000] = float("-inf")          # p_v = 0 there: no KL term
    q_logits[1, 2] = p_logits[1]                       # an identical view: KL 0
    plan = _plan(p_logits, q_logits, tv=False, **plan_kw)
    assert (plan.kb, plan.groups) == ((1, K) if split_views else (K, 1))
    assert plan.splits == (1 if splits == "one" else plan.splits) and plan.block == block
    outs = []
    for _ in range(2):
        kl = torch.full((B, K, P), float("nan"), device=kernel_device)
        _k._kl_only(p_logits, q_logits, kl, 1.3, plan)
        outs.append(kl)
    ref = window_divergence_reference(p_logits, q_logits, temperature=1.3, tv=False)[0]
    assert torch.equal(outs[0], outs[1])
    torch.testing.assert_close(outs[0], ref, atol=2e-5, rtol=1e-4)
    assert outs[0][1, 2].abs().max() < 1e-5 and (outs[0][0] > 1e-3).all()
    assert int(_common.counters(p_logits.device, 1).abs().sum()) == 0


def _normalisers(p_logits, q_logits, temperature):
    """The rows' logsumexp(logits / T), q's laid out as the engine keeps them: a permuted
    view of [P, B, K] (one row of normalisers per draft step)."""
    p_lse = torch.logsumexp(p_logits.float() / temperature, dim=-1)
    q_lse = torch.logsumexp(q_logits.float() / temperature, dim=-1).permute(2, 0, 1).contiguous().permute(1, 2, 0)
    return p_lse, q_lse


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("splits", ["one", "default", "many"])
@pytest.mark.parametrize("split_views", [False, True])
def test_given_normalisers_one_pass(kernel_device, splits, dtype, split_views):
    # TV and KL from given normalisers (one launch): against the reference computing its own
    # normalisers and the reference using the given ones; outputs NaN-poisoned (the launcher
    # writes through its own buffers: the kernel entry is called on poisoned tensors), a
    # masked column range, an identical view giving 0, multi-step chunks, repeat calls
    # bitwise equal, counters left at zero.
    plan_kw = dict(block=1024, split_views=split_views)
    if splits != "default":
        plan_kw["programs"] = 1 << 20 if splits == "many" else 1
    B, K, P, V, T = 2, 3, 3, 4099, 0.7
    p_logits, q_logits = _inputs(B, K, P, V, torch.float32, kernel_device, noise=0.8, seed=9)
    p_logits = (p_logits * 5.0).to(dtype).contiguous()
    q_logits = q_logits.to(dtype)
    p_logits[0, 1, 1000:3000] = float("-inf")
    q_logits[1, 2] = p_logits[1]
    p_lse, q_lse = _normalisers(p_logits, q_logits, T)
    ref = window_divergence_reference(p_logits, q_logits, temperature=T)
    ref_given = window_divergence_reference(p_logits, q_logits, temperature=T, p_lse=p_lse, q_lse=q_lse)
    outs = []
    for _ in range(2):
        kl = torch.full((B, K, P), float("nan"), device=kernel_device)
        tv = torch.full((B, K, P), float("nan"), device=kernel_device)
        _k._given_norms(p_logits, q_logits, p_lse, q_lse, kl, tv, T, _plan(p_logits, q_logits, given=True, **plan_kw))
        outs.append((kl, tv))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    kl, tv = outs[0]
    for got, want in ((kl, ref[0]), (tv, ref[1]), (kl, ref_given[0]), (tv, ref_given[1])):
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    assert kl[1, 2].abs().max() < 1e-5 and tv[1, 2].abs().max() < 1e-5 and (tv[0] > 1e-3).all()
    assert int(_common.counters(p_logits.device, 1).abs().sum()) == 0
    # through the public entry, and the given normalisers are what it uses: shifted ones
    # change the result as the reference says
    got = _k.window_divergence(p_logits, q_logits, temperature=T, p_lse=p_lse, q_lse=q_lse)
    torch.testing.assert_close(got[1], ref[1], atol=2e-5, rtol=1e-4)
    assert got[2] is None and got[3] is None
    shifted = window_divergence_reference(p_logits, q_logits, temperature=T, p_lse=p_lse + 0.05, q_lse=q_lse)
    got = _k.window_divergence(p_logits, q_logits, temperature=T, p_lse=p_lse + 0.05, q_lse=q_lse)
    torch.testing.assert_close(got[1], shifted[1], atol=2e-5, rtol=1e-4)
    assert (got[1] - ref[1]).abs().max() > 1e-3


# the engine's block at K = 4 (P = 6) with V = 8111: the plans of V = 32064 (2 one-pass splits,
# 3 grid-pass splits of 6 blocks, 3 grid chunks) at a quarter of the interpreter's time (was 20 s
# of CPU); the large vocabulary at K = 1
@pytest.mark.parametrize("B, K, P, V", [(1, 4, 6, 8111), (3, 2, 5, 1000), (2, 1, 2, 151936)])
def test_given_normalisers_engine_shapes(B, K, P, V, kernel_device):
    p_logits, q_logits = _inputs(B, K, P, V, torch.bfloat16, kernel_device, noise=0.6, seed=B + V)
    p_lse, q_lse = _normalisers(p_logits, q_logits, 1.0)
    ref = window_divergence_reference(p_logits, q_logits)
    for tv in (True, False):
        kl, tv_out, _, _ = _k.window_divergence(p_logits, q_logits, tv=tv, p_lse=p_lse, q_lse=q_lse)
        torch.testing.assert_close(kl, ref[0], atol=2e-5, rtol=1e-4)
        if tv:
            torch.testing.assert_close(tv_out, ref[1], atol=2e-5, rtol=1e-4)
        else:
            assert tv_out is None
    # with a grid the kernels compute their own normalisers: same results
    grid = simplex_grid(K, 2).to(kernel_device)
    got = _k.window_divergence(p_logits, q_logits, grid=grid, p_lse=p_lse, q_lse=q_lse)
    want = window_divergence_reference(p_logits, q_logits, grid=grid)
    torch.testing.assert_close(got[3], want[3], atol=2e-5, rtol=1e-4)


def test_plans_from_shapes():
    # the engine's block at one request (P = 6, V = 32064, bf16, an H100 / H200): KL and TV
    # from normalisers one view per program; at 64 requests all views in one program
    p = _k.one_pass_plan(1, 4, 6, 32064, itemsize=2, sms=132)
    assert (p.kb, p.groups, p.block, p.splits) == (1, 4, 1024, 32)
    p = _k.one_pass_plan(64, 4, 6, 32064, itemsize=2, sms=132)
    assert (p.kb, p.groups, p.block, p.splits) == (4, 1, 512, 3)
    p = _k.two_pass_plan(1, 4, 6, 32064, 286, itemsize=2, sms=132)   # the K = 4 w-grid: 16-vector tiles
    assert (p.g_block, p.g_chunks, p.block_g) == (16, 18, 128)
    p = _k.two_pass_plan(1, 2, 6, 32064, 11, itemsize=2, sms=132)    # K = 2: 4-vector tiles
    assert (p.g_block, p.g_chunks, p.block_g) == (4, 3, 256)
    assert _k.two_pass_plan(1, 2, 6, 32064, 0, itemsize=2, sms=132).g_chunks == 1


def test_plan_must_match_the_call(kernel_device):
    p_logits, q_logits = _inputs(1, 2, 2, 100, torch.float32, kernel_device)
    one = _plan(p_logits, q_logits, tv=False)
    with pytest.raises(ValueError):   # TV without normalisers takes two passes
        _k.window_divergence(p_logits, q_logits, plan=one)
    with pytest.raises(ValueError):   # another vocabulary
        _k.window_divergence(p_logits, q_logits, tv=False,
                             plan=_k.one_pass_plan(1, 2, 2, 101, itemsize=4, sms=4))
    assert _k.window_divergence(p_logits, q_logits, tv=False, plan=one)[1] is None


def test_given_normalisers_bad_inputs_raise(kernel_device):
    p_logits, q_logits = _inputs(2, 2, 3, 100, torch.float32, kernel_device)
    p_lse, q_lse = _normalisers(p_logits, q_logits, 1.0)
    for bad in (dict(p_lse=p_lse), dict(q_lse=q_lse), dict(p_lse=p_lse[:, :2], q_lse=q_lse),
                dict(p_lse=p_lse, q_lse=q_lse.double()), dict(p_lse=p_lse, q_lse=q_lse[:, :1])):
        with pytest.raises(ValueError):
            _k.window_divergence(p_logits, q_logits, **bad)
    with pytest.raises(ValueError):
        window_divergence_reference(p_logits, q_logits, p_lse=p_lse)
    assert window_divergence(p_logits, q_logits, p_lse=p_lse, q_lse=q_lse)[0].shape == (2, 2, 3)


@pytest.mark.parametrize("p_dtype, q_dtype", [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32),
                                              (torch.float16, torch.bfloat16)])
def test_mixed_dtypes(p_dtype, q_dtype, kernel_device):
    p_logits, q_logits = _inputs(2, 2, 3, 3001, torch.float32, kernel_device)
    p_logits, q_logits = p_logits.to(p_dtype), q_logits.to(q_dtype)
    ref = window_divergence_reference(p_logits, q_logits, temperature=0.9)
    kl, tv, _, _ = _k.window_divergence(p_logits, q_logits, temperature=0.9)
    kl1, _, _, _ = _k.window_divergence(p_logits, q_logits, temperature=0.9, tv=False)
    for got, want in ((kl, ref[0]), (tv, ref[1]), (kl1, ref[0])):
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


def test_dispatch_cpu_uses_reference():
    p_logits, q_logits = _inputs(1, 2, 2, 100, torch.float32, "cpu")
    grid = simplex_grid(2, 2)
    out = window_divergence(p_logits, q_logits, grid=grid)
    ref = window_divergence_reference(p_logits, q_logits, grid=grid)
    for a, b in zip(out, ref):
        assert torch.equal(a, b)


def test_bad_inputs_raise(kernel_device):
    p_logits, q_logits = _inputs(1, 2, 2, 100, torch.float32, kernel_device)
    with pytest.raises(ValueError):
        _k.window_divergence(p_logits, q_logits[:, :, :1])
    with pytest.raises(ValueError):
        _k.window_divergence(p_logits, q_logits, grid=torch.ones(3, 3, device=kernel_device))
    with pytest.raises(ValueError):
        _k.window_divergence(torch.randn(1, 100, 2, device=kernel_device).transpose(1, 2), q_logits)


@pytest.mark.gpu
@pytest.mark.parametrize("B, K, P, V", [(1, 4, 6, 32064), (4, 2, 5, 151936), (16, 4, 6, 32064), (64, 1, 6, 32064)])
def test_gpu_full_size_bf16(B, K, P, V):
    p_logits, q_logits = _inputs(B, K, P, V, torch.bfloat16, "cuda", noise=0.6)
    grid = simplex_grid(K, 10).cuda()
    out = window_divergence(p_logits, q_logits, grid=grid)
    ref = window_divergence_reference(p_logits, q_logits, grid=grid)
    torch.testing.assert_close(out[0], ref[0], atol=5e-5, rtol=1e-4)
    torch.testing.assert_close(out[1], ref[1], atol=5e-5, rtol=1e-4)
    torch.testing.assert_close(out[3], ref[3], atol=5e-5, rtol=1e-4)
    p_lse, q_lse = _normalisers(p_logits, q_logits, 1.0)
    kl, tv, _, _ = window_divergence(p_logits, q_logits, p_lse=p_lse, q_lse=q_lse)
    torch.testing.assert_close(kl, ref[0], atol=5e-5, rtol=1e-4)
    torch.testing.assert_close(tv, ref[1], atol=5e-5, rtol=1e-4)
    _check_match(out[2], ref[2], p_logits, q_logits, grid, 1.0)
    for kw in (dict(grid=grid), dict(p_lse=p_lse, q_lse=q_lse), dict(tv=False)):   # CUDA-graph replays agree
        run = lambda: window_divergence(p_logits, q_logits, **kw)
        eager, captured = run(), replayed(run)
        for a, b in zip(eager, captured):
            assert (a is None and b is None) or torch.equal(a, b)
