"""Residual add fused into the RMSNorm that follows it.

A decoder layer adds the attention output to the residual stream and normalises the sum
for the MLP, then adds the MLP output and normalises for the next layer's attention. Each
add was its own launch ahead of the (compiled) norm; here one program per token row reads
x and delta once, writes the sum s = x + delta (rounded to the model dtype, as the eager
add does) and weight * rmsnorm(s).

Grid (rows,): the whole hidden vector of a row is one [BLOCK] tile (4096 -> 8 warps, one
16-byte load per thread per tensor in bf16), so the mean of squares is a single in-register
reduction. At decode (1-6 rows) the call is latency-bound: one round trip to memory, one
block reduction, one store.
"""
import torch
import triton
import triton.language as tl

from ._common import pdl, pdl_wait

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_MAX_HIDDEN = 65536


@triton.jit
def _add_rms_norm_kernel(
    x_ptr, delta_ptr, w_ptr, sum_ptr, out_ptr,
    stride_x, stride_d, stride_s, stride_o, N, eps,
    HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    ok = offs < N
    w = tl.load(w_ptr + offs, mask=ok, other=0.0)  # a weight: no earlier kernel writes it
    pdl_wait(PDL)
    x = tl.load(x_ptr + row * stride_x + offs, mask=ok, other=0.0)
    if HAS_DELTA:
        d = tl.load(delta_ptr + row * stride_d + offs, mask=ok, other=0.0)
        x = (x.to(tl.float32) + d.to(tl.float32)).to(x.dtype)  # the residual stream keeps the model dtype
        tl.store(sum_ptr + row * stride_s + offs, x, mask=ok)
    xf = x.to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(xf * xf, axis=0) / N + eps)
    y = (xf * rstd).to(x.dtype)  # normalised, rounded, then scaled: the reference's two roundings
    tl.store(out_ptr + row * stride_o + offs, (w.to(tl.float32) * y.to(tl.float32)).to(out_ptr.dtype.element_ty),
             mask=ok)


def add_rms_norm(x, delta, weight, eps, *, out=None, sum_out=None):
    """Triton residual add + RMSNorm; see `tabed_engine.ops.add_rms_norm` for the contract.

    x [..., N], delta like x or None, weight [N] in x's dtype -> (s, out), s = x + delta (x
    itself when delta is None) and out = weight * rmsnorm(s), both [..., N] in x's dtype.
    `out` / `sum_out`: optional contiguous buffers to write into (tests poison them).
    """
    N = x.shape[-1]
    if weight.shape != (N,):
        raise ValueError(f"weight must be [{N}], got {tuple(weight.shape)}")
    if delta is not None and delta.shape != x.shape:
        raise ValueError(f"delta {tuple(delta.shape)} does not match x {tuple(x.shape)}")
    if x.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"x dtype {x.dtype} not supported (float16, bfloat16, float32)")
    if weight.dtype != x.dtype or (delta is not None and delta.dtype != x.dtype):
        raise TypeError(f"dtypes differ: x {x.dtype}, delta {None if delta is None else delta.dtype}, "
                        f"weight {weight.dtype}")
    if not 1 <= N <= _MAX_HIDDEN:
        raise ValueError(f"hidden size {N} not in 1..{_MAX_HIDDEN}")
    if any(t is not None and t.device != x.device for t in (delta, weight)):
        raise ValueError("x, delta and weight must be on one device")
    x2 = x.reshape(-1, N)  # a view for the engine's contiguous activations
    d2 = x2 if delta is None else delta.reshape(-1, N)
    if x2.stride(-1) != 1 or d2.stride(-1) != 1 or weight.stride(0) != 1:
        x2, d2, weight = x2.contiguous(), d2.contiguous(), weight.contiguous()
    M = x2.shape[0]
    for buf, name in ((out, "out"), (sum_out, "sum_out")):
        if buf is not None and (buf.shape != x.shape or buf.dtype != x.dtype or buf.device != x.device
                                or not buf.is_contiguous()):
            raise ValueError(f"{name} must be a contiguous {tuple(x.shape)} {x.dtype} tensor on {x.device}")
    if delta is None:
        s = x
    else:
        s = torch.empty(x.shape, device=x.device, dtype=x.dtype) if sum_out is None else sum_out
    out = torch.empty(x.shape, device=x.device, dtype=x.dtype) if out is None else out
    if M == 0:
        return s, out
    s2, out2 = s.reshape(-1, N), out.view(-1, N)
    BLOCK = triton.next_power_of_2(N)
    num_warps = max(1, min(16, BLOCK // 512))
    use_pdl = pdl(x.device)
    _add_rms_norm_kernel[(M,)](
        x2, d2, weight, s2, out2,
        x2.stride(0), d2.stride(0), s2.stride(0), out2.stride(0), N, float(eps),
        HAS_DELTA=delta is not None, BLOCK=BLOCK, PDL=use_pdl, num_warps=num_warps, launch_pdl=use_pdl,
    )
    return s, out
