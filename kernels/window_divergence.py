"""Divergences between the target distribution and each draft view over a window.

One program per (request, position, chunk of grid weight vectors).  Pass 1: online
logsumexp of the target row and the K view rows (and the target argmax).  Pass 2 needs
those normalisers: per V block it forms p and each q_k, accumulates KL(p||q_k) and
TV(p, q_k) and, with a weight grid, the G_BLOCK mixtures sum_k g_k q_k of its chunk
(running argmax and KL per mixture), so G x P x V is never stored.  Splitting G over
programs keeps enough programs in flight when B * P is small (B=1, P=6: 6 programs
without the split, 108 with G=286); each chunk repeats pass 1, which then hits L2.
"""
import torch
import triton
import triton.language as tl

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _window_divergence_kernel(
    p_ptr, q_ptr, grid_ptr, kl_ptr, tv_ptr, match_ptr, gkl_ptr,
    P, V, G, stride_pb, stride_pp, stride_qb, stride_qk, stride_qp,
    stride_gg, stride_gk, inv_temperature,
    K: tl.constexpr, KP: tl.constexpr, BLOCK1: tl.constexpr, BLOCK2: tl.constexpr,
    G_BLOCK: tl.constexpr, HAS_GRID: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    b = pid // P
    pos = pid % P
    ks = tl.arange(0, KP)
    kmask = ks < K
    p_row = p_ptr + b * stride_pb + pos * stride_pp
    q_row = q_ptr + b * stride_qb + pos * stride_qp

    # Pass 1: normalisers of p and of every q_k; argmax of p for the grid.
    cols = tl.arange(0, BLOCK1)
    mp = float("-inf")
    sp = 0.0
    mq = tl.full([KP], float("-inf"), tl.float32)
    sq = tl.zeros([KP], tl.float32)
    p_idx = 0
    for v0 in range(0, V, BLOCK1):
        offs = v0 + cols
        vmask = offs < V
        xp = tl.load(p_row + offs, mask=vmask, other=float("-inf")).to(tl.float32) * inv_temperature
        xq = tl.load(q_row + ks.to(tl.int64)[:, None] * stride_qk + offs[None, :],
                     mask=kmask[:, None] & vmask[None, :],
                     other=float("-inf")).to(tl.float32) * inv_temperature
        blk_max = tl.max(xp, axis=0)
        p_idx = tl.where(blk_max > mp, v0 + tl.argmax(xp, axis=0), p_idx)
        mp_new = tl.maximum(mp, blk_max)
        mp_safe = tl.where(mp_new == float("-inf"), 0.0, mp_new)  # rows may hold -inf
        sp = sp * tl.exp(mp - mp_safe) + tl.sum(tl.exp(xp - mp_safe), axis=0)
        mp = mp_new
        mq_new = tl.maximum(mq, tl.max(xq, axis=1))
        mq_safe = tl.where(mq_new == float("-inf"), 0.0, mq_new)
        sq = sq * tl.exp(mq - mq_safe) + tl.sum(tl.exp(xq - mq_safe[:, None]), axis=1)
        mq = mq_new
    lse_p = mp + tl.log(sp)
    lse_q = tl.where(kmask, mq + tl.log(tl.where(kmask, sq, 1.0)), 0.0)

    # Pass 2: divergences per view and per grid mixture.
    cols = tl.arange(0, BLOCK2)
    kl = tl.zeros([KP], tl.float32)
    tv = tl.zeros([KP], tl.float32)
    gs = chunk * G_BLOCK + tl.arange(0, G_BLOCK)
    gmask = gs < G
    g_best = tl.full([G_BLOCK], -1.0, tl.float32)
    g_idx = tl.zeros([G_BLOCK], tl.int32)
    g_kl = tl.zeros([G_BLOCK], tl.float32)
    for v0 in range(0, V, BLOCK2):
        offs = v0 + cols
        vmask = offs < V
        logp = tl.load(p_row + offs, mask=vmask, other=float("-inf")).to(tl.float32) * inv_temperature - lse_p
        pv = tl.exp(logp)
        mix = tl.zeros([G_BLOCK, BLOCK2], tl.float32)
        for k in tl.static_range(K):
            lse_k = tl.sum(tl.where(ks == k, lse_q, 0.0), axis=0)
            logq = tl.load(q_row + k * stride_qk + offs, mask=vmask,
                           other=float("-inf")).to(tl.float32) * inv_temperature - lse_k
            qv = tl.exp(logq)
            kl_k = tl.sum(tl.where(pv > 0, pv * (logp - logq), 0.0), axis=0)
            tv_k = tl.sum(tl.abs(pv - qv), axis=0)
            kl += tl.where(ks == k, kl_k, 0.0)
            tv += tl.where(ks == k, tv_k, 0.0)
            if HAS_GRID:
                g_k = tl.load(grid_ptr + gs * stride_gg + k * stride_gk, mask=gmask, other=0.0)
                mix += g_k[:, None] * qv[None, :]
        if HAS_GRID:
            score = tl.where(vmask[None, :], mix, -1.0)
            blk_best = tl.max(score, axis=1)
            blk_idx = tl.argmax(score, axis=1)
            take = blk_best > g_best  # strict: the earlier block wins ties
            g_idx = tl.where(take, v0 + blk_idx, g_idx)
            g_best = tl.where(take, blk_best, g_best)
            p2 = pv[None, :]
            g_kl += tl.sum(tl.where(p2 > 0, p2 * (logp[None, :] - tl.log(tl.where(p2 > 0, mix, 1.0))), 0.0), axis=1)

    out = (b * K + ks) * P + pos
    n_views = tl.where(chunk == 0, K, 0)  # the first grid chunk writes kl and tv
    tl.store(kl_ptr + out, kl, mask=ks < n_views)
    tl.store(tv_ptr + out, 0.5 * tv, mask=ks < n_views)
    if HAS_GRID:
        gout = (b * G + gs) * P + pos
        tl.store(match_ptr + gout, (g_idx == p_idx).to(tl.int8), mask=gmask)
        tl.store(gkl_ptr + gout, g_kl, mask=gmask)


def window_divergence(p_logits, q_logits, *, temperature=1.0, grid=None):
    """Triton launcher; see `tabed_engine.ops.window_divergence.window_divergence`."""
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
    dev = p_logits.device
    kl = torch.empty(B, K, P, dtype=torch.float32, device=dev)
    tv = torch.empty(B, K, P, dtype=torch.float32, device=dev)
    if grid is not None:
        if grid.dim() != 2 or grid.shape[1] != K or grid.dtype != torch.float32 or grid.device != dev:
            raise ValueError(f"grid must be float32 [G, {K}] on {dev}, got {tuple(grid.shape)} {grid.dtype}")
        G = grid.shape[0]
        match = torch.empty(B, G, P, dtype=torch.uint8, device=dev)
        gkl = torch.empty(B, G, P, dtype=torch.float32, device=dev)
        G_BLOCK = min(16, triton.next_power_of_2(max(G, 1)))
        n_chunks = triton.cdiv(G, G_BLOCK)
        # [G_BLOCK, BLOCK2] mixture tile of 4K fp32 values: 16 per thread at 8 warps.
        BLOCK2 = max(16, min(triton.next_power_of_2(V), 4096 // G_BLOCK))
    else:
        G, G_BLOCK, n_chunks = 0, 1, 1
        match = gkl = None
        BLOCK2 = max(16, min(triton.next_power_of_2(V), 2048))
    KP = triton.next_power_of_2(K)
    # Pass 1 streams K+1 rows: ~4K elements per step in flight.
    BLOCK1 = max(16, min(triton.next_power_of_2(V), 4096 // KP))
    if B * P * n_chunks > 0:
        _window_divergence_kernel[(B * P, n_chunks)](
            p_logits, q_logits, grid if grid is not None else kl,
            kl, tv, match if match is not None else kl, gkl if gkl is not None else kl,
            P, V, G, p_logits.stride(0), p_logits.stride(1),
            q_logits.stride(0), q_logits.stride(1), q_logits.stride(2),
            grid.stride(0) if grid is not None else 0, grid.stride(1) if grid is not None else 0,
            1.0 / float(temperature),
            K=K, KP=KP, BLOCK1=BLOCK1, BLOCK2=BLOCK2, G_BLOCK=G_BLOCK,
            HAS_GRID=grid is not None, num_warps=8,
        )
    if match is not None:
        match = match.view(torch.bool)
    return kl, tv, match, gkl
