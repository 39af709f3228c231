"""Fused ensemble mixing of the K draft views: softmax per view, mix, pick a token.

The vocabulary of each request is cut into S chunks, grid (B, S), with S from the shapes
and the device's SM count only (`_n_vsplit`: about 4 programs per SM whatever B is, 8
greedy with K > 1, 16 when sampling (8 with K > 1 and no mixture row); with one view row
per pass-1 program, `_ROWWISE`, 4 per SM over the B * K rows; at least 1024 columns per
chunk), so the launcher never syncs and can be captured in a CUDA graph.  Two launches
exchange small partials:

  1. `_mix_partial_kernel`: per (row, chunk) max and sum-exp of the K views (one view
     per program, grid (B * K, S), where `_ROWWISE` applies); greedy with
     one view (KP == 1) also the chunk's argmax; sampling also the sum-exp of each draw
     slot (below).
  2. `_mix_chunk_kernel`: folds the S partials of its row into the normalisers (S * K
     floats), then forms q = sum_k w_k softmax_k over a chunk: writes the mixture row,
     and greedy with K > 1 its chunk's best (q, index), the row's last program to arrive
     (atomic counter) folding the S bests into the token; a certified row (below) is
     finished by program (b, 0) at once.  Greedy with one view the pick is already
     known, so program (b, 0) finishes it.  Sampling: one more program per row draws.

With the mixture row and logits and row larger than half of L2, the two passes run in one
launch instead (`_mix_fused_kernel`: each program reads its chunk for pass 1, waits for its
row's other chunks, and reads it again for pass 2 while it is still in L2); with K > 1 its
passes take each chunk's whole steps without column masks and, for bf16 rows at even
offsets, as 32-bit words of two columns (`_FUSED_PAIRS`).

Passes over the logits: one greedy with a single view; for K > 1 and for sampling, one
plus what needs q (every chunk with the mixture row; greedy without it, only what can
beat the candidates, below; sampling without it, 1/32 of the row): q_v needs every view's
final normaliser, and the second read comes from L2 when the batch's logits fit in it (33
MB at B = 128, K = 4, V = 32064; pass 1 then loads them evict_last, see `_P1_EVICT`).
Greedy without the mixture row: pass 1 also keeps each view's argmax and second-largest
logit; a token that is no view's argmax has q_v <= sum_k w_k q_k(second largest), so when
the best of the K candidates beats that bound, it is the argmax and the second pass is
skipped (always, when the views agree on their argmax).  Otherwise (several pass-1 steps
per chunk) pass 2 re-reads only the thread slots of pass 1 whose bound, from each view's
slot maximum, can reach the best candidate's q (`_live_chunk_best`).
Pass 1 streams 16-byte groups, each loaded and reduced by one thread (its running max,
sum-exp and best group live in that thread: no barrier in the loop, ~9 SASS instructions
and 1.1 exp2 per element against ~13 and 1 with element-wise running values), the
cross-thread reduction once per program; pass 2 keeps element-wise running values
(best / step, see `_common`). Both use exp2 with the temperature and log2(e) folded into
one scale: x * scale - lse2 is one FMA.

Chunk bests combine by value, then lowest index, so ties resolve like torch.argmax and
the result does not depend on the split.  A sample is an inverse CDF with one uniform per
request, output 0 of Philox(seed, counter offset + b * V) (`_common.uniforms`), in a fixed
draw order: draw slot T = (c mod P) // SW first (P = 512, SW = 16: 32 slots), then column.
Pass 1's thread slots each lie in one draw slot (chunks and steps are multiples of P), so
it stores every (chunk, view, slot) sum-exp at no cost in its loop; the draw folds them
into 32 slot masses, picks the slot with the uniform and re-reads only that slot's
columns (1/32 of the row) to walk their prefix sums (`_slot_draw`).  The order depends on
P and SW only: any split draws the same token, unless u falls within float rounding of a
boundary.  (Before: natural order, the drawn chunk walked by one program, 1/S of the row
and a chain of dependent steps at large B.)
"""
import torch
import triton
import triton.language as tl

from ._common import (_MAX_SPLITS, BIG_IDX, LN2, LOG2E, NEG_BIG, best_combine, best_step, chunk_block, chunking,
                      counters, exp2, group_best_cols, group_cols, group_items, group_lse_step, l2_cache_bytes, log2,
                      lse_reduce, n_vsplit as _n_vsplit, pdl, pdl_wait, target_programs, ticket, uniforms, tile_warps)

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Columns per view and pass-1 step (_TILE // KP) and programs per SM. H200, cold
# [B * K, 32064] bf16 inputs (graph replays, HEAD vs the thread-owned groups of pass 1 in
# one process, 2 rounds): greedy B = 512, K = 1 16.3 -> 12.7 us (48% -> 61% of copy
# bandwidth) at 2048 x 4; 4096 x 4 14.1, 2048 x 8 15.3, 2 pipelining stages 14.0. Greedy with
# K > 1 (the certifying pass 1 keeps more per slot) is faster at 8 programs per SM: B = 256,
# K = 2 29.2 -> 23.5 us, B = 128, K = 4 32.3 -> 26.9, agreeing views (certified) 25.2 -> 19.9
# and 22.7 -> 21.1 (at 4 per SM 29.7, 33.6, 24.0, 27.7). At B <= 16 the split (32 chunks of
# 1008) does not change.
_TILE = 2048
_PROGRAMS_PER_SM = 4
# Pass 2 (the mixture row, greedy K > 1's chunk pass): elements per step over the K views
# and per thread (warps = tile / (32 * this)).
_CHUNK_TILE = 2048
_CHUNK_PER_THREAD = 16
_VIEWS_PROGRAMS_PER_SM = 8
# Sampling programs per SM: 16, but 8 with K > 1 and no mixture row (pass 1 alone, which then
# carries K views per program). H200, cold [B * K, 32064] bf16 inputs, graph replays, with
# the slot draw below: no mixture row B = 512, K = 1 17.0 us at 16 vs 19.2 at 8; B = 128,
# K = 4 17.8 vs 15.0; with the mixture row 39.6 vs 40.1 and 25.1 vs 26.6 (H100: B = 256, K = 2
# 19.9 vs 19.1, with the mixture row 39.1 vs 40.2).
_SAMPLE_PROGRAMS_PER_SM = 16
_SAMPLE_VIEWS_PROGRAMS_PER_SM = 8
# Sampling's draw order (see `_slot_draw`): period P and slot width SW in columns, P // SW
# draw slots; pass 1 stores a sum-exp per (chunk, view, slot), the draw re-reads one slot,
# SW / P of the row. Tests shrink P to split small V. The draw program: 4 warps (B = 1, K = 2
# 4.39 us vs 4.50 with 2, 5.04 with 1; B = 512, K = 1 17.0 vs 16.4 and 16.8), its loops
# without software pipelining (with 3 stages B = 1, K = 2 5.34 vs 4.86 us on an H100).
_DRAW_PERIOD = 512
_DRAW_WIDTH = 16
_DRAW_WARPS = 4
# The draw's slot sums: up to _DRAW_TILE floats in one tile loaded beside the chunk partials
# (V = 32064: 32 chunks x 4 views x 32 slots); more chunks (large V) fold in steps of that size.
_DRAW_TILE = 4096
_DRAW_STAGES = 1
# Greedy K > 1 without the mixture row: certify the argmax from pass 1's per-view top-2
# (see `_mix_chunk_kernel`) and skip the second pass when it holds. False: always two passes.
_CERTIFY = True
# Software-pipelining stages of pass 1's loop: 1 (H200, greedy B = 512, K = 1: 12.7 us vs
# 14.0 with 2; B = 128, K = 4 33.6 vs 29.4 at 4 programs per SM but 26.9 with 1 stage at 8).
_STAGES = 1
# Pass-1 elements per thread and step (warps = tile / (32 * this), 4 to 16): 16 (32: B = 512,
# K = 1 12.7 us either way at 2048-column tiles, 25.3 vs 14.1 at 4096).
_PER_THREAD = 16
# Pass 1's loads when a second pass reads the logits again (the mixture row, greedy K > 1,
# sampling's walk): kept in L2 first ("evict_last"). H200, cold, one process: sample with the
# mixture row B = 512, K = 1 39.5 -> 38.4 us (59% -> 60% of copy), B = 256, K = 2 30.4 -> 29.8,
# B = 128, K = 4 24.1 -> 23.8; sample B = 128, K = 4 15.0 -> 14.6; greedy K > 1 and sample
# B = 512, K = 1 within 0.1. The mixture row's stores marked "evict_first" as well: mixed
# (B = 512 38.3, B = 256 30.9), not kept.
_P1_EVICT = "evict_last"
# Pass 1 with K > 1 and no mixture row: one view row per program, grid (B * K, S), S from B * K
# rows at _PROGRAMS_PER_SM (the layout of K = 1) instead of K views per program at 2048 / KP
# columns per view and step; the views are independent until pass 2. H200, cold bf16 inputs,
# graph replays, one process (K views per program -> one): engine shapes greedy B = 1, K = 4
# 6.75 -> 5.66 us, agreeing views 4.90 -> 3.94, B = 1, K = 2 4.89 -> 4.66, B = 16, K = 4 10.87
# -> 9.43, sample B = 16, K = 4 7.74 -> 6.63; at 33 MB within 0.7 us (agreeing B = 128, K = 4
# 18.2 -> 17.5); past L2 sample B = 512, K = 4 48.1 -> 42.2. Not taken: sampling with K = 2
# (B = 1 4.26 vs 4.39, B = 1024 41.3 vs 41.9); the mixture row (its pass 2 wants the finer
# split: B = 128, K = 4 23.9 vs 34.0); greedy where B * K rows leave one chunk per row (B =
# 512, K = 4; B = 1024, K = 2), as pass 2 would re-read a disagreeing row's live slots in one
# program, from DRAM (random views B = 512, K = 4 58.4 -> 62.7 and 58.3 -> 57.7 in two A/Bs,
# 68.1 in the benchmark against 57.5 before; agreeing 53.9 -> 47.8). 1024-column steps:
# faster past L2 (agreeing B = 512, K = 4 43.8), slower at 33 MB (sample B = 128, K = 4 16.2).
_ROWWISE = True
# Greedy with logits larger than L2: one view row per program with at least 2 chunks per row
# and 1024-column steps, where the rule above falls back. H200, cold bf16 inputs, graph
# replays, one process (fallback -> this): random views B = 512, K = 4 (131 MB) 57.5 -> 48.9 us
# (54% -> 64% of copy), agreeing 52.9 -> 45.1, B = 1024, K = 2 50.9 -> 47.7, agreeing 49.1 ->
# 45.9. Not at 33 MB: B = 128, K = 4 17.6 -> 19.8, B = 256, K = 2 18.2 -> 20.5 (at
# 2048-column steps 17.8 and 18.2); 3 chunks per row: 52.1 at B = 512, K = 4.
_ROWWISE_BIG_SPLIT = 2
_ROWWISE_BIG_TILE = 1024
# The mixture row with logits and row larger than half of L2: both passes in one launch
# (`_mix_fused_kernel`), each chunk's second read right after its first, from L2.
# _FUSED_WAIT: each program writes its own chunk (False: the row's last program writes them
# all, as under the interpreter). Chunks of _FUSED_TASK_BYTES of logits, at most _FUSED_CHUNK
# columns; pass-1 steps of _FUSED_TILE elements over the K views (K = 1: _TILE); pass-2 steps
# of _FUSED_CHUNK_TILE elements (_FUSED_CHUNK_TILE_K2 with two views; greedy K > 1, whose
# pass 2 keeps a running best per element: _FUSED_GREEDY_COLUMNS per view), its loads and the
# mixture's stores marked evict_first (_FUSED_EVICT2: the chunks still to be read again stay
# in L2); 4 warps (greedy K = 1: 8). H200, cold bf16 inputs, graph replays, one process
# (sweeps of chunks of 2048-8192 columns, pass-1 steps 2048-8192, pass-2 steps 1024-8192, 4 /
# 8 warps, eviction hints; polling the counter with plain loads or with a nanosleep backoff,
# neither kept), two launches -> one at these settings: sample B = 512, K = 4 (197 MB) 95.5
# -> 75.5 us (49% -> 61% of copy), B = 1024, K = 2 114.7 -> 90.6 (54% -> 68%), B = 2048, K =
# 1 146.8 -> 116.1 (63% -> 80%), B = 256, K = 2 (66 MB) 29.8 -> 25.8; greedy 97.2 -> 82.0,
# 111.9 -> 96.3, 148.0 -> 114.6, 36.0 -> 26.8 (48/55/63/43% -> 57/64/81/58%). Taken where
# logits and mixture row exceed L2 times _FUSED_L2 (60 MB on the H200): at 49 MB (B = 128,
# K = 4) greedy 31.4 -> 23.7 us, sampling 23.8 -> 23.7; at 99 MB (B = 512, K = 1) 45.9 ->
# 32.3 and 38.7 -> 33.5. Tried since (B = 512, K = 4, greedy 197 MB, us): the chunk bests and
# arrivals in one 64-bit word per row by compare-and-swap, no fence after the mixture stores
# (H200 82.1 -> 86.4; B = 1, K = 4 without the row 5.7 -> 11.6); pass 2's running best without
# its third value (64 -> 56 registers; H100 105.4 -> 111.8); 2 / 3 pipelining stages (H200
# 81.9 -> 89.3 / 89.5); 20-40 KB tasks (H100 105.4 at 32 KB: 114.3 / 105.5 / 110.5 / 117.5 at
# 20 / 24 / 28 / 40 KB); one program per row (no ticket, no wait; 8-32 warps, 2048-8192
# columns per view and step: H200 83.8 -> 92.2-119.2; B = 1024, K = 2 98.3 -> 112.7-142.0;
# sampling B = 512, K = 4 78.1 -> 99.5-125.1). Greedy with K > 1 reads pass 2's logits in
# the row's 16-byte store layout, which spares triton 3.6's shared-memory exchange before
# each step's stores, and keeps its running best without a value (`_mix_chunk`'s
# STORE_TILES). H200, in-process A/B (HEAD -> both): B = 512, K = 4 84.6 -> 81.5 us, B = 1024,
# K = 2 98.0 -> 96.3, B = 256, K = 4 45.7 -> 45.0, B = 128, K = 4 25.8 -> 25.0, tokens equal;
# each alone (B = 512, K = 4 / B = 1024, K = 2): the layout 80.8 / 102.9, the best without
# its value 87.9 / 101.3 (one more program per SM). Not with one view (the layout: B = 2048,
# K = 1 117.7 -> 128.4) nor for sampling (B = 512, K = 4 77.1 -> 76.5, within noise).
# Profile: benchmarks/results/two_pass_profile.md.
_FUSED_L2 = 0.5
_FUSED = True
_FUSED_WAIT = True
_FUSED_CHUNK = 8192
_FUSED_TASK_BYTES = 32768
_FUSED_TILE = 4096
_FUSED_CHUNK_TILE = 4096
_FUSED_CHUNK_TILE_K2 = 8192
_FUSED_GREEDY_COLUMNS = 1024
_FUSED_EVICT2 = "evict_first"
# _FUSED_PAIRS (K > 1, bf16 rows at even offsets from a 4-byte address): both passes run each
# chunk's whole steps first without column masks, reading the logits as 32-bit words of two
# (x = word << 16, word & 0xffff0000: one integer instruction per element where unpacking
# bf16 took 1.5); sampling's pass 2 then takes the [BLOCK // 4, 4] store layout too. sm_90
# SASS per step at K = 4: pass 1 229 -> 207, pass 2 223 -> 193 instructions (no masks alone:
# 203). H200, in-process A/B, two rounds (HEAD -> masks only -> word pairs, us; tokens equal,
# rows within 2e-7): greedy B = 512, K = 4 79.2 -> 77.3 -> 76.4, B = 256, K = 4 42.8 -> 41.8 ->
# 41.4, B = 1024, K = 2 93.8 -> 93.6 -> 93.8; sampling 76.9 -> 77.1 -> 75.1, 43.8 -> 43.5 ->
# 42.7, 93.4 -> 93.5 -> 88.0 (word pairs in pass 2 alone, sampling B = 512, K = 4: 81.9, so
# both passes). One view: within 1% (sampling B = 2048, K = 1 118.3 -> 117.6), not taken.
_FUSED_PAIRS = True


@triton.jit
def _mix_partial_kernel(
    logits_ptr, part_ptr, part_idx_ptr, cert_ptr, cert_idx_ptr, slot_ptr,
    K, V, S, CHUNK, stride_logits, scale,
    KP: tl.constexpr, BLOCK: tl.constexpr, VEC: tl.constexpr, RPT: tl.constexpr, PICK: tl.constexpr,
    CERT: tl.constexpr, MULTI: tl.constexpr, DRAW: tl.constexpr, P: tl.constexpr, SW: tl.constexpr,
    STAGES: tl.constexpr, EVICT: tl.constexpr, FAST: tl.constexpr, PDL: tl.constexpr,
    ROWWISE: tl.constexpr, KV: tl.constexpr,
):
    """Pass 1 as its own launch: program (row, chunk) = (program_id(0), program_id(1)), see
    `_mix_partial`."""
    pdl_wait(PDL)
    _mix_partial(tl.program_id(0), tl.program_id(1), logits_ptr, part_ptr, part_idx_ptr, cert_ptr, cert_idx_ptr,
                 slot_ptr, K, V, S, CHUNK, stride_logits, scale, KP, BLOCK, VEC, RPT, PICK, CERT, MULTI, DRAW,
                 P, SW, STAGES, EVICT, FAST, ROWWISE, KV, False)


@triton.jit
def _mix_partial(
    pid, sp, logits_ptr, part_ptr, part_idx_ptr, cert_ptr, cert_idx_ptr, slot_ptr,
    K, V, S, CHUNK, stride_logits, scale,
    KP: tl.constexpr, BLOCK: tl.constexpr, VEC: tl.constexpr, RPT: tl.constexpr, PICK: tl.constexpr,
    CERT: tl.constexpr, MULTI: tl.constexpr, DRAW: tl.constexpr, P: tl.constexpr, SW: tl.constexpr,
    STAGES: tl.constexpr, EVICT: tl.constexpr, FAST: tl.constexpr, ROWWISE: tl.constexpr, KV: tl.constexpr,
    PAIRS: tl.constexpr,
):
    """Pass 1 of chunk sp of program row pid: per (row, chunk) max and sum-exp; with PICK
    (greedy, one view) the chunk's argmax; with CERT (greedy, K > 1) each view's argmax in
    the chunk and its second-largest logit.

    Each step reads a [KP, RPT, NT, VEC] tile of thread-owned groups (see `_common`; with
    ROWWISE, KP == 1 and program row r is view r % K of request r // K; partial rows hold
    KV views either way):
    running max and sum-exp per view and slot. The argmax keeps each slot's best step (its
    values and start), the column within it is found once, after the loop. MULTI (CERT
    with several steps per chunk) keeps only the start and reads the values again after the
    loop (and stores the slot maxima below): the K views' kept values cost registers (H200
    B = 128, K = 4 26.9 -> 25.4 us, agreeing views 16.8 -> 15.4), while with one view (B =
    512 12.7 -> 14.8) or one step (B = 1, K = 2 5.6 -> 5.8) the extra dependent read costs
    more.

    part row (b, s) of width 2 * KP + 2: [max_k | sumexp_k | best score | best y], max in
    logit units, sumexp of exp2((x - max) * scale), y = x * scale (log2 units); cert /
    cert_idx rows (b, s) of KP: second-largest logit / argmax index per view; with MULTI,
    slot rows (b, s, k) of NT: each thread slot's max (logit units), the bounds of
    `_live_chunk_best`.

    PAIRS (bf16 rows at even offsets from a 4-byte address): the chunk's whole steps first,
    without column masks, each 16-byte group loaded as four 32-bit words of two columns
    (x = word << 16 for the even one, word & 0xffff0000 for the odd one: one integer
    instruction per element where unpacking took 1.5), then the masked last step.

    DRAW (sampling): also the chunk's sum-exp per view and draw slot against the view's
    chunk max (P // SW slots: slot T holds the columns c with (c mod P) // SW == T; the
    chunk starts at a multiple of P and NT * VEC is one, so each thread slot lies in one
    draw slot), rows (b, s, k) of P // SW in slot.
    """
    start = sp * CHUNK
    end = tl.minimum(start + CHUNK, V)
    NT: tl.constexpr = BLOCK // (RPT * VEC)                        # slots (threads) per view
    ks = tl.arange(0, KP)
    if ROWWISE:  # grid (B * K, S), KP == 1: program row r is view r % K of request r // K
        r = pid.to(tl.int64)
        b = r // K
        kv = ks + (r % K).to(tl.int32)                             # [1]: the view
        kmask = ks < 1
        rows_ptr = (logits_ptr + r * stride_logits + ks * 0)[:, None, None, None]
    else:
        b = pid.to(tl.int64)
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
    v_part = start  # where the column-masked steps begin: at once, or after the whole steps of PAIRS
    if PAIRS:  # whole steps first: bf16 logits loaded as 32-bit words of two, no column masks
        v_part = start + (end - start) // BLOCK * BLOCK
        wcols = group_cols(RPT, NT, VEC // 2)                      # [RPT, NT, VEC // 2] words of a step
        wrows = rows_ptr.to(tl.pointer_type(tl.int32))
        for v0 in tl.range(start, v_part, BLOCK, num_stages=STAGES):
            u = tl.load(wrows + (v0 // 2 + wcols)[None], mask=lmask, other=-8323200,   # 0xff80ff80: -inf twice
                        eviction_policy=EVICT)
            lo, hi = _bf16_halves(u)
            x = tl.reshape(tl.join(lo, hi), [KP, RPT, NT, VEC])
            m, s, m2, bx, b_v0 = _partial_step(x, v0, m, s, m2, bx, b_v0, scale, PICK, CERT, MULTI, FAST)
    for v0 in tl.range(v_part, end, BLOCK, num_stages=STAGES):
        offs = v0 + gcols
        x = tl.load(rows_ptr + offs[None], mask=lmask & (offs < end)[None], other=float("-inf"),
                    eviction_policy=EVICT).to(tl.float32)
        m, s, m2, bx, b_v0 = _partial_step(x, v0, m, s, m2, bx, b_v0, scale, PICK, CERT, MULTI, FAST)
    if PICK or CERT:
        if MULTI:  # the best step's values, read again (L2)
            boffs = b_v0[:, None, :, None] + gcols[None]
            bx = tl.maximum(tl.load(rows_ptr + boffs, mask=lmask & (boffs < end), other=NEG_BIG).to(tl.float32),
                            NEG_BIG)  # -inf as NEG_BIG, the start value: a slot of -inf finds its first column
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
        tl.store(cert_ptr + (b * S + sp) * KV + kv, c_2nd)
        tl.store(cert_idx_ptr + (b * S + sp) * KV + kv, c_idx)
        # each thread slot's max per view: the bounds that let pass 2 skip slots
        if MULTI:
            tl.store(slot_ptr + _slot_max_offsets(b, S, sp, kv, KV, NT), m, mask=kmask[:, None])
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
def _partial_step(x, v0, m, s, m2, bx, b_v0, scale, PICK: tl.constexpr, CERT: tl.constexpr, MULTI: tl.constexpr,
                  FAST: tl.constexpr):
    """One step of `_mix_partial`'s loop over the [KP, RPT, NT, VEC] tile x read at v0: the
    running max and sum-exp, and the argmax / certificate state it keeps."""
    m_old = m
    m, s, take, g_max = group_lse_step(x, m, s, scale, FAST)
    if CERT:
        m2 = tl.where(take, m_old, tl.maximum(m2, g_max))
    if PICK or CERT:
        if not MULTI:
            bx = tl.where(take[:, None, :, None], x, bx)
        b_v0 = tl.where(take, v0, b_v0)
    return m, s, m2, bx, b_v0


@triton.jit
def _mix_chunk_kernel(
    logits_ptr, weights_ptr, seed_ptr, offset_ptr, part_ptr, part_idx_ptr, cert_ptr, cert_idx_ptr,
    slot_ptr, certified_ptr, token_ptr, token_prob_ptr, mixture_ptr, lse_ptr, cnt_ptr,
    V, S, CHUNK, stride_logits, stride_wb, stride_wk, stride_mix, scale,
    K: tl.constexpr, KP: tl.constexpr, SP: tl.constexpr, BLOCK: tl.constexpr,
    GREEDY: tl.constexpr, WRITE_MIX: tl.constexpr, PICKED: tl.constexpr, CERT: tl.constexpr,
    REPORT: tl.constexpr, TOK_K: tl.constexpr, P: tl.constexpr, SW: tl.constexpr, SB: tl.constexpr,
    NB: tl.constexpr, DSTAGES: tl.constexpr, BLOCK1: tl.constexpr, RPT: tl.constexpr, VEC: tl.constexpr,
    SMAX: tl.constexpr, LIVE: tl.constexpr, FAST: tl.constexpr, PDL: tl.constexpr,
):
    """Pass 2 as its own launch, see `_mix_chunk`. Programs run in the reverse of pass 1's
    order, so the chunks pass 1 read last (the likeliest to be still in L2 when the logits
    exceed it) are read first."""
    pdl_wait(PDL)
    _mix_chunk((tl.num_programs(0) - 1 - tl.program_id(0)).to(tl.int64),
               tl.num_programs(1) - 1 - tl.program_id(1), tl.num_programs(1),
               logits_ptr, weights_ptr, seed_ptr, offset_ptr, part_ptr, part_idx_ptr, cert_ptr, cert_idx_ptr,
               slot_ptr, certified_ptr, token_ptr, token_prob_ptr, mixture_ptr, lse_ptr, cnt_ptr,
               V, S, CHUNK, stride_logits, stride_wb, stride_wk, stride_mix, scale,
               K, KP, SP, BLOCK, GREEDY, WRITE_MIX, PICKED, CERT, REPORT, TOK_K, P, SW, SB, NB, DSTAGES,
               BLOCK1, RPT, VEC, SMAX, LIVE, FAST, "", "", False, True, False)


@triton.jit
def _mix_chunk(
    b, sp, n_prog, logits_ptr, weights_ptr, seed_ptr, offset_ptr, part_ptr, part_idx_ptr, cert_ptr, cert_idx_ptr,
    slot_ptr, certified_ptr, token_ptr, token_prob_ptr, mixture_ptr, lse_ptr, cnt_ptr,
    V, S, CHUNK, stride_logits, stride_wb, stride_wk, stride_mix, scale,
    K: tl.constexpr, KP: tl.constexpr, SP: tl.constexpr, BLOCK: tl.constexpr,
    GREEDY: tl.constexpr, WRITE_MIX: tl.constexpr, PICKED: tl.constexpr, CERT: tl.constexpr,
    REPORT: tl.constexpr, TOK_K: tl.constexpr, P: tl.constexpr, SW: tl.constexpr, SB: tl.constexpr,
    NB: tl.constexpr, DSTAGES: tl.constexpr, BLOCK1: tl.constexpr, RPT: tl.constexpr, VEC: tl.constexpr,
    SMAX: tl.constexpr, LIVE: tl.constexpr, FAST: tl.constexpr, CACHE: tl.constexpr, EVICT2: tl.constexpr,
    STORE_TILES: tl.constexpr, FOLD: tl.constexpr, PAIRS: tl.constexpr,
):
    """Pass 2 of request b (int64), program sp of the row's n_prog: fold the S partials into
    the normalisers, then q over this program's chunk.

    CERT (greedy, K > 1, no mixture row): first the candidates, each view's argmax c_j. A
    token that is no view's argmax has q_v <= bound = sum_k w_k q_k(second largest of view
    k), so when the best candidate's q exceeds the bound it is the argmax of q and the pass
    over the chunk is skipped (views that agree on their argmax always certify) and program
    (b, 0) stores the token. Otherwise the chunk pass below runs: with LIVE > 0 (pass 1
    took several steps per chunk and stored its thread-slot maxima, BLOCK1 / RPT / VEC its
    tile) over the live slots only, LIVE at a time with SMAX steps each (`_live_chunk_best`),
    else over the whole chunk as without CERT.

    Greedy, K > 1, chunk pass: each program stores its chunk's best (q, index); with FOLD it
    counts itself in (atomic counter of row b) and the last of the row's S programs to
    arrive reads the S bests (past L1: other programs wrote them) and stores the token
    (without FOLD the caller does, `_mix_fused_kernel`).

    Sampling: one program per row draws the token from pass 1's draw-slot partials
    (`_slot_draw`): one program per row without the mixture row; with it S + 1, programs
    0 .. S - 1 write q over their chunks and program S draws beside them.

    CACHE: the cache modifier of the loads of pass 1's partials (".cg" where pass 1 ran in
    the same launch, `_mix_fused_kernel`); EVICT2: the eviction policy of the chunk pass's
    logits loads and mixture stores. STORE_TILES (greedy, K > 1, the mixture row in one
    launch): the chunk pass's columns as [BLOCK // 4, 4] tiles, the layout of the row's
    16-byte stores (a [BLOCK] tile of 16-byte logits loads takes a shared-memory exchange and
    two barriers before each step's stores), and the running best without its value (q is
    the score); its whole steps run without masks, the last partial one after them. PAIRS
    (bf16, the launcher's alignment): that layout and those whole steps with the logits read
    as 32-bit words of two (`_tile_q_pairs`)."""
    ks = tl.arange(0, KP)
    kmask = ks < K
    ss = tl.arange(0, SP)
    smask = ss < S
    W: tl.constexpr = 2 * KP + 2
    prow = part_ptr + (b * S + ss) * W  # [SP]
    pmask = smask[:, None] & kmask[None, :]
    d_pre = 0.0
    if not GREEDY:
        if SB >= SP:  # the draw's slot sums, one tile, loaded beside the partials (before any reduction)
            d_pre = tl.load(slot_ptr + _slot_offsets(b, S, ss, ks, KP, P // SW),
                            mask=((ss < tl.where(sp == n_prog - 1, S, 0))[:, None]
                                  & kmask[None, :])[:, :, None], other=0.0,
                            cache_modifier=CACHE)   # the draw program only
    ms = 0.0
    if LIVE > 0:  # pass 1's thread-slot maxima of this chunk, loaded beside the partials
        ms = tl.load(slot_ptr + _slot_max_offsets(b, S, sp, ks, KP, BLOCK1 // (RPT * VEC)), mask=kmask[:, None],
                     other=NEG_BIG, cache_modifier=CACHE)
    pm, ps, lse2 = _row_normalisers(prow, ks, pmask, kmask, scale, KP, FAST, CACHE)
    if sp == 0:
        tl.store(lse_ptr + b * K + ks, lse2 * LN2, mask=kmask)
    w = tl.load(weights_ptr + b * stride_wb + ks * stride_wk, mask=kmask, other=0.0)

    run_chunk = 1
    if CERT:
        crow = (b * S + ss[:, None]) * KP + ks[None, :]           # [SP, KP]
        c_idx = tl.load(cert_idx_ptr + crow, mask=pmask, other=BIG_IDX, cache_modifier=CACHE)
        top_k = tl.max(pm, axis=0)                                 # [KP] each view's max
        arg_k = tl.min(tl.where(pmask & (pm == top_k[None, :]), c_idx, BIG_IDX), axis=0)
        second = tl.maximum(
            tl.max(tl.load(cert_ptr + crow, mask=pmask, other=NEG_BIG, cache_modifier=CACHE), axis=0),
            tl.max(tl.where(pmask & (c_idx != arg_k[None, :]), pm, NEG_BIG), axis=0))
        bound = tl.sum(tl.where(kmask, w * exp2(second * scale - lse2, FAST), 0.0), axis=0)
        # q at the candidates: x_c[k, j] = logit of view k at view j's argmax
        cand = tl.where(kmask, arg_k, 0)
        x_c = tl.load(logits_ptr + (b * K + ks[:, None]).to(tl.int64) * stride_logits + cand[None, :],
                      mask=kmask[:, None] & kmask[None, :], other=float("-inf")).to(tl.float32)
        q_c = tl.sum(w[:, None] * exp2(x_c * scale - lse2[:, None], FAST), axis=0)   # [KP]
        q_c = tl.where(kmask, q_c, -1.0)
        q_cert = tl.max(q_c, axis=0)
        tok_c = tl.min(tl.where(q_c == q_cert, cand, BIG_IDX), axis=0)
        run_chunk = 1 - (q_cert > bound).to(tl.int32)   # NaN (a NaN or all -inf view): not certified
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
                       K, KP, SP, P, SW, SB, NB, TOK_K, DSTAGES, FAST, CACHE)

    if WRITE_MIX or (GREEDY and not PICKED):
        if (run_chunk != 0) & (sp < S):
            start = sp * CHUNK
            end = tl.minimum(start + CHUNK, V)
            if LIVE > 0:  # only the thread slots of pass 1 that can beat the candidates
                best, idx, q_best = _live_chunk_best(logits_ptr, b, start, end, ms, w, lse2, q_cert, ks, kmask,
                                                     stride_logits, scale, K, BLOCK1, RPT, VEC, SMAX, LIVE, FAST)
            else:
                if STORE_TILES or PAIRS:
                    cols = tl.arange(0, BLOCK // 4)[:, None] * 4 + tl.arange(0, 4)[None, :]
                else:
                    cols = tl.arange(0, BLOCK)
                best = tl.full(cols.shape, float("-inf"), tl.float32)
                best_v0 = tl.zeros(cols.shape, tl.int32) + start
                if not STORE_TILES:
                    best_q = tl.zeros(cols.shape, tl.float32)
                v_part = start  # where the masked steps begin: at once, or after the whole steps
                if STORE_TILES or PAIRS:  # whole steps: no masks (with PAIRS, bf16 logits in 32-bit words of two)
                    v_part = start + (end - start) // BLOCK * BLOCK
                    for v0 in range(start, v_part, BLOCK):
                        offs = v0 + cols
                        if PAIRS:
                            q = _tile_q_pairs(logits_ptr, b, v0, w, lse2, ks, stride_logits, scale, K, BLOCK, FAST,
                                              EVICT2)
                        else:
                            q = _tile_q(logits_ptr, b, offs, None, w, lse2, ks, stride_logits, scale, K, FAST, EVICT2)
                        if WRITE_MIX:
                            tl.store(mixture_ptr + b * stride_mix + offs, q, eviction_policy=EVICT2)
                        if GREEDY and not PICKED:  # (STORE_TILES: the layout's running best)
                            best, best_v0 = _take_best(q, v0, best, best_v0)
                for v0 in range(v_part, end, BLOCK):
                    offs = v0 + cols
                    vmask = offs < end
                    q = _tile_q(logits_ptr, b, offs, vmask, w, lse2, ks, stride_logits, scale, K, FAST, EVICT2)
                    if WRITE_MIX:
                        tl.store(mixture_ptr + b * stride_mix + offs, q, mask=vmask, eviction_policy=EVICT2)
                    if GREEDY and not PICKED:
                        score = tl.where(vmask, q, float("-inf"))
                        if STORE_TILES:
                            best, best_v0 = _take_best(score, v0, best, best_v0)
                        else:
                            best, best_v0, best_q = best_step(score, q, v0, best, best_v0, best_q)
                if GREEDY and not PICKED:
                    if STORE_TILES:  # columns in row-major order: the [BLOCK] tile's
                        best = tl.reshape(best, [BLOCK])
                        best, idx, _ = best_combine(best, tl.reshape(best_v0, [BLOCK]), best, tl.arange(0, BLOCK), 0)
                        q_best = best   # the score is the value
                    else:
                        best, idx, q_best = best_combine(best, best_v0, best_q, cols, 0)
            if GREEDY and not PICKED:  # the best slots are free: pass 1 wrote them only with PICK
                row = part_ptr + (b * S + sp) * W
                tl.store(row + 2 * KP, best)
                tl.store(row + 2 * KP + 1, q_best)
                tl.store(part_idx_ptr + b * S + sp, idx)
                if FOLD:
                    tl.debug_barrier()  # the chunk's best is stored before the release below
                    arrived = tl.atomic_add(cnt_ptr + b, 1, sem="acq_rel", scope="gpu")
                    if arrived == S - 1:  # the row's last chunk: its S bests -> token (lowest index on ties)
                        _fold_token(prow, part_idx_ptr, token_ptr, token_prob_ptr, b, S, ss, smask, ks, KP, V, TOK_K)
                        tl.store(cnt_ptr + b, 0)  # every chunk has arrived: ready for the next launch


@triton.jit
def _take_best(score, v0, best, best_v0):
    """STORE_TILES's running best per element: the score where it beats the kept one (strict:
    earlier steps keep ties), and the step it came from."""
    take = score > best
    return tl.where(take, score, best), tl.where(take, v0, best_v0)


@triton.jit
def _mix_fused_kernel(
    logits_ptr, weights_ptr, seed_ptr, offset_ptr, part_ptr, part_idx_ptr, slot_ptr, token_ptr, token_prob_ptr,
    mixture_ptr, lse_ptr, cnt_ptr,
    B, V, S, CHUNK, stride_logits, stride_wb, stride_wk, stride_mix, scale,
    K: tl.constexpr, KP: tl.constexpr, SP: tl.constexpr, BLOCK1: tl.constexpr, BLOCK2: tl.constexpr,
    VEC: tl.constexpr, RPT: tl.constexpr, GREEDY: tl.constexpr, PICKED: tl.constexpr, TOK_K: tl.constexpr,
    P: tl.constexpr, SW: tl.constexpr, SB: tl.constexpr, NB: tl.constexpr, DSTAGES: tl.constexpr,
    STAGES: tl.constexpr, EVICT: tl.constexpr, EVICT2: tl.constexpr, WAIT: tl.constexpr, PAIRS: tl.constexpr,
    FAST: tl.constexpr, PDL: tl.constexpr,
):
    """The mixture row's two passes in one launch: the program that read a chunk in pass 1
    reads it again for pass 2 right after (from L2, where the logits exceed it).

    B * S programs, one per (row, chunk). A program takes a ticket (atomic counter: tickets
    follow the order programs start in) and runs chunk t % S of row t // S: pass 1
    (`_mix_partial`), then it counts itself in (the row's arrival counter). The row's last
    to arrive draws the token (sampling), the partials of the whole row being stored. Then
    pass 2 (`_mix_chunk`): with WAIT each program waits (spinning on the counter) until its
    row's S programs have arrived and writes its own chunk; the S programs of a row hold
    consecutive tickets, so they are running or done whenever at least S programs fit on the
    device at once (the launcher's condition) and the wait ends. Without WAIT (the CPU
    interpreter, which runs programs one after another) the row's last to arrive writes
    every chunk. Greedy with K > 1: the chunks' bests are folded into the token by the row's
    last program done (its counter acquire-release), one atomic per program fewer than a
    fold counter of their own (H200, one process: B = 512, K = 4 81.0 -> 80.2 us, B = 1024,
    K = 2 95.6 -> 94.4, B = 128, K = 4 25.1 -> 24.6).

    Counters (cnt_ptr): [0] the ticket, [1 + b] row b's arrivals, [1 + B + b] its programs
    done; the last ticket and each row's last program reset theirs, so every launch leaves
    them zero."""
    pdl_wait(PDL)
    t = ticket(cnt_ptr, B * S)
    b = (t // S).to(tl.int64)
    sp = t % S
    _mix_partial(b, sp, logits_ptr, part_ptr, part_idx_ptr, part_ptr, part_idx_ptr, slot_ptr,
                 K, V, S, CHUNK, stride_logits, scale, KP, BLOCK1, VEC, RPT, PICKED, False, False,
                 not GREEDY, P, SW, STAGES, EVICT, FAST, False, KP, PAIRS)
    tl.debug_barrier()  # every thread's partials are stored before the release
    arrived = tl.atomic_add(cnt_ptr + 1 + b, 1, sem="acq_rel", scope="gpu")
    # pass 2's programs per row as `_mix_chunk` numbers them: S chunks, and sampling's draw (S)
    N2: tl.constexpr = 0 if GREEDY else 1
    if not GREEDY:
        if arrived == S - 1:
            _mix_chunk(b, S, S + N2, logits_ptr, weights_ptr, seed_ptr, offset_ptr, part_ptr, part_idx_ptr,
                       part_ptr, part_idx_ptr, slot_ptr, token_ptr, token_ptr, token_prob_ptr, mixture_ptr, lse_ptr,
                       cnt_ptr, V, S, CHUNK, stride_logits, stride_wb, stride_wk, stride_mix, scale,
                       K, KP, SP, BLOCK2, GREEDY, True, PICKED, False, False, TOK_K, P, SW, SB, NB, DSTAGES,
                       BLOCK1, RPT, VEC, 1, 0, FAST, ".cg", EVICT2, GREEDY and not PICKED, False, PAIRS)
    c_lo, c_hi = group_items(cnt_ptr + 1 + b, arrived, S, sp, WAIT)   # its own chunk, or all (no WAIT)
    for c in range(c_lo, c_hi):
        _mix_chunk(b, c, S + N2, logits_ptr, weights_ptr, seed_ptr, offset_ptr, part_ptr, part_idx_ptr,
                   part_ptr, part_idx_ptr, slot_ptr, token_ptr, token_ptr, token_prob_ptr, mixture_ptr, lse_ptr,
                   cnt_ptr, V, S, CHUNK, stride_logits, stride_wb, stride_wk, stride_mix, scale,
                   K, KP, SP, BLOCK2, GREEDY, True, PICKED, False, False, TOK_K, P, SW, SB, NB, DSTAGES,
                   BLOCK1, RPT, VEC, 1, 0, FAST, ".cg", EVICT2, GREEDY and not PICKED, False, PAIRS)
    if GREEDY and not PICKED:  # the chunk bests: folded by the row's last program done
        tl.debug_barrier()  # every thread's chunk best is stored before the release
        done = tl.atomic_add(cnt_ptr + 1 + B + b, 1, sem="acq_rel", scope="gpu")
    else:
        done = tl.atomic_add(cnt_ptr + 1 + B + b, 1, sem="relaxed", scope="gpu")
    if done == S - 1:  # the row's last program: every one has passed its wait
        if GREEDY and not PICKED:
            ss = tl.arange(0, SP)
            _fold_token(part_ptr + (b * S + ss) * (2 * KP + 2), part_idx_ptr, token_ptr, token_prob_ptr, b, S, ss,
                        ss < S, tl.arange(0, KP), KP, V, TOK_K)
        tl.store(cnt_ptr + 1 + b, 0)
        tl.store(cnt_ptr + 1 + B + b, 0)


# Pass 2 of greedy K > 1 re-reads a thread slot of pass 1 only where its bound, the mixture
# of the views' slot maxima, times this factor reaches the candidates' best q: a margin for
# the rounding of exp2 (one MUFU op) and of the sums; a larger bound only reads more.
_BOUND_MARGIN = tl.constexpr(1.0009765625)  # 1 + 2^-10
# ... gathering up to this many of its columns per view at once (a batch of live slots).
# H200, cold, one process, against the full chunk pass: B = 128, K = 4 with independent views
# 25.6 -> 19.2 us, B = 256, K = 2 22.6 -> 18.3; agreeing views 19.6 -> 17.8 and 19.0 -> 17.3.
_LIVE_COLUMNS = 512


@triton.jit
def _slot_max_offsets(b, S, sp, ks, KP: tl.constexpr, NT: tl.constexpr):
    """Offsets of pass 1's thread-slot maxima of chunk (b, sp), [KP, NT]: rows (b, s, k)."""
    return ((b * S + sp) * KP + ks[:, None]) * NT + tl.arange(0, NT)[None, :]


@triton.jit
def _live_chunk_best(logits_ptr, b, start, end, ms, w, lse2, q_floor, ks, kmask, stride_logits, scale,
                     K: tl.constexpr, BLOCK: tl.constexpr, RPT: tl.constexpr, VEC: tl.constexpr,
                     SMAX: tl.constexpr, L: tl.constexpr, FAST: tl.constexpr):
    """Greedy K > 1: the chunk's best q, its lowest column and q there, reading only the
    columns that can reach q_floor (the best candidate's q, attained by a column).

    Pass 1 (BLOCK columns per view and step, RPT groups of VEC columns per thread slot)
    stored each slot's max per view, ms [KP, NT]. No column of slot t has q above ub_t =
    sum_k w_k 2^(ms_k,t * scale - lse2_k), so only the slots with ub_t >= q_floor are read
    (a NaN bound reads its slot): with peaked or disagreeing views, the few that hold a
    view's top values. The live slots are gathered L at a time (rank by a prefix count),
    each with all its columns in the chunk (SMAX >= steps): [L, SMAX, RPT, VEC] per view
    and batch, one load per view, q by `_tile_q` (the values of the full pass). Looping
    over pass 1's steps instead is a chain of dependent round trips for little data, ~4 us
    of an 11 us pass at B = 128, K = 4. No live slot: -inf and the chunk's first column."""
    NT: tl.constexpr = BLOCK // (RPT * VEC)
    tt = tl.arange(0, NT)
    ub = tl.sum(tl.where(kmask[:, None], w[:, None] * exp2(ms * scale - lse2[:, None], FAST), 0.0), axis=0)
    live = ((ub * _BOUND_MARGIN < q_floor) == 0).to(tl.int32)   # [NT]
    rank = tl.cumsum(live, 0) - live                             # among the live slots
    n_live = tl.sum(live, axis=0)
    # [1, SMAX, RPT, VEC] offsets of a slot's columns from the chunk start and slot 0
    cols = (tl.arange(0, SMAX)[None, :, None, None] * BLOCK
            + (tl.arange(0, RPT)[None, None, :, None] * NT) * VEC + tl.arange(0, VEC)[None, None, None, :])
    jj = tl.arange(0, L)
    top = float("-inf")
    idx = start
    q_top = 0.0
    for j0 in range(0, n_live, L):
        pick = (live[None, :] != 0) & (rank[None, :] == (j0 + jj)[:, None])
        slot = tl.max(tl.where(pick, tt[None, :], -1), axis=1)    # [L]: the live slots j0 .. j0 + L - 1
        offs = start + cols + slot[:, None, None, None] * VEC      # [L, SMAX, RPT, VEC]
        vmask = (slot >= 0)[:, None, None, None] & (offs < end)
        q = _tile_q(logits_ptr, b, offs, vmask, w, lse2, ks, stride_logits, scale, K, FAST, "")
        score = tl.where(vmask, q, float("-inf"))
        t_top = _tile_max(score)
        t_idx = -_tile_max(tl.where(score == t_top, -offs, -BIG_IDX))   # lowest column
        take = (t_top > top) | ((t_top == top) & (t_idx < idx))  # batches interleave columns
        q_top = tl.where(take, _tile_max(tl.where(offs == t_idx, q, float("-inf"))), q_top)
        idx = tl.where(take, t_idx, idx)
        top = tl.maximum(top, t_top)
    return top, idx, q_top


@triton.jit
def _tile_max(x):
    """Max of a 4D tile ([L, SMAX, RPT, VEC]): the axes a thread holds first."""
    return tl.max(tl.max(tl.max(tl.max(x, axis=3), axis=2), axis=1), axis=0)


@triton.jit
def _fold_bests(prow, idx_row, ss, smask, KP: tl.constexpr, V):
    """The row's S chunk bests (part rows `prow` [SP]: best score at 2 * KP, its value at
    2 * KP + 1; indices at idx_row + s) -> (token, its value): the highest score, lowest
    index on ties (as torch.argmax). Loaded past L1: other programs of the same launch may
    have written them."""
    bv = tl.load(prow + 2 * KP, mask=smask, other=float("-inf"), cache_modifier=".cg")
    by = tl.load(prow + 2 * KP + 1, mask=smask, other=0.0, cache_modifier=".cg")
    bi = tl.load(idx_row + ss, mask=smask, other=V, cache_modifier=".cg")
    top = tl.max(bv, axis=0)
    tok = tl.min(tl.where(bv == top, bi, V), axis=0)
    return tok, tl.sum(tl.where(smask & (bi == tok), by, 0.0), axis=0)


@triton.jit
def _fold_token(prow, part_idx_ptr, token_ptr, token_prob_ptr, b, S, ss, smask, ks, KP: tl.constexpr, V,
                TOK_K: tl.constexpr):
    """Greedy, K > 1: row b's S chunk bests (`_fold_bests`) -> its token and probability."""
    tok, q_tok = _fold_bests(prow, part_idx_ptr + b * S, ss, smask, KP, V)
    _store_token(token_ptr, b, tok, ks, TOK_K)
    tl.store(token_prob_ptr + b, q_tok)


@triton.jit
def _store_token(token_ptr, b, tok, ks, TOK_K: tl.constexpr):
    """Request b's token: stored once (TOK_K = 1), or into each of its TOK_K view rows
    (token_ptr + b * TOK_K + k), the next draft step's input ids. ks: arange(KP), KP >= TOK_K."""
    tl.store(token_ptr + b * TOK_K + ks, (tok + 0 * ks).to(tl.int64), mask=ks < TOK_K)


@triton.jit
def _row_normalisers(prow, ks, pmask, kmask, scale, KP: tl.constexpr, FAST: tl.constexpr, CACHE: tl.constexpr):
    """Row b's S pass-1 partials ([SP] row pointers `prow`) -> (chunk maxima pm and sum-exps
    ps, [SP, KP]; each view's log2-normaliser lse2, [KP], 0 for padded views)."""
    pm = tl.load(prow[:, None] + ks[None, :], mask=pmask, other=NEG_BIG, cache_modifier=CACHE)
    ps = tl.load(prow[:, None] + KP + ks[None, :], mask=pmask, other=0.0, cache_modifier=CACHE)
    top, tot = lse_reduce(pm, ps, scale, 0, FAST)
    lse2 = tl.where(kmask, top * scale + log2(tl.where(kmask, tot, 1.0), FAST), 0.0)  # log2 units
    return pm, ps, lse2


@triton.jit
def _slot_draw(logits_ptr, part_ptr, slot_ptr, seed_ptr, offset_ptr, token_ptr, token_prob_ptr,
               b, w, lse2, pm, pmask, d_pre, ks, kmask, V, S, stride_logits, scale,
               K: tl.constexpr, KP: tl.constexpr, SP: tl.constexpr, P: tl.constexpr, SW: tl.constexpr,
               SB: tl.constexpr, NB: tl.constexpr, TOK_K: tl.constexpr, DSTAGES: tl.constexpr,
               FAST: tl.constexpr, CACHE: tl.constexpr):
    """Draw request b's token by inverse CDF in the draw order (slot T = (c mod P) // SW
    first, then column): slot T's mixture mass M_T = sum_{s,k} w_k 2^(max_s,k * scale -
    lse2_k) sumexp_s,k,T over pass 1's partials (chunks s, SB at a time); the row's uniform
    u (Philox output 0 at counter offset + b * V) picks the first slot whose cumulative mass
    exceeds r = u * sum_T M_T (never one of zero mass), and its columns (SW per period of P,
    NB periods per step: 1/(P/SW) of the row) are re-read and walked in order to the first
    whose prefix sum of q passes what is left of r. A sum that falls short (float rounding)
    takes the slot's last column with q > 0. The order depends on P and SW only, not on the
    split, so any split draws the same token from the same uniform (up to rounding at a
    boundary). Stores the token and q(token).

    When every chunk's slot sums fit one tile (SB >= SP: V = 32064 at any B, K <= 4) the
    caller loaded them (d_pre, [SP, KP, P // SW]) beside the chunk partials (pm, [SP, KP]),
    so they arrive with them instead of after the normalisers' reductions (a separate
    load after them cost ~0.8 us of a 3.4 us draw at B = 1, H200)."""
    NSS: tl.constexpr = P // SW
    tt = tl.arange(0, NSS)
    sb = tl.arange(0, SB)
    if SB >= SP:
        mass = _slot_mass(pm, d_pre, pmask, w, lse2, scale, FAST)
    else:
        mass = tl.zeros([NSS], tl.float32)
        for s0 in tl.range(0, S, SB, num_stages=DSTAGES):
            smask = (s0 + sb) < S
            dmask = smask[:, None] & kmask[None, :]
            pm_b = tl.load(part_ptr + (b * S + s0 + sb[:, None]) * (2 * KP + 2) + ks[None, :], mask=dmask,
                           other=NEG_BIG, cache_modifier=CACHE)   # chunk max per view, [SB, KP]
            d_s = tl.load(slot_ptr + _slot_offsets(b, S, s0 + sb, ks, KP, NSS), mask=dmask[:, :, None], other=0.0,
                          cache_modifier=CACHE)
            mass += _slot_mass(pm_b, d_s, dmask, w, lse2, scale, FAST)
    cum = tl.cumsum(mass, 0)                                          # non-decreasing
    u = tl.sum(tl.where(tl.arange(0, 4) == 0,
                        uniforms(tl.load(seed_ptr), tl.load(offset_ptr) + b * V, 0, 4), 0.0), axis=0)
    r = u * tl.max(cum, axis=0)
    slot = tl.sum((cum <= r).to(tl.int32), axis=0)
    slot = tl.minimum(slot, tl.max(tl.where(mass > 0, tt, 0), axis=0))
    r_in = r - tl.sum(tl.where(tt < slot, mass, 0.0), axis=0)
    ii = tl.arange(0, NB * SW)
    run = 0.0                       # q summed over the slot's earlier steps
    hit = BIG_IDX                   # first column whose prefix sum passes r_in, and its q
    q_hit = 0.0
    last = slot * SW                # last column with q > 0 (the fallback), and its q
    q_last = 0.0
    for n0 in tl.range(0, tl.cdiv(V, P), NB, num_stages=DSTAGES):
        offs = (n0 + ii // SW) * P + slot * SW + ii % SW   # NB periods' SW columns: the draw order
        vmask = offs < V
        q = _tile_q(logits_ptr, b, offs, vmask, w, lse2, ks, stride_logits, scale, K, FAST, "")
        pos = vmask & (q > 0)       # never a zero-probability token
        cs = tl.cumsum(q, 0) + run
        # one reduction: the first column passing r_in and the last with q > 0, with their q
        h, q_h, lst, q_l = tl.reduce((tl.where(pos & (cs > r_in), offs, BIG_IDX), q, tl.where(pos, offs, -1), q),
                                     0, _first_last)
        q_hit = tl.where(hit == BIG_IDX, q_h, q_hit)
        hit = tl.minimum(hit, h)
        q_last = tl.where(lst >= 0, q_l, q_last)
        last = tl.maximum(last, lst)
        run += tl.sum(q, axis=0)
    tok = tl.where(hit < BIG_IDX, hit, last)
    _store_token(token_ptr, b, tok, ks, TOK_K)
    tl.store(token_prob_ptr + b, tl.where(hit < BIG_IDX, q_hit, q_last))


@triton.jit
def _slot_offsets(b, S, chunks, ks, KP: tl.constexpr, NSS: tl.constexpr):
    """Offsets of pass 1's draw-slot sums of row b, [len(chunks), KP, NSS]: rows (b, s, k)."""
    return ((b * S + chunks[:, None, None]) * KP + ks[None, :, None]) * NSS + tl.arange(0, NSS)[None, None, :]


@triton.jit
def _slot_mass(pm, d, mask, w, lse2, scale, FAST: tl.constexpr):
    """Slot masses [NSS] of a tile of chunks: sum over chunks s and views k of
    w_k 2^(pm_s,k * scale - lse2_k) d_s,k,T, with pm [SB, KP] the chunk maxima, d
    [SB, KP, NSS] the slot sums and mask [SB, KP] the valid (chunk, view) pairs."""
    coef = tl.where(mask, w[None, :] * exp2(pm * scale - lse2[None, :], FAST), 0.0)
    return tl.sum(tl.sum(coef[:, :, None] * d, axis=1), axis=0)


@triton.jit
def _first_last(h0, qh0, l0, ql0, h1, qh1, l1, ql1):
    """Combine for `_slot_draw`'s scan: the lower first index and the higher last index, each
    with its value."""
    take_h = h1 < h0
    take_l = l1 > l0
    return tl.where(take_h, h1, h0), tl.where(take_h, qh1, qh0), tl.where(take_l, l1, l0), tl.where(take_l, ql1, ql0)


@triton.jit
def _tile_q(logits_ptr, b, offs, vmask, w, lse2, ks, stride_logits, scale, K: tl.constexpr, FAST: tl.constexpr,
            EVICT: tl.constexpr):
    """Mixture q = sum_k w_k 2^(x_k * scale - lse2_k) at columns `offs` (any shape) of row b
    (vmask None: every column is in the row). The views one tile at a time (K is a
    constexpr): the sum over views stays inside each thread; a [KP, ...] tile spreads the
    views over warps and its sum costs a shared-memory exchange and barriers every step."""
    q = tl.zeros(offs.shape, tl.float32)
    for k in tl.static_range(K):
        ptr = logits_ptr + (b * K + k) * stride_logits + offs
        if vmask is None:
            x = tl.load(ptr, eviction_policy=EVICT).to(tl.float32)
        else:
            x = tl.load(ptr, mask=vmask, other=float("-inf"), eviction_policy=EVICT).to(tl.float32)
        q += _view_scalar(w, ks, k) * exp2(x * scale - _view_scalar(lse2, ks, k), FAST)
    return q


@triton.jit
def _view_scalar(v, ks, k: tl.constexpr):
    """Element k of a per-view vector v ([KP])."""
    return tl.sum(tl.where(ks == k, v, 0.0), axis=0)


@triton.jit
def _bf16_halves(u):
    """The two bf16 values of each 32-bit word of u, as float32: (the low half, the even
    column: u << 16; the high half: u & 0xffff0000), one integer instruction each."""
    return (u << 16).to(tl.float32, bitcast=True), (u & -65536).to(tl.float32, bitcast=True)


@triton.jit
def _tile_q_pairs(logits_ptr, b, v0, w, lse2, ks, stride_logits, scale, K: tl.constexpr, BLOCK: tl.constexpr,
                  FAST: tl.constexpr, EVICT: tl.constexpr):
    """`_tile_q` over the whole step [v0, v0 + BLOCK) of bf16 logits in the [BLOCK // 4, 4]
    layout of the row's 16-byte stores, each view's columns loaded as 32-bit words of two
    (the launcher's PAIRS: even row stride, 4-byte aligned base, v0 even): the even column
    is the low half, x = word << 16, the odd one x = word & 0xffff0000, one integer
    instruction per element where unpacking bf16 pairs took 1.5."""
    words = v0 // 2 + tl.arange(0, BLOCK // 4)[:, None] * 2 + tl.arange(0, 2)[None, :]   # [BLOCK // 4, 2]
    q_lo = tl.zeros([BLOCK // 4, 2], tl.float32)
    q_hi = tl.zeros([BLOCK // 4, 2], tl.float32)
    for k in tl.static_range(K):
        row = (logits_ptr + (b * K + k) * stride_logits).to(tl.pointer_type(tl.int32))
        u = tl.load(row + words, eviction_policy=EVICT)
        w_k = _view_scalar(w, ks, k)
        l_k = _view_scalar(lse2, ks, k)
        lo, hi = _bf16_halves(u)
        q_lo += w_k * exp2(lo * scale - l_k, FAST)
        q_hi += w_k * exp2(hi * scale - l_k, FAST)
    return tl.reshape(tl.join(q_lo, q_hi), [BLOCK // 4, 4])


def ensemble_mix(logits, weights, *, greedy, seed=None, offset=None, temperature=1.0,
                 return_mixture=False, mixture_out=None, certified_out=None, view_tokens_out=None):
    """Triton launcher; see `tabed_engine.ops.ensemble_mix.ensemble_mix` for the contract.

    `view_tokens_out` ([B*K] int64, contiguous): the kernel stores request b's token in rows
    b*K .. b*K+K-1 (the next draft step's input ids, no repeat kernel), and the returned
    token is the strided view of its rows b*K.

    `mixture_out` ([B, V] fp32, unit last stride, any row stride) is written in place when
    given (e.g. a slice of the engine's [B, gamma, V] buffer) and implies return_mixture.
    `certified_out` ([B] int32, optional): for greedy K > 1 without the mixture row, 1
    where pass 1's certificate decided the token (no second pass), else 0; untouched
    otherwise (benchmarks report the rate).
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
    use_pdl = pdl(dev)  # programmatic dependent launches (see _common.pdl)
    if view_tokens_out is not None:
        if (view_tokens_out.shape != (R,) or view_tokens_out.dtype != torch.int64
                or view_tokens_out.device != dev or not view_tokens_out.is_contiguous()):
            raise ValueError(f"view_tokens_out must be a contiguous int64 [{R}] tensor on {dev}")
        token, tok_k = view_tokens_out, K      # the kernel writes every view row
    else:
        token, tok_k = torch.empty(B, dtype=torch.int64, device=dev), 1
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
    scale = LOG2E.value / float(temperature)  # exp(x / T) = exp2(x * scale)
    fast = dev.type == "cuda"
    seed_arg = seed if not greedy else token      # unused pointers when greedy
    offset_arg = offset if not greedy else token
    mix_arg = mixture if write_mix else token_prob
    stride_mix = mixture.stride(0) if write_mix else 0
    if greedy:
        per_sm = _PROGRAMS_PER_SM if K == 1 else _VIEWS_PROGRAMS_PER_SM
    else:
        per_sm = _SAMPLE_VIEWS_PROGRAMS_PER_SM if K > 1 and mixture is None else _SAMPLE_PROGRAMS_PER_SM
    # sampling: the draw order's period (V <= _DRAW_PERIOD: natural order whatever P), chunks
    # and pass-1 steps are multiples of it
    period = _DRAW_WIDTH if greedy else min(_DRAW_PERIOD, max(_DRAW_WIDTH, triton.next_power_of_2(V)))
    # pass 1 one view row per program (see _ROWWISE): V split for B * K rows at 4 per SM;
    # greedy only where that leaves pass 2 two chunks per row or more
    # (past L2, greedy: at least _ROWWISE_BIG_SPLIT chunks per row, _ROWWISE_BIG_TILE steps)
    rowwise = _ROWWISE and K > 1 and mixture is None and (greedy or K > 2)
    big = rowwise and greedy and logits.numel() * logits.element_size() > l2_cache_bytes(dev)
    if rowwise:
        S, chunk = chunking(V, max(_ROWWISE_BIG_SPLIT if big else 1, _n_vsplit(B * K, V, dev, _PROGRAMS_PER_SM)),
                            period)
        rowwise = S > 1 or not greedy
    # the mixture row past L2: one launch, chunks from _FUSED_TASK_BYTES (see _mix_fused_kernel)
    nbytes = logits.numel() * logits.element_size() + B * V * 4
    fused = _FUSED and write_mix and nbytes > l2_cache_bytes(dev) * _FUSED_L2
    if fused:
        cols = max(16, min(_FUSED_CHUNK, _FUSED_TASK_BYTES // (K * logits.element_size())))
        S, chunk = chunking(V, min(_MAX_SPLITS, triton.cdiv(V, cols)), period)
    elif not rowwise:
        S, chunk = chunking(V, _n_vsplit(B, V, dev, per_sm), period)
    KP1 = 1 if rowwise else KP                 # pass 1's views per program
    picked = KP == 1 and greedy  # greedy, one view: argmax q_v = argmax x_v, no normaliser needed
    tile = (_FUSED_TILE if K > 1 else _TILE) if fused else _ROWWISE_BIG_TILE if big and rowwise else _TILE
    BLOCK = max(chunk_block(chunk, tile // KP1), period)
    # pass 2's columns per view and step
    if fused:
        if greedy and not picked:
            tile2 = _FUSED_GREEDY_COLUMNS * KP
        else:
            tile2 = _FUSED_CHUNK_TILE_K2 if KP == 2 else _FUSED_CHUNK_TILE
    else:
        tile2 = _CHUNK_TILE
    BLOCK2 = max(chunk_block(chunk, tile2 // KP), period)
    num_warps = tile_warps(KP * BLOCK2, _CHUNK_PER_THREAD)
    SP = triton.next_power_of_2(S)
    vec = 16 // logits.element_size()          # one 16-byte load per group
    p1_warps = (8 if picked else 4) if fused else tile_warps(KP1 * BLOCK, _PER_THREAD)
    # groups per thread and step; sampling: a thread's slot lies in one draw slot
    rpt = max(1, min(BLOCK // (vec * 32 * p1_warps), BLOCK // period))
    part = torch.empty(B * S * (2 * KP + 2), dtype=torch.float32, device=dev)
    part_idx = torch.empty(B * S, dtype=torch.int32, device=dev)
    cert = _CERTIFY and greedy and not picked and not write_mix
    cert_buf = torch.empty(B * S * KP if cert else 1, dtype=torch.float32, device=dev)
    cert_idx = torch.empty(B * S * KP if cert else 1, dtype=torch.int32, device=dev)
    n_slots = 1 if greedy else period // _DRAW_WIDTH
    nt = BLOCK // (rpt * vec)                  # pass 1's thread slots per view
    smax = triton.next_power_of_2(triton.cdiv(chunk, BLOCK))    # pass 1's steps per chunk, rounded up
    # greedy K > 1, several steps per chunk (MULTI): pass 1 reads the best steps again and
    # pass 2 only the live thread slots (with one step the full chunk is one load per view,
    # and the bounds cost more than they save)
    live = cert and chunk > BLOCK
    # sampling: draw-slot sums per (chunk, view); greedy K > 1: each thread slot's max
    slot = torch.empty(B * S * KP * (nt if live else n_slots) if live or not greedy else 1,
                       dtype=torch.float32, device=dev)
    # every chunk when the mixture row is written (sampling: and a program that draws) or
    # greedy K > 1 compares chunk bests; else one program per row (greedy K = 1 finishes the
    # pick, sampling draws)
    n_prog = S + (not greedy) if write_mix else (S if greedy and not picked else 1)
    sb = min(SP, max(1, _DRAW_TILE // (KP * n_slots)))
    nb = min(triton.next_power_of_2(triton.cdiv(V, period)), max(1, 1024 // _DRAW_WIDTH))
    if fused:
        # whole steps read as 32-bit words of two bf16 (rows at even offsets from a 4-byte address)
        pairs = (_FUSED_PAIRS and K > 1 and logits.dtype == torch.bfloat16 and logits.stride(0) % 2 == 0
                 and logits.data_ptr() % 4 == 0)
        _mix_fused_kernel[(B * S,)](
            logits, weights, seed_arg, offset_arg, part, part_idx, slot, token, token_prob, mixture, lse,
            counters(dev, 1 + 2 * B),
            B, V, S, chunk, logits.stride(0), weights.stride(0), weights.stride(1), stride_mix, scale,
            K=K, KP=KP, SP=SP, BLOCK1=BLOCK, BLOCK2=BLOCK2, VEC=vec, RPT=rpt, GREEDY=greedy, PICKED=picked,
            TOK_K=tok_k, P=period, SW=_DRAW_WIDTH, SB=sb, NB=nb, DSTAGES=_DRAW_STAGES, STAGES=_STAGES,
            EVICT=_P1_EVICT, EVICT2=_FUSED_EVICT2, WAIT=_FUSED_WAIT and fast and S <= target_programs(dev, 1),
            PAIRS=pairs,
            FAST=fast,
            num_warps=p1_warps, PDL=use_pdl, launch_pdl=use_pdl,
        )
        return token[::tok_k], token_prob, mixture, lse
    _mix_partial_kernel[(B * K if rowwise else B, S)](
        logits, part, part_idx, cert_buf, cert_idx, slot,
        K, V, S, chunk, logits.stride(0), scale,
        KP=KP1, ROWWISE=rowwise, KV=KP, BLOCK=BLOCK, VEC=vec, RPT=rpt, PICK=picked, CERT=cert, MULTI=live,
        DRAW=not greedy, P=period,
        SW=_DRAW_WIDTH, STAGES=_STAGES, EVICT=_P1_EVICT if write_mix or not picked else "",  # "": default
        FAST=fast, num_warps=p1_warps, PDL=use_pdl, launch_pdl=use_pdl,
    )
    _mix_chunk_kernel[(B, n_prog)](
        logits, weights, seed_arg, offset_arg, part, part_idx, cert_buf, cert_idx, slot,
        certified_out if certified_out is not None else token, token, token_prob, mix_arg, lse, counters(dev, B),
        V, S, chunk, logits.stride(0), weights.stride(0), weights.stride(1),
        stride_mix, scale,
        K=K, KP=KP, SP=SP, BLOCK=BLOCK2, GREEDY=greedy, WRITE_MIX=write_mix, PICKED=picked,
        CERT=cert, REPORT=cert and certified_out is not None, TOK_K=tok_k, P=period,
        SW=_DRAW_WIDTH, SB=sb, NB=nb, DSTAGES=_DRAW_STAGES, BLOCK1=BLOCK, RPT=rpt, VEC=vec,
        SMAX=smax, LIVE=min(16, max(1, _LIVE_COLUMNS // (smax * rpt * vec))) if live else 0, FAST=fast,
        num_warps=_DRAW_WARPS if n_prog == 1 and not greedy else num_warps,
        PDL=use_pdl, launch_pdl=use_pdl,
    )
    return token[::tok_k], token_prob, mixture, lse
