"""gemv (one-row linear layers of AR decode): Triton kernel (interpreter on CPU) against F.linear in
float64, the engine's dispatch, and the decoder using it.

Tolerance: the kernel's error against a float64 product must be within twice the
reference's own error (F.linear in the same dtype) plus one rounding of the output.
Outputs are NaN-poisoned, shapes are not multiples of the block sizes.
"""
import pytest
import torch

from tabed_engine.kernels import gemv as _k
from tabed_engine.ops import gemv as ops

EPS_OF = {torch.float32: 2.0 ** -23, torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7}


def make_case(M, N, K, dtype, device, *, gated=False, bias=False, seed=0, lead=None):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(M, 2 * K if gated else K, generator=gen)
    w = torch.randn(N, K, generator=gen) / K ** 0.5
    b = torch.randn(N, generator=gen) if bias else None
    to = lambda t: None if t is None else t.to(device=device, dtype=dtype)  # noqa: E731
    x = to(x)
    if lead is not None:
        x = x.view(*lead, x.shape[-1])
    return x, to(w), to(b)


def check(y, x, w, b, gated):
    y = y.cpu()
    assert not y.isnan().any(), "NaN left (unwritten output)"
    xc, wc = x.cpu(), w.cpu()
    bc = None if b is None else b.cpu()
    a = ops.silu_mul_reference(xc) if gated else xc   # the kernel's rounded activations
    truth = torch.nn.functional.linear(a.double(), wc.double(), None if bc is None else bc.double())
    ref = ops.linear_reference(xc, wc, bc, gated=gated)
    ref_err = (ref.double() - truth).abs().max().item()
    err = (y.double() - truth).abs().max().item()
    slack = EPS_OF[x.dtype] * truth.abs().max().item()
    assert err <= 2 * ref_err + slack, f"max err {err:.3g} vs reference {ref_err:.3g} (slack {slack:.3g})"


def check_glu(y, x, w, b):
    """y = silu(gate) * up of x @ [gate; up]^T (+ b): against the product rounded to x's dtype
    and gated in float64 (what the unfused path computes)."""
    y = y.cpu()
    assert not y.isnan().any(), "NaN left (unwritten output)"
    xc, wc, bc = x.cpu(), w.cpu(), None if b is None else b.cpu()
    prod = torch.nn.functional.linear(xc.double(), wc.double(), None if bc is None else bc.double())
    gate, up = prod.to(x.dtype).double().chunk(2, dim=-1)
    truth = torch.nn.functional.silu(gate) * up
    ref_err = (ops.linear_reference(xc, wc, bc, glu=True).double() - truth).abs().max().item()
    err = (y.double() - truth).abs().max().item()
    # a gate/up value whose rounding differs (a product within an ulp of a tie) moves the
    # output by up to one ulp of silu(gate) * up's inputs: slack of a few output roundings
    slack = 4 * EPS_OF[x.dtype] * truth.abs().max().item()
    assert err <= 2 * ref_err + slack, f"max err {err:.3g} vs reference {ref_err:.3g} (slack {slack:.3g})"


CASES = [(N, K, dt) for (N, K) in [(37, 300), (1000, 517), (173, 1031), (96, 2048), (61, 77)]
         for dt in (torch.bfloat16, torch.float16, torch.float32)]


@pytest.mark.parametrize("N,K,dtype", CASES)
def test_kernel_matches_reference(N, K, dtype, kernel_device):
    M = 1
    for gated, bias in ((False, False), (False, True), (True, False)):
        x, w, b = make_case(M, N, K, dtype, kernel_device, gated=gated, bias=bias, seed=N + K)
        out = torch.full((M, N), float("nan"), device=kernel_device, dtype=dtype)
        y = _k.gemv(x, w, b, gated=gated, out=out)
        assert y is out
        check(y, x, w, b, gated)


def test_kernel_leading_dims_and_strided_row(kernel_device):
    # x [1, 1, K] as a column slice of a wider buffer; x [K] alone
    x, w, b = make_case(1, 50, 130, torch.float32, kernel_device, bias=True, seed=7)
    wide = torch.zeros(3, 200, device=kernel_device)
    wide[1, 33:163] = x[0]
    y = _k.gemv(wide[1:2, 33:163].view(1, 1, 130), w, b)
    assert y.shape == (1, 1, 50)
    check(y.reshape(1, 50), x, w, b, False)
    y1 = _k.gemv(x[0], w, b)
    assert y1.shape == (50,)
    check(y1[None], x, w, b, False)


def test_kernel_rejects_bad_input(kernel_device):
    x, w, _ = make_case(2, 40, 64, torch.float32, kernel_device)
    with pytest.raises(ValueError, match="last dim"):
        _k.gemv(x[:, :60], w)
    with pytest.raises(ValueError, match="2 \\* weight"):
        _k.gemv(x[:1], w, gated=True)
    with pytest.raises(ValueError, match="one row"):
        _k.gemv(torch.zeros(2, 128, device=kernel_device), w, gated=True)
    with pytest.raises(ValueError, match="one row"):
        _k.gemv(x, w)
    with pytest.raises(TypeError, match="dtype"):
        _k.gemv(x[:1].half(), w)
    with pytest.raises(ValueError, match="bias"):
        _k.gemv(x[:1], w, torch.zeros(39, device=kernel_device))
    with pytest.raises(ValueError, match="out"):
        _k.gemv(x[:1], w, out=torch.empty(1, 41, device=kernel_device))
    y = _k.gemv(x[:1], w)   # still usable
    check(y, x[:1], w, None, False)


# 1-16 rows in a 16-row tile, 17-32 in a 32-row one, 33-64 in a 64-row one
ROW_CASES = [(M, N, K, dt) for (M, N, K) in [(2, 37, 300), (6, 1000, 517), (16, 173, 1031), (5, 96, 2048),
                                              (9, 61, 77), (17, 37, 301), (31, 173, 1031), (33, 61, 77),
                                              (47, 999, 517), (64, 173, 2049)]
             for dt in (torch.bfloat16, torch.float16)]


@pytest.mark.parametrize("M,N,K,dtype", ROW_CASES)
def test_rows_kernel_matches_reference(M, N, K, dtype, kernel_device):
    for bias in (False, True):
        x, w, b = make_case(M, N, K, dtype, kernel_device, bias=bias, seed=M + N + K)
        out = torch.full((M, N), float("nan"), device=kernel_device, dtype=dtype)
        y = _k.gemv_rows(x, w, b, out=out)
        assert y is out
        check(y, x, w, b, False)


GLU_CASES = [(M, I, K, dt) for (M, I, K) in [(2, 37, 300), (6, 500, 517), (16, 87, 1031), (4, 1536, 768),
                                              (9, 61, 77), (17, 37, 301), (33, 87, 1031), (47, 61, 77),
                                              (64, 45, 2049)]
             for dt in (torch.bfloat16, torch.float16)]


@pytest.mark.parametrize("M,I,K,dtype", GLU_CASES)
def test_rows_kernel_glu_epilogue(M, I, K, dtype, kernel_device):
    # weight [gate; up] of [2I, K] -> silu(gate) * up of the product, against the product
    # rounded to dtype and gated in float64 (what the unfused path computes)
    x, w, b = make_case(M, 2 * I, K, dtype, kernel_device, bias=True, seed=M + I + K)
    for bias in (None, b):
        out = torch.full((M, I), float("nan"), device=kernel_device, dtype=dtype)
        y = _k.gemv_rows(x, w, bias, glu=True, out=out)
        assert y is out
        check_glu(y, x, w, bias)
    with pytest.raises(ValueError, match="even"):
        _k.gemv_rows(x, w[:-1], glu=True)
    with pytest.raises(ValueError, match="out"):
        _k.gemv_rows(x, w, glu=True, out=torch.empty(M, 2 * I, device=kernel_device, dtype=dtype))


def test_rows_kernel_glu_after_the_product(kernel_device):
    # the gate as a silu_mul launch after the product (matrices of GLU_EPILOGUE_MAX elements
    # and more): the same numbers as the epilogue
    M, I, K, dtype = 5, 45, 200, torch.bfloat16
    x, w, b = make_case(M, 2 * I, K, dtype, kernel_device, bias=True, seed=11)
    fused = _k.gemv_rows(x, w, b, glu=True)
    out = torch.full((M, I), float("nan"), device=kernel_device, dtype=dtype)
    y = _k.gemv_rows(x, w, b, glu=True, out=out, glu_epilogue=False)
    assert y is out
    check_glu(y, x, w, b)
    assert torch.equal(y, fused)
    with pytest.raises(ValueError, match="out"):
        _k.gemv_rows(x, w, glu=True, out=torch.empty(M, 2 * I, device=kernel_device, dtype=dtype))


def test_rows_kernel_leading_dims_strided_rows_and_errors(kernel_device):
    x, w, b = make_case(6, 50, 130, torch.bfloat16, kernel_device, bias=True, seed=3)
    wide = torch.zeros(6, 200, device=kernel_device, dtype=torch.bfloat16)
    wide[:, 33:163] = x
    y = _k.gemv_rows(wide[:, 33:163].view(2, 3, 130), w, b)   # row stride 200, leading dims kept
    assert y.shape == (2, 3, 50)
    check(y.reshape(6, 50), x, w, b, False)
    with pytest.raises(ValueError, match="1 to 64 rows"):
        _k.gemv_rows(torch.zeros(65, 130, device=kernel_device, dtype=torch.bfloat16), w)
    with pytest.raises(TypeError, match="float16 or bfloat16"):
        _k.gemv_rows(x.float(), w.float())
    with pytest.raises(ValueError, match="last dim"):
        _k.gemv_rows(x[:, :100], w)
    with pytest.raises(ValueError, match="out"):
        _k.gemv_rows(x, w, out=torch.empty(6, 49, device=kernel_device, dtype=torch.bfloat16))
    check(_k.gemv_rows(x, w, b), x, w, b, False)   # still usable


def test_rows_kernel_config_override(kernel_device):
    # config= replaces _dot_config's: the default given explicitly is the same launch, another
    # valid config only reorders the fp32 sums; malformed configs are refused before a launch
    for M, N, K in ((6, 90, 300), (40, 77, 201)):
        x, w, b = make_case(M, N, K, torch.bfloat16, kernel_device, bias=True, seed=M)
        default = _k._dot_config(N, K, _k.dot_block_m(M))
        y = _k.gemv_rows(x, w, b)
        assert torch.equal(_k.gemv_rows(x, w, b, config=default), y)
        assert torch.equal(_k.gemv_rows(x, w, b, config=list(default)), y)
        out = torch.full((M, N), float("nan"), device=kernel_device, dtype=torch.bfloat16)
        check(_k.gemv_rows(x, w, b, config=(16, 64, 2, 2), out=out), x, w, b, False)
        for glu_epilogue in (True, False):   # the gate in the epilogue and after the product
            out = torch.full((M, N // 2), float("nan"), device=kernel_device, dtype=torch.bfloat16)
            check_glu(_k.gemv_rows(x, w[:N // 2 * 2], glu=True, out=out, glu_epilogue=glu_epilogue,
                                   config=(32, 32, 4, 3)), x, w[:N // 2 * 2], None)
    for bad in ((24, 128, 4, 3), (8, 128, 4, 3), (32, 100, 4, 3), (32, 0, 4, 3), (32, 128, 3, 3),
                (32, 128, 4, 0), (32, 128, 4), (32, 128, 4, 3, 0), (32, 128, 4, 3, 2, 1), "fast", 32):
        with pytest.raises(ValueError, match="config|BLOCK_N|num_warps"):
            _k.gemv_rows(x, w, config=bad)


SPLIT_CASES = [(6, 90, 300, 64, 2), (17, 61, 1031, 128, 3), (40, 173, 517, 64, 5), (64, 96, 2049, 256, 4),
               (33, 37, 77, 32, 8)]


@pytest.mark.parametrize("M,N,K,BK,splits", SPLIT_CASES)
def test_rows_kernel_split_k(M, N, K, BK, splits, kernel_device):
    # K split over programs, the last to arrive summing the fp32 partials in split order: the
    # reference's numbers (bias, the GLU gate in the folding program), the same bits on every
    # call, the arrival counters left zero for the next launch
    from tabed_engine.kernels import _common

    assert _k.k_split(K, BK, splits)[0] > 1
    x, w, b = make_case(M, N, K, torch.bfloat16, kernel_device, bias=True, seed=M + K)
    for bias in (None, b):
        out = torch.full((M, N), float("nan"), device=kernel_device, dtype=torch.bfloat16)
        y = _k.gemv_rows(x, w, bias, out=out, config=(32, BK, 4, 2, splits))
        assert y is out
        check(y, x, w, bias, False)
        assert torch.equal(_k.gemv_rows(x, w, bias, config=(32, BK, 4, 2, splits)), y)
        wg = w[:N // 2 * 2]
        out = torch.full((M, N // 2), float("nan"), device=kernel_device, dtype=torch.bfloat16)
        check_glu(_k.gemv_rows(x, wg, None if bias is None else bias[:N // 2 * 2], glu=True, out=out,
                               config=(16, BK, 2, 3, splits)), x, wg, None if bias is None else bias[:N // 2 * 2])
    assert not _common.counters(x.device, 1).any()


def test_k_split():
    # chunks of whole BLOCK_K tiles, only the non-empty ones launched
    assert _k.k_split(4096, 128, 4) == (4, 1024)
    assert _k.k_split(11008, 256, 4) == (4, 2816)      # 43 tiles: 11 + 11 + 11 + 10
    assert _k.k_split(300, 64, 8) == (5, 64)           # 5 tiles of K cannot feed 8 programs
    assert _k.k_split(300, 64, 1) == (1, 320)
    assert _k.k_split(77, 32, 8) == (3, 32)


def test_rows_launch_plan():
    # the row tile: the next power of two of the rows, at least 16
    assert [_k.dot_block_m(M) for M in (1, 2, 16, 17, 31, 32, 33, 47, 64)] == [16, 16, 16, 32, 32, 32, 64, 64, 64]
    # the draft's 16-row configs are the rules measured inside its forward; the swept shapes
    # take the sweep's entry at every row tile
    assert [_k._dot_config(N, K, 16) for N, K in [(768, 3072), (6144, 768), (32064, 768), (12288, 768)]] == [
        (16, 512, 2, 3), (16, 128, 2, 4), (64, 128, 4, 3), (32, 256, 4, 4)]
    for (N, K, block_m), cfg in _k._DOT_CONFIGS.items():
        assert _k._dot_config(N, K, block_m) == cfg
    assert _k._dot_config(4096, 4096) == _k._dot_config(4096, 4096, 16)
    # every row tile at the 7B target's and the 68M draft's shapes: valid tiles, the pipeline
    # within the rules' 96 KB of shared memory (a swept entry: within an sm_90 block's 227 KB),
    # at most 32 fp32 accumulator values a thread
    for block_m in (16, 32, 64):
        for N, K in [(12288, 4096), (4096, 4096), (22016, 4096), (4096, 11008), (32064, 4096), (2304, 768),
                     (768, 768), (6144, 768), (768, 3072), (32064, 768), (37, 300)]:
            cfg = _k._dot_config(N, K, block_m)
            assert _k._checked_config(cfg)[:len(cfg)] == cfg
            smem = 227 << 10 if (N, K, block_m) in _k._DOT_CONFIGS else 96 << 10
            assert _k.dot_smem_bytes(block_m, cfg) <= smem, (N, K, block_m, cfg)
            assert block_m * cfg[0] <= 32 * 32 * cfg[2], (N, K, block_m, cfg)


def test_dispatch():
    x, w, b = make_case(3, 4096, 64, torch.bfloat16, "cpu", bias=True)
    assert ops.gemv_kind(x, w, b) is None                     # CPU: reference
    assert torch.equal(ops.linear(x, w, b), torch.nn.functional.linear(x, w, b))
    xg, _, _ = make_case(3, 4096, 64, torch.bfloat16, "cpu", gated=True)   # gated rows: reference
    assert torch.equal(ops.linear(xg, w, gated=True),
                       torch.nn.functional.linear(ops.silu_mul_reference(xg), w))
    assert torch.equal(ops.linear(x, w, glu=True), ops.silu_mul_reference(torch.nn.functional.linear(x, w)))
    with pytest.raises(ValueError, match="exclusive"):
        ops.linear(xg, w, gated=True, glu=True)
    meta = lambda *s, dt=torch.bfloat16: torch.empty(*s, device="meta", dtype=dt)  # noqa: E731
    # the rule, checked on shapes alone: few rows and wide outputs on CUDA only
    assert ops.gemv_kind(meta(1, 64), meta(4096, 64)) is None   # meta is not CUDA


@pytest.mark.gpu
def test_dispatch_gpu_rule():
    dev = "cuda"
    x1, w, _ = make_case(1, 4096, 2048, torch.bfloat16, dev)
    assert ops.gemv_kind(x1, w) == "row"
    x6 = torch.zeros(6, 2048, device=dev, dtype=torch.bfloat16)
    assert ops.gemv_kind(x6, w) == "rows"                                                 # verification
    for M in (17, 64):                                                     # a tree's nodes, a batch's chains
        assert ops.gemv_kind(torch.zeros(M, 2048, device=dev, dtype=torch.bfloat16), w) == "rows"
    assert ops.gemv_kind(torch.zeros(65, 2048, device=dev, dtype=torch.bfloat16), w) is None   # prefill: cuBLAS
    assert ops.gemv_kind(x6.float(), w.float()) is None                                   # fp32 rows: cuBLAS
    assert ops.gemv_kind(x1, w[:ops.MIN_FEATURES - 1]) is None                           # narrow: cuBLAS
    assert ops.gemv_kind(x1[:, :128], w[:, :128]) is None                                # short K: cuBLAS
    assert ops.gemv_kind(x1.float(), w) is None                                          # mixed dtypes
    for M in (1, 6, 40):   # gated through the dispatch: fused in the GEMV / the silu_mul kernel first
        xg, wg, _ = make_case(M, 4096, 2048, torch.bfloat16, dev, gated=True, seed=M)
        check(ops.linear(xg, wg, gated=True), xg, wg, None, True)
        # glu through the dispatch: the GEMV then silu_mul / the rows GEMV's epilogue
        xu, wu, _ = make_case(M, 4096, 2048, torch.bfloat16, dev, seed=M + 1)
        y = ops.linear(xu, wu, glu=True)
        ref = ops.silu_mul_reference(ops.linear(xu, wu))
        assert y.shape == (M, 2048) and (y.float() - ref.float()).abs().max().item() <= 0.02 * ref.abs().max().item()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kernel_real_shapes_gpu(dtype):
    # the Llama-7B projections (q/k/v, o, gate/up, down with the gate fused, lm_head)
    for N, K, gated in [(12288, 4096, False), (4096, 4096, False), (22016, 4096, False),
                        (4096, 11008, True), (32064, 4096, False)]:
        x, w, _ = make_case(1, N, K, dtype, "cuda", gated=gated, seed=N)
        out = torch.full((1, N), float("nan"), device="cuda", dtype=dtype)
        check(_k.gemv(x, w, gated=gated, out=out), x, w, None, gated)
        for M in ((6, 33, 64) if dtype == torch.bfloat16 else ()):
            # verification's rows (the gate applied before, as the MLP does): a chain, a tree, a batch
            x6, w6, _ = make_case(M, N, K, dtype, "cuda", gated=gated, seed=N + M)
            a6 = ops.silu_mul_reference(x6) if gated else x6
            out6 = torch.full((M, N), float("nan"), device="cuda", dtype=dtype)
            check(_k.gemv_rows(a6, w6, out=out6), a6, w6, None, False)
            if N == 22016:   # gate/up: the SiLU gate after the product, as verification's MLP runs it
                out6 = torch.full((M, N // 2), float("nan"), device="cuda", dtype=dtype)
                check_glu(_k.gemv_rows(x6, w6, glu=True, out=out6), x6, w6, None)
    if dtype == torch.bfloat16:   # the LLaVA-68M-shape draft's gate/up: a step over 2 or 4 views, or a batch's
        for M in (2, 4, 24, 48):
            x, w, _ = make_case(M, 6144, 768, dtype, "cuda", seed=M)
            out = torch.full((M, 3072), float("nan"), device="cuda", dtype=dtype)
            check_glu(_k.gemv_rows(x, w, glu=True, out=out), x, w, None)


def _smoke_run(tmp_path, kernel_device, *argv):
    """benchmarks/bench_gemv.py --smoke with argv (interpreter, tiny shapes): the JSON rows."""
    if kernel_device == "cuda":
        pytest.skip("--smoke runs the CPU interpreter")
    import json

    from bench_scripts import load_benchmark

    out = tmp_path / "gemv.json"
    load_benchmark("bench_gemv").main(["--smoke", *argv, "--out", str(out)])
    return json.loads(out.read_text())["rows"]


def test_benchmark_smoke(tmp_path, kernel_device):
    # the table at one row and at a 64-row tile: the kernels within a bf16 rounding of cuBLAS's path
    rows = _smoke_run(tmp_path, kernel_device, "--rows", "1", "40")
    assert [(r["name"], r["rows"]) for r in rows[:-1]] == [("small", 1), ("small_gated", 1), ("small", 40),
                                                          ("small_gated", 40), ("small_glu", 40)]
    for r in rows[:-1]:
        assert r["max_abs_err_vs_eager"] < 0.1 and r["stream_us"]["fused"] > 0 and r["stream_us"]["eager"] > 0


def test_benchmark_sweep_smoke(tmp_path, kernel_device):
    # --sweep: per shape the best config of the grid (or the default), within a bf16 rounding of
    # cuBLAS's path, next to positive baselines; the winners printed as `_DOT_CONFIGS` takes them
    import ast

    from bench_scripts import load_benchmark

    rows = _smoke_run(tmp_path, kernel_device, "--sweep", "--sweep-rows", "40")
    swept, configs = rows[:-1], rows[-1]
    assert [(r["name"], r["rows"], r["block_m"]) for r in swept] == [("small", 40, 64), ("small_glu", 40, 64)]
    bench = load_benchmark("bench_gemv")
    grid = bench.sweep_configs(64, bench.SMOKE_GRID, 227 << 10)
    for r in swept:
        assert tuple(r["best"]) in grid + [tuple(r["default"])] and r["best_us"] > 0
        assert r["max_abs_err_vs_cublas"] < 0.1 and not r["failed"]
        assert all(r["baseline_us"][k] > 0 for k in ("cublas", "rows16", "split16"))
    assert ast.literal_eval(configs["literal"]) == {(r["N"], r["K"], 64): tuple(r["best"]) for r in swept}


@pytest.mark.gpu
def test_split_k_on_two_streams_at_once_gpu():
    # split-K launches on two streams at the same time (the draft's view prefill beside the
    # target's prefill): each stream counts arrivals in its own workspace, so every launch
    # folds all its partials exactly once; with one shared workspace the two streams' programs
    # count in the same counters and outputs come out unwritten (NaN here) or wrong
    from tabed_engine.kernels import _common

    # few programs (2 column tiles x 8 K-splits) streaming a long K: the two streams' launches
    # run side by side for their whole length, their folds of tile 0 at the same time
    cfg = (32, 128, 4, 2, 8)
    cases = [make_case(2, 64, (1 << 19) + 37, torch.bfloat16, "cuda", seed=s) for s in (1, 2)]
    want = [_k.gemv_rows(x, w, config=cfg) for x, w, _ in cases]
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    assert streams[0].cuda_stream != streams[1].cuda_stream
    outs = [[torch.full_like(y, float("nan")) for _ in range(200)] for y in want]
    torch.cuda.synchronize()
    for i in range(200):                       # interleaved launches: the streams overlap
        for s, (x, w, _), out in zip(streams, cases, outs):
            with torch.cuda.stream(s):
                _k.gemv_rows(x, w, out=out[i], config=cfg)
    torch.cuda.synchronize()
    for y, out in zip(want, outs):
        bad = sum(not torch.equal(o, y) for o in out)
        assert bad == 0, f"{bad} of {len(out)} launches differ from the stream-alone result"
    with torch.cuda.stream(streams[0]):
        a = _common.counters(torch.device("cuda"), 1)
    with torch.cuda.stream(streams[1]):
        b = _common.counters(torch.device("cuda"), 1)
    assert a.data_ptr() != b.data_ptr() and not a.any() and not b.any()
