"""Verification of a drafted chain: accepted prefix length and the next (bonus) token.

Two layouts, picked from the shapes alone (`_n_vsplit`; the launcher never syncs, so it
can be captured in a CUDA graph).

One program per request (many requests, `_chain_verify_kernel`).  Greedy: the gamma+1
target rows are read as one [GP, BLOCK] tile per step, so all their argmaxes come out of
a single sweep over V; the worst case (all accepted) reads the same bytes as an
early-exit loop.  Sampling: the gamma acceptance tests need only p(x_i) and q(x_i)
(gathered as a vector); then two sweeps over one row pair at the first rejection: sum of
the residual max(p - q, 0), then an inverse-CDF search with a running cumulative sum.

V split (few requests; the engine verifies B = 1): one program streaming V is a chain of
dependent loads on one SM (~38 us for 6 rows of 32K), so V is cut into S chunks, grid
(B, S), and a one-program-per-request kernel combines the chunk partials:
  greedy    `_argmax_partial_kernel`: per (position, chunk) best logit and its index ->
            `_greedy_accept_kernel`: best per position (lowest index on ties, as
            torch.argmax), then the accepted prefix and the next token.
  sampling  `_residual_partial_kernel`: each program redoes the gamma gathers of the
            acceptance test (a few loads) to know the row pair, then sums the residual
            and p over its chunk (and its last index with mass) ->
            `_residual_draw_kernel`: totals, prefix over the chunk sums to find the chunk
            holding u * total, and an inverse-CDF scan of that chunk only.  Deterministic
            given the uniforms; only the summation order differs from the one-program
            kernel and the reference (chunk sums, then in-chunk cumsum), which can move a
            draw across a CDF boundary when u * total is within rounding of it.
"""
import torch
import triton
import triton.language as tl

from ._common import chunking, fold_row_argmax, load_rows, n_vsplit as _n_vsplit

@triton.jit
def _rows_argmax(p_ptr, b, gamma, start, end, stride_pb, stride_pt,
                 GP: tl.constexpr, BLOCK: tl.constexpr):
    """Max and its (lowest) index of the gamma + 1 rows of request b over [start, end),
    read as [GP, BLOCK] tiles so all rows' loads are in flight together."""
    js = tl.arange(0, GP)
    cols = tl.arange(0, BLOCK)
    rows = p_ptr + b * stride_pb + js.to(tl.int64) * stride_pt
    best = tl.full([GP], float("-inf"), tl.float32)
    idx = tl.zeros([GP], tl.int32) + start
    for v0 in range(start, end, BLOCK):
        x = load_rows(rows, v0 + cols, js <= gamma, v0 + cols < end, 1.0)
        best, idx = fold_row_argmax(x, v0, best, idx)
    return best, idx


@triton.jit
def _accept_prefix(draft, idx, js, gamma, GP: tl.constexpr):
    """Greedy: accepted prefix length and next token from the per-position argmax idx.
    Position gamma has no draft token: it always "misses" and yields the bonus."""
    miss = (draft != idx.to(tl.int64)) | (js >= gamma)
    n_acc = tl.min(tl.where(miss, js, GP), axis=0)
    return n_acc, tl.sum(tl.where(js == n_acc, idx, 0), axis=0)


@triton.jit
def _num_accepted(draft_ptr, q_ptr, p_ptr, u_ptr, b, gamma,
                  stride_db, stride_dt, stride_qb, stride_qt, stride_pb, stride_pt,
                  stride_ub, stride_ut, GP: tl.constexpr):
    """Accepted prefix length: token i passes when u_i * q(x_i) < p(x_i)."""
    js = tl.arange(0, GP)
    dmask = js < gamma
    draft = tl.load(draft_ptr + b * stride_db + js * stride_dt, mask=dmask, other=-1)
    x_safe = tl.where(dmask, draft, 0)
    px = tl.load(p_ptr + b * stride_pb + js * stride_pt + x_safe, mask=dmask, other=0.0)
    qx = tl.load(q_ptr + b * stride_qb + js * stride_qt + x_safe, mask=dmask, other=0.0)
    u = tl.load(u_ptr + b * stride_ub + js * stride_ut, mask=dmask, other=0.0)
    rejected = dmask & ~(u * qx < px)
    return tl.min(tl.where(rejected, js, gamma), axis=0)


@triton.jit
def _residual(p_row, q_row, offs, vmask, q_len):
    """p and the residual max(p - q, 0) at offs; q reads as 0 from q_len on (no q row)."""
    pv = tl.load(p_row + offs, mask=vmask, other=0.0)
    qv = tl.load(q_row + offs, mask=vmask & (offs < q_len), other=0.0)
    return pv, tl.maximum(pv - qv, 0.0)


@triton.jit
def _residual_sums(p_row, q_row, start, end, q_len, BLOCK: tl.constexpr):
    """Over [start, end): sums of the residual and of p, and the last index where each
    has mass (-1 if none)."""
    cols = tl.arange(0, BLOCK)
    tot_r = 0.0
    tot_p = 0.0
    last_r = -1
    last_p = -1
    for v0 in range(start, end, BLOCK):
        offs = v0 + cols
        pv, r = _residual(p_row, q_row, offs, offs < end, q_len)
        tot_r += tl.sum(r, axis=0)
        tot_p += tl.sum(pv, axis=0)
        last_r = tl.maximum(last_r, tl.max(tl.where(r > 0, offs, -1), axis=0))
        last_p = tl.maximum(last_p, tl.max(tl.where(pv > 0, offs, -1), axis=0))
    return tot_r, tot_p, last_r, last_p


@triton.jit
def _residual_search(p_row, q_row, start, end, q_len, run, target, V, BLOCK: tl.constexpr):
    """Inverse CDF over [start, end) with `run` mass before start: the first v whose
    cumulative residual exceeds target (-1 if none), and the last v with mass (-1 if none)."""
    cols = tl.arange(0, BLOCK)
    token = -1
    last = -1
    for v0 in range(start, end, BLOCK):
        offs = v0 + cols
        vmask = offs < end
        _, r = _residual(p_row, q_row, offs, vmask, q_len)
        cs = run + tl.cumsum(r, axis=0)
        first = tl.min(tl.where(vmask & (cs > target), offs, V), axis=0)
        token = tl.where((token < 0) & (first < V), first, token)
        last = tl.maximum(last, tl.max(tl.where(r > 0, offs, -1), axis=0))
        run += tl.sum(r, axis=0)
    return token, last


@triton.jit
def _chain_verify_kernel(
    draft_ptr, q_ptr, p_ptr, u_ptr, num_acc_ptr, next_ptr,
    gamma, V, stride_db, stride_dt, stride_qb, stride_qt, stride_pb, stride_pt,
    stride_ub, stride_ut,
    GP: tl.constexpr, BLOCK: tl.constexpr, GREEDY: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    js = tl.arange(0, GP)
    if GREEDY:
        draft = tl.load(draft_ptr + b * stride_db + js * stride_dt, mask=js < gamma, other=-1)
        _, idx = _rows_argmax(p_ptr, b, gamma, 0, V, stride_pb, stride_pt, GP, BLOCK)
        n_acc, token = _accept_prefix(draft, idx, js, gamma, GP)
    else:
        n_acc = _num_accepted(draft_ptr, q_ptr, p_ptr, u_ptr, b, gamma, stride_db, stride_dt,
                              stride_qb, stride_qt, stride_pb, stride_pt, stride_ub, stride_ut, GP)
        p_row = p_ptr + b * stride_pb + n_acc * stride_pt
        q_row = q_ptr + b * stride_qb + n_acc * stride_qt
        # Sweep 1: mass of the residual, and of p for the fallback.
        q_len = tl.where(n_acc < gamma, V, 0)  # all accepted: bonus token from p_gamma, q = 0
        tot_r, tot_p, _, _ = _residual_sums(p_row, q_row, 0, V, q_len, BLOCK)
        # Sum r == 0 means p_i <= q_i everywhere, i.e. p_i == q_i (both sum to 1): then a
        # rejection has probability 0 and only rounding gets here; p_i is then the exact
        # conditional distribution, so sampling it cannot bias the output.
        use_p = tot_r <= 0.0
        target = tl.load(u_ptr + b * stride_ub + gamma * stride_ut) * tl.where(use_p, tot_p, tot_r)
        # Sweep 2: first v whose cumulative mass exceeds u * total.
        token, last_nz = _residual_search(p_row, q_row, 0, V, tl.where(use_p, 0, q_len),
                                          tl.zeros_like(target), target, V, BLOCK)
        # Rounding can leave the running sum just short of u * total: take the last
        # token with mass (what an exact sum would have hit).
        token = tl.where(token < 0, tl.maximum(last_nz, 0), token)
    tl.store(num_acc_ptr + b, n_acc.to(tl.int64))
    tl.store(next_ptr + b, token.to(tl.int64))


@triton.jit
def _argmax_partial_kernel(
    p_ptr, part_val_ptr, part_idx_ptr, gamma, V, S, CHUNK, stride_pb, stride_pt,
    GP: tl.constexpr, BLOCK: tl.constexpr,
):
    """Greedy split pass: best logit and its (lowest) index per position in one chunk."""
    b = tl.program_id(0).to(tl.int64)
    sp = tl.program_id(1)
    start = sp * CHUNK
    best, idx = _rows_argmax(p_ptr, b, gamma, start, tl.minimum(start + CHUNK, V),
                             stride_pb, stride_pt, GP, BLOCK)
    out = (b * S + sp) * GP + tl.arange(0, GP)
    tl.store(part_val_ptr + out, best)
    tl.store(part_idx_ptr + out, idx)


@triton.jit
def _greedy_accept_kernel(
    draft_ptr, part_val_ptr, part_idx_ptr, num_acc_ptr, next_ptr,
    gamma, V, S, stride_db, stride_dt, GP: tl.constexpr, SP: tl.constexpr,
):
    """Greedy combine: per-position argmax over the chunks, accepted prefix, next token."""
    b = tl.program_id(0).to(tl.int64)
    js = tl.arange(0, GP)
    ss = tl.arange(0, SP)
    smask = ss < S
    ptrs = (b * S + ss)[:, None] * GP + js[None, :]  # [SP, GP]
    val = tl.load(part_val_ptr + ptrs, mask=smask[:, None], other=float("-inf"))
    pidx = tl.load(part_idx_ptr + ptrs, mask=smask[:, None], other=V)
    top = tl.max(val, axis=0)
    idx = tl.min(tl.where(val == top[None, :], pidx, V), axis=0)  # ties: lowest index
    draft = tl.load(draft_ptr + b * stride_db + js * stride_dt, mask=js < gamma, other=-1)
    n_acc, token = _accept_prefix(draft, idx, js, gamma, GP)
    tl.store(num_acc_ptr + b, n_acc.to(tl.int64))
    tl.store(next_ptr + b, token.to(tl.int64))


@triton.jit
def _residual_partial_kernel(
    draft_ptr, q_ptr, p_ptr, u_ptr, part_ptr, part_idx_ptr,
    gamma, V, S, CHUNK, stride_db, stride_dt, stride_qb, stride_qt, stride_pb, stride_pt,
    stride_ub, stride_ut, GP: tl.constexpr, BLOCK: tl.constexpr,
):
    """Sampling split pass: chunk sums of max(p - q, 0) and of p, and their last index with
    mass, for the row pair at the first rejection (p_gamma alone when all pass)."""
    b = tl.program_id(0).to(tl.int64)
    sp = tl.program_id(1)
    n_acc = _num_accepted(draft_ptr, q_ptr, p_ptr, u_ptr, b, gamma, stride_db, stride_dt,
                          stride_qb, stride_qt, stride_pb, stride_pt, stride_ub, stride_ut, GP)
    p_row = p_ptr + b * stride_pb + n_acc * stride_pt
    q_row = q_ptr + b * stride_qb + n_acc * stride_qt
    q_len = tl.where(n_acc < gamma, V, 0)  # no q row for the bonus (q = 0)
    start = sp * CHUNK
    tot_r, tot_p, last_r, last_p = _residual_sums(p_row, q_row, start, tl.minimum(start + CHUNK, V),
                                                  q_len, BLOCK)
    out = (b * S + sp) * 2
    tl.store(part_ptr + out, tot_r)
    tl.store(part_ptr + out + 1, tot_p)
    tl.store(part_idx_ptr + out, last_r)
    tl.store(part_idx_ptr + out + 1, last_p)


@triton.jit
def _residual_draw_kernel(
    draft_ptr, q_ptr, p_ptr, u_ptr, part_ptr, part_idx_ptr, num_acc_ptr, next_ptr,
    gamma, V, S, CHUNK, stride_db, stride_dt, stride_qb, stride_qt, stride_pb, stride_pt,
    stride_ub, stride_ut, GP: tl.constexpr, SP: tl.constexpr, BLOCK: tl.constexpr,
):
    """Sampling combine: totals, the chunk holding u * total, inverse-CDF scan of it."""
    b = tl.program_id(0).to(tl.int64)
    n_acc = _num_accepted(draft_ptr, q_ptr, p_ptr, u_ptr, b, gamma, stride_db, stride_dt,
                          stride_qb, stride_qt, stride_pb, stride_pt, stride_ub, stride_ut, GP)
    ss = tl.arange(0, SP)
    smask = ss < S
    part = part_ptr + (b * S + ss) * 2
    sum_r = tl.load(part, mask=smask, other=0.0)
    sum_p = tl.load(part + 1, mask=smask, other=0.0)
    last_r = tl.load(part_idx_ptr + (b * S + ss) * 2, mask=smask, other=-1)
    last_p = tl.load(part_idx_ptr + (b * S + ss) * 2 + 1, mask=smask, other=-1)
    tot_r = tl.sum(sum_r, axis=0)
    # Sum r == 0 means p_i <= q_i everywhere, i.e. p_i == q_i (both sum to 1): then a
    # rejection has probability 0 and only rounding gets here; p_i is then the exact
    # conditional distribution, so sampling it cannot bias the output.
    use_p = tot_r <= 0.0
    sums = tl.where(use_p, sum_p, sum_r)
    lasts = tl.where(use_p, last_p, last_r)
    target = tl.load(u_ptr + b * stride_ub + gamma * stride_ut) * tl.sum(sums, axis=0)
    # First chunk whose cumulative mass exceeds u * total; its exclusive prefix.
    cs = tl.cumsum(sums, axis=0)
    hit = tl.min(tl.where(smask & (cs > target), ss, S), axis=0)
    run = tl.sum(tl.where(ss < hit, sums, 0.0), axis=0)
    p_row = p_ptr + b * stride_pb + n_acc * stride_pt
    q_row = q_ptr + b * stride_qb + n_acc * stride_qt
    q_len = tl.where((n_acc < gamma) & ~use_p, V, 0)
    start = hit * CHUNK  # hit == S (no chunk): start >= V, the scan is empty
    token, last_in = _residual_search(p_row, q_row, start, tl.minimum(start + CHUNK, V), q_len,
                                      run, target, V, BLOCK)
    # Rounding can leave the in-chunk sum just short of u * total (take the chunk's last
    # token with mass), or every prefix short of it (take the row's last token with mass):
    # what an exact sum would have hit.
    last_all = tl.maximum(tl.max(lasts, axis=0), 0)
    token = tl.where(token < 0, tl.where(hit < S, last_in, last_all), token)
    tl.store(num_acc_ptr + b, n_acc.to(tl.int64))
    tl.store(next_ptr + b, token.to(tl.int64))


def chain_verify(draft_tokens, q_probs, p, *, greedy, uniforms=None):
    """Triton launcher; see `tabed_engine.ops.chain_verify.chain_verify` for the contract."""
    if draft_tokens.dim() != 2 or draft_tokens.dtype != torch.int64:
        raise ValueError(f"draft_tokens must be int64 [B, gamma], got {draft_tokens.dtype} "
                         f"{tuple(draft_tokens.shape)}")
    B, gamma = draft_tokens.shape
    if p.dim() != 3 or p.shape[:2] != (B, gamma + 1):
        raise ValueError(f"p must be [B, gamma+1, V] = [{B}, {gamma + 1}, V], got {tuple(p.shape)}")
    V = p.shape[2]
    if p.stride(2) != 1 or p.device != draft_tokens.device:
        raise ValueError("p must have a contiguous last dimension, on the device of draft_tokens")
    if greedy:
        if p.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise TypeError(f"p dtype {p.dtype} not supported")
        q_probs = uniforms = p  # unused by the greedy kernel
    else:
        if q_probs is None or uniforms is None:
            raise ValueError("sampling needs q_probs and uniforms")
        if p.dtype != torch.float32 or q_probs.dtype != torch.float32 or uniforms.dtype != torch.float32:
            raise TypeError("sampling needs float32 p, q_probs and uniforms")
        if q_probs.shape != (B, gamma, V) or q_probs.stride(2) != 1:
            raise ValueError(f"q_probs must be [B, gamma, V] = [{B}, {gamma}, {V}] with unit last stride")
        if uniforms.shape != (B, gamma + 1):
            raise ValueError(f"uniforms must be [B, gamma+1] = [{B}, {gamma + 1}]")
        if q_probs.device != p.device or uniforms.device != p.device:
            raise ValueError("all inputs must be on one device")
    dev = p.device
    num_acc = torch.empty(B, dtype=torch.int64, device=dev)
    next_token = torch.empty(B, dtype=torch.int64, device=dev)
    GP = triton.next_power_of_2(gamma + 1)
    if B == 0:
        return num_acc, next_token
    strides = (draft_tokens.stride(0), draft_tokens.stride(1), q_probs.stride(0), q_probs.stride(1),
               p.stride(0), p.stride(1), uniforms.stride(0), uniforms.stride(1))
    # [GP, BLOCK] tiles of 8K elements when greedy; one row pair of 4K when sampling.
    block_max = 8192 // GP if greedy else 4096
    S, chunk = chunking(V, _n_vsplit(B, V))
    if S == 1:
        BLOCK = max(16, min(triton.next_power_of_2(V), block_max))
        _chain_verify_kernel[(B,)](
            draft_tokens, q_probs, p, uniforms, num_acc, next_token, gamma, V, *strides,
            GP=GP, BLOCK=BLOCK, GREEDY=bool(greedy), num_warps=8,
        )
        return num_acc, next_token

    BLOCK = max(16, min(triton.next_power_of_2(chunk), block_max))
    SP = triton.next_power_of_2(S)
    if greedy:
        part_val = torch.empty(B * S * GP, dtype=torch.float32, device=dev)
        part_idx = torch.empty(B * S * GP, dtype=torch.int32, device=dev)
        _argmax_partial_kernel[(B, S)](
            p, part_val, part_idx, gamma, V, S, chunk, p.stride(0), p.stride(1),
            GP=GP, BLOCK=BLOCK, num_warps=8 if GP * BLOCK >= 4096 else 4,
        )
        _greedy_accept_kernel[(B,)](
            draft_tokens, part_val, part_idx, num_acc, next_token, gamma, V, S,
            draft_tokens.stride(0), draft_tokens.stride(1), GP=GP, SP=SP,
            num_warps=1 if SP * GP <= 256 else 4,
        )
    else:
        part = torch.empty(B * S * 2, dtype=torch.float32, device=dev)
        part_idx = torch.empty(B * S * 2, dtype=torch.int32, device=dev)
        num_warps = 8 if BLOCK >= 2048 else 4
        _residual_partial_kernel[(B, S)](
            draft_tokens, q_probs, p, uniforms, part, part_idx, gamma, V, S, chunk, *strides,
            GP=GP, BLOCK=BLOCK, num_warps=num_warps,
        )
        _residual_draw_kernel[(B,)](
            draft_tokens, q_probs, p, uniforms, part, part_idx, num_acc, next_token,
            gamma, V, S, chunk, *strides, GP=GP, SP=SP, BLOCK=BLOCK, num_warps=num_warps,
        )
    return num_acc, next_token
