"""Skinny linear layers: y = x @ W^T (+ bias) for a few rows (decode, verification, drafts).

A decode step reads every weight byte once for one to a few rows of activations, so the
projection is a matrix-vector product bound by HBM bandwidth. One program owns BLOCK_N
output features and streams their weight rows over K in [BLOCK_N, BLOCK_K] tiles (loads
marked evict-first: nothing reads them again this step); x stays in L1/L2. No split-K, so
no partials and no second launch; the N / BLOCK_N programs (512-8000 at the 7B shapes)
fill every SM.

* One row (`_gemv_fma_kernel`): an fp32 accumulator per tile element, multiply-add on the
  CUDA cores, one reduction over the tile after the loop.
* 2-16 rows (`_gemv_dot_kernel`): the rows padded to 16 and the tile product on tensor
  cores (tl.dot, fp32 accumulate; exact fp32 for fp32 inputs).

For one row the input may be a gate/up pair, x = [gate | up] of width 2K: the kernel feeds
silu(gate) * up (fp32, rounded once to x's dtype like the fused pointwise kernel it
replaces) to the product, so the MLP's down projection needs no separate SiLU launch. Every
program recomputes the gate over all of K, which is cheap for one row and was not for more
(six rows padded to 16, 128 programs: the down projection ran 7x slower than unfused), so
the tensor-core kernel takes its rows already gated.

Block shapes from a sweep on an H200 (graph replays, weights larger than L2, bf16): at the
Llama-7B decode shapes these ran 5-20% faster than cuBLAS (one row: q/k/v 31.8 -> 26.9 us,
o 13.3 -> 10.6, gate/up 47.1 -> 44.9, down 28.1 -> 23.7; six rows 3-13% faster).
"""
import torch
import triton
import triton.language as tl

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_ROWS = 16


@triton.jit
def _load_x(x_ptr, offs_k, k_ok, K, GATED: tl.constexpr, EVEN_K: tl.constexpr):
    """Activations at columns offs_k (any shape), fp32; silu(gate) * up when GATED."""
    if EVEN_K:
        x = tl.load(x_ptr + offs_k, eviction_policy="evict_last")
    else:
        x = tl.load(x_ptr + offs_k, mask=k_ok, other=0.0, eviction_policy="evict_last")
    if GATED:
        if EVEN_K:
            u = tl.load(x_ptr + K + offs_k, eviction_policy="evict_last")
        else:
            u = tl.load(x_ptr + K + offs_k, mask=k_ok, other=0.0, eviction_policy="evict_last")
        g = x.to(tl.float32)
        a = g / (1.0 + tl.exp(-g)) * u.to(tl.float32)
        x = a.to(u.dtype)  # one rounding to the model dtype, like the pointwise kernel
    return x.to(tl.float32)


@triton.jit
def _gemv_fma_kernel(x_ptr, w_ptr, b_ptr, y_ptr, N, K, stride_wn,
                     HAS_BIAS: tl.constexpr, GATED: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, STAGES: tl.constexpr, EVEN_K: tl.constexpr):
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    rows = tl.where(n_ok, offs_n, 0).to(tl.int64)  # clamped: the loop needs no row mask
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        if EVEN_K:
            w = tl.load(w_ptr + rows[:, None] * stride_wn + offs_k[None, :], eviction_policy="evict_first")
        else:
            w = tl.load(w_ptr + rows[:, None] * stride_wn + offs_k[None, :], mask=k_ok[None, :], other=0.0,
                        eviction_policy="evict_first")
        x = _load_x(x_ptr, offs_k, k_ok, K, GATED, EVEN_K)
        acc += w.to(tl.float32) * x[None, :]
    y = tl.sum(acc, 1)
    if HAS_BIAS:
        y += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs_n, y.to(y_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def _gemv_dot_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                     HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr,
                     EVEN_K: tl.constexpr, PRECISION: tl.constexpr, DOT_FP32: tl.constexpr,
                     TWO_LEVEL: tl.constexpr):
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    rows = tl.where(n_ok, offs_n, 0).to(tl.int64)
    offs_m = tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    xrow = x_ptr + tl.where(m_ok, offs_m, 0).to(tl.int64)[:, None] * stride_xm
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        if EVEN_K:
            w = tl.load(w_ptr + rows[:, None] * stride_wn + offs_k[None, :], eviction_policy="evict_first")
        else:
            w = tl.load(w_ptr + rows[:, None] * stride_wn + offs_k[None, :], mask=k_ok[None, :], other=0.0,
                        eviction_policy="evict_first")
        x = _load_x(xrow, offs_k[None, :], k_ok[None, :], K, False, EVEN_K)
        # padded rows repeat row 0 (clamped pointers, no mask in the loop); they are not stored
        if DOT_FP32:  # the CPU interpreter's bf16 tl.dot is wrong; the same values in fp32
            x, w = x, w.to(tl.float32)
        else:
            x = x.to(w.dtype)
        if TWO_LEVEL:  # fp32: each tile's product summed on its own, then added to the total
            acc += tl.dot(x, tl.trans(w), input_precision=PRECISION, out_dtype=tl.float32)
        else:          # 16-bit inputs: accumulate in place (the output rounding dominates)
            acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION, out_dtype=tl.float32)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def _config(M: int, N: int, K: int):
    """(BLOCK_N, BLOCK_K, num_warps, stages) from the H200 sweep (see the module docstring)."""
    if M == 1:
        return (8, 512, 4, 3) if N * K <= (1 << 25) else (4, 1024, 4, 3)
    return (64, 128, 4, 3) if N >= 16384 else (32, 256, 4, 4)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias=None, *, gated: bool = False, out=None):
    """y = x @ weight^T (+ bias) for at most MAX_ROWS rows of x.

    x [..., K] (or [..., 2K] = [gate | up] when `gated`: the product uses silu(gate) * up),
    weight [N, K] with unit last stride, bias [N] or None -> y [..., N] in x's dtype. One
    dtype for x, weight and bias (float16/bfloat16/float32).
    """
    if x.dtype not in _FLOAT_DTYPES or weight.dtype != x.dtype or (bias is not None and bias.dtype != x.dtype):
        raise TypeError(f"gemv: x, weight and bias must share one float dtype, got {x.dtype}, {weight.dtype}, "
                        f"{None if bias is None else bias.dtype}")
    if weight.dim() != 2 or weight.stride(1) != 1:
        raise ValueError(f"gemv: weight must be [N, K] with unit last stride, got {tuple(weight.shape)} "
                         f"strides {weight.stride()}")
    N, K = weight.shape
    width = 2 * K if gated else K
    if x.shape[-1] != width:
        raise ValueError(f"gemv: x's last dim {x.shape[-1]} != {'2 * ' if gated else ''}weight's K = {K}")
    if bias is not None and (bias.shape != (N,) or bias.stride(0) != 1):
        raise ValueError(f"gemv: bias must be [{N}] contiguous, got {tuple(bias.shape)}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, width)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    M = x2.shape[0]
    if not 1 <= M <= MAX_ROWS:
        raise ValueError(f"gemv: 1..{MAX_ROWS} rows, got {M}")
    if gated and M != 1:
        raise ValueError(f"gemv: the fused SiLU gate takes one row, got {M} (gate the rows first)")
    if out is not None and (out.shape != (*lead, N) or out.dtype != x.dtype or not out.is_contiguous()):
        raise ValueError(f"gemv: out must be a contiguous {x.dtype} tensor of shape {(*lead, N)}")
    y = out if out is not None else torch.empty(*lead, N, device=x.device, dtype=x.dtype)
    y2 = y.view(M, N)
    BN, BK, warps, stages = _config(M, N, K)
    grid = (triton.cdiv(N, BN),)
    b = bias if bias is not None else weight  # placeholder pointer, never read
    if M == 1:
        _gemv_fma_kernel[grid](x2, weight, b, y2, N, K, weight.stride(0), HAS_BIAS=bias is not None,
                               GATED=gated, BLOCK_N=BN, BLOCK_K=BK, STAGES=stages, EVEN_K=K % BK == 0,
                               num_warps=warps)
    else:
        _gemv_dot_kernel[grid](x2, weight, b, y2, M, N, K, x2.stride(0), weight.stride(0), y2.stride(0),
                               HAS_BIAS=bias is not None, BLOCK_M=16, BLOCK_N=BN, BLOCK_K=BK,
                               STAGES=stages, EVEN_K=K % BK == 0,
                               PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
                               DOT_FP32=x.device.type != "cuda", TWO_LEVEL=x.dtype == torch.float32,
                               num_warps=warps)
    return y
