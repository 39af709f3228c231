"""The children of a draft tree's frontier nodes: the top k tokens of each node's ensemble mixture.

For request b and frontier node t, q = sum_k w[b, (t,) k] softmax(logits[b*K + k, t] / T) over
the vocabulary; the children are the k most probable tokens, with their log q. The Triton
kernel (CUDA) never stores q: a greedy tree keeps only its tokens (the greedy walk reads no
mixture), so the [B, T, V] rows and their log are traffic it skips.
"""
from __future__ import annotations

from typing import Optional

import torch


def mix_views(logits: torch.Tensor, w: torch.Tensor, temperature: float) -> torch.Tensor:
    """Mixture probabilities [B, T, V] fp32 of the views' logits [B*K, T, V] with weights
    w [B, K] (or [B, T, K]): sum_k w_k softmax(logits_k / temperature)."""
    BK, T, V = logits.shape
    B = w.shape[0]
    p = torch.softmax(logits.float() / temperature, dim=-1).view(B, BK // B, T, V)
    wk = w[:, :, None] if w.dim() == 2 else w.transpose(1, 2)          # [B, K, T]
    return (p * wk[..., None]).sum(1)


def mix_topk_reference(logits: torch.Tensor, w: torch.Tensor, k: int, temperature: float = 1.0):
    """Plain PyTorch (ground truth for tests; the CPU path): `mix_views`, log, top k."""
    logq = torch.log(mix_views(logits, w, temperature))
    ids = logq.topk(k, dim=-1).indices
    return ids, logq.gather(-1, ids)


def mix_topk(logits: torch.Tensor, w: torch.Tensor, k: int, temperature: float = 1.0, *,
             kernel: Optional[bool] = None):
    """Top k tokens of each frontier node's mixture and their log-probabilities.

    Parameters
    ----------
    logits : Tensor [B*K, T, V], bf16/fp16/fp32, unit last stride, any other strides
        Rows b*K .. b*K+K-1 are the K views of request b; T frontier nodes.
    w : Tensor [B, K] or [B, T, K] fp32
        Mixture weights (per request, or per node as the `confidence` policy gives).
    k : int, 1 <= k <= min(8, V)
    temperature : float > 0
    kernel : bool, optional
        None: the Triton kernel for CUDA tensors, the reference otherwise. True: the kernel
        on any device (tests run it on the CPU under the Triton interpreter).

    Returns
    -------
    ids : Tensor [B, T, k] int64, by decreasing q; the kernel breaks exact ties by the lowest
        token id (torch.topk does not say)
    logq : Tensor [B, T, k] fp32, log q of those tokens
    """
    if kernel is None:
        kernel = logits.is_cuda
    if kernel:
        from tabed_engine.kernels.mix_topk import mix_topk as fn
    else:
        fn = mix_topk_reference
    return fn(logits, w, k, temperature)
