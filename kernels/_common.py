"""Building blocks shared by the ensemble kernels (ensemble_mix, chain_verify).

`@triton.jit` helpers are inlined into the kernels that call them (constexpr arguments
pass through), so a kernel built from them compiles to the same code as if written out.
The V split rule is shared too: both ops cut the vocabulary the same way.
"""
import triton
import triton.language as tl

# V split.  At B = 1 a program's latency is about one DRAM round trip plus its reductions
# for any chunk below a few K elements; ~1K elements per row and chunk (a few 16-byte
# loads per thread, issued together) keeps the per-program fixed cost small next to its
# work, and the partials to combine few.  Splitting stops at ~128 programs (one wave on a
# 132-SM H100 / H200).  B = 1, V = 32064 gives 32 chunks of 1008; B >= 128 keeps one
# program per request (S = 1).
_MIN_CHUNK = 1024
_TARGET_PROGRAMS = 128


def n_vsplit(B, V):
    """Requested number of V chunks per request (shapes only, no device query)."""
    return max(1, min(triton.cdiv(V, _MIN_CHUNK), _TARGET_PROGRAMS // max(B, 1)))


def chunking(V, S):
    """(S, chunk): `S` requested chunks of V made 16-aligned and all non-empty."""
    if S <= 1:
        return 1, V
    chunk = triton.cdiv(triton.cdiv(V, S), 16) * 16
    return triton.cdiv(V, chunk), chunk


@triton.jit
def load_rows(rows_ptr, offs, row_mask, col_mask, scale):
    """[R, BLOCK] fp32 tile of the rows `rows_ptr` ([R] pointers) at columns `offs`,
    times `scale`; -inf where masked."""
    x = tl.load(rows_ptr[:, None] + offs[None, :], mask=row_mask[:, None] & col_mask[None, :],
                other=float("-inf"))
    return x.to(tl.float32) * scale


@triton.jit
def online_lse(x, m, s):
    """Fold the [R, BLOCK] tile x into each row's running max m and sum-exp s (both [R])."""
    m_new = tl.maximum(m, tl.max(x, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    s = s * tl.exp(m - m_safe) + tl.sum(tl.exp(x - m_safe[:, None]), axis=1)
    return m_new, s


@triton.jit
def pick_score(val, offs, vmask, seed, rng_base, GREEDY: tl.constexpr, LOG: tl.constexpr):
    """Score whose argmax picks the token: `val` when greedy; else an exponential race
    with E_v = -log(u_v), u_v = Philox(seed, rng_base + v): val / E_v, or with LOG (val
    a log-probability up to a constant) val - log(E_v).  -inf outside vmask."""
    score = val
    if not GREEDY:
        e = -tl.log(tl.rand(seed, rng_base + offs))
        if LOG:
            score = val - tl.log(e)
        else:
            score = val / e
    return tl.where(vmask, score, float("-inf"))


@triton.jit
def fold_best(score, val, v0, cols, best, best_idx, best_val):
    """Fold one block (columns v0 + cols) into a running (best score, its index, its val);
    the earlier block wins ties, within a block the lowest index (as torch.argmax)."""
    blk_best = tl.max(score, axis=0)
    blk_idx = tl.argmax(score, axis=0)
    blk_val = tl.sum(tl.where(cols == blk_idx, val, 0.0), axis=0)
    take = blk_best > best
    return (tl.where(take, blk_best, best), tl.where(take, v0 + blk_idx, best_idx),
            tl.where(take, blk_val, best_val))


@triton.jit
def fold_row_argmax(x, v0, best, idx):
    """Fold the [R, BLOCK] tile x (columns v0 + arange) into each row's running max and
    its index; the earlier block wins ties."""
    blk_best = tl.max(x, axis=1)
    take = blk_best > best
    return tl.where(take, blk_best, best), tl.where(take, v0 + tl.argmax(x, axis=1), idx)
