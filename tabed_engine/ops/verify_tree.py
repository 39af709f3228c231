"""Tree verification: which drafted nodes the target accepts, and the token after them.

`verify_tree` runs the compiled kernel of `tabed_engine._C` (csrc/verify_tree*.{h,cpp,cu})
for the tensors' device when the extension is loaded, and `verify_tree_reference`
otherwise. The reference is the specification; it mirrors the kernel's arithmetic
(float64 sums in index order via `cumsum`, fp32 acceptance test) so the CPU kernel
matches it bit for bit.
"""
from __future__ import annotations

import torch

from tabed_engine.ops import _ext

__all__ = ["verify_tree", "verify_tree_reference"]


def verify_tree(tokens, parents, p, q=None, uniforms=None, greedy=True):
    """Walk a draft tree per request and return the accepted path and the next token.

    Parameters
    ----------
    tokens : int64 [B, N]
        Node tokens; node 0 is the root (the last committed token).
    parents : int64 [B, N]
        Parent of each node, ``parents[:, i] < i`` for ``i >= 1`` (topological order,
        siblings in the order they were drawn); ``parents[:, 0]`` is ignored. A parent of
        -1 marks a padding node (a tree smaller than N): it is never visited.
    p : [B, N, V]
        Greedy: target logits at each node (any float dtype). Sampling: target
        probabilities, float32, already processed (temperature, top-p).
    q : float32 [B, N, V] or None
        Sampling only: the draft distribution at each node from which its children
        were drawn without replacement.
    uniforms : float32 [B, N + 1] or None
        Sampling only: U[0, 1) draws; ``[:, :N-1]`` are consumed one per tested child,
        ``[:, N]`` samples the next token.
    greedy : bool

    Returns
    -------
    path : int64 [B, N]
        Accepted node indices starting with 0 (the root), padded with -1.
    num_accepted : int64 [B]
        Number of accepted non-root nodes.
    next_token : int64 [B]
        Target argmax (greedy) or sample from the final residual distribution.
    """
    if _ext.use_ext(p.device):
        return torch.ops.tabed_engine.verify_tree(tokens, parents, p, q, uniforms, bool(greedy))
    return verify_tree_reference(tokens, parents, p, q, uniforms, greedy)


def _check(tokens, parents, p, q, uniforms, greedy):
    if tokens.dim() != 2 or parents.shape != tokens.shape:
        raise ValueError(f"tokens and parents must both be [B, N], got {tuple(tokens.shape)} "
                         f"and {tuple(parents.shape)}")
    if tokens.dtype != torch.int64 or parents.dtype != torch.int64:
        raise TypeError(f"tokens and parents must be int64, got {tokens.dtype} and {parents.dtype}")
    B, N = tokens.shape
    if N < 1 or p.dim() != 3 or p.shape[:2] != (B, N) or p.shape[2] < 1:
        raise ValueError(f"p must be [B, N, V] = [{B}, {N}, V >= 1], got {tuple(p.shape)}")
    if not p.is_floating_point():
        raise TypeError(f"p must be a float tensor, got {p.dtype}")
    if greedy:
        return
    if p.dtype != torch.float32:
        raise TypeError(f"sampling needs p as float32 probabilities, got {p.dtype}")
    if q is None or q.numel() == 0 or q.shape != p.shape or q.dtype != torch.float32:
        raise ValueError("sampling needs q: float32 draft probabilities shaped like p "
                         f"{tuple(p.shape)}, got {None if q is None else (tuple(q.shape), q.dtype)}")
    if uniforms is None or uniforms.shape != (B, N + 1) or uniforms.dtype != torch.float32:
        raise ValueError(f"sampling needs uniforms float32 [B, N+1] = [{B}, {N + 1}], got "
                         f"{None if uniforms is None else (tuple(uniforms.shape), uniforms.dtype)}")


def _first_true(mask):
    """Index of the first True per row (0 when none; callers mask that case)."""
    return mask.to(torch.int8).argmax(dim=1)


def _sum64(x):
    # float64 sum in index order (CPU cumsum is sequential): the kernel's order.
    return x.double().cumsum(dim=1)[:, -1:]


def _normalize(x, s):
    """float(x / s) where s > 0, else x unchanged (degenerate rows; see csrc/verify_tree.h)."""
    return torch.where(s > 0, (x.double() / s).float(), x)


def verify_tree_reference(tokens, parents, p, q=None, uniforms=None, greedy=True):
    """Plain-PyTorch `verify_tree` (same arguments and results).

    Vectorised over requests: each of at most N - 1 steps tests one child per request
    (a request tests every node at most once), rows that stopped are masked.
    """
    _check(tokens, parents, p, q, uniforms, greedy)
    B, N = tokens.shape
    V = p.shape[2]
    dev = tokens.device
    rows = torch.arange(B, device=dev)
    node = torch.arange(N, device=dev)
    # path with a dump column N where masked-out rows write.
    path = torch.full((B, N + 1), -1, dtype=torch.int64, device=dev)
    path[:, 0] = 0
    n_acc = torch.zeros(B, dtype=torch.int64, device=dev)
    cur = torch.zeros(B, dtype=torch.int64, device=dev)
    active = torch.ones(B, dtype=torch.bool, device=dev)

    if greedy:
        best = p.argmax(dim=2)  # [B, N]; torch: lowest index on ties, NaN is the max
        for _ in range(N - 1):
            t = best[rows, cur]
            match = (parents == cur[:, None]) & (node > cur[:, None]) & (tokens == t[:, None])
            hit = match.any(dim=1) & active
            c = _first_true(match)
            n_acc = n_acc + hit
            path[rows, torch.where(hit, n_acc, N)] = c
            cur = torch.where(hit, c, cur)
            active = hit
        return path[:, :N].contiguous(), n_acc, best[rows, cur]

    r = p[:, 0].clone()  # residual target distribution at the current node, [B, V]
    d = q[:, 0].clone()  # draft distribution of the untested children, [B, V]
    last = torch.zeros(B, dtype=torch.int64, device=dev)  # last tested node
    k = torch.zeros(B, dtype=torch.int64, device=dev)     # uniforms used
    for _ in range(N - 1):
        cand = (parents == cur[:, None]) & (node > last[:, None])
        has = cand.any(dim=1) & active
        c = _first_true(cand)
        x = tokens[rows, c]
        u = uniforms[rows, k.clamp(max=N)]
        k = k + has
        valid = has & (x >= 0) & (x < V)
        xc = x.clamp(0, V - 1)[:, None]
        accept = valid & (u * d.gather(1, xc)[:, 0] < r.gather(1, xc)[:, 0])
        reject = valid & ~accept
        # rejection: r <- norm(max(r - d, 0)), d(x) <- 0, d <- norm(d)
        rt = (r - d).clamp_min(0)
        dz = d.scatter(1, xc, 0.0)
        dn = _normalize(dz, _sum64(dz))
        sr = _sum64(rt)
        rn = torch.where(sr > 0, (rt.double() / sr).float(), dn)
        acc2, rej2 = accept[:, None], reject[:, None]
        r = torch.where(acc2, p[rows, c], torch.where(rej2, rn, r))
        d = torch.where(acc2, q[rows, c], torch.where(rej2, dn, d))
        n_acc = n_acc + accept
        path[rows, torch.where(accept, n_acc, N)] = c
        cur = torch.where(accept, c, cur)
        last = torch.where(has, c, last)
        active = has

    # inverse-CDF sample of r: first index whose running float64 sum exceeds u * total;
    # if rounding leaves none, the last positive index; an all-zero row gives 0.
    cum = r.double().cumsum(dim=1)
    target = uniforms[:, N].double() * cum[:, -1]
    over = cum > target[:, None]
    pos = r > 0
    last_pos = torch.where(pos.any(dim=1), V - 1 - _first_true(pos.flip(1)), 0)
    nxt = torch.where(over.any(dim=1), _first_true(over), last_pos)
    return path[:, :N].contiguous(), n_acc, nxt
