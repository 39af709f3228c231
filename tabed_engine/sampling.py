"""Target-side token selection shared by autoregressive and speculative decoding, so that
both sample from exactly the same processed distribution."""
from __future__ import annotations

import torch

from .config import SamplingParams


def target_probs(logits: torch.Tensor, sp: SamplingParams, lse_out: torch.Tensor | None = None) -> torch.Tensor:
    """Processed target distribution: softmax(logits / T) restricted to top-k / top-p.

    logits: [..., V] float32 -> probabilities [..., V] float32 (rows sum to 1).
    top-k keeps the k largest logits (ties at the k-th value kept); top-p keeps the smallest
    prefix of the sorted distribution whose mass reaches p (the token crossing p is kept).
    lse_out: optional [...] float32, filled with logsumexp(logits / T) before top-k / top-p
    (the unrestricted distribution's normaliser, for the history's divergences).
    """
    x = logits.float() / sp.temperature
    if lse_out is not None:
        torch.logsumexp(x, dim=-1, out=lse_out)
    if sp.top_k and sp.top_k < x.shape[-1]:
        kth = torch.topk(x, sp.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if sp.top_p < 1.0:
        sorted_p, idx = torch.sort(probs, dim=-1, descending=True)
        before = sorted_p.cumsum(-1) - sorted_p          # mass strictly before each token
        drop_sorted = before >= sp.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, idx, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample_from(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One sample per row via argmax(p / E), E ~ Exp(1) (no host sync). probs: [R, V]."""
    e = torch.empty_like(probs).exponential_(generator=generator)
    return torch.argmax(probs / e, dim=-1)


def pick_tokens(logits: torch.Tensor, sp: SamplingParams, generator) -> torch.Tensor:
    """Next token per row from target logits [R, V]: argmax when greedy, else a sample."""
    if sp.greedy:
        return torch.argmax(logits, dim=-1)
    return sample_from(target_probs(logits, sp), generator)
