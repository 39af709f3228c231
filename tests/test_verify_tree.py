"""verify_tree: compiled kernels (CPU here, CUDA with -m gpu) against the PyTorch reference,
the reference against a literal scalar transcription of the spec, and losslessness of
stochastic verification by a chi-square test."""
import math

import pytest
import torch

from tabed_engine.ops import _ext
from tabed_engine.ops.verify_tree import verify_tree, verify_tree_reference

needs_ext = pytest.mark.skipif(not _ext.HAS_CPU_KERNELS, reason=f"tabed_engine._C not built: {_ext.EXT_ERROR}")
needs_cuda_ext = pytest.mark.skipif(not _ext.HAS_CUDA_KERNELS, reason="tabed_engine._C built without CUDA")


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # The reference issues many small ops; on a busy 2-core machine intra-op threads
    # spin against each other (40 ms instead of 70 us per op), so run these serially.
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def op(*args):
    return torch.ops.tabed_engine.verify_tree(*args)


def poison_allocator(device, numel=1 << 16):
    # Freed -7 blocks are what the kernel's output allocations most likely reuse, so an
    # output element that is never written shows up as -7 instead of a lucky zero.
    torch.full((numel,), -7, dtype=torch.int64, device=device)


# ----------------------------------------------------------------------------- inputs

def random_parents(B, N, g):
    """[B, N] parents with parents[:, i] < i: a mix of deep chains and wide fans."""
    i = torch.arange(N)
    back = (torch.rand(B, N, generator=g) ** 2 * i).long()  # mostly recent nodes -> depth
    parents = (i - 1 - back).clamp(min=0)
    parents[:, 0] = -1
    return parents


def random_dists(B, N, V, g, sharp=3.0):
    x = torch.rand(B, N, V, generator=g) ** sharp + 1e-3
    return x / x.sum(-1, keepdim=True)


def greedy_inputs(B, N, V, g, dtype):
    p = torch.randn(B, N, V, generator=g).to(dtype)
    if V <= 1000:  # some exact ties between values -> lowest-index rule matters
        p = (p * 2).round() / 2
    parents = random_parents(B, N, g)
    best = p.float().argmax(-1)
    hit = torch.rand(B, N, generator=g) < 0.7
    tokens = torch.where(hit, best.gather(1, parents.clamp(min=0)), torch.randint(0, V, (B, N), generator=g))
    tokens[:, 0] = torch.randint(0, V, (B,), generator=g)
    return tokens, parents, p


def sampling_inputs(B, N, V, g):
    q = random_dists(B, N, V, g)
    noise = torch.rand(B, N, V, generator=g) * 0.6 + 0.7
    p = q * noise  # close to q, so long paths get accepted
    p = p / p.sum(-1, keepdim=True)
    parents = random_parents(B, N, g)
    # children drawn from their parent's q (with replacement: fine for exactness tests)
    flat = q.gather(1, parents.clamp(min=0)[..., None].expand(B, N, V)).reshape(B * N, V)
    tokens = torch.multinomial(flat, 1, generator=g).reshape(B, N)
    u = torch.rand(B, N + 1, generator=g)
    return tokens, parents, p, q, u


# ------------------------------------------------------- literal spec (scalar loops)

def spec_walk(tokens, parents, p, q, u, greedy):
    """The op spec transcribed with per-request Python loops, with the kernel's arithmetic
    (float32 products, float64 sums in index order)."""
    B, N = tokens.shape
    V = p.shape[-1]
    path = torch.full((B, N), -1, dtype=torch.int64)
    n_acc = torch.zeros(B, dtype=torch.int64)
    nxt = torch.zeros(B, dtype=torch.int64)
    for b in range(B):
        cur, k, path[b, 0] = 0, 0, 0
        if greedy:
            while True:
                t = int(p[b, cur].argmax())
                kids = [c for c in range(cur + 1, N) if int(parents[b, c]) == cur and int(tokens[b, c]) == t]
                if not kids:
                    break
                cur = kids[0]
                n_acc[b] += 1
                path[b, n_acc[b]] = cur
            nxt[b] = t
            continue
        r, d = p[b, 0].clone(), q[b, 0].clone()
        c = cur
        while True:
            kids = [x for x in range(c + 1, N) if int(parents[b, x]) == cur]
            if not kids:
                break
            c = kids[0]
            x, uk = int(tokens[b, c]), u[b, k]
            k += 1
            if not 0 <= x < V:
                continue
            if bool(uk * d[x] < r[x]):  # float32 product, like the kernel
                cur = c
                n_acc[b] += 1
                path[b, n_acc[b]] = c
                r, d = p[b, c].clone(), q[b, c].clone()
                continue
            rt = (r - d).clamp_min(0)
            dz = d.clone()
            dz[x] = 0
            sr, sd = sum(float(v) for v in rt), sum(float(v) for v in dz)
            dn = (dz.double() / sd).float() if sd > 0 else dz
            r = (rt.double() / sr).float() if sr > 0 else dn
            d = dn
        target, cum, tok = float(u[b, N]) * sum(float(v) for v in r), 0.0, -1
        for i in range(V):
            cum += float(r[i])
            if cum > target:
                tok = i
                break
        if tok < 0:
            pos = [i for i in range(V) if r[i] > 0]
            tok = pos[-1] if pos else 0
        nxt[b] = tok
    return path, n_acc, nxt


def assert_same(got, want, what=""):
    names = ("path", "num_accepted", "next_token")
    for name, a, b in zip(names, got, want):
        assert a.dtype == torch.int64 and a.shape == b.shape, (what, name, a.dtype, a.shape, b.shape)
        assert torch.equal(a.cpu(), b.cpu()), f"{what} {name} differs\n{a}\n{b}"


# ----------------------------------------------------------------------- reference

@pytest.mark.parametrize("seed", range(4))
def test_reference_matches_spec_greedy(seed):
    g = torch.Generator().manual_seed(seed)
    B, N, V = 1 + seed * 2, [3, 17, 33, 8][seed], [7, 50, 13, 120][seed]
    tokens, parents, p = greedy_inputs(B, N, V, g, torch.float32)
    got = verify_tree_reference(tokens, parents, p, None, None, True)
    assert_same(got, spec_walk(tokens, parents, p, None, None, True), "greedy")
    assert got[1].sum() > 0  # the inputs do exercise acceptance


@pytest.mark.parametrize("seed", range(4))
def test_reference_matches_spec_sampling(seed):
    g = torch.Generator().manual_seed(100 + seed)
    B, N, V = 1 + seed * 2, [3, 17, 33, 8][seed], [7, 50, 13, 120][seed]
    tokens, parents, p, q, u = sampling_inputs(B, N, V, g)
    tokens[0, -1] = V + 3  # an out-of-range token: never accepted, still uses a uniform
    got = verify_tree_reference(tokens, parents, p, q, u, False)
    assert_same(got, spec_walk(tokens, parents, p, q, u, False), "sampling")


def test_reference_degenerate_rows_no_nan():
    # r == d exactly: rejection impossible; all-zero p: next token 0; zero draft mass.
    V, N = 5, 4
    tokens = torch.tensor([[0, 1, 2, 3]])
    parents = torch.tensor([[-1, 0, 0, 0]])
    p = torch.zeros(1, N, V)
    q = torch.zeros(1, N, V)
    q[0, 0, 1] = 1.0
    u = torch.full((1, N + 1), 0.5)
    for impl in [verify_tree_reference] + ([op] if _ext.HAS_CPU_KERNELS else []):
        path, n, nxt = impl(tokens, parents, p, q, u, False)
        assert n.item() == 0 and nxt.item() == 0 and path[0].tolist() == [0, -1, -1, -1]


def test_padding_nodes_are_never_visited():
    # a tree padded with parent -1 nodes (the view tree's fixed shape) walks exactly like the
    # tree alone, although every padding node carries the token the target wants at the root
    g = torch.Generator().manual_seed(11)
    B, N, V, P = 3, 9, 40, 6
    tokens, parents, p = greedy_inputs(B, N, V, g, torch.float32)
    root_best = p[:, 0].argmax(-1, keepdim=True)
    # row 0: the root's own children all miss, so a visited padding node would be accepted
    tokens[0] = torch.where(parents[0] == 0, (root_best[0] + 1) % V, tokens[0])
    want = verify_tree_reference(tokens, parents, p, None, None, True)
    tokens2 = torch.cat([tokens, root_best.expand(B, P)], 1)
    parents2 = torch.cat([parents, torch.full((B, P), -1)], 1)
    p2 = torch.cat([p, torch.randn(B, P, V, generator=g)], 1)
    assert want[1][0] == 0 and want[1].sum() > 0
    for impl in [verify_tree_reference] + ([op] if _ext.HAS_CPU_KERNELS else []):
        path, n, nxt = impl(tokens2, parents2, p2, None, None, True)
        assert torch.equal(path[:, :N], want[0]) and (path[:, N:] == -1).all()
        assert torch.equal(n, want[1]) and torch.equal(nxt, want[2])
        # the same padding nodes as root children (parent 0) are taken in row 0: the test
        # can tell padding from real nodes
        taken = impl(tokens2, torch.cat([parents, torch.zeros(B, P, dtype=torch.long)], 1), p2, None, None, True)
        assert taken[1][0] > 0


# ------------------------------------------------------------- CPU kernel == reference

CASES = [  # (B, N, V, seed); V = 32064 kept to a few rows (CPU time)
    (1, 1, 1000, 0), (3, 5, 1000, 1), (9, 64, 1000, 2), (7, 37, 1000, 3), (2, 64, 32064, 4), (4, 13, 32064, 5),
]


@needs_ext
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("B,N,V,seed", CASES)
def test_cpu_greedy_matches_reference(B, N, V, seed, dtype):
    g = torch.Generator().manual_seed(seed)
    tokens, parents, p = greedy_inputs(B, N, V, g, dtype)
    want = verify_tree_reference(tokens, parents, p, None, None, True)
    poison_allocator("cpu")
    got = op(tokens, parents, p, None, None, True)
    assert_same(got, want, f"greedy {dtype}")
    assert verify_tree(tokens, parents, p).__len__() == 3


@needs_ext
@pytest.mark.parametrize("B,N,V,seed", CASES)
def test_cpu_sampling_matches_reference(B, N, V, seed):
    g = torch.Generator().manual_seed(1000 + seed)
    tokens, parents, p, q, u = sampling_inputs(B, N, V, g)
    want = verify_tree_reference(tokens, parents, p, q, u, False)
    poison_allocator("cpu")
    got = op(tokens, parents, p, q, u, False)
    # Bit-exact on the CPU: the kernel and the reference do the same fp32 products and
    # the same float64 sums in the same (index) order (see csrc/verify_tree.h).
    assert_same(got, want, "sampling")
    if N > 8:
        assert want[1].max() > 0


@needs_ext
def test_cpu_strided_inputs():
    g = torch.Generator().manual_seed(7)
    B, N, V = 5, 12, 300
    tokens, parents, p, q, u = sampling_inputs(B, N, V, g)
    # non-contiguous views of everything (transposed storage, padded vocab rows)
    tok_t = tokens.t().contiguous().t()
    par_t = parents.t().contiguous().t()
    p_pad = torch.cat([p, torch.rand(B, N, 7)], -1)[..., :V]
    q_pad = torch.cat([q, torch.rand(B, N, 7)], -1)[..., :V]
    u_t = u.t().contiguous().t()
    assert not p_pad.is_contiguous() and not tok_t.is_contiguous()
    for greedy in (True, False):
        want = verify_tree_reference(tokens, parents, p, q, u, greedy)
        assert_same(op(tok_t, par_t, p_pad, q_pad, u_t, greedy), want, "strided")
    # vocab axis not contiguous (p.transpose): the binding makes it contiguous
    pt = p.transpose(1, 2).contiguous().transpose(1, 2)
    assert_same(op(tokens, parents, pt, None, None, True),
                verify_tree_reference(tokens, parents, p, None, None, True), "vocab-strided")


@needs_ext
def test_cpu_errors_are_clear():
    g = torch.Generator().manual_seed(0)
    tokens, parents, p, q, u = sampling_inputs(2, 4, 10, g)
    with pytest.raises(RuntimeError, match="tokens must be int64"):
        op(tokens.int(), parents, p, q, u, False)
    with pytest.raises(RuntimeError, match=r"p must be \[B, N, V\]"):
        op(tokens, parents, p[:, :3], q, u, False)
    with pytest.raises(RuntimeError, match="needs p as float32"):
        op(tokens, parents, p.half(), q, u, False)
    with pytest.raises(RuntimeError, match="needs the draft probabilities q"):
        op(tokens, parents, p, None, u, False)
    with pytest.raises(RuntimeError, match=r"uniforms must be \[B, N\+1\]"):
        op(tokens, parents, p, q, u[:, :-1], False)
    with pytest.raises(RuntimeError, match="at least the root"):
        op(tokens[:, :0], parents[:, :0], p[:, :0], None, None, True)
    with pytest.raises(ValueError, match="uniforms"):
        verify_tree_reference(tokens, parents, p, q, None, False)


@needs_ext
def test_opcheck_and_compile():
    g = torch.Generator().manual_seed(3)
    tokens, parents, p, q, u = sampling_inputs(2, 6, 20, g)
    for greedy in (True, False):
        torch.library.opcheck(torch.ops.tabed_engine.verify_tree.default, (tokens, parents, p, q, u, greedy),
                              test_utils=("test_schema", "test_faketensor"))

    @torch.compile(backend="aot_eager", fullgraph=True)
    def f(tokens, parents, p, q, u):
        return op(tokens, parents, p, q, u, False)

    assert_same(f(tokens, parents, p, q, u), verify_tree_reference(tokens, parents, p, q, u, False), "compiled")


# ------------------------------------------------------------------------ losslessness

def _chi2_crit(df, z=4.75):
    """Wilson-Hilferty upper quantile of chi-square(df) at normal z (4.75: p ~ 1e-6)."""
    a = 2.0 / (9 * df)
    return df * (1 - a + z * math.sqrt(a)) ** 3


def _chi2(counts, probs):
    n = counts.sum()
    exp = probs.double() * n
    keep = exp > 0
    assert counts[~keep].sum() == 0, "token with zero target probability was emitted"
    return float(((counts[keep] - exp[keep]) ** 2 / exp[keep]).sum()), int(keep.sum()) - 1


def lossless_trial(impl, device, draft_q_for_verifier=None, B=200_000, V=6, seed=0):
    """Two-level tree per row, children drawn WITHOUT replacement from the draft:
    root -> 3 children (nodes 1..3) ~ q_root; child j -> 2 children ~ q2[token_j].
    Target: p_root at the root, p2[t] after token t, p3[t1, t2] after (t1, t2).
    Returns chi-square statistics (stat, df) of the first emitted token against p_root,
    and of the second emitted token after an accepted first token t, per t."""
    g = torch.Generator().manual_seed(seed)
    sharp = lambda *s: (lambda x: x / x.sum(-1, keepdim=True))(torch.rand(*s, generator=g) ** 2 + 0.02)  # noqa
    p_root, q_root = sharp(V), sharp(V)
    p2, q2, p3 = sharp(V, V), sharp(V, V), sharp(V, V, V)
    kids = torch.multinomial(q_root.expand(B, V), 3, replacement=False, generator=g)          # [B, 3]
    grand = torch.multinomial(q2[kids.reshape(-1)], 2, replacement=False, generator=g).reshape(B, 6)
    N = 10
    tokens = torch.cat([torch.zeros(B, 1, dtype=torch.int64), kids, grand], 1)
    parents = torch.tensor([-1, 0, 0, 0, 1, 1, 2, 2, 3, 3]).expand(B, N).contiguous()
    kid_of_grand = kids.repeat_interleave(2, dim=1)                                           # [B, 6]
    p = torch.cat([p_root.expand(B, 1, V), p2[kids], p3[kid_of_grand, grand]], 1)
    q = torch.cat([q_root.expand(B, 1, V), q2[kids], torch.full((B, 6, V), 1.0 / V)], 1)
    if draft_q_for_verifier is not None:  # negative control: lie about the draft
        q[:, 0] = draft_q_for_verifier
    u = torch.rand(B, N + 1, generator=g)
    path, n_acc, nxt = impl(*(t.to(device) for t in (tokens, parents, p, q, u)), False)
    path, n_acc, nxt = path.cpu(), n_acc.cpu(), nxt.cpu()
    rows = torch.arange(B)
    first = torch.where(n_acc >= 1, tokens[rows, path[:, 1].clamp(min=0)], nxt)
    stats = [_chi2(torch.bincount(first, minlength=V).double(), p_root)]
    second = torch.where(n_acc >= 2, tokens[rows, path[:, 2].clamp(min=0)], nxt)
    for t in range(V):
        sel = (n_acc >= 1) & (first == t)
        if sel.sum() >= 2000:
            stats.append(_chi2(torch.bincount(second[sel], minlength=V).double(), p2[t]))
    return stats, float((n_acc >= 1).double().mean())


LOSSLESS_IMPLS = [pytest.param(verify_tree_reference, id="reference"),
                  pytest.param(op, id="cpu_kernel", marks=needs_ext)]


@pytest.mark.parametrize("impl", LOSSLESS_IMPLS)
def test_sampling_is_lossless(impl):
    stats, acc_rate = lossless_trial(impl, "cpu")
    assert 0.2 < acc_rate < 0.99  # both acceptance and rejection paths are exercised
    assert len(stats) >= 4
    for stat, df in stats:
        assert stat < _chi2_crit(df), (stat, df, stats)


def test_lossless_test_has_power():
    # With 200k samples a 2% shift of one token's probability gives chi2 ~ n d^2 / p
    # ~ 200000 * 0.02^2 / 0.3 ~ 270 >> the ~35 threshold. Check the statistic does blow
    # up on a non-lossless verifier: one told the wrong draft distribution.
    stats, _ = lossless_trial(verify_tree, "cpu", draft_q_for_verifier=torch.full((6,), 1 / 6))
    assert stats[0][0] > 10 * _chi2_crit(stats[0][1]), stats[0]


# ------------------------------------------------------------------------------ GPU

@pytest.mark.gpu
@needs_cuda_ext
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("B,N,V,seed", CASES + [(4, 64, 32064, 9)])
def test_cuda_greedy_matches_reference(B, N, V, seed, dtype):
    g = torch.Generator().manual_seed(seed)
    args = [t.cuda() for t in greedy_inputs(B, N, V, g, dtype)]
    want = verify_tree_reference(*args, None, None, True)
    poison_allocator("cuda")
    assert_same(op(*args, None, None, True), want, f"cuda greedy {dtype}")


@pytest.mark.gpu
@needs_cuda_ext
@pytest.mark.parametrize("B,N,V,seed", CASES + [(4, 64, 32064, 9), (512, 16, 1000, 10)])
def test_cuda_sampling_matches_reference(B, N, V, seed):
    g = torch.Generator().manual_seed(2000 + seed)
    tokens, parents, p, q, u = sampling_inputs(B, N, V, g)
    want = verify_tree_reference(tokens, parents, p, q, u, False)  # CPU reference
    poison_allocator("cuda")
    got = [t.cpu() for t in op(*(t.cuda() for t in (tokens, parents, p, q, u)), False)]
    # The block reductions sum in another order than the CPU; a row can only differ if a
    # uniform lands within ~1e-16 (relative) of an acceptance or CDF boundary, so
    # essentially never; allow 1% of rows to keep the test about bugs, not rounding.
    same = (got[0] == want[0]).all(1) & (got[1] == want[1]) & (got[2] == want[2])
    assert (~same).sum() <= B // 100, f"{int((~same).sum())} of {B} rows differ"
    assert ((got[0] == -1) | (got[0] >= 0)).all()


@pytest.mark.gpu
@needs_cuda_ext
def test_cuda_sampling_is_lossless():
    stats, _ = lossless_trial(op, "cuda")
    for stat, df in stats:
        assert stat < _chi2_crit(df), stats


@pytest.mark.gpu
@needs_cuda_ext
def test_cuda_greedy_row_layouts_nan_ties_deep_trees_and_graphs():
    """The CUDA greedy path: argmax of every node row first (16-byte loads when aligned,
    a scalar tail, a scalar path otherwise), then the walk on those argmaxes (staged in
    shared memory, or read from `path` itself for trees over 512 nodes)."""
    g = torch.Generator().manual_seed(21)
    # Unaligned rows (vocab padded by an odd count: no vector loads) and odd V (a tail).
    for V, pad, dtype in ((32064, 7, torch.bfloat16), (32064, 0, torch.bfloat16), (1003, 0, torch.float16),
                          (4097, 0, torch.float32), (515, 3, torch.float64)):
        tokens, parents, p = greedy_inputs(3, 17, V, g, dtype)
        p_dev = torch.cat([p, torch.randn(3, 17, pad).to(dtype)], -1)[..., :V] if pad else p
        want = verify_tree_reference(tokens, parents, p, None, None, True)
        poison_allocator("cuda")
        assert_same(op(tokens.cuda(), parents.cuda(), p_dev.cuda(), None, None, True), want, f"{V} {pad} {dtype}")
    # Ties far apart (other threads, other vectors) -> lowest index; NaN is the maximum,
    # the first NaN wins.
    V = 32064
    p = torch.zeros(2, 3, V, dtype=torch.bfloat16)
    p[:, :, [31000, 20000, 5000]] = 3.0
    p[1, :, [30000, 9001]] = float("nan")
    tokens = torch.tensor([[0, 5000, 5000], [0, 9001, 9001]])
    parents = torch.tensor([[-1, 0, 1], [-1, 0, 1]])
    want = verify_tree_reference(tokens, parents, p, None, None, True)
    assert want[1].tolist() == [2, 2] and want[2].tolist() == [5000, 9001]
    assert_same(op(tokens.cuda(), parents.cuda(), p.cuda(), None, None, True), want, "ties/nan")
    # Deep chains beyond the shared-memory staging: node i + 1 hangs under node i, so the
    # path entry written is the node whose argmax is read next.
    N, V = 700, 64
    p = torch.randn(2, N, V, generator=g)
    parents = (torch.arange(N) - 1).expand(2, N).contiguous()
    tokens = torch.cat([torch.zeros(2, 1, dtype=torch.int64), p[:, :-1].argmax(-1)], 1)
    tokens[1, 600] = (tokens[1, 600] + 1) % V  # the second request stops at depth 599
    want = verify_tree_reference(tokens, parents, p, None, None, True)
    assert want[1].tolist() == [N - 1, 599]
    assert_same(op(tokens.cuda(), parents.cuda(), p.cuda(), None, None, True), want, "deep chain")
    # CUDA-graph capture: both launches replay on the stream.
    tokens, parents, p = (t.cuda() for t in greedy_inputs(2, 16, 32064, g, torch.bfloat16))
    want = verify_tree_reference(tokens, parents, p, None, None, True)
    op(tokens, parents, p, None, None, True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = op(tokens, parents, p, None, None, True)
    graph.replay()
    assert_same(out, want, "graph")
