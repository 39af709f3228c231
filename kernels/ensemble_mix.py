"""Fused ensemble mixing of the K draft views: softmax per view, mix, pick a token.

One program per request reads its K logit rows as one [KP, BLOCK] tile per step, so
the K rows' loads are in flight together.  Pass 1 is an online softmax (running max and
sum per row).  The mixture q = sum_k w_k softmax_k needs every view's final normaliser
before any q_v is known, so for K > 1 a second pass over V forms q block by block and
keeps a running argmax (the rows were just read, so pass 2 mostly hits L2).  With a
single view and no mixture to write, pass 2 is skipped: argmax_v q_v / E_v equals
argmax_v (x_v - log E_v), which needs no normaliser.
"""
import torch
import triton
import triton.language as tl

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _ensemble_mix_kernel(
    logits_ptr, weights_ptr, seed_ptr, offset_ptr,
    token_ptr, token_prob_ptr, mixture_ptr, lse_ptr,
    K, V, stride_logits, stride_wb, stride_wk, stride_mix, inv_temperature,
    KP: tl.constexpr, BLOCK: tl.constexpr, GREEDY: tl.constexpr,
    WRITE_MIX: tl.constexpr, ONE_PASS: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    ks = tl.arange(0, KP)
    kmask = ks < K
    cols = tl.arange(0, BLOCK)
    rows_ptr = logits_ptr + (b * K + ks).to(tl.int64)[:, None] * stride_logits
    if not GREEDY:
        seed = tl.load(seed_ptr)
        # Philox counter of element (b, v) is offset + b * V + v: independent draws
        # per request and per vocabulary entry; the caller advances offset by B * V.
        rng_base = tl.load(offset_ptr) + b * V

    # Pass 1: online logsumexp of each view (fp32); with ONE_PASS also the pick.
    m = tl.full([KP], float("-inf"), tl.float32)
    s = tl.zeros([KP], tl.float32)
    best = float("-inf")
    best_idx = 0
    best_x = 0.0
    for v0 in range(0, V, BLOCK):
        offs = v0 + cols
        vmask = offs < V
        x = tl.load(rows_ptr + offs[None, :], mask=kmask[:, None] & vmask[None, :],
                    other=float("-inf")).to(tl.float32) * inv_temperature
        m_new = tl.maximum(m, tl.max(x, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        s = s * tl.exp(m - m_safe) + tl.sum(tl.exp(x - m_safe[:, None]), axis=1)
        m = m_new
        if ONE_PASS:
            xv = tl.sum(x, axis=0)  # KP == 1: the row itself
            score = xv
            if not GREEDY:
                u = tl.rand(seed, rng_base + offs)
                score = xv - tl.log(-tl.log(u))
            score = tl.where(vmask, score, float("-inf"))
            blk_best = tl.max(score, axis=0)
            blk_idx = tl.argmax(score, axis=0)
            blk_x = tl.sum(tl.where(cols == blk_idx, xv, 0.0), axis=0)
            take = blk_best > best  # strict: the earlier block wins ties
            best_x = tl.where(take, blk_x, best_x)
            best_idx = tl.where(take, v0 + blk_idx, best_idx)
            best = tl.where(take, blk_best, best)
    lse = tl.where(kmask, m + tl.log(tl.where(kmask, s, 1.0)), 0.0)
    tl.store(lse_ptr + b * K + ks, lse, mask=kmask)

    if ONE_PASS:
        best_q = tl.exp(best_x - tl.sum(lse, axis=0))
    else:
        w = tl.load(weights_ptr + b * stride_wb + ks * stride_wk, mask=kmask, other=0.0)
        best_q = 0.0
        for v0 in range(0, V, BLOCK):
            offs = v0 + cols
            vmask = offs < V
            x = tl.load(rows_ptr + offs[None, :], mask=kmask[:, None] & vmask[None, :],
                        other=float("-inf")).to(tl.float32) * inv_temperature
            q = tl.sum(tl.exp(x - lse[:, None]) * w[:, None], axis=0)  # [BLOCK]
            if WRITE_MIX:
                tl.store(mixture_ptr + b * stride_mix + offs, q, mask=vmask)
            score = q
            if not GREEDY:
                u = tl.rand(seed, rng_base + offs)
                score = q / -tl.log(u)  # q_v / E_v, E_v ~ Exp(1)
            score = tl.where(vmask, score, float("-inf"))
            blk_best = tl.max(score, axis=0)
            blk_idx = tl.argmax(score, axis=0)
            blk_q = tl.sum(tl.where(cols == blk_idx, q, 0.0), axis=0)
            take = blk_best > best
            best_q = tl.where(take, blk_q, best_q)
            best_idx = tl.where(take, v0 + blk_idx, best_idx)
            best = tl.where(take, blk_best, best)
    tl.store(token_ptr + b, best_idx.to(tl.int64))
    tl.store(token_prob_ptr + b, best_q)


def ensemble_mix(logits, weights, *, greedy, seed=None, offset=None, temperature=1.0,
                 return_mixture=False, mixture_out=None):
    """Triton launcher; see `tabed_engine.ops.ensemble_mix.ensemble_mix` for the contract.

    `mixture_out` ([B, V] fp32, unit last stride, any row stride) is written in place when
    given (e.g. a slice of the engine's [B, gamma, V] buffer) and implies return_mixture.
    Does no host synchronisation, so it can be captured in a CUDA graph.
    """
    if logits.dim() != 2 or weights.dim() != 2:
        raise ValueError(f"logits must be [B*K, V] and weights [B, K], got "
                         f"{tuple(logits.shape)} and {tuple(weights.shape)}")
    if logits.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"logits dtype {logits.dtype} not supported")
    if weights.dtype != torch.float32:
        raise TypeError(f"weights must be float32, got {weights.dtype}")
    B, K = weights.shape
    R, V = logits.shape
    if R != B * K or B == 0 or V == 0:
        raise ValueError(f"logits has {R} rows, expected B*K = {B}*{K}")
    if logits.stride(1) != 1:
        raise ValueError("logits must have a contiguous last dimension")
    if weights.device != logits.device:
        raise ValueError("logits and weights must be on the same device")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if not greedy:
        for name, t in (("seed", seed), ("offset", offset)):
            if t is None or t.dtype != torch.int64 or t.numel() != 1 or t.device != logits.device:
                raise ValueError(f"sampling needs {name} as an int64 tensor [1] on {logits.device}")
    dev = logits.device
    token = torch.empty(B, dtype=torch.int64, device=dev)
    token_prob = torch.empty(B, dtype=torch.float32, device=dev)
    lse = torch.empty(R, dtype=torch.float32, device=dev)
    mixture = mixture_out
    if mixture is None and return_mixture:
        mixture = torch.empty(B, V, dtype=torch.float32, device=dev)
    if mixture is not None:
        if (mixture.shape != (B, V) or mixture.dtype != torch.float32
                or mixture.stride(1) != 1 or mixture.device != dev):
            raise ValueError("mixture_out must be float32 [B, V] with unit last stride")
    KP = triton.next_power_of_2(K)
    # ~8K elements per step (16 KiB of bf16 in flight per program); 8 warps keep the
    # per-thread tile at 32 fp32 values, so nothing spills.
    BLOCK = max(16, min(triton.next_power_of_2(V), 8192 // KP))
    num_warps = 8 if KP * BLOCK >= 4096 else 4
    write_mix = mixture is not None
    _ensemble_mix_kernel[(B,)](
        logits, weights, seed if not greedy else token, offset if not greedy else token,
        token, token_prob, mixture if write_mix else token_prob, lse,
        K, V, logits.stride(0), weights.stride(0), weights.stride(1),
        mixture.stride(0) if write_mix else 0, 1.0 / float(temperature),
        KP=KP, BLOCK=BLOCK, GREEDY=bool(greedy), WRITE_MIX=write_mix,
        ONE_PASS=(KP == 1 and not write_mix), num_warps=num_warps,
    )
    return token, token_prob, mixture, lse
