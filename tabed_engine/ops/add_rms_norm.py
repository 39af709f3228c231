"""RMSNorm, optionally with the residual add that precedes it fused in.

A decoder layer computes s = x + delta (the residual stream plus a sub-block's output) and
then weight * rmsnorm(s) for the next sub-block. `add_rms_norm` returns both; on CUDA one
Triton launch does it, elsewhere the reference runs the plain ops.
"""
from __future__ import annotations

import torch


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * (x / sqrt(mean(x^2) + eps)): statistics in float32, normalised x rounded to
    x's dtype before the weight is applied (the Llama / HF order)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def add_rms_norm_reference(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(s, rms_norm_reference(s)) with s = x + delta, or s = x when delta is None."""
    s = x if delta is None else x + delta
    return s, rms_norm_reference(s, weight, eps)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual add then RMSNorm: the Triton kernel for CUDA tensors of one dtype, else the
    reference.

    Parameters
    ----------
    x : torch.Tensor
        [..., N] residual stream (float16/bfloat16/float32).
    delta : torch.Tensor or None
        Like x, added to it first (None: normalise x alone).
    weight : torch.Tensor
        [N] norm weight.
    eps : float
        Added to the mean of squares.

    Returns
    -------
    tuple of torch.Tensor
        s = x + delta in x's dtype (x itself when delta is None), and weight * rmsnorm(s)
        [..., N].
    """
    same_dtype = weight.dtype == x.dtype and (delta is None or delta.dtype == x.dtype)
    if x.is_cuda and same_dtype:  # mixed dtypes promote in the reference: keep its semantics
        from tabed_engine.kernels import add_rms_norm as _k

        return _k.add_rms_norm(x, delta, weight, eps)
    return add_rms_norm_reference(x, delta, weight, eps)
