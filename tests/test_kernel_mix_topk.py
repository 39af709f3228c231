"""mix_topk: Triton kernel (CPU interpreter here, CUDA on a GPU) vs the PyTorch reference
(mix_views, log, top k)."""
import pytest
import torch

from tabed_engine.kernels import mix_topk as _k
from tabed_engine.ops.mix_topk import mix_topk, mix_topk_reference
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


@pytest.mark.parametrize("dtype, atol, rtol", DTYPES)
@pytest.mark.parametrize("B, K, T, V, k, temperature, per_node, splits", [
    (1, 1, 1, 1000, 1, 1.0, False, None), (2, 2, 3, 1001, 3, 0.7, False, None),
    (3, 4, 5, 2999, 4, 1.0, True, None), (1, 3, 2, 3001, 8, 0.7, True, 1),
    (2, 1, 4, 1777, 2, 0.7, False, 5), (3, 2, 1, 2048, 4, 1.0, True, 3),
])
def test_matches_reference(B, K, T, V, k, temperature, per_node, splits, dtype, atol, rtol, kernel_device,
                           poisoned_empty):
    logits, w = _inputs(B, K, T, V, dtype, kernel_device, per_node)
    plan = _k.topk_plan(B * T, V, sms=4, splits=splits) if splits else None
    ids, logq = _k.mix_topk(logits, w, k, temperature, plan=plan)
    ref_ids, ref_logq = mix_topk_reference(logits, w, k, temperature)
    assert ids.shape == logq.shape == (B, T, k) and ids.dtype == torch.int64 and logq.dtype == torch.float32
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(logq, ref_logq, atol=atol, rtol=rtol)


def test_any_split_gives_the_same_children(kernel_device):
    logits, w = _inputs(1, 3, 2, 2500, torch.float32, kernel_device, per_node=False, seed=4)
    outs = [_k.mix_topk(logits, w, 5, 0.8, plan=_k.topk_plan(2, 2500, sms=4, splits=s)) for s in (1, 2, 7, 24)]
    assert all(torch.equal(o[0], outs[0][0]) for o in outs)
    assert all(torch.allclose(o[1], outs[0][1], atol=1e-6, rtol=1e-6) for o in outs)


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
def test_gpu_full_size_in_a_graph(B, K, T):
    """V = 32064 bf16 in a CUDA graph (the tree draft's shape): the same children as the
    reference where the k-th and (k+1)-th mixture values are apart, log q close."""
    logits, w = _inputs(B, K, T, 32064, torch.bfloat16, "cuda", per_node=False)
    _k.mix_topk(logits, w, 4)           # compiled outside the capture
    ids, logq = replayed(lambda: _k.mix_topk(logits, w, 4))
    ref_ids, ref_logq = mix_topk_reference(logits, w, 5)
    clear = (ref_logq[..., 3] - ref_logq[..., 4]) > 1e-4
    assert torch.equal(ids[clear], ref_ids[..., :4][clear]) and clear.float().mean() > 0.9
    torch.testing.assert_close(logq, ref_logq[..., :4], atol=1e-4, rtol=1e-4)
