"""Tree attention over a paged KV cache: decode, chain verification and tree verification.

The cache is a pool of pages `[pages, Hkv, PAGE, D]` per layer; row r's slot s lives in page
`block_table[r, s // PAGE]` at offset `s % PAGE`. A key tile of BLOCK_N slots never straddles a
page (PAGE is a multiple of BLOCK_N), so each tile costs one table load and its K/V rows are
contiguous as in an unpaged cache.

Query node i of row r attends to the committed prefix, cache slots [0, lengths[r]), and to
the tree slots lengths[r] + j whose bit j is set in tree_mask[r, i] (the nodes' own K/V are
already in the cache). One program owns a tile of (node, query head) pairs that share one
kv head, so K/V are read once per kv head and QK^T / PV run on tensor cores (tl.dot).
Flash-decoding online softmax in fp32, base-2 exponentials with the scale folded in.

Two key loops per program: the full prefix blocks need no mask at all (every query sees
them), only the one or two blocks that hold the prefix end and the tree slots test bits.

Split-K: with few rows (R=1, Hkv=32 -> 32 programs on 132 SMs) most SMs would idle and a
single SM cannot keep enough loads in flight to come near HBM bandwidth, so key blocks are
dealt round-robin to SPLITS programs per (row, kv head) and their partial (max, sum,
unnormalised output) are combined by the last of those programs to finish (an arrival
counter per tile, the "last block" pattern), so the split path is still one launch: in a
decode step of 32 layers a separate combine kernel cost a dependent launch per layer.
The counters live in a per-device workspace that the combining program resets to zero.
The deal is cyclic (block b -> split b % SPLITS) so the work stays balanced for any length
without reading `lengths` on the host.

Causal mode (`causal=True`, no mask words): a prompt chunk of N tokens (any N up to the cache
span) over a row whose cache holds the prefix, node i seeing slots [0, length + i] (its own K/V
and the earlier nodes' are written). A tile of nodes [lo, hi] takes the blocks below
length + lo + 1 unmasked, and the masked loop tests `slot < length + node + 1` up to
length + hi + 1 only: a tile of early nodes never walks the rest of the chunk, and no slot at
or past length + N is loaded.

Invariance (`invariant=True`: 16-query tiles, block b in split b % SPLITS, the splits
combined in order, all from the cache shape): a node's output is a function of its own
visible keys only, so a causal node i equals an AR step (one query, mask 1) at length + i,
and a chain node at that slot, bit for bit. (1) The same blocks go to the same split in the
same order whichever loop takes them, and a row of a tensor-core dot does not depend on the
other rows of its tile. (2) A block the node sees whole gives the same bits in
either loop: the masked step applies the mask by selecting after `s - m`, so a visible score
takes the unmasked step's arithmetic, and masked loads read the same values. (3) A block the
node sees part of gives what the AR step's block gives: both mask the same slots, p = 0 there,
and K/V of slots past the tile's last node read as 0 (other=0, so no 0 * NaN). (4) A block the
node sees none of (one a longer row of its tile needs) leaves m, l, acc unchanged: every score
is -inf, so m_new = m, alpha = exp2(0) = 1, p = 0, l + 0 = l and acc * 1 + (0 @ V) = acc (V
finite: slots below length + N are written, the rest load as 0). A split that saw no key at
all keeps m = -1e30, l = 0, acc = 0, as in the AR step, where it ran no block.

Paths (`paths=True`, a tree): a node's ancestors sit at the tree's slots, not at the slots an
AR step of its depth d holds them, so the blocks past the prefix's last whole one are read
per node as an AR step at length + d reads them: virtual slot v is the prefix's slot v below
length, else the node's path's (v - length)-th node (its set bits in slot order, the root
first). Each such block is one masked step per node of the tile, visible to that node's rows
only; by (4) the other rows pass it unchanged, and by (1)-(3) the node's rows get the AR
step's arithmetic on the same values in the same lanes.

One query per row (N = 1: an AR decode step, a draft step) takes a leaner kernel: one program
per (row, query head, split) with the scores and the weighted sum of V as CUDA-core
multiply-adds over [BLOCK_N, D] tiles (a 16-row tensor-core tile would be 15/16 padding),
the same last-arrival combine, and about four programs per SM (faster than the tensor-core
kernel at one query: benchmarks/results/tree_attention_h100.json).
"""
import torch
import triton
import triton.language as tl

from ._common import counters as _counters, pdl, pdl_wait

_MAX_NODES = 64  # tree_mask is one int64 word per node
_SM_COUNT = {}


@triton.jit
def _attend_block(q, k, v, m_i, l_i, acc, qk_scale, vis,
                  MASKED: tl.constexpr, PRECISION: tl.constexpr, DOT_FP32: tl.constexpr):
    # q: [BM, BD]  k, v: [BN, BD]  vis: [BM, BN] (only read when MASKED)
    in_ty = v.dtype
    if DOT_FP32:  # the CPU interpreter's bf16 tl.dot returns garbage (triton 3.9); same values in fp32
        q, k, v = q.to(tl.float32), k.to(tl.float32), v.to(tl.float32)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION, out_dtype=tl.float32) * qk_scale
    if MASKED:  # the mask selects after `s - m`: a visible score takes the unmasked step's arithmetic
        m_new = tl.maximum(m_i, tl.max(tl.where(vis, s, float("-inf")), 1))
        p = tl.exp2(tl.where(vis, s - m_new[:, None], float("-inf")))
    else:
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(in_ty).to(v.dtype), v, input_precision=PRECISION, out_dtype=tl.float32)
    return m_new, l_i, acc


@triton.jit
def _attend_paths(q, k_base, v_base, tab, bits_ptr, node, m_i, l_i, acc, b, pid_m, length, N, SLOTS, S, qk_scale,
                  stride_mn, stride_kp, stride_ks, stride_vp, stride_vs, offs_b, d_ok,
                  GROUP: tl.constexpr, PAGE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  PRECISION: tl.constexpr, DOT_FP32: tl.constexpr):
    """Key block b of the virtual sequence each node of the tile sees (`paths`): slot v below
    `length` is the prefix's, slot length + k its path's k-th node (its k-th set bit, the
    root first), so the block holds what an AR step's block b holds at length + depth. One
    masked step per node of the tile, visible to that node's rows only (the others' state
    passes unchanged: every score masked, K/V loads 0 where not visible)."""
    offs_v = b * BLOCK_N + offs_b
    tail = offs_v - length
    for t in tl.static_range(BLOCK_M):
        row = pid_m * BLOCK_M + t
        nn = row // GROUP
        if t == 0:
            first_row = nn < N
        else:
            first_row = (nn < N) & (row % GROUP == 0)
        if first_row:
            nbits = tl.load(bits_ptr + nn * stride_mn)
            j_of = tl.zeros([BLOCK_N], tl.int32)
            cnt = tl.zeros([BLOCK_N], tl.int32)
            for j in range(0, SLOTS):
                bit = ((nbits >> j) & 1).to(tl.int32)
                j_of = tl.where((bit != 0) & (cnt == tail), j, j_of)
                cnt += bit
            slot = tl.where(offs_v < length, offs_v, length + j_of)
            lane = ((offs_v < length) | ((tail >= 0) & (tail < cnt))) & (offs_v < S) & (slot < S)
            page = tl.load(tab + slot // PAGE, mask=lane, other=0).to(tl.int64)
            offs_p = slot % PAGE
            ld = lane[:, None] & d_ok[None, :]
            k = tl.load(k_base + page[:, None] * stride_kp + offs_p[:, None] * stride_ks, mask=ld, other=0.0)
            v = tl.load(v_base + page[:, None] * stride_vp + offs_p[:, None] * stride_vs, mask=ld, other=0.0)
            vis = (node == nn)[:, None] & lane[None, :]
            m_i, l_i, acc = _attend_block(q, k, v, m_i, l_i, acc, qk_scale, vis, True, PRECISION, DOT_FP32)
    return m_i, l_i, acc


@triton.jit
def _combine_splits(m_part_ptr, l_part_ptr, acc_part_ptr, rows, n_rows, row_ok, offs_d, d_ok,
                    SPLITS: tl.constexpr, D_STRIDE: tl.constexpr, BLOCK_ROWS: tl.constexpr,
                    BLOCK_D: tl.constexpr):
    """Normalised output [BLOCK_ROWS, BLOCK_D] of flat (r, n, h) rows from the SPLITS
    partials (m, l: [SPLITS, n_rows]; acc: [SPLITS, n_rows, D_STRIDE]). A split that saw no
    key has m = -1e30, l = 0: weight 0. Loads bypass L1 (.cg): the partials were written by
    other programs."""
    ok = row_ok[:, None] & d_ok[None, :]
    m_run = tl.full([BLOCK_ROWS], -1.0e30, tl.float32)
    l_run = tl.zeros([BLOCK_ROWS], tl.float32)
    acc = tl.zeros([BLOCK_ROWS, BLOCK_D], tl.float32)
    for sp in tl.static_range(SPLITS):
        m = tl.load(m_part_ptr + sp * n_rows + rows, mask=row_ok, other=-1.0e30, cache_modifier=".cg")
        l = tl.load(l_part_ptr + sp * n_rows + rows, mask=row_ok, other=0.0, cache_modifier=".cg")
        a = tl.load(acc_part_ptr + (sp * n_rows + rows)[:, None] * D_STRIDE + offs_d[None, :], mask=ok,
                    other=0.0, cache_modifier=".cg")
        m_new = tl.maximum(m_run, m)
        w_run = tl.exp2(m_run - m_new)
        w = tl.exp2(m - m_new)
        l_run = l_run * w_run + l * w
        acc = acc * w_run[:, None] + a * w[:, None]
        m_run = m_new
    return acc / tl.where(l_run > 0, l_run, 1.0)[:, None]


@triton.jit
def _tree_attention_kernel(
    q_ptr, k_ptr, v_ptr, tab_ptr, len_ptr, mask_ptr, out_ptr, m_part_ptr, l_part_ptr, acc_part_ptr, cnt_ptr,
    stride_qr, stride_qn, stride_qh,
    stride_kp, stride_kh, stride_ks,
    stride_vp, stride_vh, stride_vs,
    stride_tr,
    stride_mr, stride_mn,
    stride_or, stride_on, stride_oh,
    R, N, SLOTS, H, S, qk_scale,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, SPLITS: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr, PDL: tl.constexpr, CAUSAL: tl.constexpr, PATHS: tl.constexpr,
):
    pdl_wait(PDL)
    pid_m = tl.program_id(0)  # tile of (node, head-in-group) pairs; fastest so tiles sharing K/V run together
    pid_rh = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    num_kv = H // GROUP
    r = pid_rh // num_kv
    kh = pid_rh % num_kv
    length = tl.load(len_ptr + r)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # m = node * GROUP + g
    node = offs_m // GROUP
    head = kh * GROUP + offs_m % GROUP
    m_ok = node < N
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    offs_b = tl.arange(0, BLOCK_N)

    q = tl.load(q_ptr + r * stride_qr + node[:, None] * stride_qn + head[:, None] * stride_qh + offs_d[None, :],
                mask=m_ok[:, None] & d_ok[None, :], other=0.0)
    if CAUSAL:  # node i sees slots < length + i + 1; the tile's nodes are [lo, hi]
        lo = (pid_m * BLOCK_M) // GROUP
        hi = tl.minimum((pid_m * BLOCK_M + BLOCK_M - 1) // GROUP, N - 1)
    else:
        bits = tl.load(mask_ptr + r * stride_mr + node * stride_mn, mask=m_ok, other=0)
    k_base = k_ptr + kh * stride_kh + offs_d[None, :]
    v_base = v_ptr + kh * stride_vh + offs_d[None, :]
    tab = tab_ptr + r * stride_tr

    # Finite start so a row whose first blocks are all masked never computes (-inf) - (-inf).
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    if CAUSAL:  # blocks every node of the tile sees whole
        n_full = (length + lo + 1) // BLOCK_N
    else:
        n_full = length // BLOCK_N
    for b in range(split, n_full, SPLITS):
        page = tl.load(tab + (b * BLOCK_N) // PAGE).to(tl.int64)
        offs_p = (b * BLOCK_N) % PAGE + offs_b  # the tile's slots inside its page
        k_ptrs = k_base + page * stride_kp + offs_p[:, None] * stride_ks
        v_ptrs = v_base + page * stride_vp + offs_p[:, None] * stride_vs
        if BLOCK_D == HEAD_DIM:  # no mask at all: plain vectorised loads
            k = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
        else:
            k = tl.load(k_ptrs, mask=d_ok[None, :], other=0.0)
            v = tl.load(v_ptrs, mask=d_ok[None, :], other=0.0)
        m_i, l_i, acc = _attend_block(q, k, v, m_i, l_i, acc, qk_scale, None, False, PRECISION, DOT_FP32)

    if CAUSAL:
        end = length + hi + 1  # the tile's last node's own slot: a tile of early nodes stops early
    elif PATHS:  # a node's virtual slots end at length + its depth (its set bits - 1)
        ones = tl.zeros([BLOCK_M], tl.int32)
        for j in range(0, SLOTS):
            ones += ((bits >> j) & 1).to(tl.int32)
        end = length + tl.max(tl.where(m_ok, ones, 1), 0)
    else:
        end = length + SLOTS  # the tree's slots: the queries' own and any fed before them
    first = n_full + (split - n_full % SPLITS + SPLITS) % SPLITS  # continue the cyclic deal
    for b in range(first, tl.cdiv(end, BLOCK_N), SPLITS):
        if PATHS:
            m_i, l_i, acc = _attend_paths(q, k_base, v_base, tab, mask_ptr + r * stride_mr, node, m_i, l_i, acc,
                                          b, pid_m, length, N, SLOTS, S, qk_scale, stride_mn, stride_kp,
                                          stride_ks, stride_vp, stride_vs, offs_b, d_ok, GROUP, PAGE, BLOCK_M,
                                          BLOCK_N, PRECISION, DOT_FP32)
        else:
            offs_s = b * BLOCK_N + offs_b
            s_ok = (offs_s < end) & (offs_s < S)  # slots past the tree may hold anything (NaN)
            if CAUSAL:
                vis = offs_s[None, :] < (length + node + 1)[:, None]
            else:
                j = offs_s - length
                in_tree = (j >= 0) & s_ok
                jj = tl.where(in_tree, j, 0).to(tl.int64)
                bit = ((bits[:, None] >> jj[None, :]) & 1) != 0
                vis = (offs_s < length)[None, :] | (in_tree[None, :] & bit)
            page = tl.load(tab + (b * BLOCK_N) // PAGE, mask=b * BLOCK_N < S, other=0).to(tl.int64)
            offs_p = (b * BLOCK_N) % PAGE + offs_b
            ld_ok = s_ok[:, None] & d_ok[None, :]
            k = tl.load(k_base + page * stride_kp + offs_p[:, None] * stride_ks, mask=ld_ok, other=0.0)
            v = tl.load(v_base + page * stride_vp + offs_p[:, None] * stride_vs, mask=ld_ok, other=0.0)
            m_i, l_i, acc = _attend_block(q, k, v, m_i, l_i, acc, qk_scale, vis, True, PRECISION, DOT_FP32)

    if SPLITS == 1:
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        o_ptrs = out_ptr + r * stride_or + node[:, None] * stride_on + head[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :])
    else:
        part = ((split * R + r) * N + node) * H + head  # partials: [SPLITS, R, N, H(, D)]
        tl.store(m_part_ptr + part, m_i, mask=m_ok)
        tl.store(l_part_ptr + part, l_i, mask=m_ok)
        tl.store(acc_part_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=m_ok[:, None] & d_ok[None, :])
        # The last split of this tile to arrive combines all SPLITS partials in split order.
        tl.debug_barrier()  # every thread's partial stores precede the release below
        cnt = cnt_ptr + pid_rh * tl.num_programs(0) + pid_m
        arrived = tl.atomic_add(cnt, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLITS - 1:
            o = _combine_splits(m_part_ptr, l_part_ptr, acc_part_ptr, (r * N + node) * H + head, R * N * H,
                                m_ok, offs_d, d_ok, SPLITS, HEAD_DIM, BLOCK_M, BLOCK_D)
            o_ptrs = out_ptr + r * stride_or + node[:, None] * stride_on + head[:, None] * stride_oh + offs_d[None, :]
            tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :])
            tl.store(cnt, 0)  # every split has arrived: ready for the next launch


@triton.jit
def _decode_attention_kernel(
    q_ptr, k_ptr, v_ptr, tab_ptr, len_ptr, mask_ptr, out_ptr, m_part_ptr, l_part_ptr, acc_part_ptr, cnt_ptr,
    stride_qr, stride_qh, stride_kp, stride_kh, stride_ks, stride_vp, stride_vh, stride_vs, stride_tr,
    stride_mr, stride_or, stride_oh, H, S, qk_scale,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, SPLITS: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr,
):
    pdl_wait(PDL)
    pid = tl.program_id(0).to(tl.int64)  # row * H + query head
    split = tl.program_id(1)
    r = pid // H
    h = pid % H
    kh = h // GROUP
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    offs_b = tl.arange(0, BLOCK_N)
    # visible: the prefix [0, length) and the node's own slot `length` when its bit 0 is set
    length = tl.load(len_ptr + r) + (tl.load(mask_ptr + r * stride_mr) & 1).to(tl.int32)
    q = tl.load(q_ptr + r * stride_qr + h * stride_qh + offs_d, mask=d_ok, other=0.0).to(tl.float32) * qk_scale
    k_base = k_ptr + kh * stride_kh + offs_d[None, :]
    v_base = v_ptr + kh * stride_vh + offs_d[None, :]
    tab = tab_ptr + r * stride_tr
    m_i = tl.full([], -1.0e30, tl.float32)  # finite: a split with no keys never computes inf - inf
    l_i = tl.zeros([], tl.float32)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for b in range(split, tl.cdiv(length, BLOCK_N), SPLITS):
        offs_s = b * BLOCK_N + offs_b
        s_ok = offs_s < length  # slots past the visible ones may hold anything (NaN)
        ld_ok = s_ok[:, None] & d_ok[None, :]
        page = tl.load(tab + (b * BLOCK_N) // PAGE, mask=b * BLOCK_N < S, other=0).to(tl.int64)
        offs_p = (b * BLOCK_N) % PAGE + offs_b
        k = tl.load(k_base + page * stride_kp + offs_p[:, None] * stride_ks, mask=ld_ok, other=0.0)
        v = tl.load(v_base + page * stride_vp + offs_p[:, None] * stride_vs, mask=ld_ok, other=0.0)
        sc = tl.where(s_ok, tl.sum(k.to(tl.float32) * q[None, :], 1), -1.0e30)
        m_new = tl.maximum(m_i, tl.max(sc, 0))
        alpha = tl.exp2(m_i - m_new)
        p = tl.where(s_ok, tl.exp2(sc - m_new), 0.0)
        l_i = l_i * alpha + tl.sum(p, 0)
        acc = acc * alpha + tl.sum(p[:, None] * v.to(tl.float32), 0)
        m_i = m_new
    o_ptrs = out_ptr + r * stride_or + h * stride_oh + offs_d
    if SPLITS == 1:
        tl.store(o_ptrs, (acc / tl.where(l_i > 0, l_i, 1.0)).to(out_ptr.dtype.element_ty), mask=d_ok)
    else:
        n_rows = tl.num_programs(0)
        tl.store(m_part_ptr + split * n_rows + pid, m_i)
        tl.store(l_part_ptr + split * n_rows + pid, l_i)
        tl.store(acc_part_ptr + (split * n_rows + pid) * BLOCK_D + offs_d, acc)
        tl.debug_barrier()  # every thread's partial stores precede the release below
        cnt = cnt_ptr + pid
        arrived = tl.atomic_add(cnt, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLITS - 1:  # the last split of this (row, head) combines all partials
            o = _combine_splits(m_part_ptr, l_part_ptr, acc_part_ptr, tl.zeros([1], tl.int64) + pid, n_rows,
                                tl.full([1], 1, tl.int1), offs_d, d_ok, SPLITS, BLOCK_D, 1, BLOCK_D)
            tl.store(o_ptrs, tl.reshape(o, [BLOCK_D]).to(out_ptr.dtype.element_ty), mask=d_ok)
            tl.store(cnt, 0)  # every split has arrived: ready for the next launch


def _decode_splits(device, programs, max_blocks):
    """Splits for the one-query kernel: about four programs per SM, at most 16, at most the
    blocks (an H100 sweep, benchmarks/results/tree_attention_h100.json)."""
    if device.type != "cuda":
        return 1
    return max(1, min(16, max_blocks, triton.cdiv(4 * _sm_count(device), programs)))


def _decode_attention(q, k_cache, v_cache, block_table, lengths, tree_mask, out, qk_scale, num_splits):
    R, _, H, D = q.shape
    Hkv, PAGE = k_cache.shape[1], k_cache.shape[2]
    S = block_table.shape[1] * PAGE
    BLOCK_N, BLOCK_D = 64, max(16, triton.next_power_of_2(D))
    splits = num_splits or _decode_splits(q.device, R * H, triton.cdiv(S, BLOCK_N))
    if splits == 1:
        m_part = l_part = acc_part = counters = out  # unused
    else:
        m_part = torch.empty((splits, R * H), device=q.device, dtype=torch.float32)
        l_part = torch.empty_like(m_part)
        acc_part = torch.empty((splits, R * H, BLOCK_D), device=q.device, dtype=torch.float32)
        counters = _counters(q.device, R * H)
    use_pdl = pdl(q.device)
    _decode_attention_kernel[(R * H, splits)](
        q, k_cache, v_cache, block_table, lengths, tree_mask, out, m_part, l_part, acc_part, counters,
        q.stride(0), q.stride(2), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_table.stride(0), tree_mask.stride(0),
        out.stride(0), out.stride(2), H, S, qk_scale,
        GROUP=H // Hkv, HEAD_DIM=D, SPLITS=splits, PAGE=PAGE,
        BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D, PDL=use_pdl, num_warps=2, num_stages=2, launch_pdl=use_pdl,
    )
    return out


def _sm_count(device):
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


def _pick_splits(device, base_programs, queries_per_kv, max_blocks):
    """Split-K factor, from shapes only (lengths stay on the device, no sync).

    About one program per SM: with fewer, the idle SMs' bandwidth is lost; a one-row call is
    latency-bound and more splits only add partials. Each split writes and the last one to
    finish reads R*N*H*D fp32 partials, so splits are capped at 192 / (N*group): 3 for 64
    queries per kv head, 16 for one (benchmarks/results/tree_attention_sweep.json). Splits
    beyond a short row's block count just write m=-1e30, l=0.
    """
    if device.type != "cuda":
        return 1
    sms = _sm_count(device)
    if base_programs > sms:
        return 1
    cap = min(16, max(1, 192 // queries_per_kv), max_blocks)
    return max(1, min(triton.cdiv(sms, base_programs), cap))


# Row-count-invariant attention (`invariant=True`): the tensor-core kernel for every call (one
# query too), 16-row query tiles and this many key splits (fewer only for a cache of fewer key
# blocks): a launch config from the cache's shape alone, never from the rows or nodes launched.
INVARIANT_SPLITS = 4


def invariant_launch(S: int, D: int, dtype: torch.dtype):
    """(BLOCK_M, BLOCK_N, splits, num_warps, stages) of the invariant attention over a cache of
    S slots and head dim D: a node's keys are dealt to the same splits and summed in the same
    order whether it is an AR step's one query or one of a chain's nodes, alone or in a batch."""
    BLOCK_D = max(16, triton.next_power_of_2(D))
    BLOCK_N = 64 if BLOCK_D <= 128 else 32
    stages = 2 if (dtype == torch.float32 or BLOCK_D > 128) else 3
    return 16, BLOCK_N, max(1, min(INVARIANT_SPLITS, triton.cdiv(S, BLOCK_N))), 4, stages


def check_page(page: int):
    """A page must hold whole key tiles of both kernels (64 slots; 32 for head dims over 128)."""
    if page % 64:
        raise ValueError(f"page size {page} must be a multiple of 64 (the attention kernels' key tile)")


def tree_attention(q, k_cache, v_cache, block_table, lengths, tree_mask=None, *, scale=None, out=None,
                   num_splits=None, config=None, tree_slots=None, invariant=False, causal=False, paths=False):
    """Triton tree attention; see `tabed_engine.ops.tree_attention` for the contract.

    q [R, N, H, D], k_cache/v_cache page pools [P, Hkv, PAGE, D] (any strides, unit last
    stride), block_table [R, W] int32 (row r's slot s: page block_table[r, s // PAGE]; the
    cache spans S = W * PAGE slots), lengths [R] int32, tree_mask [R, N] int64 -> out
    [R, N, H, D] in q's dtype. `num_splits` overrides the
    split-K heuristic (tests use it to cover both paths on the interpreter); `config`, a dict
    with any of block_m / num_warps / splits, overrides the N > 1 kernel's launch
    (`benchmarks/bench_tree_attention.py --sweep`). `tree_slots` (default N, at most 64): the
    tree slots lengths[r] + j the bits may name, when the N queries are the last of them.
    `invariant`: `invariant_launch`'s config whatever R and N (`num_splits` / `config` refused),
    so a query's output does not depend on the other rows and nodes of the launch: a chain's
    node j (slot lengths[r] + j) gets the bits an AR step at that length gets.
    `causal` (tree_mask None, no tree_slots): node i sees slots [0, lengths[r] + i] (a prompt
    chunk over a cached prefix), N up to S; with `invariant` a node gets the bits of an AR
    step at lengths[r] + i.
    `paths` (a tree): a node's bits are its path, the root's slot first (every set bit an
    ancestor or itself, an ancestor at a lower slot than its descendants); its keys past the
    prefix are summed as an AR step at lengths[r] + depth holds them (depth: its set bits - 1,
    the path's nodes at the slots after the prefix), so with `invariant` a tree node gets that
    AR step's bits. Costs one masked key step per node of a query tile in the blocks past the
    prefix's last whole one.
    """
    if paths and causal:
        raise ValueError("tree_attention: paths is for tree masks, not causal calls")
    if invariant and (num_splits is not None or config is not None):
        raise ValueError("tree_attention: invariant calls take no num_splits / config")
    if q.dim() != 4 or k_cache.dim() != 4 or v_cache.dim() != 4:
        raise ValueError(f"q must be [R, N, H, D] and k/v page pools [P, Hkv, PAGE, D], got {tuple(q.shape)}, "
                         f"{tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    R, N, H, D = q.shape
    _, Hkv, PAGE, _ = k_cache.shape
    if k_cache.shape != v_cache.shape or k_cache.shape[3] != D:
        raise ValueError(f"k/v pools {tuple(k_cache.shape)}, {tuple(v_cache.shape)} do not match q {tuple(q.shape)}")
    if block_table.dim() != 2 or block_table.shape[0] != R or block_table.dtype != torch.int32:
        raise ValueError(f"block_table must be int32 [{R}, W], got {block_table.dtype} {tuple(block_table.shape)}")
    if block_table.stride(1) != 1:
        raise ValueError("block_table needs a contiguous last dimension")
    check_page(PAGE)
    S = block_table.shape[1] * PAGE
    if Hkv == 0 or H % Hkv:
        raise ValueError(f"query heads ({H}) must be a multiple of kv heads ({Hkv})")
    if causal:
        if tree_mask is not None or tree_slots is not None:
            raise ValueError("tree_attention: causal calls take no tree_mask / tree_slots")
        if not 1 <= N <= S:
            raise ValueError(f"N={N} causal query nodes per row, expected 1..{S} (the cache span)")
        tree_slots = N
    else:
        if tree_mask is None:
            raise ValueError("tree_attention: tree_mask is required unless causal=True")
        if not 1 <= N <= _MAX_NODES:
            raise ValueError(f"N={N} query nodes per row, expected 1..{_MAX_NODES} (or causal=True)")
        tree_slots = N if tree_slots is None else int(tree_slots)
        if not N <= tree_slots <= _MAX_NODES:
            raise ValueError(f"tree_slots={tree_slots}: expected N={N} to {_MAX_NODES}")
        if tree_mask.shape != (R, N) or tree_mask.dtype != torch.int64:
            raise ValueError(f"tree_mask must be int64 [{R}, {N}], got {tree_mask.dtype} {tuple(tree_mask.shape)}")
    if D > 256:
        raise ValueError(f"head_dim {D} > 256 is not supported")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"q dtype {q.dtype} not supported (float16, bfloat16, float32)")
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise TypeError(f"dtypes differ: q {q.dtype}, k {k_cache.dtype}, v {v_cache.dtype}")
    if lengths.shape != (R,) or lengths.dtype != torch.int32:
        raise ValueError(f"lengths must be int32 [{R}], got {lengths.dtype} {tuple(lengths.shape)}")
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("q, k_cache and v_cache need a contiguous last dimension")
    tensors = (k_cache, v_cache, block_table, lengths) + (() if causal else (tree_mask,))
    if any(t.device != q.device for t in tensors):
        raise ValueError("q, k_cache, v_cache, block_table, lengths and tree_mask must be on one device")
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    elif out.shape != q.shape or out.dtype != q.dtype or out.device != q.device or out.stride(-1) != 1:
        raise ValueError(f"out must be {tuple(q.shape)} {q.dtype} on {q.device} with a contiguous last dim")
    lengths = lengths.contiguous()
    if R == 0:
        return out

    scale = D ** -0.5 if scale is None else float(scale)
    qk_scale = scale * 1.4426950408889634  # log2(e): exp2 in the kernel
    if N == 1 and tree_slots == 1 and not invariant and not causal and not paths:
        return _decode_attention(q, k_cache, v_cache, block_table, lengths, tree_mask, out, qk_scale, num_splits)

    group = H // Hkv
    config = config or {}
    if invariant:
        block_m, _, splits, warps, _ = invariant_launch(S, D, q.dtype)
        config = {"block_m": block_m, "splits": splits, "num_warps": warps}
    # up to 32 queries per kv head: 16-query tiles (more programs, each with fewer rows to
    # combine); past that one 64-query tile reads K/V once (tree_attention_sweep.json); a
    # prompt chunk has many tiles per kv head already and keeps 64
    BLOCK_M = config.get("block_m") or (16 if N * group <= 32 else 64)
    BLOCK_D = max(16, triton.next_power_of_2(D))
    BLOCK_N = 64 if BLOCK_D <= 128 else 32
    m_blocks = triton.cdiv(N * group, BLOCK_M)
    splits = (config.get("splits") or num_splits
              or _pick_splits(q.device, R * Hkv * m_blocks, N * group, triton.cdiv(S, BLOCK_N)))
    # fp32 inputs take the exact (non-TF32) tensor-core path: the fp32 engine path must match
    # the reference to ~1e-6, TF32 would give ~1e-3.
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    dot_fp32 = q.device.type != "cuda"  # interpreter
    num_stages = 2 if (q.dtype == torch.float32 or BLOCK_D > 128) else 3

    if splits == 1:
        m_part = l_part = acc_part = counters = out  # unused
    else:
        m_part = torch.empty((splits, R, N, H), device=q.device, dtype=torch.float32)
        l_part = torch.empty_like(m_part)
        acc_part = torch.empty((splits, R, N, H, D), device=q.device, dtype=torch.float32)
        counters = _counters(q.device, m_blocks * R * Hkv)
    mask = lengths.view(R, 1) if causal else tree_mask  # causal: never read
    use_pdl = pdl(q.device)
    _tree_attention_kernel[(m_blocks, R * Hkv, splits)](
        q, k_cache, v_cache, block_table, lengths, mask, out, m_part, l_part, acc_part, counters,
        q.stride(0), q.stride(1), q.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_table.stride(0),
        mask.stride(0), mask.stride(1),
        out.stride(0), out.stride(1), out.stride(2),
        R, N, tree_slots, H, S, qk_scale,
        GROUP=group, HEAD_DIM=D, SPLITS=splits, PAGE=PAGE,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D, PRECISION=precision, DOT_FP32=dot_fp32,
        PDL=use_pdl, CAUSAL=causal, PATHS=bool(paths), num_warps=config.get("num_warps", 4), num_stages=num_stages,
        launch_pdl=use_pdl,
    )
    return out
