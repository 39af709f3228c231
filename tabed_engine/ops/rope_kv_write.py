"""RoPE on the new tokens' q and k, and their K/V written into the paged cache.

Row r's T new tokens come out of the fused qkv projection as [q heads | k heads | v heads]
per token. q and k are rotated (HF rotate-half convention, in float32, cast back); k and v
go to cache slots lengths[r] + t of cache row rows[r] (row r by default), and rotated q is
returned for attention (and, on request, the new k and v as dense [R, Hkv, T, D] tensors).
The Triton kernel does all of it in one launch (the CUDA decode path and the CUDA fresh
prefill); the reference is the chain of PyTorch ops the model runs elsewhere.
"""
from __future__ import annotations

import torch

from tabed_engine.ops.paged import write_slots


def rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin in float32, cast back to x's dtype.

    x: [..., D]; cos/sin: float32, broadcastable to x (e.g. x [R, T, H, D], cos [R, T, 1, D]).
    """
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


def use_kernel(qkv: torch.Tensor, head_dim: int) -> bool:
    """Whether `rope_kv_write` runs the Triton kernel: CUDA tensors and an even head dim (an
    odd one is not rotate-half pairs: reference only)."""
    return qkv.is_cuda and head_dim % 2 == 0


def rope_kv_write_reference(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    lengths: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    *,
    out: torch.Tensor | None = None,
    rows: torch.Tensor | None = None,
    k_out: torch.Tensor | None = None,
    v_out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain-PyTorch RoPE + cache write (split, two rotations, two index_put writes).

    Same contract as `rope_kv_write`; cache slots past the end and rows past the cache raise
    instead of being dropped.
    """
    R, T, _ = qkv.shape
    D = k_cache.shape[-1]
    q, k, v = qkv.view(R, T, -1, D).split([num_heads, num_kv_heads, num_kv_heads], dim=2)
    cos, sin = cos.reshape(R, T, 1, D), sin.reshape(R, T, 1, D)
    q, k = rope_reference(q, cos, sin), rope_reference(k, cos, sin)
    table = block_table if rows is None else block_table[rows.long()]
    slots = lengths.long()[:, None] + torch.arange(T, device=qkv.device)[None, :]       # [R, T]
    write_slots(k_cache, table, slots, k)
    write_slots(v_cache, table, slots, v)
    if k_out is not None:
        k_out.copy_(k.transpose(1, 2))
    if v_out is not None:
        v_out.copy_(v.transpose(1, 2))
    return q.contiguous() if out is None else out.copy_(q)


def rope_kv_write(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    lengths: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    *,
    out: torch.Tensor | None = None,
    rows: torch.Tensor | None = None,
    k_out: torch.Tensor | None = None,
    v_out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rotate q and k of the new tokens and write k, v into the cache: the Triton kernel for
    CUDA tensors with an even head dim (`use_kernel`), else the reference.

    Parameters
    ----------
    qkv : torch.Tensor
        [R, T, (H + 2 Hkv) * D] fused projection output, per token q heads then k heads then
        v heads (float16/bfloat16/float32, contiguous last dimension).
    cos, sin : torch.Tensor
        [R, T, D] or [R, T, 1, D] float32, the RoPE table rows at each token's position.
    k_cache, v_cache : torch.Tensor
        [P, Hkv, PAGE, D] one layer's page pool (strides honoured, unit last stride), written in
        place at slots lengths[r] + t of row rows[r]. The caller keeps lengths[r] + T <= S
        (the kernel drops writes past the end, the reference raises).
    block_table : torch.Tensor
        [Rc, W] int32 (unit last stride): row c's slot s is in page block_table[c, s // PAGE];
        the cache spans S = W * PAGE slots. Read on the device only.
    lengths : torch.Tensor
        [R] int32 on qkv's device, committed prefix length per row. Read on the device only:
        the call is CUDA-graph safe.
    num_heads, num_kv_heads : int
        H and Hkv, H a multiple of Hkv.
    out : torch.Tensor, optional
        [R, T, H, D] buffer in qkv's dtype for rotated q, any strides with a unit last one:
        `buf.transpose(1, 2)` of a contiguous [R, H, T, D] `buf` lays q out for SDPA.
    rows : torch.Tensor, optional
        [R] int32 or int64 on qkv's device: the cache row input row r writes to (default row
        r, and then Rc = R). Read on the device only, like `lengths`, so one CUDA graph serves
        every row; for the same reason the call cannot check it: the caller keeps the rows
        distinct and in [0, Rc) (the kernel drops writes to other rows, the reference raises
        past the end).
    k_out, v_out : torch.Tensor, optional
        [R, Hkv, T, D] buffers in qkv's dtype (unit last stride), both or neither: they also
        receive rotated k and raw v (e.g. contiguous keys and values for SDPA).

    Returns
    -------
    torch.Tensor
        [R, T, H, D] rotated q in qkv's dtype (contiguous unless `out` is given).
    """
    R, T = qkv.shape[:2]
    D = k_cache.shape[-1]
    if use_kernel(qkv, D):
        from tabed_engine.kernels import rope_kv_write as _k

        return _k.rope_kv_write(qkv, cos.reshape(R, T, D), sin.reshape(R, T, D), k_cache, v_cache,
                                block_table, lengths, num_heads, num_kv_heads, out=out, rows=rows, k_out=k_out, v_out=v_out)
    return rope_kv_write_reference(qkv, cos, sin, k_cache, v_cache, block_table, lengths, num_heads, num_kv_heads,
                                   out=out, rows=rows, k_out=k_out, v_out=v_out)
