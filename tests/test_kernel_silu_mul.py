"""silu_mul (SwiGLU activation ahead of the 2-64-row down projection): Triton kernel
(interpreter on CPU) against the PyTorch reference and a float64 ground truth.

The kernel and the reference both compute in float32 and round once; the two float32 silu
formulas (g / (1 + e^-g) vs g * sigmoid(g)) may differ in the last float32 bit, and off
CUDA the interpreter casts fp32 -> bf16/fp16 by truncation, so each element must be no
further from the float64 truth than 2x the reference's own error plus four units in the last
place of the dtype (float32: 32, the GPU's approximate exp2 and the division round too).
Outputs are NaN-poisoned; K is not a multiple of the block.
"""
import pytest
import torch

from tabed_engine.kernels import silu_mul as _k
from tabed_engine.ops import gemv as ops

EPS_OF = {torch.float32: 2.0 ** -23, torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7}


def make_case(M, K, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(M, 2 * K, generator=gen) * 3).to(device=device, dtype=dtype)


def check(y, x):
    y, x = y.cpu(), x.cpu()
    assert not y.isnan().any(), "NaN left (unwritten output)"
    g, u = x.double().chunk(2, dim=-1)
    truth = g * torch.sigmoid(g) * u
    ref = ops.silu_mul_reference(x)
    ref_err = (ref.double() - truth).abs()
    err = (y.double() - truth).abs()
    ulps = 32 if x.dtype == torch.float32 else 4   # float32: the GPU's exp2 is approximate, x/(1+e^-x) amplifies it
    step = ulps * EPS_OF[x.dtype] * truth.abs() + 1e-30
    assert (err <= 2 * ref_err + step).all(), f"max err {err.max().item():.3g} vs reference {ref_err.max().item():.3g}"


@pytest.mark.parametrize("M,K", [(1, 1), (2, 37), (6, 1500), (9, 2049), (16, 3000)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_kernel_matches_reference(M, K, dtype, kernel_device):
    x = make_case(M, K, dtype, kernel_device, seed=M * K)
    out = torch.full((M, K), float("nan"), device=kernel_device, dtype=dtype)
    y = _k.silu_mul(x, out=out)
    assert y is out
    check(y, x)


def test_kernel_leading_dims_strided_rows_errors_and_reuse(kernel_device):
    x = make_case(6, 130, torch.bfloat16, kernel_device, seed=3)
    wide = torch.zeros(6, 300, device=kernel_device, dtype=torch.bfloat16)
    wide[:, 17:277] = x
    y = _k.silu_mul(wide[:, 17:277].view(2, 3, 260))   # row stride 300, leading dims kept
    assert y.shape == (2, 3, 130)
    check(y.reshape(6, 130), x)
    assert _k.silu_mul(x[:0]).shape == (0, 130)
    with pytest.raises(ValueError, match="even"):
        _k.silu_mul(x[:, :259])
    with pytest.raises(TypeError, match="dtype"):
        _k.silu_mul(x.to(torch.int32))
    with pytest.raises(ValueError, match="out"):
        _k.silu_mul(x, out=torch.empty(6, 129, device=kernel_device, dtype=torch.bfloat16))
    check(_k.silu_mul(x), x)   # still usable


def test_dispatch_on_cpu_is_the_reference():
    x = make_case(3, 50, torch.bfloat16, "cpu")
    assert torch.equal(ops.silu_mul(x), ops.silu_mul_reference(x))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_real_shapes_gpu(dtype):
    # verification's 6 rows and a 4-view draft step: Llama-7B MLP 11008, LLaVA-68M MLP 3072
    for M, K in ((6, 11008), (4, 3072), (1, 11008)):
        x = make_case(M, K, dtype, "cuda", seed=K)
        out = torch.full((M, K), float("nan"), device="cuda", dtype=dtype)
        check(_k.silu_mul(x, out=out), x)
        check(ops.silu_mul(x), x)
