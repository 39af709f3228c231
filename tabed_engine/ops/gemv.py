"""Linear layers of the decoder, with a matrix-vector fast path for AR decode.

`linear(x, weight, bias)` is `F.linear`; with `gated=True` its input is the MLP's
[gate | up] pair and the product uses silu(gate) * up. On CUDA, with weights of at least
`MIN_FEATURES` outputs × `MIN_FEATURES` inputs (`gemv_kind`):
* one-row calls (an AR decode step) run the Triton GEMV (`tabed_engine.kernels.gemv.gemv`),
  which streams the weight at close to HBM bandwidth in one launch and applies the SiLU gate
  as it reads;
* 2-64 rows in float16/bfloat16 (verification of γ + 1 tokens or of a draft tree's nodes,
  a batch's chains, a draft step over several views) run its tensor-core sibling
  (`gemv_rows`), still bound by the weight read; the decoder's MLP takes its SiLU gate in the
  gate/up projection's epilogue (`glu=True`), a `gated` input gets its own Triton launch
  (`silu_mul`) first;
everything else (prefill, matrices narrower than `MIN_FEATURES`, float32 rows, the CPU) runs
the reference (cuBLAS on the GPU).

`invariant=True` (the engine's row-count-invariant decode path, `Engine(..., invariant=True)`):
on CUDA every call, any number of rows and any float dtype, runs one tensor-core kernel whose
launch config depends on the weight's shape only (`gemv_rows(..., invariant=True)`), so a row's
output has the same bits alone, among a verification's rows or in a batch.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

# Smaller matrices stay on cuBLAS. The LLaVA-68M-shape draft (hidden 768, MLP 3072) is
# included: alone its projections were as fast or faster on cuBLAS, but a draft step is a
# chain of ~25 latency-bound launches, and on the Triton GEMVs every launch of the chain can
# overlap the one before (programmatic dependent launch, `kernels/_common.py`). Graph replay
# of a draft forward with PDL on, 1 / 2 / 4 rows (`benchmarks/bench_pdl.py`, H100,
# results/pdl_h100.json): 104 / 103 / 107 us with cuBLAS projections, 81 / 93 / 96 us here.
MIN_FEATURES = 512


def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up = [gate | up] on the last dim, computed in float32 and
    rounded once to the input dtype (what the fused pointwise kernels do)."""
    gate, up = gate_up.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(gate_up.dtype)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up: the Triton kernel (`tabed_engine.kernels.silu_mul`) for CUDA tensors,
    the reference elsewhere (same math: float32, one rounding)."""
    if gate_up.is_cuda and gate_up.dtype in (torch.float16, torch.bfloat16, torch.float32):
        from tabed_engine.kernels.silu_mul import silu_mul as _silu_mul

        return _silu_mul(gate_up)
    return silu_mul_reference(gate_up)


def linear_reference(x: torch.Tensor, weight: torch.Tensor, bias=None, *, gated: bool = False,
                     glu: bool = False) -> torch.Tensor:
    """F.linear(x, weight, bias), with x = silu_mul_reference(x) first when `gated` and
    silu_mul_reference of the product when `glu`."""
    y = F.linear(silu_mul_reference(x) if gated else x, weight, bias)
    return silu_mul_reference(y) if glu else y


def gemv_kind(x: torch.Tensor, weight: torch.Tensor, bias=None, *, invariant: bool = False):
    """The path `linear` takes for these arguments: "invariant" (`invariant` on CUDA: the
    row-count-invariant kernel), "row" (one row, Triton GEMV), "rows" (2-64 rows in
    float16/bfloat16, tensor-core GEMV) or None (the reference)."""
    if invariant and x.is_cuda and weight.dtype == x.dtype and x.dtype in (torch.float16, torch.bfloat16,
                                                                          torch.float32):
        return "invariant"
    if not (x.is_cuda and min(weight.shape) >= MIN_FEATURES and weight.dtype == x.dtype
            and (bias is None or bias.dtype == x.dtype) and weight.stride(-1) == 1 and x.shape[-1] > 0):
        return None
    from tabed_engine.kernels.gemv import MAX_DOT_ROWS

    rows = x.numel() // x.shape[-1]
    if rows == 1:
        return "row"
    if 2 <= rows <= MAX_DOT_ROWS and x.dtype in (torch.float16, torch.bfloat16):
        return "rows"
    return None


def linear(x: torch.Tensor, weight: torch.Tensor, bias=None, *, gated: bool = False,
           glu: bool = False, invariant: bool = False) -> torch.Tensor:
    """y = x @ weight^T (+ bias); `gated`: x is [..., 2K] = [gate | up] and the product
    uses silu(gate) * up; `glu`: weight is [gate; up] ([2I, K]) and y = silu(gate) * up of
    the product ([..., I]).

    Parameters
    ----------
    x : torch.Tensor
        [..., K] activations ([..., 2K] when gated).
    weight : torch.Tensor
        [N, K].
    bias : torch.Tensor or None
        [N].
    gated : bool
        Apply the SwiGLU gate to x first.
    glu : bool
        Apply the SwiGLU gate to the product (on the 2-64-row path in the GEMV's epilogue).
    invariant : bool
        On CUDA, the row-count-invariant kernel (see the module docstring); the reference elsewhere.

    Returns
    -------
    torch.Tensor
        [..., N] in x's dtype ([..., N / 2] with `glu`).
    """
    if gated and glu:
        raise ValueError("linear: gated and glu are exclusive")
    kind = gemv_kind(x, weight, bias, invariant=invariant)
    if kind == "invariant":
        from tabed_engine.kernels.gemv import gemv_rows

        return gemv_rows(silu_mul(x) if gated else x, weight, bias, glu=glu, invariant=True)
    if kind == "row":
        from tabed_engine.kernels.gemv import gemv

        y = gemv(x, weight, bias, gated=gated)
        return silu_mul(y) if glu else y
    if kind == "rows":
        from tabed_engine.kernels.gemv import gemv_rows

        return gemv_rows(silu_mul(x) if gated else x, weight, bias, glu=glu)
    return linear_reference(x, weight, bias, gated=gated, glu=glu)
