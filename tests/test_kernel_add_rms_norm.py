"""add_rms_norm: Triton kernel (interpreter on CPU) against the PyTorch reference and a
float64 ground truth.

The residual sum must equal the reference's bit for bit (one fp32 add, one rounding), except
that off CUDA the Triton interpreter casts fp32 -> bf16 by truncation, so there a bf16 sum
may be the truncated neighbour. The normalised output must be within 2x the reference's own
error against float64 (flash-attention style) plus one rounding step. Outputs are NaN-poisoned.
"""
import pytest
import torch

from tabed_engine.kernels import add_rms_norm as _k
from tabed_engine.ops.add_rms_norm import add_rms_norm, add_rms_norm_reference, rms_norm_reference

EPS_OF = {torch.float32: 2.0 ** -23, torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7}


def make_case(shape, dtype, device, *, with_delta=True, seed=0):
    gen = torch.Generator().manual_seed(seed)
    N = shape[-1]
    x = torch.randn(shape, generator=gen) * 2 + 0.5
    delta = torch.randn(shape, generator=gen) * 3 if with_delta else None
    weight = 1 + 0.3 * torch.randn(N, generator=gen)
    to = lambda t: None if t is None else t.to(device=device, dtype=dtype)  # noqa: E731
    return to(x), to(delta), to(weight)


def check(x, delta, weight, eps, s, out):
    s_ref, out_ref = add_rms_norm_reference(x.cpu(), None if delta is None else delta.cpu(), weight.cpu(), eps)
    s, out = s.cpu(), out.cpu()
    assert not s.isnan().any() and not out.isnan().any(), "NaN left (unwritten output)"
    if not torch.equal(s, s_ref):
        assert s.dtype == torch.bfloat16 and not x.is_cuda, f"{(s != s_ref).sum().item()} sums differ"
        s32 = x.cpu().float() + delta.cpu().float()
        trunc = (s32.view(torch.int32) & -65536).view(torch.float32).to(torch.bfloat16)
        assert ((s == s_ref) | (s == trunc)).all(), "sums neither rounded nor truncated"
    s64 = s_ref.double()
    truth = weight.cpu().double() * s64 * torch.rsqrt(s64.pow(2).mean(-1, keepdim=True) + eps)
    err = (out.double() - truth).abs().max().item()
    base = (out_ref.double() - truth).abs().max().item()
    slack = EPS_OF[x.dtype] * truth.abs().max().item()
    assert err <= 2 * base + slack, f"max err {err:.3g} vs reference {base:.3g} (slack {slack:.3g})"


CASES = [
    (shape, dtype, with_delta)
    for i, (shape, dtype) in enumerate(
        (sh, dt) for sh in [(1, 1, 48), (3, 9, 60), (5, 2, 123), (2, 6, 1000), (1, 3, 4096)]
        for dt in (torch.bfloat16, torch.float16, torch.float32))
    for with_delta in [i % 4 != 3]
]


@pytest.mark.parametrize("shape,dtype,with_delta", CASES)
def test_kernel_matches_reference(shape, dtype, with_delta, kernel_device):
    x, delta, weight = make_case(shape, dtype, kernel_device, with_delta=with_delta, seed=shape[-1])
    out = torch.full_like(x, float("nan"))
    s_buf = torch.full_like(x, float("nan"))
    s, res = _k.add_rms_norm(x, delta, weight, 1e-5, out=out, sum_out=s_buf)
    assert res is out
    assert s is (s_buf if with_delta else x)
    check(x, delta, weight, 1e-5, s, out)


def test_kernel_strided_input_and_large_eps(kernel_device):
    # x and delta as column slices of wider buffers (row stride != N); eps large enough to matter
    x, delta, weight = make_case((4, 5, 77), torch.float32, kernel_device, seed=3)
    wide = torch.zeros(4, 5, 100, device=kernel_device)
    wide[..., 10:87] = x
    s, out = _k.add_rms_norm(wide[..., 10:87], delta, weight, 0.5)
    check(x, delta, weight, 0.5, s, out)


def test_dispatch_on_cpu_is_reference():
    x, delta, weight = make_case((2, 3, 60), torch.bfloat16, "cpu", seed=4)
    s, out = add_rms_norm(x, delta, weight, 1e-6)
    s_ref, out_ref = add_rms_norm_reference(x, delta, weight, 1e-6)
    assert torch.equal(s, s_ref) and torch.equal(out, out_ref)
    s, out = add_rms_norm(x, None, weight, 1e-6)
    assert s is x and torch.equal(out, rms_norm_reference(x, weight, 1e-6))


def test_reference_matches_transformers():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    x, _, weight = make_case((3, 4, 64), torch.bfloat16, "cpu", with_delta=False, seed=5)
    hf = LlamaRMSNorm(64, eps=1e-5).to(torch.bfloat16)
    hf.weight.data.copy_(weight)
    assert torch.equal(rms_norm_reference(x, weight, 1e-5), hf(x))


def test_launcher_rejects_bad_input():
    x, delta, weight = make_case((2, 3, 16), torch.float32, "cpu")
    with pytest.raises(ValueError, match="weight"):
        _k.add_rms_norm(x, delta, weight[:8], 1e-6)
    with pytest.raises(ValueError, match="does not match"):
        _k.add_rms_norm(x, delta[:1], weight, 1e-6)
    with pytest.raises(TypeError, match="dtypes differ"):
        _k.add_rms_norm(x, delta, weight.half(), 1e-6)
    with pytest.raises(ValueError, match="out must be"):
        _k.add_rms_norm(x, delta, weight, 1e-6, out=torch.empty(2, 3, 17))


# ---- GPU only: the LLaVA-1.5-7B hidden size ---------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 6, 600])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("with_delta", [True, False])
def test_gpu_hidden_4096(rows, dtype, with_delta):
    x, delta, weight = make_case((1, rows, 4096), dtype, "cuda", with_delta=with_delta, seed=rows)
    s, out = add_rms_norm(x, delta, weight, 1e-5)
    check(x, delta, weight, 1e-5, s, out)
