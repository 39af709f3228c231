"""Divergences between the target distribution and each draft view over a window.

For each request b, view k and window position p: KL(p || q_k) and TV(p, q_k), and with a
weight grid the `w-grid` statistics of each mixture sum_k g_k q_k. The engine calls this
once per speculative block (B requests, P = gamma positions, K <= 4 views, V ~ 32k): B * P
is small, so the vocabulary itself is split over programs. Three modes, each one path:

* KL alone (`kld`, `hedge`): `_wd_kl_kernel`, one launch and one pass. KL needs no
  normaliser up front: sum_v p_v (y_p - y_k) accumulates against the running max of the
  target and is rescaled with its sum-exp; the last program of each row folds the splits.
* KL and TV from given normalisers (`tvd`: the draft's mixing kernel returns the views'
  logsumexp, the greedy verification the target's): `_wd_given_kernel`, one launch and one
  pass, every term final when read.
* TV without normalisers, or a weight grid: two launches. `_wd_stats_kernel` computes per V
  split the max and sum-exp of the target and the views and the target's first argmax;
  `_wd_div_kernel` merges them and computes over its split the partial KL and sum |p - q_k|
  and, for the G_BLOCK weight vectors of its grid chunk, each mixture's partial (max, first
  argmax) and KL(p || mixture), so G x P x V is never stored. The last program of each
  (row, chunk) to arrive (atomic counter) reduces the partials in split order.

Streaming passes keep running values per thread over 16-byte groups that thread alone
loads (see `_common`); exponentials are exp2 with temperature and log2(e) folded into one
scale, divergences summed in log2 units and scaled by ln 2 once. Everything accumulates in
fp32; argmax ties resolve to the lowest index (torch.argmax); the split counts come from the
shapes and the SM count (`one_pass_plan`, `two_pass_plan`: no host sync, so the launcher
runs in graph capture); partial sums are reduced in a fixed order: results are
deterministic.

Files: the launch plans and their tuning constants in `window_divergence_plan`, the one-pass
kernels in `window_divergence_one_pass`, the two-pass kernels in `window_divergence_two_pass`;
this module checks the arguments and picks the path. The plans, `check_normalisers` and the
path launchers (`_kl_only`, `_given_norms`, `_two_pass`) are importable from here.
"""
import torch

from ._common import sm_count
from .window_divergence_one_pass import _given_norms, _kl_only
from .window_divergence_plan import OnePassPlan, TwoPassPlan, check_normalisers, one_pass_plan, two_pass_plan
from .window_divergence_two_pass import _two_pass

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def window_divergence(p_logits, q_logits, *, temperature=1.0, grid=None, tv=True, p_lse=None, q_lse=None,
                      plan=None):
    """Triton launcher; see `tabed_engine.ops.window_divergence.window_divergence`.
    KL alone (tv=False, no grid) and TV without a grid from given normalisers (p_lse,
    q_lse) are one launch and one pass over the logits; otherwise (TV without normalisers, a
    grid) two launches. `plan`: a `one_pass_plan` or `two_pass_plan` for these shapes and
    this mode (default: the device's)."""
    if p_logits.dim() != 3 or q_logits.dim() != 4:
        raise ValueError(f"p_logits must be [B, P, V] and q_logits [B, K, P, V], got "
                         f"{tuple(p_logits.shape)} and {tuple(q_logits.shape)}")
    B, P, V = p_logits.shape
    Bq, K, Pq, Vq = q_logits.shape
    if (Bq, Pq, Vq) != (B, P, V):
        raise ValueError(f"q_logits {tuple(q_logits.shape)} does not match p_logits {tuple(p_logits.shape)}")
    for name, t in (("p_logits", p_logits), ("q_logits", q_logits)):
        if t.dtype not in _FLOAT_DTYPES:
            raise TypeError(f"{name} dtype {t.dtype} not supported")
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dimension")
    if q_logits.device != p_logits.device:
        raise ValueError("p_logits and q_logits must be on the same device")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    given = check_normalisers(p_lse, q_lse, B, K, P, p_logits.device)
    dev = p_logits.device
    if grid is not None and (grid.dim() != 2 or grid.shape[1] != K or grid.dtype != torch.float32
                             or grid.device != dev):
        raise ValueError(f"grid must be float32 [G, {K}] on {dev}, got {tuple(grid.shape)} {grid.dtype}")
    G = 0 if grid is None else grid.shape[0]
    one_pass = grid is None and (given or not tv)
    itemsize = max(p_logits.element_size(), q_logits.element_size())
    kind = OnePassPlan if one_pass else TwoPassPlan
    if plan is None:
        if one_pass:
            plan = one_pass_plan(B, K, P, V, itemsize=itemsize, sms=sm_count(dev))
        else:
            plan = two_pass_plan(B, K, P, V, G, itemsize=itemsize, sms=sm_count(dev))
    elif (not isinstance(plan, kind) or (plan.B, plan.K, plan.P, plan.V) != (B, K, P, V)
          or plan.vec != (16 // itemsize if one_pass else min(16 // itemsize, plan.block1))
          or (not one_pass and plan.G != G)):
        raise ValueError(f"plan {plan} does not match these arguments")
    kl = torch.empty(B, K, P, dtype=torch.float32, device=dev)
    tv = torch.empty(B, K, P, dtype=torch.float32, device=dev) if tv or grid is not None else None
    match = torch.empty(B, G, P, dtype=torch.uint8, device=dev) if grid is not None else None
    gkl = torch.empty(B, G, P, dtype=torch.float32, device=dev) if grid is not None else None
    if B * P and K and V:
        if one_pass and tv is not None:
            _given_norms(p_logits, q_logits, p_lse, q_lse, kl, tv, temperature, plan)
        elif one_pass:
            _kl_only(p_logits, q_logits, kl, temperature, plan)
        else:
            _two_pass(p_logits, q_logits, grid, kl, tv, match, gkl, temperature, plan)
    return kl, tv, (match.view(torch.bool) if match is not None else None), gkl
