"""Ensemble mixing of the K draft views: softmax per view, mix, pick a token.

The vocabulary of each request is cut into S chunks (`mix_plan`, from the shapes and the
SM count only, so the launcher never syncs and can be captured in a CUDA graph). Two
launches exchange small partials:

  1. `_mix_partial_kernel`, one program per (row, chunk): each view's max and sum-exp over
     the chunk. Greedy with one view (PICK) also the chunk's argmax; greedy K > 1 (CERT)
     each view's argmax and second-largest logit; sampling (DRAW) the sum-exp of each draw
     slot. Rows are requests (K views per program) or, without the mixture row and K > 1,
     single view rows (ROWWISE: grid (B * K, S), the views being independent until pass 2).
  2. `_mix_chunk_kernel`, one program per (request, chunk): folds the request's S partials
     into the normalisers, then
       - greedy, one view: program (b, 0) finishes the pick (one pass over the logits);
       - greedy K > 1: a token that is no view's argmax has q_v <= sum_k w_k q_k(second
         largest of view k), so when the best view argmax beats that bound it is the
         argmax of q and the second pass is skipped (always, when the views agree);
         otherwise each program takes its chunk's best q and the row's last program to
         arrive (atomic counter) folds the S bests into the token;
       - the mixture row: q over each chunk;
       - sampling: one more program per request draws (`_slot_draw`).

Passes keep per-thread running values and reduce across the tile once per program (see
`_common`); exp2 with the temperature and log2(e) folded into one scale. Chunk bests
combine by value, then lowest index, so ties resolve like torch.argmax whatever the split.

A sample is an inverse CDF with one uniform per request, output 0 of Philox(seed, counter
offset + b * V) (`_common.uniforms`), in a fixed draw order: draw slot T = (c mod P) // SW
first, then column. Pass 1 stores every (chunk, view, slot) sum-exp; the draw folds them into
P // SW slot masses, picks the slot with the uniform and re-reads only that slot's columns.
The order depends on P and SW only: any split draws the same token, unless u falls within
float rounding of a boundary.
"""

import torch
import triton
import triton.language as tl

from ._common import (BIG_IDX, LN2, LOG2E, NEG_BIG, argmax_lowest, best_combine, best_step, counters, exp2,
                      group_best_cols, group_cols, group_lse_step, lse_reduce, pdl, pdl_wait, sm_count)
from .ensemble_mix_draw import (_fold_bests, _fold_token, _row_normalisers, _slot_draw, _slot_offsets, _store_token,
                                _tile_q)
from .ensemble_mix_plan import _FLOAT_DTYPES, mix_plan


@triton.jit
def _mix_partial_kernel(
    logits_ptr, part_ptr, part_idx_ptr, cert_ptr, cert_idx_ptr, slot_ptr,
    K, V, S, CHUNK, stride_logits, scale,
    KP: tl.constexpr, KV: tl.constexpr, ROWWISE: tl.constexpr, BLOCK: tl.constexpr, VEC: tl.constexpr,
    RPT: tl.constexpr, PICK: tl.constexpr, CERT: tl.constexpr, DRAW: tl.constexpr, P: tl.constexpr,
    SW: tl.constexpr, EVICT: tl.constexpr, FAST: tl.constexpr, PDL: tl.constexpr,
):
    """Pass 1 of chunk program_id(1) of row program_id(0): per (row, chunk) max and sum-exp;
    with PICK (greedy, one view) the chunk's argmax; with CERT (greedy, K > 1) each view's
    argmax in the chunk and its second-largest logit.

    Each step reads a [KP, RPT, NT, VEC] tile of thread-owned groups (see `_common`; with
    ROWWISE, KP == 1 and row r is view r % K of request r // K; partial rows hold KV views
    either way): running max and sum-exp per view and slot; the argmax keeps each slot's
    best step (values and start), its column found once, after the loop.

    part row (b, s) of width 2 * KV + 2: [max_k | sumexp_k | best score | best y], max in
    logit units, sumexp of exp2((x - max) * scale), y = x * scale (log2 units); cert /
    cert_idx rows (b, s) of KV: second-largest logit / argmax index per view. DRAW
    (sampling): also the chunk's sum-exp per view and draw slot against the view's chunk
    max (slot T holds the columns c with (c mod P) // SW == T; the chunk starts at a
    multiple of P and NT * VEC is one, so each thread slot lies in one draw slot), rows
    (b, s, k) of P // SW in slot.
    """
    pdl_wait(PDL)
    sp = tl.program_id(1)
    start = sp * CHUNK
    end = tl.minimum(start + CHUNK, V)
    NT: tl.constexpr = BLOCK // (RPT * VEC)                        # slots (threads) per view
    ks = tl.arange(0, KP)
    if ROWWISE:
        r = tl.program_id(0).to(tl.int64)
        b = r // K
        kv = ks + (r % K).to(tl.int32)                             # [1]: the view
        kmask = ks < 1
        rows_ptr = (logits_ptr + r * stride_logits + ks * 0)[:, None, None, None]
    else:
        b = tl.program_id(0).to(tl.int64)
        kv = ks
        kmask = ks < K
        rows_ptr = (logits_ptr + (b * K + ks).to(tl.int64) * stride_logits)[:, None, None, None]
    gcols = group_cols(RPT, NT, VEC)                               # [RPT, NT, VEC] columns of a step
    m = tl.full([KP, NT], NEG_BIG, tl.float32)                     # running max of each slot
    s = tl.zeros([KP, NT], tl.float32)                             # sum of exp2((x - m) * scale)
    bx = tl.full([KP, RPT, NT, VEC], NEG_BIG, tl.float32)          # PICK/CERT: the best step's values
    b_v0 = tl.zeros([KP, NT], tl.int32) + start                    # PICK/CERT: that step
    m2 = tl.full([KP, NT], NEG_BIG, tl.float32)                    # CERT: max of the slot's other steps
    lmask = kmask[:, None, None, None]
    for v0 in tl.range(start, end, BLOCK, num_stages=1):           # no software pipelining: faster
        offs = v0 + gcols
        x = tl.load(rows_ptr + offs[None], mask=lmask & (offs < end)[None], other=float("-inf"),
                    eviction_policy=EVICT).to(tl.float32)
        m_old = m
        m, s, take, g_max = group_lse_step(x, m, s, scale, FAST)
        if CERT:
            m2 = tl.where(take, m_old, tl.maximum(m2, g_max))
        if PICK or CERT:
            bx = tl.where(take[:, None, :, None], x, bx)
            b_v0 = tl.where(take, v0, b_v0)
    if PICK or CERT:
        # each slot's max: its first column in the best step (lowest index on ties)
        col = group_best_cols(bx, m, b_v0, gcols)                  # [KP, NT]
        # per view: the chunk's max, its lowest column
        c_top = tl.max(m, axis=1)
        c_idx = tl.min(tl.where(m == c_top[:, None], col, BIG_IDX), axis=1)
    if CERT:
        # and its second-largest value (equal to the max when the max occurs twice): the best
        # step's other values, the slot's other steps, the other slots' maxima
        rest = tl.where(gcols[None] + b_v0[:, None, :, None] == col[:, None, :, None], NEG_BIG, bx)
        second = tl.maximum(m2, tl.max(tl.max(rest, axis=3), axis=1))
        c_2nd = tl.max(tl.where(col == c_idx[:, None], second, m), axis=1)
        tl.store(cert_ptr + (b * S + sp) * KV + kv, c_2nd, mask=kmask)
        tl.store(cert_idx_ptr + (b * S + sp) * KV + kv, c_idx, mask=kmask)
    top, tot = lse_reduce(m, s, scale, 1, FAST)
    if DRAW:
        NSS: tl.constexpr = P // SW
        m4 = tl.reshape(m, [KP, NT * VEC // P, NSS, SW // VEC])    # thread t -> slot (t * VEC mod P) // SW
        s4 = tl.reshape(s, [KP, NT * VEC // P, NSS, SW // VEC])
        d_s = tl.sum(tl.sum(s4 * exp2((m4 - top[:, None, None, None]) * scale, FAST), axis=3), axis=1)
        d_off = ((b * S + sp) * KV + kv[:, None]) * NSS + tl.arange(0, NSS)[None, :]
        tl.store(slot_ptr + d_off, d_s, mask=kmask[:, None])
    row = part_ptr + (b * S + sp) * (2 * KV + 2)
    tl.store(row + kv, top, mask=kmask)
    tl.store(row + KV + kv, tot, mask=kmask)
    if PICK:  # KP == 1: the chunk's best score (and value) y = x * scale, and its column
        tl.store(row + 2 * KP + ks, c_top * scale)
        tl.store(row + 2 * KP + 1 + ks, c_top * scale)
        tl.store(part_idx_ptr + b * S + sp + ks, c_idx)


@triton.jit
def _mix_chunk_kernel(
    logits_ptr, weights_ptr, seed_ptr, offset_ptr, part_ptr, part_idx_ptr, cert_ptr, cert_idx_ptr,
    slot_ptr, certified_ptr, token_ptr, token_prob_ptr, mixture_ptr, lse_ptr, cnt_ptr,
    V, S, CHUNK, stride_logits, stride_wb, stride_wk, stride_mix, scale,
    K: tl.constexpr, KP: tl.constexpr, SP: tl.constexpr, BLOCK: tl.constexpr,
    GREEDY: tl.constexpr, WRITE_MIX: tl.constexpr, PICKED: tl.constexpr, CERT: tl.constexpr,
    REPORT: tl.constexpr, TOK_K: tl.constexpr, P: tl.constexpr, SW: tl.constexpr, SB: tl.constexpr,
    NB: tl.constexpr, FAST: tl.constexpr, PDL: tl.constexpr,
):
    """Pass 2 of request b, program sp of the row's n_prog: fold the S partials into the
    normalisers, then q over this program's chunk. Programs run in the reverse of pass 1's
    order, so the chunks pass 1 read last (the likeliest to be still in L2) are read first.

    CERT (greedy, K > 1, no mixture row): first the candidates, each view's argmax c_j. A
    token that is no view's argmax has q_v <= bound = sum_k w_k q_k(second largest of view
    k), so when the best candidate's q exceeds the bound it is the argmax of q: the chunk
    pass is skipped and program (b, 0) stores the token (REPORT: and 1 at certified[b]).

    Greedy, K > 1, chunk pass: each program stores its chunk's best (q, index) and counts
    itself in (atomic counter of row b); the last of the row's S programs to arrive reads
    the S bests and stores the token.

    Sampling: program n_prog - 1 of the row draws the token from pass 1's draw-slot partials
    (`_slot_draw`); with the mixture row programs 0 .. S - 1 write q over their chunks."""
    pdl_wait(PDL)
    b = (tl.num_programs(0) - 1 - tl.program_id(0)).to(tl.int64)
    n_prog = tl.num_programs(1)
    sp = n_prog - 1 - tl.program_id(1)
    ks = tl.arange(0, KP)
    kmask = ks < K
    ss = tl.arange(0, SP)
    smask = ss < S
    W: tl.constexpr = 2 * KP + 2
    prow = part_ptr + (b * S + ss) * W  # [SP]
    pmask = smask[:, None] & kmask[None, :]
    d_pre = 0.0
    if not GREEDY:
        if SB >= SP:  # the draw's slot sums, one tile, loaded beside the partials (the draw program only)
            d_pre = tl.load(slot_ptr + _slot_offsets(b, S, ss, ks, KP, P // SW),
                            mask=((ss < tl.where(sp == n_prog - 1, S, 0))[:, None]
                                  & kmask[None, :])[:, :, None], other=0.0)
    pm, ps, lse2 = _row_normalisers(prow, ks, pmask, kmask, scale, KP, FAST)
    if sp == 0:
        tl.store(lse_ptr + b * K + ks, lse2 * LN2, mask=kmask)
    w = tl.load(weights_ptr + b * stride_wb + ks * stride_wk, mask=kmask, other=0.0)

    run_chunk = 1
    if CERT:
        crow = (b * S + ss[:, None]) * KP + ks[None, :]           # [SP, KP]
        c_idx = tl.load(cert_idx_ptr + crow, mask=pmask, other=BIG_IDX)
        top_k = tl.max(pm, axis=0)                                 # [KP] each view's max
        arg_k = tl.min(tl.where(pmask & (pm == top_k[None, :]), c_idx, BIG_IDX), axis=0)
        second = tl.maximum(
            tl.max(tl.load(cert_ptr + crow, mask=pmask, other=NEG_BIG), axis=0),
            tl.max(tl.where(pmask & (c_idx != arg_k[None, :]), pm, NEG_BIG), axis=0))
        bound = tl.sum(tl.where(kmask, w * exp2(second * scale - lse2, FAST), 0.0), axis=0)
        # q at the candidates: x_c[k, j] = logit of view k at view j's argmax
        cand = tl.where(kmask, arg_k, 0)
        x_c = tl.load(logits_ptr + (b * K + ks[:, None]).to(tl.int64) * stride_logits + cand[None, :],
                      mask=kmask[:, None] & kmask[None, :], other=float("-inf")).to(tl.float32)
        q_c = tl.sum(w[:, None] * exp2(x_c * scale - lse2[:, None], FAST), axis=0)   # [KP]
        q_cert, tok_c = argmax_lowest(tl.where(kmask, q_c, -1.0), cand, 0)
        # NaN (a NaN or all -inf view): not certified; nor a candidate outside the vocabulary
        run_chunk = 1 - ((q_cert > bound) & (tok_c < V)).to(tl.int32)
        if REPORT:
            if sp == 0:
                tl.store(certified_ptr + b, 1 - run_chunk)
        if run_chunk == 0:  # certified: the row's token is decided, no chunk pass, no fold
            if sp == 0:
                _store_token(token_ptr, b, tok_c, ks, TOK_K)
                tl.store(token_prob_ptr + b, q_cert)

    if PICKED:  # greedy, one view: pass 1 found the pick, program (b, 0) finishes it
        if sp == 0:
            tok, y_tok = _fold_bests(prow, part_idx_ptr + b * S, ss, smask, KP, V)
            q_tok = exp2(y_tok - tl.sum(lse2, axis=0), FAST) * tl.sum(w, axis=0)
            _store_token(token_ptr, b, tok, ks, TOK_K)
            tl.store(token_prob_ptr + b, q_tok)

    if not GREEDY:
        if sp == n_prog - 1:  # the row's draw program: 1 of 1, or S + 1 of S + 1
            _slot_draw(logits_ptr, part_ptr, slot_ptr, seed_ptr, offset_ptr, token_ptr, token_prob_ptr,
                       b, w, lse2, pm, pmask, d_pre, ks, kmask, V, S, stride_logits, scale,
                       K, KP, SP, P, SW, SB, NB, TOK_K, FAST)

    if WRITE_MIX or (GREEDY and not PICKED):
        if (run_chunk != 0) & (sp < S):
            start = sp * CHUNK
            end = tl.minimum(start + CHUNK, V)
            cols = tl.arange(0, BLOCK)
            best = tl.full([BLOCK], float("-inf"), tl.float32)
            best_v0 = tl.zeros([BLOCK], tl.int32) + start
            best_q = tl.zeros([BLOCK], tl.float32)
            for v0 in range(start, end, BLOCK):
                offs = v0 + cols
                vmask = offs < end
                q = _tile_q(logits_ptr, b, offs, vmask, w, lse2, ks, stride_logits, scale, K, FAST)
                if WRITE_MIX:
                    tl.store(mixture_ptr + b * stride_mix + offs, q, mask=vmask)
                if GREEDY and not PICKED:
                    best, best_v0, best_q = best_step(tl.where(vmask, q, float("-inf")), q, v0, best, best_v0,
                                                      best_q)
            if GREEDY and not PICKED:  # the best slots are free: pass 1 wrote them only with PICK
                best, idx, q_best = best_combine(best, best_v0, best_q, cols, 0)
                row = part_ptr + (b * S + sp) * W
                tl.store(row + 2 * KP, best)
                tl.store(row + 2 * KP + 1, q_best)
                tl.store(part_idx_ptr + b * S + sp, idx)
                tl.debug_barrier()  # the chunk's best is stored before the release below
                arrived = tl.atomic_add(cnt_ptr + b, 1, sem="acq_rel", scope="gpu")
                if arrived == S - 1:  # the row's last chunk: its S bests -> token (lowest index on ties)
                    _fold_token(prow, part_idx_ptr, token_ptr, token_prob_ptr, b, S, ss, smask, ks, KP, V, TOK_K)
                    tl.store(cnt_ptr + b, 0)  # every chunk has arrived: ready for the next launch


def ensemble_mix(logits, weights, *, greedy, seed=None, offset=None, temperature=1.0,
                 return_mixture=False, mixture_out=None, view_tokens_out=None, certified_out=None, plan=None):
    """Triton launcher; see `tabed_engine.ops.ensemble_mix.ensemble_mix` for the contract.

    `view_tokens_out` ([B*K] int64, contiguous): the kernel stores request b's token in rows
    b*K .. b*K+K-1 (the next draft step's input ids), and the returned token is the strided
    view of its rows b*K. `mixture_out` ([B, V] fp32, unit last stride, any row stride) is
    written in place when given and implies return_mixture. `certified_out` ([B] int32):
    where the plan certifies (greedy K > 1 without the mixture row), 1 where pass 1's
    certificate decided the token, else 0 (tests and benchmarks read it). `plan`: a
    `mix_plan` for these shapes (default: the device's). No host synchronisation, so the
    call can be captured in a CUDA graph.
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
    if view_tokens_out is not None:
        if (view_tokens_out.shape != (R,) or view_tokens_out.dtype != torch.int64
                or view_tokens_out.device != dev or not view_tokens_out.is_contiguous()):
            raise ValueError(f"view_tokens_out must be a contiguous int64 [{R}] tensor on {dev}")
        token, tok_k = view_tokens_out, K      # the kernel writes every view row
    else:
        token, tok_k = torch.empty(B, dtype=torch.int64, device=dev), 1
    mixture = mixture_out
    if mixture is None and return_mixture:
        mixture = torch.empty(B, V, dtype=torch.float32, device=dev)
    if mixture is not None:
        if (mixture.shape != (B, V) or mixture.dtype != torch.float32
                or mixture.stride(1) != 1 or mixture.device != dev):
            raise ValueError("mixture_out must be float32 [B, V] with unit last stride")
    write_mix = mixture is not None
    if plan is None:
        plan = mix_plan(B, K, V, itemsize=logits.element_size(), greedy=greedy, write_mix=write_mix,
                        sms=sm_count(dev))
    elif ((plan.B, plan.K, plan.V, plan.greedy, plan.write_mix, plan.vec)
          != (B, K, V, bool(greedy), write_mix, 16 // logits.element_size())):
        raise ValueError(f"plan {plan} does not match these arguments")
    token_prob = torch.empty(B, dtype=torch.float32, device=dev)
    lse = torch.empty(R, dtype=torch.float32, device=dev)
    KP = triton.next_power_of_2(K)
    S = plan.splits
    n_slots = 1 if plan.greedy else plan.period // plan.width
    part = torch.empty(B * S * (2 * KP + 2), dtype=torch.float32, device=dev)
    part_idx = torch.empty(B * S, dtype=torch.int32, device=dev)
    cert_buf = torch.empty(B * S * KP if plan.cert else 1, dtype=torch.float32, device=dev)
    cert_idx = torch.empty(B * S * KP if plan.cert else 1, dtype=torch.int32, device=dev)
    slot = torch.empty(B * S * KP * n_slots if not plan.greedy else 1, dtype=torch.float32, device=dev)
    scale = LOG2E.value / float(temperature)  # exp(x / T) = exp2(x * scale)
    fast = dev.type == "cuda"
    use_pdl = pdl(dev)  # programmatic dependent launches (see _common.pdl)
    _mix_partial_kernel[(plan.rows1, S)](
        logits, part, part_idx, cert_buf, cert_idx, slot,
        K, V, S, plan.chunk, logits.stride(0), scale,
        KP=1 if plan.rowwise else KP, KV=KP, ROWWISE=plan.rowwise, BLOCK=plan.block1, VEC=plan.vec,
        RPT=plan.rpt, PICK=plan.picked, CERT=plan.cert, DRAW=not plan.greedy, P=plan.period, SW=plan.width,
        EVICT=plan.evict1, FAST=fast, PDL=use_pdl, launch_pdl=use_pdl, num_warps=plan.warps1,
    )
    report = plan.cert and certified_out is not None
    _mix_chunk_kernel[(B, plan.n_prog)](
        logits, weights, seed if not plan.greedy else token, offset if not plan.greedy else token,
        part, part_idx, cert_buf, cert_idx, slot, certified_out if report else token, token, token_prob,
        mixture if write_mix else token_prob, lse, counters(dev, B),
        V, S, plan.chunk, logits.stride(0), weights.stride(0), weights.stride(1),
        mixture.stride(0) if write_mix else 0, scale,
        K=K, KP=KP, SP=triton.next_power_of_2(S), BLOCK=plan.block2, GREEDY=plan.greedy, WRITE_MIX=write_mix,
        PICKED=plan.picked, CERT=plan.cert, REPORT=report, TOK_K=tok_k, P=plan.period, SW=plan.width,
        SB=plan.sb, NB=plan.nb, FAST=fast, PDL=use_pdl, launch_pdl=use_pdl, num_warps=plan.warps2,
    )
    return token[::tok_k], token_prob, mixture, lse
