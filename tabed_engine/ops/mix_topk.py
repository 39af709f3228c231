"""The children of a draft tree's frontier nodes from each node's ensemble mixture.

For request b and frontier node t, q = sum_k w[b, (t,) k] softmax(logits[b*K + k, t] / T) over
the vocabulary; the children are the k most probable tokens (greedy) or k draws without
replacement (Gumbel-top-k: the top k of log q + Gumbel noise, the noise a counter-based hash of
a device seed and offset), with their log q. The Triton kernel (CUDA) stores q only where the
caller asks for it (sampling: the verification reads it; a greedy walk reads only the tokens).
"""
from __future__ import annotations

from typing import Optional

import torch

KERNEL_MAX_K = 8   # children per node the kernel takes (its unrolled selection rounds)
_M1, _M2, _GOLD = -4658895280553007687, -7723592293110705685, -7046029254386353131  # splitmix64 (int64)


def _shr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def hash_uniform(seed: torch.Tensor, offset: torch.Tensor, n: int) -> torch.Tensor:
    """n uniforms in (0, 1), float64, from splitmix64 of (seed, offset + i): device tensors in,
    no host sync, the same numbers on every device (graph-safe, unlike a host generator)."""
    z = seed + (offset + torch.arange(n, device=seed.device)) * _GOLD
    z = (z ^ _shr(z, 30)) * _M1
    z = (z ^ _shr(z, 27)) * _M2
    z = z ^ _shr(z, 31)
    return (_shr(z, 11).double() + 0.5) * 2.0 ** -53


def pick_children(logq: torch.Tensor, k: int, greedy: bool, seed, offset) -> torch.Tensor:
    """k distinct children per row of log-probabilities logq [..., V]: the top k (greedy) or
    k draws without replacement, in draw order (Gumbel-top-k). Returns token ids [..., k]."""
    if greedy:
        return logq.topk(k, dim=-1).indices
    u = hash_uniform(seed, offset, logq.numel()).view(logq.shape)
    gumbel = -torch.log(-torch.log(u))
    return (logq.double() + gumbel).topk(k, dim=-1).indices


def mix_views(logits: torch.Tensor, w: torch.Tensor, temperature: float) -> torch.Tensor:
    """Mixture probabilities [B, T, V] fp32 of the views' logits [B*K, T, V] with weights
    w [B, K] (or [B, T, K]): sum_k w_k softmax(logits_k / temperature)."""
    BK, T, V = logits.shape
    B = w.shape[0]
    p = torch.softmax(logits.float() / temperature, dim=-1).view(B, BK // B, T, V)
    wk = w[:, :, None] if w.dim() == 2 else w.transpose(1, 2)          # [B, K, T]
    return (p * wk[..., None]).sum(1)


def mix_topk_reference(logits: torch.Tensor, w: torch.Tensor, k: int, temperature: float = 1.0, *, seed=None,
                       offset=None, mixture_out=None, out_rows=None):
    """Plain PyTorch (ground truth for tests; the CPU path): `mix_views`, log, `pick_children`."""
    q = mix_views(logits, w, temperature)
    if mixture_out is not None:
        mixture_out.scatter_(1, out_rows[..., None].expand(q.shape), q)
    logq = torch.log(q)
    ids = pick_children(logq, k, seed is None, seed, offset)
    return ids, logq.gather(-1, ids)


def mix_topk(logits: torch.Tensor, w: torch.Tensor, k: int, temperature: float = 1.0, *, seed=None, offset=None,
             mixture_out=None, out_rows=None, kernel: Optional[bool] = None):
    """Each frontier node's k children and their log-probabilities under its mixture.

    Parameters
    ----------
    logits : Tensor [B*K, T, V], bf16/fp16/fp32, unit last stride, any other strides
        Rows b*K .. b*K+K-1 are the K views of request b; T frontier nodes.
    w : Tensor [B, K] or [B, T, K] fp32
        Mixture weights (per request, or per node as the `confidence` policy gives).
    k : int, 1 <= k <= V (the kernel: at most KERNEL_MAX_K; more, as the root's children of a
        tree wider than that, take the reference)
    temperature : float > 0
    seed, offset : Tensor [1] int64, optional
        Sampling: k draws without replacement, ranked by log q + Gumbel noise, the noise of
        node (b, t) and token v from `hash_uniform(seed, offset + (b * T + t) * V + v)`.
        None: greedy, the top k of q.
    mixture_out, out_rows : Tensor [B, N, V] fp32 (unit last stride), Tensor [B, T] int64, optional
        Also store node (b, t)'s mixture q into mixture_out[b, out_rows[b, t]].
    kernel : bool, optional
        None: the Triton kernel for CUDA tensors and k <= KERNEL_MAX_K, the reference
        otherwise. True: as for CUDA tensors whatever the device (tests run the kernel on the
        CPU under the Triton interpreter); False: the reference.

    Returns
    -------
    ids : Tensor [B, T, k] int64, in rank order; the kernel breaks exact ties by the lowest
        token id (torch.topk does not say)
    logq : Tensor [B, T, k] fp32, log q of those tokens
    """
    if (logits.is_cuda if kernel is None else kernel) and k <= KERNEL_MAX_K:
        from tabed_engine.kernels.mix_topk import mix_topk as fn
    else:
        fn = mix_topk_reference
    return fn(logits, w, k, temperature, seed=seed, offset=offset, mixture_out=mixture_out, out_rows=out_rows)
