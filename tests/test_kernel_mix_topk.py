"""mix_topk: Triton kernel (CPU interpreter here, CUDA on a GPU) vs the PyTorch reference
(mix_views, log, then the top k or Gumbel-top-k with `hash_uniform` noise)."""
import pytest
import torch

import triton
import triton.language as tl
from tabed_engine.kernels import mix_topk as _k
from tabed_engine.ops.mix_topk import hash_uniform, mix_topk, mix_topk_reference
from graphs import replayed

DTYPES = [  # (dtype, atol, rtol) of log q: both sides upcast the same logits, only fp32 rounding differs
    (torch.float32, 1e-5, 1e-5),
    (torch.bfloat16, 1e-5, 1e-5),
]


@pytest.fixture
def poisoned_empty(monkeypatch):
    """torch.empty filled with NaN (floats) or -1 (integers) while a test runs: outputs and
    partials a kernel leaves unwritten show up."""
    empty = torch.empty

    def poisoned(*args, **kwargs):
        t = empty(*args, **kwargs)
        return t.fill_(float("nan") if t.is_floating_point() else -1)

    monkeypatch.setattr(torch, "empty", poisoned)


def _inputs(B, K, T, V, dtype, device, per_node, seed=0):
    """Logits [B*K, T, V]: nodes 1 .. T of a [B*K, T + 2, V] buffer (strides of a forward's
    slice), 3x spread; weights [B, K] or per node [B, T, K], rows summing to 1."""
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(B * K, T + 2, V, generator=g) * 3).to(dtype)[:, 1:T + 1]
    w = torch.rand(B, T, K, generator=g) if per_node else torch.rand(B, K, generator=g)
    w = (w + 0.05) / (w + 0.05).sum(-1, keepdim=True)
    return logits.to(device), w.to(device)


def _draw(device, seed=123456789, offset=-5):
    """Sampling arguments: the seed and counter offset tensors."""
    return dict(seed=torch.tensor([seed], device=device), offset=torch.tensor([offset], device=device))


@pytest.mark.parametrize("dtype, atol, rtol", DTYPES)
@pytest.mark.parametrize("B, K, T, V, k, temperature, per_node, splits", [
    (1, 1, 1, 1000, 1, 1.0, False, None), (2, 2, 3, 1001, 3, 0.7, False, None),
    (3, 4, 5, 2999, 4, 1.0, True, None), (1, 3, 2, 3001, 8, 0.7, True, 1),
    (2, 1, 4, 1777, 2, 0.7, False, 5), (3, 2, 1, 2048, 4, 1.0, True, 3),
])
@pytest.mark.parametrize("sample", [False, True])
def test_matches_reference(B, K, T, V, k, temperature, per_node, splits, sample, dtype, atol, rtol, kernel_device,
                           poisoned_empty):
    """The same children (sampling: the same draws, the noise being the reference's bit for bit)
    and log q; sampling also stores each node's mixture row into the rows asked for, and
    nothing else."""
    logits, w = _inputs(B, K, T, V, dtype, kernel_device, per_node)
    plan = _k.topk_plan(B * T, V, sms=4, splits=splits) if splits else None
    kw = {}
    if sample:
        rows = torch.stack([torch.randperm(T + 2, generator=torch.Generator().manual_seed(b))[:T] for b in range(B)])
        kw = dict(_draw(kernel_device), out_rows=rows.to(kernel_device))
    mix = torch.full((B, T + 2, V), float("nan"), device=kernel_device)
    ref_mix = torch.full_like(mix, float("nan"))
    ids, logq = _k.mix_topk(logits, w, k, temperature, plan=plan, **(dict(kw, mixture_out=mix) if sample else {}))
    ref_ids, ref_logq = mix_topk_reference(logits, w, k, temperature,
                                           **(dict(kw, mixture_out=ref_mix) if sample else {}))
    assert ids.shape == logq.shape == (B, T, k) and ids.dtype == torch.int64 and logq.dtype == torch.float32
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(logq, ref_logq, atol=atol, rtol=rtol)
    torch.testing.assert_close(mix, ref_mix, atol=1e-7, rtol=1e-5, equal_nan=True)   # NaN: rows left alone


@pytest.mark.parametrize("sample", [False, True])
def test_any_split_gives_the_same_children(sample, kernel_device):
    logits, w = _inputs(1, 3, 2, 2500, torch.float32, kernel_device, per_node=False, seed=4)
    kw = _draw(kernel_device) if sample else {}
    outs = [_k.mix_topk(logits, w, 5, 0.8, plan=_k.topk_plan(2, 2500, sms=4, splits=s), **kw) for s in (1, 3, 11)]
    assert all(torch.equal(o[0], outs[0][0]) for o in outs)
    assert all(torch.allclose(o[1], outs[0][1], atol=1e-6, rtol=1e-6) for o in outs)


@triton.jit
def _hash_kernel(seed_ptr, offset_ptr, out_ptr, N, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + i, _k.hash_uniform(tl.load(seed_ptr), tl.load(offset_ptr) + i), mask=i < N)


@pytest.mark.parametrize("seed, offset", [(12345, 7), (-3, 2 ** 40), (2 ** 62 + 11, -(2 ** 35))])
def test_hash_uniform_is_the_reference_bit_for_bit(seed, offset, kernel_device):
    s, o = torch.tensor([seed], device=kernel_device), torch.tensor([offset], device=kernel_device)
    out = torch.full((5000,), float("nan"), dtype=torch.float64, device=kernel_device)
    _hash_kernel[(5,)](s, o, out, 5000, BLOCK=1024)
    assert torch.equal(out, hash_uniform(s, o, 5000))


@pytest.mark.parametrize("K", [1, 2])
def test_ties_pick_lowest_index_first(K, kernel_device):
    """Equal q at columns in different chunks: the lowest ids first, in id order."""
    V = 3000
    logits = torch.full((K, 1, V), -4.0)
    for v in (2900, 1700, 40, 1100):
        logits[:, 0, v] = 2.0
    w = torch.full((1, K), 1.0 / K)
    ids, logq = _k.mix_topk(logits.to(kernel_device), w.to(kernel_device), 3,
                            plan=_k.topk_plan(1, V, sms=4, splits=3))
    assert ids.tolist() == [[[40, 1100, 1700]]]
    assert torch.allclose(logq, logq[..., :1])


def test_weights_decide_the_children(kernel_device):
    # view 0 favours tokens 5 > 6, view 1 token 9: the weights order the mixture's top 3
    # (q = 0.099, 0.040, 0.037 for 5, 9, 6 at w = (0.8, 0.2); 0.157, 0.025, 0.010 for 9, 5, 6)
    logits = torch.zeros(4, 1, 1000)
    logits[0::2, 0, 5], logits[0::2, 0, 6] = 5.0, 4.0
    logits[1::2, 0, 9] = 5.5
    w = torch.tensor([[0.8, 0.2], [0.2, 0.8]])
    ids, _ = _k.mix_topk(logits.to(kernel_device), w.to(kernel_device), 3)
    assert ids[:, 0].tolist() == [[5, 9, 6], [9, 5, 6]]


def test_plan_covers_the_vocabulary():
    for rows, V, sms in ((3, 32064, 132), (1, 32064, 132), (8, 152064, 132), (2, 1000, 4)):
        plan = _k.topk_plan(rows, V, sms=sms)
        assert plan.chunk <= 2048 and plan.block >= plan.chunk and plan.block & (plan.block - 1) == 0
        assert (plan.splits - 1) * plan.chunk < V <= plan.splits * plan.chunk
    assert _k.topk_plan(3, 32064, sms=132).splits >= 16       # a long vocabulary is spread over the device


def test_checks_arguments(kernel_device):
    logits, w = _inputs(1, 2, 2, 500, torch.float32, kernel_device, per_node=False)
    with pytest.raises(ValueError, match="k must be"):
        _k.mix_topk(logits, w, 9)
    with pytest.raises(ValueError, match="do not match"):
        _k.mix_topk(logits, w[:, :1], 2)
    with pytest.raises(TypeError, match="float32"):
        _k.mix_topk(logits, w.double(), 2)


def test_dispatch_by_device():
    logits, w = _inputs(1, 2, 2, 300, torch.float32, "cpu", per_node=False)
    ref = mix_topk_reference(logits, w, 3, 1.0)
    out = mix_topk(logits, w, 3)        # CPU tensors: the reference
    assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])


@pytest.mark.gpu
@pytest.mark.parametrize("B, K, T", [(1, 2, 3), (2, 4, 4), (4, 1, 2)])
@pytest.mark.parametrize("sample", [False, True])
def test_gpu_full_size_in_a_graph(B, K, T, sample):
    """V = 32064 bf16 in a CUDA graph (the tree draft's shape). Greedy: the reference's children
    where the 4th and 5th mixture values are apart (bf16 logits tie often; so may values inside
    the four, whose order then differs), log q close.
    Sampling: the reference's draws, and its mixture rows."""
    logits, w = _inputs(B, K, T, 32064, torch.bfloat16, "cuda", per_node=False)
    mix, ref_mix = torch.zeros(2, B, T, 32064, device="cuda")
    kw, ref_kw = {}, {}
    if sample:
        rows = torch.arange(T, device="cuda").expand(B, T).contiguous()
        kw = dict(_draw("cuda"), mixture_out=mix, out_rows=rows)
        ref_kw = dict(kw, mixture_out=ref_mix)
    _k.mix_topk(logits, w, 4, **kw)           # compiled outside the capture
    ids, logq = replayed(lambda: _k.mix_topk(logits, w, 4, **kw))
    ref_ids, ref_logq = mix_topk_reference(logits, w, 5, **ref_kw)
    if sample:
        assert torch.equal(ids, ref_ids[..., :4])
        torch.testing.assert_close(mix, ref_mix, atol=1e-7, rtol=1e-4)
    else:   # the same four children (their order may differ where bf16 q values tie)
        clear = (ref_logq[..., 3] - ref_logq[..., 4]) > 1e-4
        assert clear.float().mean() >= 0.5
        assert torch.equal(ids[clear].sort(-1).values, ref_ids[..., :4][clear].sort(-1).values)
    torch.testing.assert_close(logq, ref_logq[..., :4], atol=1e-4, rtol=1e-4)
