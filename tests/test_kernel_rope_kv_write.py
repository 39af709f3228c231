"""rope_kv_write: Triton kernel (interpreter on CPU) against the PyTorch reference.

The kernel must reproduce the reference bit for bit: same fp32 products and sum, no FMA
contraction. One exception on the CPU: the Triton interpreter casts fp32 -> bf16 by
truncation where the GPU rounds to nearest even, so there a bf16 value may be the truncated
neighbour of the reference's (never anything else); on CUDA every dtype must be exact.

The cache is layer 1 of a NaN-filled [L, 2, Rc, S, Hkv, D] buffer viewed [.., Hkv, S, D]
(non-trivial strides), handed to the kernel and the reference as a paged pool with a shuffled
block table (`paging.to_pages`, pages of PAGE slots) and read back after the call; the q output
(and k_out/v_out) are NaN-filled, so unwritten outputs and writes to the wrong slot, page, row,
head or layer are caught: after the call, every element of the buffer outside the T new slots
of each written row, and every page no row holds, must still be NaN.
"""
import json
import types

import pytest
import torch

from paging import from_pages, to_pages
from tabed_engine.kernels import rope_kv_write as _k
from tabed_engine.models.layers import rope_tables
from tabed_engine.ops.rope_kv_write import rope_kv_write, rope_kv_write_reference, rope_reference


def make_case(R, T, H, KV, D, dtype, device, *, seed=0, S=None, lengths=None, strided_qkv=False, cache_rows=None):
    gen = torch.Generator().manual_seed(seed)
    S = S or 37 + T  # not a multiple of anything
    if lengths is None:
        lengths = torch.randint(0, S - T + 1, (R,), generator=gen)
        lengths[0] = 0
        if R > 1:
            lengths[1] = S - T  # the new tokens end on the last slot
    lengths = torch.as_tensor(lengths, dtype=torch.int32)
    # RoPE positions differ from cache slots (a text-only view's positions are shifted)
    positions = lengths.long()[:, None] + torch.arange(T) + torch.randint(0, 300, (R, 1), generator=gen)
    cfg = types.SimpleNamespace(head_dim=D, rope_theta=10000.0, rope_scaling_factor=1.0)
    cos_t, sin_t = rope_tables(cfg, int(positions.max()) + 1, "cpu")
    cos, sin = cos_t[positions][:, :, None, :], sin_t[positions][:, :, None, :]  # [R, T, 1, D]
    width = (H + 2 * KV) * D
    qkv = (torch.randn(R, T + 2 * strided_qkv, width, generator=gen) * 3).to(device=device, dtype=dtype)
    if strided_qkv:  # a [R, T, width] slice of a longer buffer: strides (T + 2) width, width, 1
        qkv = qkv[:, 1:T + 1]
    buf = torch.full((2, 2, cache_rows or R, S, KV, D), float("nan"))
    return dict(qkv=qkv, cos=cos.to(device), sin=sin.to(device),
                buf=buf.to(device=device, dtype=dtype), lengths=lengths.to(device), H=H, KV=KV)


def caches(buf):
    view = buf.transpose(-3, -2)  # [L, 2, R, KV, S, D]
    return view[1, 0], view[1, 1]


PAGE = 16   # small pages: rows of a few dozen slots span several


def paged(fn, k_cache, v_cache):
    """fn(k_pool, v_pool, block_table) over the caches laid out as shuffled pages; the pages are
    read back into the caches, and pages no row holds must still be NaN."""
    kp, vp, table = to_pages(k_cache, v_cache, page=PAGE, seed=k_cache.shape[0] * 31 + k_cache.shape[2])
    res = fn(kp, vp, table)
    S = k_cache.shape[2]
    k_cache.copy_(from_pages(kp, table, S))
    v_cache.copy_(from_pages(vp, table, S))
    held = torch.zeros(kp.shape[0], dtype=torch.bool, device=kp.device)
    held[table.flatten().long()] = True
    assert kp[~held].isnan().all() and vp[~held].isnan().all(), "wrote into a page no row holds"
    return res


def take_new(cache, lengths, T, rows=None):
    """The T new slots of each input row r: cache[rows[r], :, lengths[r] + t] -> [R, T, KV, D]
    (rows[r] = r by default)."""
    rows = torch.arange(len(lengths), device=cache.device) if rows is None else rows.to(cache.device).long()
    slots = lengths.long()[:, None] + torch.arange(T, device=cache.device)
    return cache[rows[:, None], :, slots]


def assert_rope_equal(out, ref, x, cos, sin, what):
    """out == ref exactly, except that off CUDA a bf16 value may be the truncation of the
    fp32 result where the reference rounded it to nearest even."""
    assert not out.isnan().any(), f"{what}: NaN left (unwritten)"
    if torch.equal(out, ref):
        return
    assert out.dtype == torch.bfloat16 and not out.is_cuda, \
        f"{what}: {(out != ref).sum().item()} of {out.numel()} elements differ from the reference"
    ref32 = rope_reference(x.float(), cos, sin) if x is not None else ref.float()
    trunc = (ref32.view(torch.int32) & -65536).view(torch.float32).to(torch.bfloat16)
    bad = (out != ref) & (out != trunc)
    assert not bad.any(), f"{what}: {bad.sum().item()} elements neither rounded nor truncated fp32 results"


def run_and_check(case, call, *, rows=None, kv_out=False, q_heads_major=False):
    """Run `call(qkv, cos, sin, k_cache, v_cache, lengths, H, KV, out, **kw)` against the
    reference. rows: the cache row of each input row (passed as rows=); kv_out: pass NaN-filled
    k_out/v_out [R, Hkv, T, D] and check them; q_heads_major: q goes to `out` given as the
    [R, T, H, D] view of a contiguous [R, H, T, D] buffer (SDPA's layout)."""
    qkv, cos, sin, buf, lengths, H, KV = (case[n] for n in ("qkv", "cos", "sin", "buf", "lengths", "H", "KV"))
    R, T, _ = qkv.shape
    D = buf.shape[-1]
    nan = dict(device=qkv.device, dtype=qkv.dtype)
    kw = {} if rows is None else dict(rows=rows)
    if kv_out:
        kw.update(k_out=torch.full((R, KV, T, D), float("nan"), **nan),
                  v_out=torch.full((R, KV, T, D), float("nan"), **nan))
    ref_buf = buf.clone()
    q_ref = paged(lambda k, v, t: rope_kv_write_reference(qkv, cos, sin, k, v, t, lengths, H, KV, rows=rows),
                  *caches(ref_buf))

    k_cache, v_cache = caches(buf)
    if q_heads_major:
        out = torch.full((R, H, T, D), float("nan"), **nan).transpose(1, 2)
    else:
        out = torch.full((R, T, H, D), float("nan"), **nan)
    assert call(qkv, cos, sin, k_cache, v_cache, lengths, H, KV, out, **kw) is out

    x = qkv.reshape(R, T, H + 2 * KV, D)
    c4, s4 = cos.reshape(R, T, 1, D), sin.reshape(R, T, 1, D)
    assert_rope_equal(out, q_ref, x[:, :, :H], c4, s4, "q")
    k_ref, v_ref = caches(ref_buf)
    k_new = take_new(k_ref, lengths, T, rows)
    assert_rope_equal(take_new(k_cache, lengths, T, rows), k_new, x[:, :, H:H + KV], c4, s4, "k")
    assert torch.equal(take_new(v_cache, lengths, T, rows), x[:, :, H + KV:]), "v not copied exactly"
    if kv_out:  # the same k as the cache's (both checked against the reference), v as is
        assert_rope_equal(kw["k_out"], k_new.transpose(1, 2), x[:, :, H:H + KV].transpose(1, 2),
                          c4.transpose(1, 2), s4.transpose(1, 2), "k_out")
        assert torch.equal(kw["k_out"], take_new(k_cache, lengths, T, rows).transpose(1, 2)), "k_out != cache"
        assert torch.equal(kw["v_out"], x[:, :, H + KV:].transpose(1, 2)), "v_out not copied exactly"
    # nothing outside the new slots was touched (other layer, other slots, other rows)
    crow = torch.arange(R) if rows is None else rows.long()
    for cache in (k_cache, v_cache):
        cache[crow.to(qkv.device)[:, None], :, lengths.long()[:, None] + torch.arange(T, device=qkv.device)] = \
            float("nan")
    assert buf.isnan().all(), "wrote outside the new tokens' cache slots"
    return out


def launcher(qkv, cos, sin, k_cache, v_cache, lengths, H, KV, out, **kw):
    R, T, _ = qkv.shape
    D = k_cache.shape[-1]
    return paged(lambda k, v, t: _k.rope_kv_write(qkv, cos.reshape(R, T, D), sin.reshape(R, T, D), k, v, t,
                                                  lengths, H, KV, out=out, **kw), k_cache, v_cache)


def dispatcher(qkv, cos, sin, k_cache, v_cache, lengths, H, KV, out, **kw):
    return paged(lambda k, v, t: rope_kv_write(qkv, cos, sin, k, v, t, lengths, H, KV, out=out, **kw),
                 k_cache, v_cache)


HEADS = [(4, 4), (8, 2), (6, 1), (3, 3)]
CASES = [
    (R, T, H, KV, D, dtype)
    for i, ((H, KV), dtype) in enumerate(
        (hh, dt) for hh in HEADS for dt in (torch.bfloat16, torch.float16, torch.float32))
    for R, T, D in [((1, 3, 5, 2, 4)[i % 5], (1, 9, 6, 2, 5, 7)[i % 6], (12, 10, 16, 64, 14, 128)[i % 6])]
]


@pytest.mark.parametrize("R,T,H,KV,D,dtype", CASES)
def test_kernel_matches_reference(R, T, H, KV, D, dtype, kernel_device):
    case = make_case(R, T, H, KV, D, dtype, kernel_device, seed=R * 100 + T * 10 + D)
    run_and_check(case, launcher)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kernel_strided_qkv_and_ragged_rows(dtype, kernel_device):
    # qkv with a row stride past its width; lengths 0, S - T (last slot) and in between
    case = make_case(5, 4, 8, 4, 24, dtype, kernel_device, seed=7, strided_qkv=True, S=50,
                     lengths=[0, 46, 3, 17, 29])
    assert not case["qkv"].is_contiguous()
    run_and_check(case, launcher)


def test_kernel_prompt_chunk_past_64_tokens_over_a_prefix(kernel_device):
    # a chunked prefill's later chunk: 65 tokens at slots lengths + t over a cached prefix
    # (lengths 45 and 100, the second ending on the last slot), past a 64-token tile
    case = make_case(2, 65, 2, 2, 16, torch.bfloat16, kernel_device, seed=65, S=165, lengths=[45, 100])
    run_and_check(case, launcher)


def test_kernel_full_cache_drops_overflow(kernel_device):
    # lengths[r] + t >= S (the table's W * PAGE slots): those writes are dropped, not spilled
    # into another page, row or head
    case = make_case(3, 5, 4, 2, 16, torch.float32, kernel_device, S=32, lengths=[30, 0, 28])
    qkv, cos, sin, buf, lengths = (case[n] for n in ("qkv", "cos", "sin", "buf", "lengths"))
    k_cache, v_cache = caches(buf)
    out = torch.full((3, 5, 4, 16), float("nan"), device=kernel_device)
    paged(lambda k, v, t: _k.rope_kv_write(qkv, cos[:, :, 0], sin[:, :, 0], k, v, t, lengths, 4, 2, out=out),
          k_cache, v_cache)
    assert not out.isnan().any()
    written = ~k_cache.isnan().all(-1)  # [R, KV, S]
    expect = torch.zeros(3, 2, 32, dtype=torch.bool)
    expect[0, :, 30:] = expect[1, :, :5] = expect[2, :, 28:] = True
    assert torch.equal(written.cpu(), expect)
    assert torch.equal(~v_cache.isnan().all(-1), written)
    assert buf[0].isnan().all()


def test_kernel_row_outside_cache_drops_writes(kernel_device):
    # rows[r] outside [0, Rc) cannot be checked without a host sync: the writes are dropped
    # rather than spilled past the cache; q is still written
    case = make_case(2, 3, 4, 2, 16, torch.float32, kernel_device, S=20, lengths=[0, 4], cache_rows=3)
    qkv, cos, sin, buf, lengths = (case[n] for n in ("qkv", "cos", "sin", "buf", "lengths"))
    out = torch.full((2, 3, 4, 16), float("nan"), device=kernel_device)
    rows = torch.tensor([3, -1], device=kernel_device)
    paged(lambda k, v, t: _k.rope_kv_write(qkv, cos[:, :, 0], sin[:, :, 0], k, v, t, lengths, 4, 2, out=out,
                                           rows=rows), *caches(buf))
    assert not out.isnan().any()
    assert buf.isnan().all()


@pytest.mark.parametrize("rows_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kernel_rows_permuted(rows_dtype, dtype, kernel_device):
    # input row r writes cache row rows[r] (a permutation), at its own ragged slots
    case = make_case(4, 5, 6, 2, 14, dtype, kernel_device, seed=21, S=29, lengths=[3, 24, 0, 11])
    rows = torch.tensor([2, 0, 3, 1], dtype=rows_dtype, device=kernel_device)
    run_and_check(case, launcher, rows=rows)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_kernel_one_row_into_row_3_of_5(dtype, kernel_device):
    # the fresh prefill's call: one row from slot 0 into cache row 3 of 5 (the others stay
    # NaN), q into SDPA's [R, H, T, D] layout, and dense k/v for attention
    case = make_case(1, 23, 8, 4, 16, dtype, kernel_device, seed=22, S=41, lengths=[0], cache_rows=5)
    run_and_check(case, launcher, rows=torch.tensor([3], device=kernel_device), kv_out=True,
                  q_heads_major=True)


@pytest.mark.parametrize("R,T,H,KV,D,dtype", [(3, 7, 4, 4, 12, torch.float16), (2, 9, 8, 2, 64, torch.bfloat16),
                                              (1, 261, 16, 16, 128, torch.bfloat16)])
def test_kernel_kv_out_and_heads_major_q(R, T, H, KV, D, dtype, kernel_device):
    # ragged rows; the last case is a prefill-sized call (R * T > 256: the larger head tile)
    case = make_case(R, T, H, KV, D, dtype, kernel_device, seed=R + T + D)
    run_and_check(case, launcher, kv_out=True, q_heads_major=True)


def test_block_heads_plan():
    # decode-sized calls: ~1024-element tiles; prefills (R * T > 256): ~2048; always dividing H and Hkv
    assert _k._block_heads(32, 32, 64, 6) == 8
    assert _k._block_heads(32, 32, 64, 616) == 16
    assert _k._block_heads(32, 8, 64, 1800) == 8
    assert _k._block_heads(6, 2, 8, 1000) == 2
    assert _k._block_heads(40, 40, 64, 1000) == 8


def test_dispatch_on_cpu_is_reference():
    case = make_case(2, 3, 4, 2, 12, torch.float32, "cpu", seed=3)
    q = run_and_check(case, dispatcher)
    qkv = case["qkv"]
    # default output: a fresh contiguous [R, T, H, D]
    fresh = paged(lambda k, v, t: rope_kv_write(qkv, case["cos"], case["sin"], k, v, t, case["lengths"], 4, 2),
                  *caches(case["buf"].clone()))
    assert fresh.is_contiguous() and torch.equal(fresh, q)
    # rows, k_out/v_out and a heads-major q through the reference
    case = make_case(1, 6, 4, 2, 12, torch.float32, "cpu", seed=4, lengths=[0], cache_rows=3)
    run_and_check(case, dispatcher, rows=torch.tensor([1]), kv_out=True, q_heads_major=True)


def test_rope_reference_matches_transformers_and_float64():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    case = make_case(3, 7, 4, 4, 128, torch.float32, "cpu", seed=11)
    x = case["qkv"].view(3, 7, 12, 128)[:, :, :4]
    cos, sin = case["cos"], case["sin"]
    hf, _ = apply_rotary_pos_emb(x, x, cos[:, :, 0], sin[:, :, 0], unsqueeze_dim=2)
    assert torch.equal(rope_reference(x, cos, sin), hf)  # HF's own fp32 formula, bit for bit
    # rotation of each (d, d + D/2) pair by its angle, in float64
    x1, x2 = x.double().chunk(2, -1)
    c, s = cos.double()[..., :64], sin.double()[..., :64]
    rotated = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), -1)
    torch.testing.assert_close(rope_reference(x, cos, sin).double(), rotated, atol=1e-5, rtol=1e-6)
    # low precision: rotated in fp32, rounded once
    xb = x.bfloat16()
    assert torch.equal(rope_reference(xb, cos, sin), rope_reference(xb.float(), cos, sin).bfloat16())


def test_launcher_rejects_bad_input():
    case = make_case(2, 3, 4, 2, 16, torch.float32, "cpu")
    qkv, buf, lengths = case["qkv"], case["buf"], case["lengths"]
    cos, sin = case["cos"][:, :, 0], case["sin"][:, :, 0]
    k, v, table = to_pages(*caches(buf), page=PAGE)
    with pytest.raises(ValueError, match="int32"):
        _k.rope_kv_write(qkv, cos, sin, k, v, table, lengths.long(), 4, 2)
    with pytest.raises(ValueError, match="block_table"):
        _k.rope_kv_write(qkv, cos, sin, k, v, table.long(), lengths, 4, 2)
    with pytest.raises(ValueError, match="multiple"):
        _k.rope_kv_write(qkv, cos, sin, k, v, table, lengths, 3, 2)
    with pytest.raises(ValueError, match="does not match"):
        _k.rope_kv_write(qkv, cos, sin, k, v, table, lengths, 2, 2)
    with pytest.raises(TypeError, match="float32"):
        _k.rope_kv_write(qkv, cos.half(), sin, k, v, table, lengths, 4, 2)
    with pytest.raises(TypeError, match="dtypes differ"):
        _k.rope_kv_write(qkv, cos, sin, k.half(), v, table, lengths, 4, 2)
    with pytest.raises(ValueError, match="cos/sin"):
        _k.rope_kv_write(qkv, cos[:, :2], sin, k, v, table, lengths, 4, 2)
    with pytest.raises(ValueError, match="contiguous last"):
        _k.rope_kv_write(qkv, cos, sin, k.transpose(2, 3).contiguous().transpose(2, 3), v, table, lengths, 4, 2)
    R, T, KV, D = 2, 3, 2, 16
    kv_out = dict(k_out=torch.empty(R, KV, T, D), v_out=torch.empty(R, KV, T, D))
    with pytest.raises(ValueError, match="int32 or int64"):
        _k.rope_kv_write(qkv, cos, sin, k, v, table, lengths, 4, 2, rows=torch.tensor([0.0, 1.0]))
    with pytest.raises(ValueError, match="int32 or int64"):
        _k.rope_kv_write(qkv, cos, sin, k, v, table, lengths, 4, 2, rows=torch.tensor([0, 1, 0]))
    with pytest.raises(ValueError, match="one device"):
        _k.rope_kv_write(qkv, cos, sin, k, v, table, lengths, 4, 2, rows=torch.zeros(2, dtype=torch.long, device="meta"))
    with pytest.raises(ValueError, match="pass rows="):  # more cache rows than input rows
        _k.rope_kv_write(qkv, cos, sin, *to_pages(*caches(make_case(3, 3, 4, 2, 16, torch.float32, "cpu")["buf"]),
                                                   page=PAGE), lengths, 4, 2)
    with pytest.raises(ValueError, match="together"):
        _k.rope_kv_write(qkv, cos, sin, k, v, table, lengths, 4, 2, k_out=kv_out["k_out"])
    with pytest.raises(ValueError, match="k_out must be"):
        _k.rope_kv_write(qkv, cos, sin, k, v, table, lengths, 4, 2, **dict(kv_out, k_out=torch.empty(R, T, KV, D)))
    with pytest.raises(ValueError, match="v_out must be"):
        _k.rope_kv_write(qkv, cos, sin, k, v, table, lengths, 4, 2, **dict(kv_out, v_out=kv_out["v_out"].half()))
    with pytest.raises(ValueError, match="contiguous last"):
        _k.rope_kv_write(qkv, cos, sin, k, v, table, lengths, 4, 2,
                         **dict(kv_out, v_out=torch.empty(R, KV, D, T).transpose(2, 3)))
    with pytest.raises(ValueError, match="one device"):
        _k.rope_kv_write(qkv, cos, sin, k, v, table, lengths, 4, 2,
                         **dict(kv_out, k_out=torch.empty(R, KV, T, D, device="meta")))
    with pytest.raises(ValueError, match="out must be"):  # q in [R, H, T, D] itself, not its transposed view
        _k.rope_kv_write(qkv, cos, sin, k, v, table, lengths, 4, 2, out=torch.empty(R, 4, T, D))
    odd = make_case(1, 2, 2, 2, 9, torch.float32, "cpu")
    with pytest.raises(ValueError, match="odd"):
        _k.rope_kv_write(odd["qkv"], odd["cos"][:, :, 0], odd["sin"][:, :, 0], *to_pages(*caches(odd["buf"])),
                         odd["lengths"], 2, 2)


def test_benchmark_smoke(tmp_path, kernel_device):
    """benchmarks/bench_rope_kv_write.py --smoke (interpreter, tiny shapes): decode and prefill
    rows written, the fused call within a bf16 rounding of the eager chain (the interpreter
    truncates where the chain rounds), positive timings."""
    if kernel_device == "cuda":
        pytest.skip("--smoke runs the CPU interpreter")
    from bench_scripts import load_benchmark

    out = tmp_path / "rope_kv_write.json"
    load_benchmark("bench_rope_kv_write").main(["--smoke", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [(r["kind"], r["T"], r["Hkv"]) for r in rows] == [("decode", 1, 2), ("decode", 3, 2),
                                                            ("prefill", 20, 4), ("prefill", 20, 2)]
    for r in rows:
        assert r["max_abs_err_vs_eager"] < 0.1 and r["stream_us"]["fused"] > 0 and r["stream_us"]["eager"] > 0


# ---- GPU only: the LLaVA-1.5-7B decode shape, exact in every dtype ---------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("T,H,KV,lengths", [(1, 32, 32, [1999]), (6, 32, 32, [2041]), (6, 32, 32, [0]),
                                            (6, 32, 8, [777])])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_gpu_decode_shape(T, H, KV, lengths, dtype):
    case = make_case(1, T, H, KV, 128, dtype, "cuda", S=2047, lengths=lengths, seed=T)
    run_and_check(case, dispatcher)


@pytest.mark.gpu
def test_gpu_ragged_rows_and_padded_head_dims():
    run_and_check(make_case(5, 9, 32, 8, 128, torch.bfloat16, "cuda", S=2047, seed=5), dispatcher)
    run_and_check(make_case(3, 4, 6, 2, 80, torch.float16, "cuda", seed=6), dispatcher)
    run_and_check(make_case(4, 7, 6, 2, 10, torch.float32, "cuda", seed=8), dispatcher)


@pytest.mark.gpu
def test_gpu_cuda_graph_replay_reads_lengths_on_device():
    case = make_case(2, 6, 32, 32, 128, torch.bfloat16, "cuda", S=2048, lengths=[100, 5], seed=9)
    qkv, cos, sin, buf, lengths = (case[n] for n in ("qkv", "cos", "sin", "buf", "lengths"))
    k_pool, v_pool, table = to_pages(*caches(buf), page=64)
    out = torch.empty(2, 6, 32, 128, device="cuda", dtype=torch.bfloat16)
    rope_kv_write(qkv, cos, sin, k_pool, v_pool, table, lengths, 32, 32, out=out)  # compile outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        rope_kv_write(qkv, cos, sin, k_pool, v_pool, table, lengths, 32, 32, out=out)
    k_pool.fill_(float("nan"))
    v_pool.fill_(float("nan"))
    out.fill_(float("nan"))
    new_case = make_case(2, 6, 32, 32, 128, torch.bfloat16, "cuda", S=2048, lengths=[2042, 0], seed=10)
    for name in ("qkv", "cos", "sin", "lengths"):
        case[name].copy_(new_case[name])
    graph.replay()
    torch.cuda.synchronize()
    k_cache, v_cache = caches(buf)
    k_cache.copy_(from_pages(k_pool, table, 2048))
    v_cache.copy_(from_pages(v_pool, table, 2048))
    ref_buf = new_case["buf"]
    q_ref = paged(lambda k, v, t: rope_kv_write_reference(qkv, cos, sin, k, v, t, lengths, 32, 32), *caches(ref_buf))
    assert torch.equal(out, q_ref)
    assert torch.equal(buf.nan_to_num(7.0), ref_buf.nan_to_num(7.0))
