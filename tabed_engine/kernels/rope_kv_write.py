"""RoPE on q and k plus the K/V cache write, in one launch per layer.

The decode step used to spend four to six launches per layer between the qkv projection and
attention: rotate q, rotate k (one compiled kernel each), then two index_put writes into
the cache. This kernel reads the projection output once and writes rotated q to its own
buffer, rotated k and raw v into cache slots lengths[r] + t of cache row rows[r] (row r by
default; the cache is paged: slot s of row c lives in page block_table[c, s // PAGE] of the
[pages, Hkv, PAGE, D] pool, offset s % PAGE), and optionally rotated k and raw v once more to contiguous [R, Hkv, T, D] buffers
(a prefill attends over its new keys through SDPA, which wants them dense).

Grid (R * T, (H + 2 * Hkv) / BLOCK_H): one program per (row, token) and tile of BLOCK_H
heads of the fused projection row [q heads | k heads | v heads]. BLOCK_H divides both H and
Hkv, so a tile never straddles q/k/v and each program takes one branch: rotate and store
to q, rotate and store to the cache's k (and k_out), or copy to the cache's v (and v_out).
The cache row and slot are read on the device (CUDA-graph safe). The two halves of the
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
    qkv_ptr, cos_ptr, sin_ptr, len_ptr, rows_ptr, tab_ptr, q_ptr, k_ptr, v_ptr, ko_ptr, vo_ptr,
    stride_xr, stride_xt, stride_cr, stride_ct, stride_sr, stride_st,
    stride_qr, stride_qt, stride_qh,
    stride_kp, stride_kh, stride_ks,
    stride_vp, stride_vh, stride_vs, stride_tr,
    stride_kor, stride_koh, stride_kot,
    stride_vor, stride_voh, stride_vot,
    T, S, RC,
    H: tl.constexpr, KV: tl.constexpr, HALF: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
    HAS_ROWS: tl.constexpr, KV_OUT: tl.constexpr, PDL: tl.constexpr,
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
        if HAS_ROWS:  # the cache row input row r writes to
            crow = tl.load(rows_ptr + r).to(tl.int64)
        else:
            crow = r
        # a full cache or a row outside it drops the write rather than corrupt other memory
        # (compared as tiles: the interpreter turns `tile & scalar_bool` into an int32 mask)
        zero = tl.zeros([BLOCK_H, 1], tl.int64)
        row_ok = (slot < S) & (crow >= 0) & (crow < RC)
        kv_ok = ok & ((slot + zero) < S) & ((crow + zero) >= 0) & ((crow + zero) < RC)
        # the slot's page (a dropped write reads table entry 0 of row 0 instead of out of bounds)
        page = tl.load(tab_ptr + tl.where(row_ok, crow, 0) * stride_tr + tl.where(row_ok, slot, 0) // PAGE)
        page = page.to(tl.int64)
        off = slot % PAGE
        if head0 < H + KV:  # key heads, rotated -> the k pool at (page, kh, off) (and k_out[r, kh, t])
            kh = head0 - H
            y1, y2 = _rope(x1, x2, cs_ptr, sn_ptr, offs, d_ok, HALF)
            _store_heads(k_ptr + page * stride_kp + off * stride_ks + kh * stride_kh, stride_kh,
                         heads, offs, kv_ok, y1, y2, HALF)
            if KV_OUT:
                _store_heads(ko_ptr + r * stride_kor + t * stride_kot + kh * stride_koh, stride_koh,
                             heads, offs, ok, y1, y2, HALF)
        else:  # value heads, as they are -> the v pool at (page, vh, off) (and v_out[r, vh, t])
            vh = head0 - H - KV
            _store_heads(v_ptr + page * stride_vp + off * stride_vs + vh * stride_vh, stride_vh,
                         heads, offs, kv_ok, x1, x2, HALF)
            if KV_OUT:
                _store_heads(vo_ptr + r * stride_vor + t * stride_vot + vh * stride_voh, stride_voh,
                             heads, offs, ok, x1, x2, HALF)


# Calls of more tokens than this are prefills: bandwidth-bound, and R * T programs per head
# tile fill the GPU many times over (616 tokens at H = Hkv = 32: 3,696 programs of 16 heads).
_PREFILL_TOKENS = 256


def _block_heads(H, KV, block_half, tokens):
    """Heads per program: the largest power of two dividing H and KV within a tile budget.

    Up to _PREFILL_TOKENS tokens (R * T: decode, verification) the call is latency-bound and
    more, smaller programs win: ~1024 elements a tile (8 heads of 128; an H200 sweep,
    benchmarks/results/rope_kv_write.json). A prefill is bandwidth-bound: twice that (16 heads
    of 128), so that each thread of the 4 warps loads one 16-byte vector (8 bf16) per half
    of the tile, and each program's cos/sin loads serve twice the heads. Chosen by that
    argument, not measured (the benchmark's prefill rows time the head tiles around it).
    """
    g = math.gcd(H, KV)
    cap = max(1, (1024 if tokens > _PREFILL_TOKENS else 512) // block_half)
    b = 1
    while b * 2 <= cap and g % (b * 2) == 0:
        b *= 2
    return b


def rope_kv_write(qkv, cos, sin, k_cache, v_cache, block_table, lengths, num_heads, num_kv_heads, *, out=None,
                  rows=None, k_out=None, v_out=None):
    """Triton RoPE + KV write; see `tabed_engine.ops.rope_kv_write` for the contract.

    qkv [R, T, (H + 2 Hkv) * D] (unit last stride), cos/sin [R, T, D] float32, page pools
    [P, Hkv, PAGE, D] (unit last stride), block_table [Rc, W] int32 (unit last stride; the cache
    spans S = W * PAGE slots), lengths [R] int32 -> q [R, T, H, D] in qkv's dtype.
    Writes slot lengths[r] + t of cache row rows[r] (page block_table[rows[r], slot // PAGE])
    in place (rows: [R] int32/int64, default row r, then Rc = R), and rotated k / raw v to
    k_out/v_out [R, Hkv, T, D] when given (both or neither). D must be even.
    """
    H, KV = num_heads, num_kv_heads
    if qkv.dim() != 3 or k_cache.dim() != 4 or v_cache.dim() != 4:
        raise ValueError(f"qkv must be [R, T, (H + 2 Hkv) * D] and k/v page pools [P, Hkv, PAGE, D], got "
                         f"{tuple(qkv.shape)}, {tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    R, T, width = qkv.shape
    _, _, PAGE, D = k_cache.shape
    if block_table.dim() != 2 or block_table.dtype != torch.int32 or block_table.stride(1) != 1:
        raise ValueError(f"block_table must be int32 [Rc, W] with a unit last stride, got {block_table.dtype} "
                         f"{tuple(block_table.shape)}")
    RC, S = block_table.shape[0], block_table.shape[1] * PAGE
    if H <= 0 or KV <= 0 or H % KV:
        raise ValueError(f"query heads ({H}) must be a positive multiple of kv heads ({KV})")
    if width != (H + 2 * KV) * D or k_cache.shape[1] != KV or v_cache.shape != k_cache.shape:
        raise ValueError(f"qkv {tuple(qkv.shape)} does not match H={H}, Hkv={KV} and caches "
                         f"{tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    if rows is None and RC != R:
        raise ValueError(f"block_table has {RC} rows for {R} input rows: pass rows= to pick them")
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
    if rows is not None and (rows.shape != (R,) or rows.dtype not in (torch.int32, torch.int64)):
        raise ValueError(f"rows must be int32 or int64 [{R}], got {rows.dtype} {tuple(rows.shape)}")
    if (k_out is None) != (v_out is None):
        raise ValueError("k_out and v_out come together")
    kv_out = () if k_out is None else (k_out, v_out)
    for name, t in zip(("k_out", "v_out"), kv_out):
        if t.shape != (R, KV, T, D) or t.dtype != qkv.dtype:
            raise ValueError(f"{name} must be [{R}, {KV}, {T}, {D}] {qkv.dtype}, got {t.dtype} {tuple(t.shape)}")
    if any(t.stride(-1) != 1 for t in (qkv, cos, sin, k_cache, v_cache, *kv_out)):
        raise ValueError("qkv, cos, sin, k_cache, v_cache, k_out and v_out need a contiguous last dimension")
    others = (cos, sin, k_cache, v_cache, block_table, lengths, *kv_out) + (() if rows is None else (rows,))
    if any(t.device != qkv.device for t in others):
        raise ValueError("qkv, cos, sin, k_cache, v_cache, block_table, lengths, rows, k_out and v_out must be "
                         "on one device")
    if out is None:
        out = torch.empty((R, T, H, D), device=qkv.device, dtype=qkv.dtype)
    elif out.shape != (R, T, H, D) or out.dtype != qkv.dtype or out.device != qkv.device or out.stride(-1) != 1:
        raise ValueError(f"out must be {(R, T, H, D)} {qkv.dtype} on {qkv.device} with a contiguous last dim")
    if R == 0 or T == 0:
        return out
    lengths = lengths.contiguous()
    has_rows = rows is not None
    rows = rows.contiguous() if has_rows else lengths          # unread without HAS_ROWS
    k_out, v_out = kv_out or (k_cache, v_cache)                # unwritten without KV_OUT
    use_pdl = pdl(qkv.device)
    half = D // 2
    block_half = triton.next_power_of_2(half)
    block_h = _block_heads(H, KV, block_half, R * T)
    _rope_kv_write_kernel[(R * T, (H + 2 * KV) // block_h)](
        qkv, cos, sin, lengths, rows, block_table, out, k_cache, v_cache, k_out, v_out,
        qkv.stride(0), qkv.stride(1), cos.stride(0), cos.stride(1), sin.stride(0), sin.stride(1),
        out.stride(0), out.stride(1), out.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_table.stride(0),
        k_out.stride(0), k_out.stride(1), k_out.stride(2),
        v_out.stride(0), v_out.stride(1), v_out.stride(2),
        T, S, RC,
        H=H, KV=KV, HALF=half, PAGE=PAGE, BLOCK_H=block_h, BLOCK_HALF=block_half,
        HAS_ROWS=has_rows, KV_OUT=bool(kv_out), PDL=use_pdl,
        num_warps=_NUM_WARPS, enable_fp_fusion=False, launch_pdl=use_pdl,
    )
    return out
