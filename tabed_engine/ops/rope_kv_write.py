"""RoPE on the new tokens' q and k, and their K/V written into the static cache.

Row r's T new tokens come out of the fused qkv projection as [q heads | k heads | v heads]
per token. q and k are rotated (HF rotate-half convention, in float32, cast back); k and v
go to cache slots lengths[r] + t, and rotated q is returned for attention. The Triton
kernel does all of it in one launch (the CUDA decode path); the reference is the chain of
PyTorch ops the model runs elsewhere.
"""
from __future__ import annotations

import torch


def rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin in float32, cast back to x's dtype.

    x: [..., D]; cos/sin: float32, broadcastable to x (e.g. x [R, T, H, D], cos [R, T, 1, D]).
    """
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


def rope_kv_write_reference(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    lengths: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain-PyTorch RoPE + cache write (split, two rotations, two index_put writes).

    Same contract as `rope_kv_write`; cache slots past the end raise instead of being dropped.
    """
    R, T, _ = qkv.shape
    D = k_cache.shape[-1]
    q, k, v = qkv.view(R, T, -1, D).split([num_heads, num_kv_heads, num_kv_heads], dim=2)
    cos, sin = cos.reshape(R, T, 1, D), sin.reshape(R, T, 1, D)
    q, k = rope_reference(q, cos, sin), rope_reference(k, cos, sin)
    rows = torch.arange(R, device=qkv.device)[:, None]                                  # [R, 1]
    slots = lengths.long()[:, None] + torch.arange(T, device=qkv.device)[None, :]       # [R, T]
    k_cache[rows, :, slots] = k
    v_cache[rows, :, slots] = v
    return q.contiguous() if out is None else out.copy_(q)


def rope_kv_write(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    lengths: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rotate q and k of the new tokens and write k, v into the cache: the Triton kernel for
    CUDA tensors with an even head dim, else the reference.

    Parameters
    ----------
    qkv : torch.Tensor
        [R, T, (H + 2 Hkv) * D] fused projection output, per token q heads then k heads then
        v heads (float16/bfloat16/float32, contiguous last dimension).
    cos, sin : torch.Tensor
        [R, T, D] or [R, T, 1, D] float32, the RoPE table rows at each token's position.
    k_cache, v_cache : torch.Tensor
        [R, Hkv, S, D] one layer of the static cache (strides honoured), written in place at
        slots lengths[r] + t. The caller keeps lengths[r] + T <= S (the kernel drops writes
        past the end, the reference raises).
    lengths : torch.Tensor
        [R] int32 on qkv's device, committed prefix length per row. Read on the device only:
        the call is CUDA-graph safe.
    num_heads, num_kv_heads : int
        H and Hkv, H a multiple of Hkv.
    out : torch.Tensor, optional
        [R, T, H, D] buffer in qkv's dtype for rotated q.

    Returns
    -------
    torch.Tensor
        [R, T, H, D] rotated q in qkv's dtype (contiguous unless `out` is given).
    """
    R, T = qkv.shape[:2]
    D = k_cache.shape[-1]
    if qkv.is_cuda and D % 2 == 0:  # an odd head dim is not rotate-half pairs: reference only
        from tabed_engine.kernels import rope_kv_write as _k

        return _k.rope_kv_write(qkv, cos.reshape(R, T, D), sin.reshape(R, T, D), k_cache, v_cache,
                                lengths, num_heads, num_kv_heads, out=out)
    return rope_kv_write_reference(qkv, cos, sin, k_cache, v_cache, lengths, num_heads, num_kv_heads,
                                   out=out)
