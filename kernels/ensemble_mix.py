"""Fused ensemble mixing of the K draft views: softmax per view, mix, pick a token.

Two layouts, picked from the shapes alone (`_n_vsplit`), so the launcher never syncs and
can be captured in a CUDA graph:

* Many requests (B >= ~128): one program per request (`_ensemble_mix_kernel`).  It reads
  its K logit rows as one [KP, BLOCK] tile per step, so the K rows' loads are in flight
  together.  Pass 1 is an online softmax (running max and sum per row).  The mixture
  q = sum_k w_k softmax_k needs every view's final normaliser before any q_v is known,
  so for K > 1 a second pass over V forms q block by block and keeps a running argmax
  (the rows were just read, so pass 2 mostly hits L2).  With a single view and no
  mixture to write, pass 2 is skipped: argmax_v q_v / E_v equals
  argmax_v (x_v - log E_v), which needs no normaliser.

* Few requests (the speculative draft step runs B = 1): one program per request streams
  V on a single SM, a chain of dependent loads that costs ~10 us per view at V = 32K.
  Instead V is split into S chunks, grid (B, S), and the passes exchange small partials:
    1. `_mix_partial_kernel`: per (row, chunk) max and sum-exp; with one view (KP == 1)
       also the chunk's pick (best x - log E_v, or best x when greedy).
    2. `_mix_chunk_kernel`: every program folds the S partials of its rows into the
       normalisers (S * K floats), then forms q over its chunk: writes the mixture row
       and its chunk's best (q or q / E_v, index, q).  With one view the pick is already
       known, so program (b, 0) finishes it and the others only write the mixture.
    3. `_mix_pick_kernel` (K > 1): the S chunk bests -> token, token_prob.
  Chunk bests combine by value, then lowest index, so ties resolve like torch.argmax
  and the result does not depend on the split.  The Philox counter of element (b, v)
  stays offset + b * V + v, so a draw is the same whatever the layout.
"""
import torch
import triton
import triton.language as tl

from ._common import chunking, fold_best, load_rows, n_vsplit as _n_vsplit, online_lse, pick_score

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _rows_and_rng(logits_ptr, seed_ptr, offset_ptr, b, K, V, stride_logits,
                  KP: tl.constexpr, SAMPLE: tl.constexpr):
    """Request b's K row pointers ([KP]) and, when SAMPLE, its Philox seed and counter base:
    element (b, v) draws counter offset + b * V + v, independent per request and entry
    (the caller advances offset by B * V)."""
    ks = tl.arange(0, KP)
    rows_ptr = logits_ptr + (b * K + ks).to(tl.int64) * stride_logits
    seed = 0
    rng_base = 0
    if SAMPLE:
        seed = tl.load(seed_ptr)
        rng_base = tl.load(offset_ptr) + b * V
    return rows_ptr, seed, rng_base


@triton.jit
def _lse_pass(rows_ptr, kmask, start, end, inv_temperature, seed, rng_base,
              KP: tl.constexpr, BLOCK: tl.constexpr, GREEDY: tl.constexpr, PICK: tl.constexpr):
    """Pass 1 over columns [start, end): each row's running max and sum-exp (fp32); with
    PICK (one row, KP == 1) also the pick: best score x - log E_v (or x), index, x."""
    cols = tl.arange(0, BLOCK)
    m = tl.full([KP], float("-inf"), tl.float32)
    s = tl.zeros([KP], tl.float32)
    best = float("-inf")
    best_idx = start  # distinct per chunk, so a chunk's entry is found by its index
    best_x = 0.0
    for v0 in range(start, end, BLOCK):
        offs = v0 + cols
        vmask = offs < end
        x = load_rows(rows_ptr, offs, kmask, vmask, inv_temperature)
        m, s = online_lse(x, m, s)
        if PICK:
            xv = tl.sum(x, axis=0)  # KP == 1: the row itself
            score = pick_score(xv, offs, vmask, seed, rng_base, GREEDY, True)
            best, best_idx, best_x = fold_best(score, xv, v0, cols, best, best_idx, best_x)
    return m, s, best, best_idx, best_x


@triton.jit
def _mix_pass(rows_ptr, kmask, w, lse, start, end, inv_temperature, mix_row, seed, rng_base,
              BLOCK: tl.constexpr, GREEDY: tl.constexpr, WRITE_MIX: tl.constexpr,
              PICK: tl.constexpr):
    """Pass 2 over columns [start, end): the mixture q = sum_k w_k exp(x_k - lse_k), written
    to mix_row with WRITE_MIX; with PICK the best score q_v / E_v (or q_v), index, q."""
    cols = tl.arange(0, BLOCK)
    best = float("-inf")
    best_idx = start
    best_q = 0.0
    for v0 in range(start, end, BLOCK):
        offs = v0 + cols
        vmask = offs < end
        x = load_rows(rows_ptr, offs, kmask, vmask, inv_temperature)
        q = tl.sum(tl.exp(x - lse[:, None]) * w[:, None], axis=0)  # [BLOCK]
        if WRITE_MIX:
            tl.store(mix_row + offs, q, mask=vmask)
        if PICK:
            score = pick_score(q, offs, vmask, seed, rng_base, GREEDY, False)
            best, best_idx, best_q = fold_best(score, q, v0, cols, best, best_idx, best_q)
    return best, best_idx, best_q


@triton.jit
def _ensemble_mix_kernel(
    logits_ptr, weights_ptr, seed_ptr, offset_ptr,
    token_ptr, token_prob_ptr, mixture_ptr, lse_ptr,
    K, V, stride_logits, stride_wb, stride_wk, stride_mix, inv_temperature,
    KP: tl.constexpr, BLOCK: tl.constexpr, GREEDY: tl.constexpr,
    WRITE_MIX: tl.constexpr, ONE_PASS: tl.constexpr,
):
    """One program per request: pass 1 (with ONE_PASS also the pick), then pass 2."""
    b = tl.program_id(0).to(tl.int64)
    ks = tl.arange(0, KP)
    kmask = ks < K
    rows_ptr, seed, rng_base = _rows_and_rng(logits_ptr, seed_ptr, offset_ptr, b, K, V,
                                             stride_logits, KP, not GREEDY)
    m, s, best, best_idx, best_x = _lse_pass(rows_ptr, kmask, 0, V, inv_temperature, seed,
                                             rng_base, KP, BLOCK, GREEDY, ONE_PASS)
    lse = tl.where(kmask, m + tl.log(tl.where(kmask, s, 1.0)), 0.0)
    tl.store(lse_ptr + b * K + ks, lse, mask=kmask)
    if ONE_PASS:
        best_q = tl.exp(best_x - tl.sum(lse, axis=0))
    else:
        w = tl.load(weights_ptr + b * stride_wb + ks * stride_wk, mask=kmask, other=0.0)
        best, best_idx, best_q = _mix_pass(rows_ptr, kmask, w, lse, 0, V, inv_temperature,
                                           mixture_ptr + b * stride_mix, seed, rng_base,
                                           BLOCK, GREEDY, WRITE_MIX, True)
    tl.store(token_ptr + b, best_idx.to(tl.int64))
    tl.store(token_prob_ptr + b, best_q)


@triton.jit
def _mix_partial_kernel(
    logits_ptr, seed_ptr, offset_ptr, part_ptr, part_idx_ptr,
    K, V, S, CHUNK, stride_logits, inv_temperature,
    KP: tl.constexpr, BLOCK: tl.constexpr, GREEDY: tl.constexpr, PICK: tl.constexpr,
):
    """Split pass 1: per (row, chunk) max and sum-exp; with PICK (one view) the chunk's pick.

    part row (b, s) of width 2 * KP + 2: [max_k | sumexp_k | best score | best x].
    """
    b = tl.program_id(0).to(tl.int64)
    sp = tl.program_id(1)
    start = sp * CHUNK
    ks = tl.arange(0, KP)
    kmask = ks < K
    rows_ptr, seed, rng_base = _rows_and_rng(logits_ptr, seed_ptr, offset_ptr, b, K, V,
                                             stride_logits, KP, PICK and not GREEDY)
    m, s, best, best_idx, best_x = _lse_pass(rows_ptr, kmask, start, tl.minimum(start + CHUNK, V),
                                             inv_temperature, seed, rng_base, KP, BLOCK,
                                             GREEDY, PICK)
    row = part_ptr + (b * S + sp) * (2 * KP + 2)
    tl.store(row + ks, m, mask=kmask)
    tl.store(row + KP + ks, s, mask=kmask)
    if PICK:
        tl.store(row + 2 * KP, best)
        tl.store(row + 2 * KP + 1, best_x)
        tl.store(part_idx_ptr + b * S + sp, best_idx)


@triton.jit
def _mix_chunk_kernel(
    logits_ptr, weights_ptr, seed_ptr, offset_ptr, part_ptr, part_idx_ptr,
    token_ptr, token_prob_ptr, mixture_ptr, lse_ptr,
    K, V, S, CHUNK, stride_logits, stride_wb, stride_wk, stride_mix, inv_temperature,
    KP: tl.constexpr, SP: tl.constexpr, BLOCK: tl.constexpr, GREEDY: tl.constexpr,
    WRITE_MIX: tl.constexpr, PICKED: tl.constexpr,
):
    """Split pass 2: fold the S partials into lse, then q over this program's chunk."""
    b = tl.program_id(0).to(tl.int64)
    sp = tl.program_id(1)
    ks = tl.arange(0, KP)
    kmask = ks < K
    ss = tl.arange(0, SP)
    smask = ss < S
    W: tl.constexpr = 2 * KP + 2
    prow = part_ptr + (b * S + ss) * W  # [SP]
    pmask = smask[:, None] & kmask[None, :]
    pm = tl.load(prow[:, None] + ks[None, :], mask=pmask, other=float("-inf"))
    ps = tl.load(prow[:, None] + KP + ks[None, :], mask=pmask, other=0.0)
    m = tl.max(pm, axis=0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    tot = tl.sum(ps * tl.exp(pm - m_safe[None, :]), axis=0)
    lse = tl.where(kmask, m + tl.log(tl.where(kmask, tot, 1.0)), 0.0)
    if sp == 0:
        tl.store(lse_ptr + b * K + ks, lse, mask=kmask)
    w = tl.load(weights_ptr + b * stride_wb + ks * stride_wk, mask=kmask, other=0.0)

    if PICKED:  # one view: pass 1 found the pick, program (b, 0) finishes it
        if sp == 0:
            bv = tl.load(prow + 2 * KP, mask=smask, other=float("-inf"))
            bx = tl.load(prow + 2 * KP + 1, mask=smask, other=0.0)
            bi = tl.load(part_idx_ptr + b * S + ss, mask=smask, other=V)
            top = tl.max(bv, axis=0)
            tok = tl.min(tl.where(bv == top, bi, V), axis=0)  # ties: lowest index
            x_tok = tl.sum(tl.where(smask & (bi == tok), bx, 0.0), axis=0)
            q_tok = tl.exp(x_tok - tl.sum(lse, axis=0)) * tl.sum(w, axis=0)
            tl.store(token_ptr + b, tok.to(tl.int64))
            tl.store(token_prob_ptr + b, q_tok)

    if WRITE_MIX or not PICKED:
        start = sp * CHUNK
        rows_ptr, seed, rng_base = _rows_and_rng(logits_ptr, seed_ptr, offset_ptr, b, K, V,
                                                 stride_logits, KP, not PICKED and not GREEDY)
        best, best_idx, best_q = _mix_pass(rows_ptr, kmask, w, lse, start,
                                           tl.minimum(start + CHUNK, V), inv_temperature,
                                           mixture_ptr + b * stride_mix, seed, rng_base,
                                           BLOCK, GREEDY, WRITE_MIX, not PICKED)
        if not PICKED:  # the best slots are free: pass 1 wrote them only with PICK
            row = part_ptr + (b * S + sp) * W
            tl.store(row + 2 * KP, best)
            tl.store(row + 2 * KP + 1, best_q)
            tl.store(part_idx_ptr + b * S + sp, best_idx)


@triton.jit
def _mix_pick_kernel(part_ptr, part_idx_ptr, token_ptr, token_prob_ptr, V, S,
                     KP: tl.constexpr, SP: tl.constexpr):
    """Split pass 3 (K > 1): the chunk bests -> token (lowest index on ties), q(token)."""
    b = tl.program_id(0).to(tl.int64)
    ss = tl.arange(0, SP)
    smask = ss < S
    prow = part_ptr + (b * S + ss) * (2 * KP + 2)
    bv = tl.load(prow + 2 * KP, mask=smask, other=float("-inf"))
    bq = tl.load(prow + 2 * KP + 1, mask=smask, other=0.0)
    bi = tl.load(part_idx_ptr + b * S + ss, mask=smask, other=V)
    top = tl.max(bv, axis=0)
    tok = tl.min(tl.where(bv == top, bi, V), axis=0)
    tl.store(token_ptr + b, tok.to(tl.int64))
    tl.store(token_prob_ptr + b, tl.sum(tl.where(smask & (bi == tok), bq, 0.0), axis=0))


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
    write_mix = mixture is not None
    greedy = bool(greedy)
    inv_t = 1.0 / float(temperature)
    seed_arg = seed if not greedy else token      # unused pointers when greedy
    offset_arg = offset if not greedy else token
    mix_arg = mixture if write_mix else token_prob
    stride_mix = mixture.stride(0) if write_mix else 0
    S, chunk = chunking(V, _n_vsplit(B, V))
    if S == 1:
        # ~8K elements per step (16 KiB of bf16 in flight per program); 8 warps keep the
        # per-thread tile at 32 fp32 values, so nothing spills.
        BLOCK = max(16, min(triton.next_power_of_2(V), 8192 // KP))
        num_warps = 8 if KP * BLOCK >= 4096 else 4
        _ensemble_mix_kernel[(B,)](
            logits, weights, seed_arg, offset_arg,
            token, token_prob, mix_arg, lse,
            K, V, logits.stride(0), weights.stride(0), weights.stride(1),
            stride_mix, inv_t,
            KP=KP, BLOCK=BLOCK, GREEDY=greedy, WRITE_MIX=write_mix,
            ONE_PASS=(KP == 1 and not write_mix), num_warps=num_warps,
        )
        return token, token_prob, mixture, lse

    BLOCK = max(16, min(triton.next_power_of_2(chunk), 8192 // KP))
    num_warps = 8 if KP * BLOCK >= 4096 else 4
    SP = triton.next_power_of_2(S)
    picked = KP == 1  # one view: argmax q_v / E_v = argmax x_v - log E_v, no normaliser
    part = torch.empty(B * S * (2 * KP + 2), dtype=torch.float32, device=dev)
    part_idx = torch.empty(B * S, dtype=torch.int32, device=dev)
    _mix_partial_kernel[(B, S)](
        logits, seed_arg, offset_arg, part, part_idx,
        K, V, S, chunk, logits.stride(0), inv_t,
        KP=KP, BLOCK=BLOCK, GREEDY=greedy, PICK=picked, num_warps=num_warps,
    )
    _mix_chunk_kernel[(B, S if (write_mix or not picked) else 1)](
        logits, weights, seed_arg, offset_arg, part, part_idx,
        token, token_prob, mix_arg, lse,
        K, V, S, chunk, logits.stride(0), weights.stride(0), weights.stride(1),
        stride_mix, inv_t,
        KP=KP, SP=SP, BLOCK=BLOCK, GREEDY=greedy, WRITE_MIX=write_mix, PICKED=picked,
        num_warps=num_warps,
    )
    if not picked:
        _mix_pick_kernel[(B,)](part, part_idx, token, token_prob, V, S, KP=KP, SP=SP,
                               num_warps=1 if SP <= 32 else 4)
    return token, token_prob, mixture, lse
