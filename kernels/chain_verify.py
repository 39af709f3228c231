"""Verification of a drafted chain: accepted prefix length and the next (bonus) token.

One program per request.  Greedy: the gamma+1 target rows are read as one [GP, BLOCK]
tile per step, so all their argmaxes come out of a single sweep over V; at B=1 that is
one row-latency instead of up to gamma+1 dependent sweeps, and the worst case (all
accepted) reads the same bytes as an early-exit loop.  Sampling: the gamma acceptance
tests need only p(x_i) and q(x_i) (gathered as a vector); then two sweeps over one row
pair at the first rejection: sum of the residual max(p - q, 0), then an inverse-CDF
search with a running cumulative sum.
"""
import torch
import triton
import triton.language as tl


@triton.jit
def _chain_verify_kernel(
    draft_ptr, q_ptr, p_ptr, u_ptr, num_acc_ptr, next_ptr,
    gamma, V, stride_db, stride_dt, stride_qb, stride_qt, stride_pb, stride_pt,
    stride_ub, stride_ut,
    GP: tl.constexpr, BLOCK: tl.constexpr, GREEDY: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    js = tl.arange(0, GP)
    dmask = js < gamma
    cols = tl.arange(0, BLOCK)
    draft = tl.load(draft_ptr + b * stride_db + js * stride_dt, mask=dmask, other=-1)
    if GREEDY:
        rows = p_ptr + b * stride_pb + js.to(tl.int64)[:, None] * stride_pt
        best = tl.full([GP], float("-inf"), tl.float32)
        idx = tl.zeros([GP], tl.int32)
        for v0 in range(0, V, BLOCK):
            offs = v0 + cols
            x = tl.load(rows + offs[None, :], mask=(js <= gamma)[:, None] & (offs < V)[None, :],
                        other=float("-inf")).to(tl.float32)
            blk_best = tl.max(x, axis=1)
            take = blk_best > best  # strict: the earlier block wins ties
            idx = tl.where(take, v0 + tl.argmax(x, axis=1), idx)
            best = tl.where(take, blk_best, best)
        # Position gamma has no draft token: it always "misses" and yields the bonus.
        miss = (draft != idx.to(tl.int64)) | (js >= gamma)
        n_acc = tl.min(tl.where(miss, js, GP), axis=0)
        token = tl.sum(tl.where(js == n_acc, idx, 0), axis=0)
    else:
        x_safe = tl.where(dmask, draft, 0)
        px = tl.load(p_ptr + b * stride_pb + js * stride_pt + x_safe, mask=dmask, other=0.0)
        qx = tl.load(q_ptr + b * stride_qb + js * stride_qt + x_safe, mask=dmask, other=0.0)
        u = tl.load(u_ptr + b * stride_ub + js * stride_ut, mask=dmask, other=0.0)
        rejected = dmask & ~(u * qx < px)  # accept with probability min(1, p/q)
        n_acc = tl.min(tl.where(rejected, js, gamma), axis=0)
        residual = n_acc < gamma  # else: all accepted, bonus token from p_gamma
        p_row = p_ptr + b * stride_pb + n_acc * stride_pt
        q_row = q_ptr + b * stride_qb + n_acc * stride_qt
        # Sweep 1: mass of the residual, and of p for the fallback.
        q_len = tl.where(residual, V, 0)  # no q row for the bonus (q = 0)
        tot_r = 0.0
        tot_p = 0.0
        for v0 in range(0, V, BLOCK):
            offs = v0 + cols
            vmask = offs < V
            pv = tl.load(p_row + offs, mask=vmask, other=0.0)
            qv = tl.load(q_row + offs, mask=offs < q_len, other=0.0)
            tot_r += tl.sum(tl.maximum(pv - qv, 0.0), axis=0)
            tot_p += tl.sum(pv, axis=0)
        # Sum r == 0 means p_i <= q_i everywhere, i.e. p_i == q_i (both sum to 1): then a
        # rejection has probability 0 and only rounding gets here; p_i is then the exact
        # conditional distribution, so sampling it cannot bias the output.
        use_p = tot_r <= 0.0
        target = tl.load(u_ptr + b * stride_ub + gamma * stride_ut) * tl.where(use_p, tot_p, tot_r)
        # Sweep 2: first v whose cumulative mass exceeds u * total.
        q_len = tl.where(use_p, 0, q_len)
        run = 0.0
        token = -1
        last_nz = 0
        for v0 in range(0, V, BLOCK):
            offs = v0 + cols
            vmask = offs < V
            pv = tl.load(p_row + offs, mask=vmask, other=0.0)
            qv = tl.load(q_row + offs, mask=offs < q_len, other=0.0)
            r = tl.maximum(pv - qv, 0.0)
            cs = run + tl.cumsum(r, axis=0)
            first = tl.min(tl.where(vmask & (cs > target), offs, V), axis=0)
            token = tl.where((token < 0) & (first < V), first, token)
            last_nz = tl.maximum(last_nz, tl.max(tl.where(r > 0, offs, -1), axis=0))
            run += tl.sum(r, axis=0)
        # Rounding can leave the running sum just short of u * total: take the last
        # token with mass (what an exact sum would have hit).
        token = tl.where(token < 0, last_nz, token)
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
    if greedy:  # [GP, BLOCK] tile of 8K elements
        BLOCK = max(16, min(triton.next_power_of_2(V), 8192 // GP))
    else:
        BLOCK = max(16, min(triton.next_power_of_2(V), 4096))
    if B > 0:
        _chain_verify_kernel[(B,)](
            draft_tokens, q_probs, p, uniforms, num_acc, next_token,
            gamma, V, draft_tokens.stride(0), draft_tokens.stride(1),
            q_probs.stride(0), q_probs.stride(1), p.stride(0), p.stride(1),
            uniforms.stride(0), uniforms.stride(1),
            GP=GP, BLOCK=BLOCK, GREEDY=bool(greedy), num_warps=8,
        )
    return num_acc, next_token
