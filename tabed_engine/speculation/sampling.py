"""Target-side token selection shared by autoregressive and speculative decoding, so that
both sample from exactly the same processed distribution: one `SamplingParams` for a batch
whose requests pick tokens alike, or `RowSampling` (settings per row) for a batch that mixes
temperatures, top-k / top-p and greedy requests. Seeded rows pick by the Gumbel coupling
(`tabed_engine.speculation.coupling`) where unseeded ones sample."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch

from tabed_engine.config import SamplingParams
from tabed_engine.speculation.coupling import coupled_scores, seed_value


@dataclass(frozen=True, eq=False)
class RowSampling:
    """Per-row target sampling settings of a batch, as device tensors [b] (views of the
    runner's per-slot buffers: a captured graph reads them in place). A batch with these
    samples (`greedy` is False); its greedy rows get a one-hot target distribution at the
    argmax, which sampling and the lossless verification turn into exactly the greedy token.
    Rows with `coupled` set pick by the seeded Gumbel coupling with their `seed`.
    The flags say which filters any row uses (they select the work, so they key graphs)."""

    temperature: torch.Tensor   # [b] float32 > 0 (greedy rows: 1)
    top_k: torch.Tensor         # [b] int64, 0 = no top-k
    top_p: torch.Tensor         # [b] float32, 1 = no top-p
    greedy_rows: torch.Tensor   # [b] bool
    use_top_k: bool
    use_top_p: bool
    any_greedy: bool
    seed: Optional[torch.Tensor] = None      # [b] int64 (`coupling.seed_value`), coupled rows
    coupled: Optional[torch.Tensor] = None   # [b] bool: the row picks by the coupling
    any_coupled: bool = False
    greedy = False

    @property
    def key(self) -> tuple:
        return ("rows", self.use_top_k, self.use_top_p, self.any_greedy, self.any_coupled)


Sampling = Union[SamplingParams, RowSampling]


def sampling_key(sp: Sampling) -> tuple:
    """What about `sp` shapes a captured graph's work (greedy ignores temperature, top-k and
    top-p: greedy requests with any of them share one graph)."""
    if isinstance(sp, RowSampling):
        return sp.key
    return ("greedy",) if sp.greedy else (sp.temperature, sp.top_k, sp.top_p)


def row_filtered_probs(x: torch.Tensor, top_k: Optional[torch.Tensor], top_p: Optional[torch.Tensor]) -> torch.Tensor:
    """softmax(x) restricted per row to its top-k, then its top-p (renormalised), as the target
    filters: x [R, ..., V] float32 scores (logits / T, or a draft's log q); top_k [R] int64
    (0 = none) and top_p [R] float32 (1 = none), None where no row of the batch uses that
    filter (the sort is skipped). Zero exactly at the filtered tokens."""
    shape = (-1,) + (1,) * (x.dim() - 1)
    V = x.shape[-1]
    if top_k is not None or top_p is not None:
        sx, idx = torch.sort(x, dim=-1, descending=True)
    if top_k is not None:
        k = top_k.view(shape)
        kth = sx.gather(-1, (torch.where(k > 0, k.clamp(max=V), V) - 1).expand(*x.shape[:-1], 1))
        x = x.masked_fill(x < kth, float("-inf"))          # ties at the k-th value kept
    probs = torch.softmax(x, dim=-1)
    if top_p is not None:
        top_p = top_p.view(shape)
        sorted_p = probs.gather(-1, idx)
        before = sorted_p.cumsum(-1) - sorted_p           # mass strictly before each token
        drop_sorted = (before >= top_p) & (top_p < 1.0)
        drop = torch.zeros_like(drop_sorted).scatter(-1, idx, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def draft_filter(rs: "Sampling") -> dict:
    """The request filters a coupled draft applies to its proposals (`chain.draft_block`,
    `tree.tree_draft` inputs top_k / top_p): the batch's per-row tensors for each filter some
    row uses, none otherwise. Under the coupling a drafted token the target's filter removed is
    never accepted (on the tiny fixture top-k 40 of 173 took a chain's acceptance to ~0)."""
    if not isinstance(rs, RowSampling) or not rs.any_coupled:
        return {}
    return {name: t for name, t, used in (("top_k", rs.top_k, rs.use_top_k), ("top_p", rs.top_p, rs.use_top_p))
            if used}


def _row_probs(logits: torch.Tensor, rs: RowSampling, lse_out) -> torch.Tensor:
    """`target_probs` with each row's own settings (rows = the first dimension of logits)."""
    shape = (-1,) + (1,) * (logits.dim() - 1)
    x = logits.float() / rs.temperature.view(shape)
    if lse_out is not None:
        torch.logsumexp(x, dim=-1, out=lse_out)
    probs = row_filtered_probs(x, rs.top_k if rs.use_top_k else None, rs.top_p if rs.use_top_p else None)
    if rs.any_greedy:
        top = logits.argmax(-1, keepdim=True)
        onehot = torch.zeros_like(probs).scatter_(-1, top, 1.0)
        probs = torch.where(rs.greedy_rows.view(shape), onehot, probs)
    return probs


def target_probs(logits: torch.Tensor, sp: Sampling, lse_out: torch.Tensor | None = None) -> torch.Tensor:
    """Processed target distribution: softmax(logits / T) restricted to top-k / top-p (per row
    with `RowSampling`, where greedy rows are one-hot at the argmax).

    logits: [..., V] float32 -> probabilities [..., V] float32 (rows sum to 1).
    top-k keeps the k largest logits (ties at the k-th value kept); top-p keeps the smallest
    prefix of the sorted distribution whose mass reaches p (the token crossing p is kept).
    lse_out: optional [...] float32, filled with logsumexp(logits / T) before top-k / top-p
    (the unrestricted distribution's normaliser, for the history's divergences).
    """
    if isinstance(sp, RowSampling):
        return _row_probs(logits, sp, lse_out)
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


def pick_tokens(logits: torch.Tensor, sp: Sampling, generator, pos: torch.Tensor | None = None) -> torch.Tensor:
    """Next token per row from target logits [R, V]: argmax when greedy, a sample of the
    processed distribution, or for coupled rows (a seeded `SamplingParams`, `RowSampling`'s
    coupled rows) the Gumbel coupling's token at positions pos [R] int64 (device; needed then)."""
    if sp.greedy:
        return torch.argmax(logits, dim=-1)
    probs = target_probs(logits, sp)
    if isinstance(sp, RowSampling):
        tok = sample_from(probs, generator)
        if not sp.any_coupled:
            return tok
        return torch.where(sp.coupled, coupled_scores(logits, probs, sp.temperature, sp.seed, pos).argmax(-1), tok)
    if sp.coupled:
        seed = torch.full((logits.shape[0],), seed_value(sp.seed), dtype=torch.long, device=logits.device)
        return coupled_scores(logits, probs, sp.temperature, seed, pos).argmax(-1)
    return sample_from(probs, generator)
