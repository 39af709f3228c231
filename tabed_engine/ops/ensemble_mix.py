"""Ensemble mixing of the draft views: q = sum_k w_k softmax(logits_k / T), then a token.

`ensemble_mix` runs the fused Triton kernel for CUDA tensors and the PyTorch reference
otherwise.  Both draw v with probability q_v without a host sync: the kernel by inverse
CDF (one Philox uniform per request, seed and offset read from device tensors, so the call
can live inside a CUDA graph; columns in a fixed order, see `tabed_engine/kernels/ensemble_mix.py`),
the reference by the exponential race argmax_v q_v / E_v (E_v ~ Exp(1)).
"""
import torch


def ensemble_mix_reference(logits, weights, *, greedy, seed=None, offset=None,
                           temperature=1.0, return_mixture=False, mixture_out=None, view_tokens_out=None):
    """Plain-PyTorch ensemble mix (ground truth for tests; CPU path of the engine).

    Sampling draws E_v from a torch.Generator seeded with (seed, offset): it reads the
    two values on the host, so unlike the kernel it is not graph-safe, and its draws
    differ from the kernel's Philox stream (same distribution, not the same numbers).
    """
    B, K = weights.shape
    V = logits.shape[-1]
    x = logits.float() / temperature                        # [B*K, V]
    lse = torch.logsumexp(x, dim=-1)                        # [B*K]
    q_k = torch.exp(x - lse[:, None]).view(B, K, V)
    mixture = (weights.float()[:, :, None] * q_k).sum(dim=1)  # [B, V]
    if greedy:
        token = mixture.argmax(dim=-1)
    else:
        if seed is None or offset is None:
            raise ValueError("sampling needs seed and offset tensors")
        gen = torch.Generator(device=logits.device)
        gen.manual_seed((int(seed.reshape(-1)[0]) * 1_000_003 + int(offset.reshape(-1)[0])) % 2**62)
        e = torch.empty(B, V, device=logits.device).exponential_(generator=gen)
        token = (mixture / e).argmax(dim=-1)
    token_prob = mixture.gather(1, token[:, None]).squeeze(1)
    if view_tokens_out is not None:
        view_tokens_out.copy_(token.repeat_interleave(K))
    if mixture_out is not None:
        mixture_out.copy_(mixture)
        mixture = mixture_out
    elif not return_mixture:
        mixture = None
    return token, token_prob, mixture, lse


def ensemble_mix(logits, weights, *, greedy, seed=None, offset=None, temperature=1.0,
                 return_mixture=False, mixture_out=None, view_tokens_out=None):
    """Mix the K views' next-token distributions and pick one token per request.

    Parameters
    ----------
    logits : Tensor [B*K, V], bf16/fp16/fp32, unit last stride, any row stride
        Rows b*K .. b*K+K-1 are the K views of request b.
    weights : Tensor [B, K] fp32
        Mixture weights, rows summing to 1.
    greedy : bool
        argmax of the mixture (lowest index on ties) instead of a sample.
    seed, offset : Tensor [1] int64 on the logits' device, sampling only
        Philox seed and counter base; one call consumes counters
        offset .. offset + B*V - 1, the caller advances `offset` itself.
    temperature : float > 0
        Applied to every view before its softmax (also when greedy).
    return_mixture : bool
        Also return the mixture rows.
    mixture_out : Tensor [B, V] fp32, optional
        Preallocated mixture rows (unit last stride) written in place.
    view_tokens_out : Tensor [B*K] int64, optional (contiguous)
        Also receives request b's token in each of its K view rows b*K .. b*K+K-1 (the
        draft loop's next input ids; the kernel writes them, no separate repeat).

    Returns
    -------
    token : Tensor [B] int64 in [0, V); a NaN mixture row (a view of NaN logits, or of -inf
        everywhere) gives greedy token 0, the first NaN, as torch.argmax
    token_prob : Tensor [B] fp32, q[b, token[b]]
    mixture : Tensor [B, V] fp32 or None
    lse : Tensor [B*K] fp32, logsumexp(logits_k / temperature) per row
    """
    if logits.is_cuda:
        from tabed_engine.kernels.ensemble_mix import ensemble_mix as fn
    else:
        fn = ensemble_mix_reference
    return fn(logits, weights, greedy=greedy, seed=seed, offset=offset,
              temperature=temperature, return_mixture=return_mixture,
              mixture_out=mixture_out, view_tokens_out=view_tokens_out)
