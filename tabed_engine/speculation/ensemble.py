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

That one position is weak evidence: every view usually predicts the target's first token
almost exactly (KL ~ 1e-3), so 1/KL there ranks the views by noise. With greedy decoding and
a divergence policy the engine therefore runs the first block as a view tree
(`speculative.view_tree_block`): each view drafts its own chain and the target verifies all
of them at once; `EnsembleState.step_views` then records each view against the target along
its own chain, γ positions per view, before the first mixture is drafted.
"""
from __future__ import annotations

import copy

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

    policy: str = "hedge"
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
        # each row's next free slot: requests join a continuous batch at different blocks
        self.cursor = torch.zeros(batch, dtype=torch.long, device=device)  # [B]
        self.uniform = torch.full((batch, K), 1.0 / K, device=device)

    @property
    def adaptive(self) -> bool:
        return self.cfg.policy in ("kld", "tvd", "w-grid", "hedge") and self.K > 1

    @property
    def uses_normalisers(self) -> bool:
        """Whether `step` wants the rows' log-normalisers: TV (`tvd`) is then one pass over
        the logits instead of two (KL needs none up front)."""
        return self.adaptive and self.cfg.policy == "tvd"

    def reset(self):
        self.valid.zero_()
        self.cursor.zero_()

    def reset_rows(self, rows: slice):
        """Empty the history of `rows` (requests admitted there start at slot 0; their next
        weights are uniform until a position is recorded); the other rows keep theirs. In
        place, no host sync."""
        self.valid[rows] = False
        self.cursor[rows] = 0

    def step(self, p_logits, q_logits, n_acc, cursor, temperature: float = 1.0, p_lse=None, q_lse=None,
             all_positions: Optional[bool] = None):
        """Record one block at slots cursor.. and return (next weights [B, K], new cursor).

        p_logits [B, P, V] target, q_logits [B, K, P, V] views, n_acc [B] accepted drafts,
        optional p_lse [B, P] and q_lse [B, K, P] their rows' logsumexp(logits / temperature):
        positions 0..n_acc (the accepted ones plus the first rejected) are recorded; all P with
        `hedge` unless `all_positions` is False (trees: positions off the accepted path have
        no common context). Idempotent in its inputs (rewrites the same slots), as graph warm-up requires.
        Two or three launches on the GPU: `window_divergence` (one pass for KL alone) and
        `history_update`."""
        from tabed_engine.ops.history_update import POLICY_DIV, POLICY_GRID, POLICY_HEDGE, history_update
        from tabed_engine.ops.window_divergence import window_divergence

        if not self.adaptive:
            return self.uniform, cursor + p_logits.shape[1]
        kl, tv, gm, gkl = window_divergence(p_logits, q_logits, temperature=temperature, grid=self.grid,
                                            tv=self.cfg.policy == "tvd", p_lse=p_lse, q_lse=q_lse)
        policy = {"w-grid": POLICY_GRID, "hedge": POLICY_HEDGE}.get(self.cfg.policy, POLICY_DIV)
        return history_update(tv if self.cfg.policy == "tvd" else kl, gm, gkl, n_acc, cursor, self.valid,
                              self.div, self.match, self.gkl, self.grid, policy=policy, window=self.cfg.window,
                              temperature=self.cfg.temperature or 1.0, clip=HEDGE_CLIP,
                              all_positions=self.cfg.policy == "hedge" if all_positions is None else all_positions)

    def step_views(self, p_logits, q_logits, cursor, temperature: float = 1.0):
        """Record P positions where each view has its own target distributions and return
        (next weights [B, K], new cursor): the first block's view tree, where view k drafted its
        own chain and p_logits[:, k] are the target's logits along that chain. All P positions
        count for every view (each compares view k with the target on the same context).
        p_logits, q_logits: [B, K, P, V]. Divergence policies (kld, tvd, hedge) only."""
        from tabed_engine.ops.history_update import POLICY_DIV, POLICY_HEDGE, history_update
        from tabed_engine.ops.window_divergence import window_divergence

        if self.cfg.policy not in ("kld", "tvd", "hedge"):
            raise ValueError(f"per-view history needs a divergence policy, not {self.cfg.policy!r}")
        B, K, P, V = q_logits.shape
        # each (request, view) as a request with one view
        kl, tv, _, _ = window_divergence(p_logits.reshape(B * K, P, V), q_logits.reshape(B * K, 1, P, V),
                                         temperature=temperature, tv=self.cfg.policy == "tvd")
        div = (tv if self.cfg.policy == "tvd" else kl).view(B, K, P)
        n_all = torch.full((B,), P - 1, dtype=torch.long, device=div.device)
        return history_update(div, None, None, n_all, cursor, self.valid, self.div, self.match, self.gkl, None,
                              policy=POLICY_HEDGE if self.cfg.policy == "hedge" else POLICY_DIV,
                              window=self.cfg.window, temperature=self.cfg.temperature or 1.0, clip=HEDGE_CLIP,
                              all_positions=True)


def history_step(state: EnsembleState, tlogits, q_logits, n_acc, cursor, t_lse=None, q_lse=None, *,
                 temperature: float, kv_len=None):
    """Graph-capturable history update: tlogits [B, γ+1, V] from verification, q_logits
    [γ, B*K, V] from the draft loop, optionally their normalisers t_lse [B, γ+1] and q_lse
    [γ, B*K] (see `EnsembleState.uses_normalisers`). Returns (weights for the next block,
    new cursor)."""
    gamma, BK, V = q_logits.shape
    q = q_logits.view(gamma, state.B, state.K, V).permute(1, 2, 0, 3)
    if t_lse is not None:
        t_lse, q_lse = t_lse[:, :gamma], q_lse.view(gamma, state.B, state.K).permute(1, 2, 0)
    return state.step(tlogits[:, :gamma], q, n_acc, cursor, temperature, p_lse=t_lse, q_lse=q_lse)


def confidence_weights(logits: torch.Tensor, B: int, K: int, temperature: float) -> torch.Tensor:
    """`confidence` policy: one-hot weights [B, K] on the view whose next-token distribution
    has the largest max probability. logits: [B*K, V]."""
    x = logits.float() / temperature
    conf = (x.max(-1).values - torch.logsumexp(x, -1)).view(B, K)
    # scatter, not F.one_hot: one_hot validates its input with a host sync on CUDA, which a
    # CUDA-graph capture cannot contain
    return torch.zeros_like(conf).scatter_(1, conf.argmax(-1, keepdim=True), 1.0)


def state_rows(state: EnsembleState, start: int, stop: int) -> EnsembleState:
    """Rows [start, stop) of an ensemble history as a history sharing its memory."""
    view = copy.copy(state)
    view.B = stop - start
    for name in ("valid", "div", "match", "gkl", "cursor", "uniform"):
        setattr(view, name, getattr(state, name)[start:stop])
    return view
