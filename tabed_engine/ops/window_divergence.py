"""Per-view divergences from the target over a window of positions (ensemble history).

For each request b, view k and window position p: KL(p || q_k) and TV(p, q_k), and for
an optional grid of weight vectors g the `w-grid` policy statistics: does the argmax
of the mixture sum_k g_k q_k match the target argmax, and KL(p || mixture_g).
"""
import torch

_GRID_CHUNK = 16  # weight vectors per step of the reference: bounds B*16*P*V memory
# a mixture's probability is floored at float32's least positive value in its KL: a mixture
# with no mass where p has some (a draft fitted to a larger padded vocabulary, models/vocab.py)
# gets a large finite KL, not inf for every weight vector (which hid w-grid's tie-break)
MIX_FLOOR = 2.0 ** -149


def window_divergence_reference(p_logits, q_logits, *, temperature=1.0, grid=None, tv=True, p_lse=None,
                                q_lse=None):
    """Plain-PyTorch window divergences (ground truth for tests; CPU path of the engine).
    Given normalisers are used as they are (log p = logits / T - p_lse)."""
    if (p_lse is None) != (q_lse is None):
        raise ValueError("p_lse and q_lse are given together or not at all")
    if p_lse is None:
        logp = torch.log_softmax(p_logits.float() / temperature, dim=-1)     # [B, P, V]
        logq = torch.log_softmax(q_logits.float() / temperature, dim=-1)     # [B, K, P, V]
    else:
        logp = p_logits.float() / temperature - p_lse[..., None]
        logq = q_logits.float() / temperature - q_lse[..., None]
    p = logp.exp()
    q = logq.exp()
    p4 = p[:, None]
    kl = torch.where(p4 > 0, p4 * (logp[:, None] - logq), 0.0).sum(-1)  # [B, K, P]
    tv = 0.5 * (p4 - q).abs().sum(-1) if tv or grid is not None else None
    if grid is None:
        return kl, tv, None, None
    p_arg = p_logits.argmax(dim=-1)[:, None]                             # [B, 1, P]
    match, gkl = [], []
    for g in grid.float().split(_GRID_CHUNK):
        mix = torch.einsum("gk,bkpv->bgpv", g, q)                        # [B, g, P, V]
        match.append(mix.argmax(dim=-1) == p_arg)
        gkl.append(torch.where(p4 > 0, p4 * (logp[:, None] - mix.clamp_min(MIX_FLOOR).log()), 0.0).sum(-1))
    return kl, tv, torch.cat(match, dim=1), torch.cat(gkl, dim=1)


def window_divergence(p_logits, q_logits, *, temperature=1.0, grid=None, tv=True, p_lse=None, q_lse=None):
    """Divergences between the target and each draft view at P window positions.

    Parameters
    ----------
    p_logits : Tensor [B, P, V], bf16/fp16/fp32, unit last stride, any other strides
        Target logits.
    q_logits : Tensor [B, K, P, V], same dtypes and stride rules
        Draft logits of the K views (e.g. a permuted view of a [P, B, K, V] buffer).
    temperature : float > 0
        Both sides are softmax(logits / temperature).
    grid : Tensor [G, K] fp32, optional
        Mixture weight vectors (simplex grid) for the `w-grid` policy.
    tv : bool
        Also compute TV. Without TV and grid the GPU kernel makes one pass over the logits
        (KL needs no normaliser up front); TV needs both normalisers first: two passes,
        unless they are given.
    p_lse, q_lse : Tensor [B, P] and [B, K, P] fp32, optional (both or neither)
        logsumexp(logits / temperature) of each target and view row, where the caller has
        them (`ensemble_mix` returns the views', `chain_verify` the target's): without a
        grid, KL and TV then take one pass over the logits. They must be the rows'
        normalisers at this temperature (the distributions are exp(logits / T - lse)); with
        a grid the GPU kernels compute their own.

    Returns
    -------
    kl : Tensor [B, K, P] fp32, KL(p || q_k)
    tv : Tensor [B, K, P] fp32, 0.5 * sum |p - q_k|; None when tv=False and no grid
    grid_match : Tensor [B, G, P] bool or None, argmax(sum_k g_k q_k) == argmax(p)
    grid_kl : Tensor [B, G, P] fp32 or None, KL(p || sum_k g_k q_k)
    """
    if p_logits.is_cuda:
        from tabed_engine.kernels.window_divergence import window_divergence as fn
    else:
        fn = window_divergence_reference
    return fn(p_logits, q_logits, temperature=temperature, grid=grid, tv=tv, p_lse=p_lse, q_lse=q_lse)
