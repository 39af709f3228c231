"""Chain verification: how many drafted tokens the target accepts, and the next token.

Greedy: the accepted prefix is where the draft matches the target argmax.  Sampling:
speculative rejection sampling against the *mixture* q the tokens were drawn from
(accept x_i when u_i * q(x_i) < p(x_i)); the first rejection is replaced by a draw from
norm(max(p - q, 0)), and a bonus token is drawn from p_gamma when every token passes.
The output distribution is exactly p for any q.  Given the uniforms it is
deterministic, so the kernel and this reference agree token for token (up to
inverse-CDF boundaries moved by float summation order).
"""
import torch


def _inverse_cdf(r, u):
    """First index whose cumulative mass exceeds u * sum(r); r [B, V] >= 0, u [B]."""
    cs = r.cumsum(dim=-1)
    hit = cs > (u * r.sum(dim=-1))[:, None]
    # Rounding can leave cs[-1] just below u * sum: fall back to the last index with mass.
    last_nz = r.shape[-1] - 1 - (r > 0).flip(-1).int().argmax(dim=-1)
    return torch.where(hit.any(dim=-1), hit.int().argmax(dim=-1), last_nz)


def _check_lse_out(lse_out, p, B, gamma, greedy):
    """The launcher's checks of lse_out, for the reference (CPU path)."""
    if not greedy:
        raise ValueError("lse_out is greedy only (p holds target logits there)")
    if not isinstance(lse_out, torch.Tensor) or lse_out.dtype != torch.float32:
        raise TypeError(f"lse_out must be a float32 tensor, got {getattr(lse_out, 'dtype', type(lse_out))}")
    if lse_out.shape != (B, gamma + 1) or lse_out.device != p.device:
        raise ValueError(f"lse_out must be [B, gamma+1] = [{B}, {gamma + 1}] on {p.device}, got "
                         f"{tuple(lse_out.shape)} on {lse_out.device}")


def chain_verify_reference(draft_tokens, q_probs, p, *, greedy, uniforms=None, lse_out=None):
    """Plain-PyTorch chain verification (ground truth for tests; CPU path of the engine)."""
    B, gamma = draft_tokens.shape
    if lse_out is not None:
        _check_lse_out(lse_out, p, B, gamma, greedy)
        lse_out.copy_(torch.logsumexp(p.float(), dim=-1))
    if greedy:
        target = p.argmax(dim=-1)                                           # [B, gamma+1]
        n_acc = (draft_tokens == target[:, :gamma]).long().cumprod(dim=1).sum(dim=1)
        return n_acc, target.gather(1, n_acc[:, None]).squeeze(1)
    V = p.shape[-1]
    idx = draft_tokens[:, :, None]
    px = p[:, :gamma].gather(2, idx).squeeze(2)                             # [B, gamma]
    qx = q_probs.gather(2, idx).squeeze(2)
    n_acc = (uniforms[:, :gamma] * qx < px).long().cumprod(dim=1).sum(dim=1)  # [B]
    rows = n_acc[:, None, None].expand(B, 1, V)
    p_n = p.gather(1, rows).squeeze(1)                                      # [B, V]
    q_pad = torch.cat([q_probs, q_probs.new_zeros(B, 1, V)], dim=1)         # bonus: q = 0
    r = (p_n - q_pad.gather(1, rows).squeeze(1)).clamp_min(0.0)
    # Sum r == 0 only when p_i == q_i, where rejection has probability 0: p_i is then
    # the exact conditional, so the fallback cannot bias the output.
    r = torch.where((r.sum(dim=-1) > 0)[:, None], r, p_n)
    return n_acc, _inverse_cdf(r, uniforms[:, gamma])


def chain_verify(draft_tokens, q_probs, p, *, greedy, uniforms=None, lse_out=None):
    """Verify B drafted chains of gamma tokens against the target.

    Parameters
    ----------
    draft_tokens : Tensor [B, gamma] int64, values in [0, V)
    q_probs : Tensor [B, gamma, V] fp32 or None
        Draft mixture the tokens were drawn from (sampling only; ignored when greedy).
    p : Tensor [B, gamma+1, V], unit last stride
        Greedy: target logits, any float dtype.  Sampling: target probabilities (fp32,
        after temperature / top-k / top-p).
    greedy : bool
    uniforms : Tensor [B, gamma+1] fp32 in [0, 1), sampling only
        uniforms[:, i] decides acceptance of token i; uniforms[:, gamma] drives the
        inverse-CDF draw of the next token.
    lse_out : Tensor [B, gamma+1] fp32 or None, greedy only
        When given (on p's device, any strides), filled with logsumexp(p[b, j]) (natural
        log, temperature 1) for every request b and position j in 0..gamma, from the same
        pass over the logits: the engine's history step reuses the target's log-normaliser
        (TV needs it before its single pass) instead of another pass.  Passing it with
        greedy=False raises ValueError.

    Returns
    -------
    num_accepted : Tensor [B] int64 in [0, gamma]
    next_token : Tensor [B] int64, the correction (first rejection) or bonus token
    """
    if p.is_cuda:
        from tabed_engine.kernels.chain_verify import chain_verify as fn
    else:
        fn = chain_verify_reference
    return fn(draft_tokens, q_probs, p, greedy=greedy, uniforms=uniforms, lse_out=lse_out)
