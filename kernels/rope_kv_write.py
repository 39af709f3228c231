"""RoPE on q and k plus the K/V cache write, in one launch per layer.

The decode step used to spend four to six launches per layer between the qkv projection and
attention: rotate q, rotate k (one compiled kernel each), then two index_put writes into
the cache. This kernel reads the projection output once and writes rotated q to its own
buffer, rotated k and raw v into cache slots lengths[r] + t.

Grid (R * T, (H + 2 * Hkv) / BLOCK_H): one program per (row, token) and tile of BLOCK_H
heads of the fused projection row [q heads | k heads | v heads]. BLOCK_H divides both H and
Hkv, so a tile never straddles q/k/v and each program takes one branch: rotate and store
to q, rotate and store to the cache's k, or copy to the cache's v. The two halves of the
head dim are separate [BLOCK_H, BLOCK_HALF] tiles (rotate-half pairs d with d + D/2), so a
head dim that is not a power of two (tests use 10, 12, 14) is handled by masking.

Numerics match `tabed_engine.ops.rope_kv_write.rope_reference` bit for bit: the same fp32
products and sum in the same order, fp contraction off (an FMA would round once instead
of twice), round-to-nearest-even cast back.
"""
import math

import torch
import triton
import triton.language as tl

from ._common import pdl, pdl_wait

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_NUM_WARPS = 4


@triton.jit
def _rope(x1, x2, cs_ptr, sn_ptr, offs, d_ok, HALF: tl.constexpr):
    # x * cos + rotate_half(x) * sin with rotate_half(x) = [-x2, x1], as in the reference
    c1 = tl.load(cs_ptr + offs, mask=d_ok, other=0.0)[None, :]
    c2 = tl.load(cs_ptr + HALF + offs, mask=d_ok, other=0.0)[None, :]
    s1 = tl.load(sn_ptr + offs, mask=d_ok, other=0.0)[None, :]
    s2 = tl.load(sn_ptr + HALF + offs, mask=d_ok, other=0.0)[None, :]
    x1, x2 = x1.to(tl.float32), x2.to(tl.float32)
    return x1 * c1 + (-x2) * s1, x2 * c2 + x1 * s2


@triton.jit
def _store_heads(base_ptr, head_stride, heads, offs, mask, y1, y2, HALF: tl.constexpr):
    ptrs = base_ptr + heads[:, None] * head_stride + offs[None, :]
    tl.store(ptrs, y1.to(base_ptr.dtype.element_ty), mask=mask)
    tl.store(ptrs + HALF, y2.to(base_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kv_write_kernel(
    qkv_ptr, cos_ptr, sin_ptr, len_ptr, q_ptr, k_ptr, v_ptr,
    stride_xr, stride_xt, stride_cr, stride_ct, stride_sr, stride_st,
    stride_qr, stride_qt, stride_qh,
    stride_kr, stride_kh, stride_ks,
    stride_vr, stride_vh, stride_vs,
    T, S,
    H: tl.constexpr, KV: tl.constexpr, HALF: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, PDL: tl.constexpr,
):
    pdl_wait(PDL)
    pid = tl.program_id(0).to(tl.int64)
    r = pid // T
    t = pid % T
    head0 = tl.program_id(1) * BLOCK_H  # first head of the tile in [0, H + 2 KV)
    heads = tl.arange(0, BLOCK_H)
    offs = tl.arange(0, BLOCK_HALF)
    d_ok = offs < HALF
    ok = d_ok[None, :]

    x_ptrs = qkv_ptr + r * stride_xr + t * stride_xt + (head0 + heads)[:, None] * (2 * HALF) + offs[None, :]
    x1 = tl.load(x_ptrs, mask=ok, other=0.0)
    x2 = tl.load(x_ptrs + HALF, mask=ok, other=0.0)
    cs_ptr = cos_ptr + r * stride_cr + t * stride_ct
    sn_ptr = sin_ptr + r * stride_sr + t * stride_st

    if head0 < H:  # query heads -> q_out[r, t, head]
        y1, y2 = _rope(x1, x2, cs_ptr, sn_ptr, offs, d_ok, HALF)
        _store_heads(q_ptr + r * stride_qr + t * stride_qt + head0 * stride_qh, stride_qh,
                     heads, offs, ok, y1, y2, HALF)
    else:
        slot = tl.load(len_ptr + r) + t
        # a full cache drops the write rather than corrupt the next row (compared as a tile:
        # the interpreter turns `tile & scalar_bool` into an int32 mask)
        kv_ok = ok & ((slot + tl.zeros([BLOCK_H, 1], tl.int64)) < S)
        if head0 < H + KV:  # key heads, rotated -> k_cache[r, kh, slot]
            y1, y2 = _rope(x1, x2, cs_ptr, sn_ptr, offs, d_ok, HALF)
            _store_heads(k_ptr + r * stride_kr + slot * stride_ks + (head0 - H) * stride_kh, stride_kh,
                         heads, offs, kv_ok, y1, y2, HALF)
        else:  # value heads, as they are -> v_cache[r, vh, slot]
            _store_heads(v_ptr + r * stride_vr + slot * stride_vs + (head0 - H - KV) * stride_vh, stride_vh,
                         heads, offs, kv_ok, x1, x2, HALF)


def _block_heads(H, KV, block_half):
    """Largest power of two dividing H and KV, capped at ~1024 elements per tile (8 heads of
    128; the call is latency-bound: an H200 sweep, benchmarks/results/rope_kv_write.json)."""
    g = math.gcd(H, KV)
    cap = max(1, 512 // block_half)
    b = 1
    while b * 2 <= cap and g % (b * 2) == 0:
        b *= 2
    return b


def rope_kv_write(qkv, cos, sin, k_cache, v_cache, lengths, num_heads, num_kv_heads, *, out=None):
    """Triton RoPE + KV write; see `tabed_engine.ops.rope_kv_write` for the contract.

    qkv [R, T, (H + 2 Hkv) * D] (unit last stride), cos/sin [R, T, D] float32, caches
    [R, Hkv, S, D] (unit last stride), lengths [R] int32 -> q [R, T, H, D] in qkv's dtype.
    Writes k_cache/v_cache[r, :, lengths[r] + t] in place. D must be even.
    """
    H, KV = num_heads, num_kv_heads
    if qkv.dim() != 3 or k_cache.dim() != 4 or v_cache.dim() != 4:
        raise ValueError(f"qkv must be [R, T, (H + 2 Hkv) * D] and k/v caches [R, Hkv, S, D], got "
                         f"{tuple(qkv.shape)}, {tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    R, T, width = qkv.shape
    _, _, S, D = k_cache.shape
    if H <= 0 or KV <= 0 or H % KV:
        raise ValueError(f"query heads ({H}) must be a positive multiple of kv heads ({KV})")
    if width != (H + 2 * KV) * D or k_cache.shape[:2] != (R, KV) or v_cache.shape != k_cache.shape:
        raise ValueError(f"qkv {tuple(qkv.shape)} does not match H={H}, Hkv={KV} and caches "
                         f"{tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    if D % 2:
        raise ValueError(f"head_dim {D} is odd: rotate-half RoPE needs an even head dim")
    if cos.shape != (R, T, D) or sin.shape != (R, T, D):
        raise ValueError(f"cos/sin must be [{R}, {T}, {D}], got {tuple(cos.shape)}, {tuple(sin.shape)}")
    if cos.dtype != torch.float32 or sin.dtype != torch.float32:
        raise TypeError(f"cos/sin must be float32, got {cos.dtype}, {sin.dtype}")
    if qkv.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"qkv dtype {qkv.dtype} not supported (float16, bfloat16, float32)")
    if k_cache.dtype != qkv.dtype or v_cache.dtype != qkv.dtype:
        raise TypeError(f"dtypes differ: qkv {qkv.dtype}, k {k_cache.dtype}, v {v_cache.dtype}")
    if lengths.shape != (R,) or lengths.dtype != torch.int32:
        raise ValueError(f"lengths must be int32 [{R}], got {lengths.dtype} {tuple(lengths.shape)}")
    if any(t.stride(-1) != 1 for t in (qkv, cos, sin, k_cache, v_cache)):
        raise ValueError("qkv, cos, sin, k_cache and v_cache need a contiguous last dimension")
    if any(t.device != qkv.device for t in (cos, sin, k_cache, v_cache, lengths)):
        raise ValueError("qkv, cos, sin, k_cache, v_cache and lengths must be on one device")
    if out is None:
        out = torch.empty((R, T, H, D), device=qkv.device, dtype=qkv.dtype)
    elif out.shape != (R, T, H, D) or out.dtype != qkv.dtype or out.device != qkv.device or out.stride(-1) != 1:
        raise ValueError(f"out must be {(R, T, H, D)} {qkv.dtype} on {qkv.device} with a contiguous last dim")
    if R == 0 or T == 0:
        return out
    lengths = lengths.contiguous()
    use_pdl = pdl(qkv.device)

    half = D // 2
    block_half = triton.next_power_of_2(half)
    block_h = _block_heads(H, KV, block_half)
    _rope_kv_write_kernel[(R * T, (H + 2 * KV) // block_h)](
        qkv, cos, sin, lengths, out, k_cache, v_cache,
        qkv.stride(0), qkv.stride(1), cos.stride(0), cos.stride(1), sin.stride(0), sin.stride(1),
        out.stride(0), out.stride(1), out.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        T, S,
        H=H, KV=KV, HALF=half, BLOCK_H=block_h, BLOCK_HALF=block_half, PDL=use_pdl,
        num_warps=_NUM_WARPS, enable_fp_fusion=False, launch_pdl=use_pdl,
    )
    return out
