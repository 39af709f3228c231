"""Test-time adaptive ensemble weights (TABED).

After each verification the target's distributions at the accepted positions plus the
first rejected one are free; each view's divergence from them (and, for `w-grid`, how each
candidate weight vector's mixture would have done) is appended to a per-request history.
The next block's weights come from the last `window` recorded positions (0 = all).
All state lives on the device; nothing here syncs with the host.

`hedge` (exponential weights) also records the drafted positions after the first rejected
one: there the target and every view still condition on the same drafted context, so each
is a fair comparison of the views, and a block that fails early still yields γ positions of
evidence. Its weights are softmax(-Σ min(KL, 1) / temperature): the cumulative clipped
divergence sharpens the weights as evidence accumulates (1/Σ KL stays flat: w_T 0.43 of 4
views after a whole S4 answer), and the clip keeps one confidently wrong token from zeroing
a view. On the prefill position alone the absolute KLs are tiny and exponential weights
would be uniform, so that first block uses 1/KL like `kld`.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Optional

import torch

POLICIES = ("uniform", "kld", "tvd", "w-grid", "hedge", "confidence")
HEDGE_CLIP = 1.0   # nats: per-position cap of the KL that `hedge` accumulates


@dataclass
class EnsembleConfig:
    """policy: one of POLICIES. window: history positions used (0 = all). temperature:
    optional temperature on the weights of `kld`/`tvd` (w = softmax(-log D / temperature);
    None = 1, i.e. w ∝ 1/D) and `hedge` (w = softmax(-Σ min(KL, 1) / temperature)).
    grid_step: spacing of the `w-grid` simplex grid."""

    policy: str = "w-grid"
    window: int = 0
    temperature: Optional[float] = None
    grid_step: float = 0.1
    num_views: int = 2

    def __post_init__(self):
        if self.policy not in POLICIES:
            raise ValueError(f"unknown ensemble policy {self.policy!r}; choose one of {POLICIES}")
        if not isinstance(self.window, int) or self.window < 0:
            raise ValueError(f"window must be an int >= 0 (0 = all positions), got {self.window!r}")
        if self.temperature is not None and self.temperature <= 0:
            raise ValueError(f"weight temperature must be > 0, got {self.temperature}")
        steps = round(1.0 / self.grid_step) if self.grid_step > 0 else 0
        if steps < 1 or abs(steps * self.grid_step - 1.0) > 1e-6:
            raise ValueError(f"grid_step must divide 1 (e.g. 0.1, 0.25), got {self.grid_step}")

    def grid(self, device) -> torch.Tensor:
        """All weight vectors [G, K] with entries on multiples of grid_step summing to 1."""
        n, K = round(1.0 / self.grid_step), self.num_views
        pts = [c for c in itertools.product(range(n + 1), repeat=K - 1) if sum(c) <= n]
        g = torch.tensor([list(c) + [n - sum(c)] for c in pts], dtype=torch.float32, device=device)
        return g / n


class EnsembleState:
    """History for B requests × K views with room for `capacity` recorded positions per
    request. The write cursor is a device tensor and every method has fixed shapes, so one
    block's history update plus the next weights (`step`) is captured as a CUDA graph; the
    engine keeps one state per shape and `reset`s it per generation."""

    def __init__(self, cfg: EnsembleConfig, batch: int, capacity: int, device):
        self.cfg = cfg
        K = cfg.num_views
        self.K, self.B, self.capacity = K, batch, capacity
        self.valid = torch.zeros(batch, capacity, dtype=torch.bool, device=device)
        self.div = torch.zeros(batch, K, capacity, device=device)          # KL or TV per view
        self.grid = cfg.grid(device) if cfg.policy == "w-grid" and K > 1 else None
        G = 0 if self.grid is None else self.grid.shape[0]
        self.match = torch.zeros(batch, G, capacity, device=device)       # mixture argmax == target's
        self.gkl = torch.zeros(batch, G, capacity, device=device)          # KL(p || mixture)
        self.cursor = torch.zeros(1, dtype=torch.long, device=device)      # next free slot
        self.uniform = torch.full((batch, K), 1.0 / K, device=device)

    @property
    def adaptive(self) -> bool:
        return self.cfg.policy in ("kld", "tvd", "w-grid", "hedge") and self.K > 1

    def reset(self):
        self.valid.zero_()
        self.cursor.zero_()

    def step(self, p_logits, q_logits, n_acc, cursor, temperature: float = 1.0):
        """Record one block at slots cursor.. and return (next weights [B, K], new cursor).

        p_logits [B, P, V] target, q_logits [B, K, P, V] views, n_acc [B] accepted drafts:
        positions 0..n_acc (the accepted ones plus the first rejected) are recorded; all P with
        `hedge`. Idempotent in its inputs (rewrites the same slots), as graph warm-up requires."""
        from .ops.window_divergence import window_divergence

        P = p_logits.shape[1]
        idx = cursor + torch.arange(P, device=cursor.device)                  # [P]
        valid = torch.arange(P, device=n_acc.device)[None] <= n_acc[:, None]  # [B, P]
        if self.cfg.policy == "hedge":
            valid = torch.ones_like(valid)
        kl, tv, gm, gkl = window_divergence(p_logits, q_logits, temperature=temperature, grid=self.grid)
        self.valid.index_copy_(1, idx, valid)
        self.div.index_copy_(2, idx, tv if self.cfg.policy == "tvd" else kl)
        if self.grid is not None:
            self.match.index_copy_(2, idx, gm.float())
            self.gkl.index_copy_(2, idx, gkl)
        return self.weights(), cursor + P

    def _in_window(self) -> torch.Tensor:
        """[B, capacity] mask of the last `window` valid positions (all when window = 0)."""
        v = self.valid
        if self.cfg.window == 0:
            return v
        from_end = v.flip(-1).cumsum(-1).flip(-1)     # valid positions at or after each slot
        return v & (from_end <= self.cfg.window)

    def weights(self) -> torch.Tensor:
        """Weights [B, K] for the next block (uniform before any history)."""
        if not self.adaptive:
            return self.uniform
        m = self._in_window()[:, None]                                     # [B, 1, H]
        any_pos = m.flatten(1).any(-1, keepdim=True)                        # [B, 1]
        if self.cfg.policy == "w-grid":
            match = torch.where(m, self.match, 0.0).sum(-1)                 # [B, G]
            kl = torch.where(m, self.gkl, 0.0).sum(-1)                      # [B, G]
            best = match.max(-1, keepdim=True).values
            kl = kl.masked_fill(match < best, float("inf"))
            w = self.grid[kl.argmin(-1)]                                   # [B, K]
        elif self.cfg.policy == "hedge":
            t = self.cfg.temperature or 1.0
            d = torch.where(m, self.div, 0.0).sum(-1)                      # [B, K]
            first = torch.softmax(-torch.log(d.clamp_min(1e-12)), dim=-1)   # one position: 1/KL
            clipped = torch.where(m, self.div.clamp_max(HEDGE_CLIP), 0.0).sum(-1)
            later = torch.softmax(-clipped / t, dim=-1)
            w = torch.where(m.flatten(1).sum(-1, keepdim=True) <= 1, first, later)
        else:
            d = torch.where(m, self.div, 0.0).sum(-1)                      # [B, K]
            t = self.cfg.temperature or 1.0
            w = torch.softmax(-torch.log(d.clamp_min(1e-12)) / t, dim=-1)
        return torch.where(any_pos, w, self.uniform)


def history_step(state: EnsembleState, tlogits, q_logits, n_acc, cursor, *, temperature: float,
                 kv_len=None):
    """Graph-capturable history update: tlogits [B, γ+1, V] from verification, q_logits
    [γ, B*K, V] from the draft loop. Returns (weights for the next block, new cursor)."""
    gamma, BK, V = q_logits.shape
    q = q_logits.view(gamma, state.B, state.K, V).permute(1, 2, 0, 3)
    return state.step(tlogits[:, :gamma], q, n_acc, cursor, temperature)


def confidence_weights(logits: torch.Tensor, B: int, K: int, temperature: float) -> torch.Tensor:
    """`confidence` policy: one-hot weights [B, K] on the view whose next-token distribution
    has the largest max probability. logits: [B*K, V]."""
    x = logits.float() / temperature
    conf = (x.max(-1).values - torch.logsumexp(x, -1)).view(B, K)
    # scatter, not F.one_hot: one_hot validates its input with a host sync on CUDA, which a
    # CUDA-graph capture cannot contain
    return torch.zeros_like(conf).scatter_(1, conf.argmax(-1, keepdim=True), 1.0)
