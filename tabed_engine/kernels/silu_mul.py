"""SwiGLU activation, silu(gate) * up, for the MLP's [gate | up] rows in one launch.

Verification (γ + 1 rows) and a draft step over several views run the MLP's gate/up and down
projections on `gemv_rows`; this sits between them. It is a Triton launch rather than the
compiled pointwise kernel it replaces so that the chain of the step's launches stays
programmatically dependent (`kernels/_common.py`: the launch overlaps the one before and
lets the down projection's launch overlap it). The one-row GEMV applies the gate as it
reads and needs no launch at all (in the tensor-core tile of `gemv_rows` the gated
activations would reach the dot through registers: slower).

Grid (rows, cdiv(K, BLOCK)): each program reads BLOCK gates and the BLOCK matching ups of one
row, computes in float32 and rounds once to the output dtype, as the reference does.
"""
import torch
import triton
import triton.language as tl

from ._common import pdl, pdl_wait

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_BLOCK = 1024


@triton.jit
def silu_times(g, u):
    """silu(g) * u in float32 (g, u float32): the gate of the SwiGLU MLP, shared with the
    one-row GEMV's fused gate so both compute it the same way."""
    return g / (1.0 + tl.exp(-g)) * u


@triton.jit
def _silu_mul_kernel(x_ptr, y_ptr, K, stride_x, stride_y, BLOCK: tl.constexpr, PDL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < K
    pdl_wait(PDL)
    g = tl.load(x_ptr + row * stride_x + offs, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * stride_x + K + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_y + offs, silu_times(g, u).to(y_ptr.dtype.element_ty), mask=ok)


def silu_mul(gate_up: torch.Tensor, *, out=None) -> torch.Tensor:
    """silu(gate) * up for gate_up = [gate | up] on the last dim ([..., 2K] -> [..., K]),
    float32 math rounded once to gate_up's dtype (float16/bfloat16/float32). `out`: an
    optional contiguous [..., K] buffer of that dtype to write into."""
    if gate_up.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"silu_mul: dtype {gate_up.dtype} not supported (float16, bfloat16, float32)")
    if gate_up.dim() == 0 or gate_up.shape[-1] % 2:
        raise ValueError(f"silu_mul: the last dim must hold [gate | up] (even), got shape {tuple(gate_up.shape)}")
    K = gate_up.shape[-1] // 2
    lead = gate_up.shape[:-1]
    if out is None:
        out = torch.empty(*lead, K, device=gate_up.device, dtype=gate_up.dtype)
    elif out.shape != (*lead, K) or out.dtype != gate_up.dtype or out.device != gate_up.device \
            or not out.is_contiguous():
        raise ValueError(f"silu_mul: out must be a contiguous {gate_up.dtype} tensor of shape {(*lead, K)} "
                         f"on {gate_up.device}")
    x2 = gate_up.reshape(-1, 2 * K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    M = x2.shape[0]
    if M == 0 or K == 0:
        return out
    use_pdl = pdl(gate_up.device)
    y2 = out.view(M, K)
    _silu_mul_kernel[(M, triton.cdiv(K, _BLOCK))](x2, y2, K, x2.stride(0), y2.stride(0), BLOCK=_BLOCK, PDL=use_pdl,
                                                   num_warps=4, launch_pdl=use_pdl)
    return out
