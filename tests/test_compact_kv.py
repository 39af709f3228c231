"""compact_kv: compiled kernels (CPU here, CUDA with -m gpu) against the PyTorch reference,
and the reference against a literal per-slot loop of the spec. The spec and the checks read
contiguous [L, R, H, S, D] caches; the ops run on them laid out as paged pools with a shuffled
block table (`paging.layer_pages`) and are read back, so an accepted path crossing a page
boundary moves between scattered pages."""
import pytest
import torch

from paging import layer_from_pages, layer_pages
from tabed_engine.ops import _ext
from tabed_engine.ops.compact_kv import compact_kv as _compact_kv, compact_kv_reference as _reference
from tabed_engine.ops.verify_tree import verify_tree_reference

needs_ext = pytest.mark.skipif(not _ext.HAS_CPU_KERNELS, reason=f"tabed_engine._C not built: {_ext.EXT_ERROR}")
needs_cuda_ext = pytest.mark.skipif(not _ext.HAS_CUDA_KERNELS, reason="tabed_engine._C built without CUDA")


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    n = torch.get_num_threads()  # see tests/test_verify_tree.py
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def raw_op(*args):
    torch.ops.tabed_engine.compact_kv(*args)


def paged(fn):
    """fn over contiguous caches: run on them as shuffled pages, the result read back."""
    def call(k, v, lengths, path, nacc):
        kp, vp, table = layer_pages(k.cpu(), v.cpu(), seed=int(lengths.sum()) % 97)
        kp, vp, table = kp.to(k.device), vp.to(k.device), table.to(k.device)
        held = torch.zeros(kp.shape[1], dtype=torch.bool, device=k.device)
        held[table.flatten().long()] = True
        spare = kp[:, ~held].clone()
        fn(kp, vp, table, lengths, path, nacc)
        assert torch.equal(bits(kp[:, ~held]), bits(spare)), "wrote into a page no row holds"
        k.copy_(layer_from_pages(kp, table, k.shape[3]))
        v.copy_(layer_from_pages(vp, table, v.shape[3]))
    return call


op, compact_kv_reference, compact_kv = paged(raw_op), paged(_reference), paged(_compact_kv)


def bits(x):
    """Bitwise view, so NaN sentinels compare equal to themselves."""
    return x.view({8: torch.int64, 4: torch.int32, 2: torch.int16}[x.element_size()])


def spec_loop(k, v, lengths, path, num_accepted):
    """The spec, one slot at a time, from a snapshot (gather semantics)."""
    k0, v0 = k.clone(), v.clone()
    S, N = k.shape[3], path.shape[1]
    for r in range(k.shape[1]):
        ln = int(lengths[r])
        for i in range(min(max(int(num_accepted[r]), 0), N - 1) + 1):
            src, dst = ln + int(path[r, i]), ln + i
            if ln < 0 or int(path[r, i]) < 0 or src >= S or dst >= S:
                continue
            k[:, r, :, dst] = k0[:, r, :, src]
            v[:, r, :, dst] = v0[:, r, :, src]


def make_case(L, R, H, S, D, N, dtype, g, adversarial=False):
    k = torch.randn(L, R, H, S, D, generator=g).to(dtype)
    v = torch.randn(L, R, H, S, D, generator=g).to(dtype)
    # sentinels: NaN in k and -7 in v at every tree slot, so a wrong move is visible
    lengths = torch.randint(0, S - N + 1, (R,), generator=g, dtype=torch.int32)
    for r in range(R):
        k[:, r, :, lengths[r] + N - 1] = float("nan")
        v[:, r, :, lengths[r]] = -7.0
    # paths as verify_tree produces them (random trees, partly accepted)
    parents = torch.arange(N).sub(1 + (torch.rand(R, N, generator=g) ** 2 * torch.arange(N)).long()).clamp(min=0)
    p = torch.randn(R, N, 5, generator=g)
    tokens = torch.where(torch.rand(R, N, generator=g) < 0.8, p.argmax(-1).gather(1, parents), 4)
    path, nacc, _ = verify_tree_reference(tokens, parents, p, None, None, True)
    if adversarial:  # spec corner cases: unsorted paths, holes, short/over-long lengths
        path = torch.stack([torch.cat([torch.zeros(1, dtype=torch.int64), torch.randperm(N - 1, generator=g) + 1])
                            for _ in range(R)])
        path[:, N // 2] = -1
        nacc = torch.randint(-1, N + 2, (R,), generator=g)
        lengths[0] = S - 2
        if R > 2:
            lengths[1] = -1
    return k, v, lengths, path, nacc


SHAPES = [  # L, R, H, S, D, N
    (1, 1, 1, 8, 4, 3), (2, 3, 2, 40, 13, 9), (3, 9, 4, 77, 64, 33), (1, 5, 3, 130, 128, 64), (2, 2, 1, 66, 7, 64),
]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("adversarial", [False, True])
def test_reference_matches_spec(shape, adversarial):
    g = torch.Generator().manual_seed(hash((shape, adversarial)) % 1000)
    k, v, lengths, path, nacc = make_case(*shape, torch.float32, g, adversarial)
    k1, v1, k2, v2 = k.clone(), v.clone(), k.clone(), v.clone()
    compact_kv_reference(k1, v1, lengths, path, nacc)
    spec_loop(k2, v2, lengths, path, nacc)
    assert torch.equal(bits(k1), bits(k2)) and torch.equal(bits(v1), bits(v2))
    if not adversarial:  # the case moves something iff an accepted entry is out of place
        moves = ((path != torch.arange(path.shape[1])) & (torch.arange(path.shape[1]) <= nacc[:, None])).any()
        assert torch.equal(bits(k1), bits(k)) != bool(moves)


def test_reference_overlap_example():
    # path [0, 2, 3]: slot len+2 is entry 1's source and entry 2's destination.
    k = torch.arange(10.0).reshape(1, 1, 1, 10, 1)
    v = -k
    compact_kv_reference(k, v, torch.tensor([4], dtype=torch.int32), torch.tensor([[0, 2, 3, -1]]),
                         torch.tensor([2]))
    assert k.flatten().tolist() == [0, 1, 2, 3, 4, 6, 7, 7, 8, 9]
    assert v.flatten().tolist() == [-0.0, -1, -2, -3, -4, -6, -7, -7, -8, -9]


@needs_ext
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("adversarial", [False, True])
def test_cpu_matches_reference(shape, dtype, adversarial):
    g = torch.Generator().manual_seed(hash((shape, adversarial)) % 1000 + 1)
    k, v, lengths, path, nacc = make_case(*shape, dtype, g, adversarial)
    k1, v1, k2, v2 = k.clone(), v.clone(), k.clone(), v.clone()
    compact_kv_reference(k1, v1, lengths, path, nacc)
    op(k2, v2, lengths, path, nacc)
    assert torch.equal(bits(k1), bits(k2)) and torch.equal(bits(v1), bits(v2))
    # lengths are not changed; the dispatcher takes the same path
    assert lengths.dtype == torch.int32
    k3, v3 = k.clone(), v.clone()
    compact_kv(k3, v3, lengths, path, nacc)
    assert torch.equal(bits(k3), bits(k1))


@needs_ext
def test_cpu_strided_caches():
    # k and v as slices of one [2, L, R, H, S, D] buffer with padded head_dim.
    g = torch.Generator().manual_seed(5)
    k, v, lengths, path, nacc = make_case(2, 3, 2, 50, 12, 9, torch.bfloat16, g)
    buf = torch.randn(2, 2, 3, 2, 50, 16).to(torch.bfloat16)
    buf[0, ..., :12], buf[1, ..., :12] = k, v
    ks, vs = buf[0, ..., :12], buf[1, ..., :12]
    assert not ks.is_contiguous()
    pad_before = buf[..., 12:].clone()
    compact_kv_reference(k, v, lengths, path, nacc)
    op(ks, vs, lengths, path, nacc)
    assert torch.equal(bits(ks), bits(k)) and torch.equal(bits(vs), bits(v))
    assert torch.equal(bits(buf[..., 12:]), bits(pad_before))  # padding untouched


@needs_ext
def test_cpu_errors_are_clear():
    g = torch.Generator().manual_seed(0)
    k, v, lengths, path, nacc = make_case(1, 2, 1, 10, 4, 3, torch.float32, g)
    k, v, table = layer_pages(k, v, page=5)
    with pytest.raises(RuntimeError, match="lengths must be int32"):
        raw_op(k, v, table, lengths.long(), path, nacc)
    with pytest.raises(RuntimeError, match="block_table must be int32"):
        raw_op(k, v, table.long(), lengths, path, nacc)
    with pytest.raises(RuntimeError, match="share one float dtype"):
        raw_op(k, v.half(), table, lengths, path, nacc)
    with pytest.raises(RuntimeError, match=r"must be a page pool \[L, P, Hkv, PAGE, D\]"):
        raw_op(k[0], v[0], table, lengths, path, nacc)
    with pytest.raises(RuntimeError, match="must not share memory"):
        raw_op(k, k, table, lengths, path, nacc)
    with pytest.raises(RuntimeError, match="head_dim axis"):
        raw_op(k.transpose(3, 4), v.transpose(3, 4), table, lengths, path, nacc)
    with pytest.raises(TypeError, match="int32"):
        _reference(k, v, table, lengths.long(), path, nacc)


@needs_ext
def test_opcheck_and_compile():
    g = torch.Generator().manual_seed(2)
    args = make_case(2, 3, 2, 20, 8, 5, torch.float32, g)
    k, v, lengths, path, nacc = args
    torch.library.opcheck(torch.ops.tabed_engine.compact_kv.default, (*layer_pages(k, v), lengths, path, nacc),
                          test_utils=("test_schema", "test_faketensor"))
    k1, v1 = k.clone(), v.clone()
    compact_kv_reference(k1, v1, lengths, path, nacc)

    @torch.compile(backend="aot_eager", fullgraph=True)
    def f(k, v, table, lengths, path, nacc):
        raw_op(k, v, table, lengths, path, nacc)
        return k.sum()

    kp, vp, table = layer_pages(k, v)
    f(kp, vp, table, lengths, path, nacc)
    k, v = layer_from_pages(kp, table, k.shape[3]), layer_from_pages(vp, table, v.shape[3])
    assert torch.equal(bits(k), bits(k1)) and torch.equal(bits(v), bits(v1))


# ------------------------------------------------------------------------------ GPU

@pytest.mark.gpu
@needs_cuda_ext
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", SHAPES + [(4, 4, 8, 512, 128, 64), (2, 3, 2, 300, 256, 160)])
@pytest.mark.parametrize("adversarial", [False, True])
def test_cuda_matches_reference(shape, dtype, adversarial):
    g = torch.Generator().manual_seed(hash((shape, adversarial)) % 1000 + 2)
    k, v, lengths, path, nacc = make_case(*shape, dtype, g, adversarial)
    k1, v1 = k.clone(), v.clone()
    compact_kv_reference(k1, v1, lengths, path, nacc)
    kc, vc = k.cuda(), v.cuda()
    op(kc, vc, lengths.cuda(), path.cuda(), nacc.cuda())
    assert torch.equal(bits(kc.cpu()), bits(k1)) and torch.equal(bits(vc.cpu()), bits(v1))


@pytest.mark.gpu
@needs_cuda_ext
def test_cuda_odd_alignment():
    # head_dim 3 in fp16 (6-byte rows) forces the 2-byte copy unit.
    g = torch.Generator().manual_seed(9)
    k, v, lengths, path, nacc = make_case(2, 3, 2, 40, 3, 9, torch.float16, g, adversarial=True)
    k1, v1 = k.clone(), v.clone()
    compact_kv_reference(k1, v1, lengths, path, nacc)
    kc, vc = k.cuda(), v.cuda()
    op(kc, vc, lengths.cuda(), path.cuda(), nacc.cuda())
    assert torch.equal(bits(kc.cpu()), bits(k1)) and torch.equal(bits(vc.cpu()), bits(v1))
