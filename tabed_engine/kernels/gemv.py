"""Matrix-vector products for decode: y = x @ W^T (+ bias) for one row of activations.

An AR decode step reads every weight byte once for one row, so each projection is a
matrix-vector product bound by HBM bandwidth. One program owns BLOCK_N output features and
streams their weight rows over K in [BLOCK_N, BLOCK_K] tiles (loads marked evict-first:
nothing reads them again this step) with an fp32 accumulator per tile element (CUDA-core
multiply-add) and one reduction over the tile after the loop; x stays in L1/L2. No split
over K, so no partials and no second launch: the N / BLOCK_N programs (1000-8000 at the 7B
shapes) fill every SM.

The input may be a gate/up pair, x = [gate | up] of width 2K: the kernel feeds
silu(gate) * up (fp32, rounded once to x's dtype like the fused pointwise kernel it
replaces) to the product, so the MLP's down projection needs no separate SiLU launch.

Block shapes from an H200 sweep (benchmarks/results/gemv.json: 5-21% faster than cuBLAS at the
Llama-7B decode shapes).

For 2-64 rows (verification: γ + 1 rows, a draft tree's nodes, a batch's chains) `gemv_rows`
runs the same weight stream through tensor cores: the rows padded to BLOCK_M = 16, 32 or 64 (the
next power of two) by masked loads (zeros), one [BLOCK_M, BLOCK_N] fp32 tile per program. At 64
rows the product does 64 FLOP a weight byte, under the tensor cores' ridge: still bound by the
weight read. bfloat16/float16 only (a float32 dot would round through TF32).

Both are programmatically dependent launches on sm_90 (`_common.pdl`): the one-row kernel
reads its first weight tile before it waits for the kernel producing x; the rows kernel waits
first (benchmarks/results/pdl_h100.json).
"""
import torch
import triton
import triton.language as tl

from ._common import counters as _counters, pdl, pdl_wait
from .silu_mul import silu_mul, silu_times

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _load_x(x_ptr, offs_k, k_ok, K, GATED: tl.constexpr, EVEN_K: tl.constexpr):
    """Activations at columns offs_k (any shape), fp32; silu(gate) * up when GATED."""
    if EVEN_K:
        x = tl.load(x_ptr + offs_k, eviction_policy="evict_last")
    else:
        x = tl.load(x_ptr + offs_k, mask=k_ok, other=0.0, eviction_policy="evict_last")
    if GATED:
        if EVEN_K:
            u = tl.load(x_ptr + K + offs_k, eviction_policy="evict_last")
        else:
            u = tl.load(x_ptr + K + offs_k, mask=k_ok, other=0.0, eviction_policy="evict_last")
        x = silu_times(x.to(tl.float32), u.to(tl.float32)).to(u.dtype)  # one rounding, like `silu_mul`
    return x.to(tl.float32)


@triton.jit
def _load_w(w_ptr, rows, stride_wn, offs_k, K, EVEN_K: tl.constexpr):
    """A [BLOCK_N, BLOCK_K] weight tile (zeros past K), streamed: evict-first."""
    if EVEN_K:
        return tl.load(w_ptr + rows[:, None] * stride_wn + offs_k[None, :], eviction_policy="evict_first")
    return tl.load(w_ptr + rows[:, None] * stride_wn + offs_k[None, :], mask=(offs_k < K)[None, :], other=0.0,
                   eviction_policy="evict_first")


@triton.jit
def _gemv_fma_kernel(x_ptr, w_ptr, b_ptr, y_ptr, N, K, stride_wn,
                     HAS_BIAS: tl.constexpr, GATED: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, STAGES: tl.constexpr, EVEN_K: tl.constexpr, PDL: tl.constexpr):
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    rows = tl.where(n_ok, offs_n, 0).to(tl.int64)  # clamped: the loop needs no row mask
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    k_first = 0
    if PDL:  # the first weight tile is read while the kernel producing x finishes
        offs_k = tl.arange(0, BLOCK_K)
        w = _load_w(w_ptr, rows, stride_wn, offs_k, K, EVEN_K)
        pdl_wait(PDL)
        acc += w.to(tl.float32) * _load_x(x_ptr, offs_k, offs_k < K, K, GATED, EVEN_K)[None, :]
        k_first = BLOCK_K
    for k0 in tl.range(k_first, K, BLOCK_K, num_stages=STAGES):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        w = _load_w(w_ptr, rows, stride_wn, offs_k, K, EVEN_K)
        x = _load_x(x_ptr, offs_k, offs_k < K, K, GATED, EVEN_K)
        acc += w.to(tl.float32) * x[None, :]
    y = tl.sum(acc, 1)
    if HAS_BIAS:
        y += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs_n, y.to(y_ptr.dtype.element_ty), mask=n_ok)


def _config(N: int, K: int):
    """(BLOCK_N, BLOCK_K, num_warps, stages) from the H200 sweep (benchmarks/results/gemv.json),
    the threshold from an H100 A/B inside the decoders (benchmarks/results/kernels_backed_out.md)."""
    return (8, 512, 4, 3) if N * K < (1 << 24) else (4, 1024, 4, 3)


def _checked(name, x, weight, bias, out, dtypes, dtypes_text, gated, glu=False):
    """Validate a launcher's arguments; returns (N, K, rows of x, the output tensor: N
    features, N / 2 with `glu`)."""
    if x.dtype not in dtypes or weight.dtype != x.dtype or (bias is not None and bias.dtype != x.dtype):
        raise TypeError(f"{name}: x, weight and bias must share one dtype, {dtypes_text}, got {x.dtype}, "
                        f"{weight.dtype}, {None if bias is None else bias.dtype}")
    if weight.dim() != 2 or weight.stride(1) != 1:
        raise ValueError(f"{name}: weight must be [N, K] with unit last stride, got {tuple(weight.shape)} "
                         f"strides {weight.stride()}")
    N, K = weight.shape
    if glu and N % 2:
        raise ValueError(f"{name}: glu needs a [gate; up] weight with an even N, got {N}")
    n_out = N // 2 if glu else N
    width = 2 * K if gated else K
    if x.dim() == 0 or x.shape[-1] != width:
        raise ValueError(f"{name}: x's last dim {x.shape[-1] if x.dim() else None} != "
                         f"{'2 * ' if gated else ''}weight's K = {K}")
    if bias is not None and (bias.shape != (N,) or bias.stride(0) != 1):
        raise ValueError(f"{name}: bias must be [{N}] contiguous, got {tuple(bias.shape)}")
    lead = x.shape[:-1]
    if out is not None and (out.shape != (*lead, n_out) or out.dtype != x.dtype or not out.is_contiguous()):
        raise ValueError(f"{name}: out must be a contiguous {x.dtype} tensor of shape {(*lead, n_out)}")
    y = out if out is not None else torch.empty(*lead, n_out, device=x.device, dtype=x.dtype)
    return N, K, x.numel() // max(width, 1), y


def gemv(x: torch.Tensor, weight: torch.Tensor, bias=None, *, gated: bool = False, out=None):
    """y = x @ weight^T (+ bias) for one row of activations.

    x [..., K] holding one row (or [..., 2K] = [gate | up] when `gated`: the product uses
    silu(gate) * up), weight [N, K] with unit last stride, bias [N] or None -> y [..., N] in
    x's dtype. One dtype for x, weight and bias (float16/bfloat16/float32).
    """
    N, K, rows, y = _checked("gemv", x, weight, bias, out, _FLOAT_DTYPES, "a float dtype", gated)
    if rows != 1:
        raise ValueError(f"gemv: one row of activations, got {rows} (shape {tuple(x.shape)})")
    width = 2 * K if gated else K
    x1 = x.reshape(width)
    if x1.stride(0) != 1:
        x1 = x1.contiguous()
    BN, BK, warps, stages = _config(N, K)
    use_pdl = pdl(x.device)
    b = bias if bias is not None else weight  # placeholder pointer, never read
    _gemv_fma_kernel[(triton.cdiv(N, BN),)](x1, weight, b, y, N, K, weight.stride(0), HAS_BIAS=bias is not None,
                                            GATED=gated, BLOCK_N=BN, BLOCK_K=BK, STAGES=stages,
                                            EVEN_K=K % BK == 0, PDL=use_pdl, num_warps=warps, launch_pdl=use_pdl)
    return y


@triton.jit
def _load_rows_x(x_ptr, offs_m, m_ok, stride_xm, offs_k, K, EVEN_K: tl.constexpr):
    """A [BLOCK_M, BLOCK_K] activation tile (zeros in padding rows and past K)."""
    ok = m_ok[:, None] if EVEN_K else m_ok[:, None] & (offs_k < K)[None, :]
    return tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=ok, other=0.0)


@triton.jit
def _dot_step(x, w, acc, DOT_FP32: tl.constexpr):
    if DOT_FP32:  # the CPU interpreter's bf16 tl.dot returns garbage; the same values in fp32
        return tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee",
                      out_dtype=tl.float32)
    return tl.dot(x, tl.trans(w), acc, out_dtype=tl.float32)


@triton.jit(do_not_specialize=["M", "M_TILES"])
def _gemv_dot_kernel(x_ptr, w_ptr, b_ptr, y_ptr, part_ptr, cnt_ptr, M, M_TILES, N, K, K_CHUNK, stride_xm, stride_wn,
                     stride_ym, HAS_BIAS: tl.constexpr, GLU: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr, EVEN_K: tl.constexpr,
                     SPLIT: tl.constexpr, DOT_FP32: tl.constexpr, PDL: tl.constexpr):
    # programs m_tile = 0 .. M_TILES - 1 of one weight tile are consecutive (they run together and
    # share its reads in L2); one row tile (M_TILES = 1) is the plain weight-stream kernel
    pid = tl.program_id(0) // M_TILES
    m_tile = tl.program_id(0) % M_TILES
    HALF: tl.constexpr = BLOCK_N // 2
    if GLU:  # weight = [gate; up] (N = 2I): this program's first half of rows gates, second half up
        t = tl.arange(0, BLOCK_N)
        offs_j = pid * HALF + t % HALF
        n_ok = offs_j < N // 2
        offs_n = tl.where(t < HALF, offs_j, N // 2 + offs_j)
    else:
        offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
    rows = tl.where(n_ok, offs_n, 0).to(tl.int64)  # clamped weight rows: no mask in the loop
    offs_m = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    if SPLIT:  # this program's K_CHUNK columns (a multiple of BLOCK_K)
        k_lo = tl.program_id(1) * K_CHUNK
        k_hi = tl.minimum(k_lo + K_CHUNK, K)
    else:      # the whole row from a constant 0, as the pipeliner saw it before splits existed
        k_lo = 0
        k_hi = K
    pdl_wait(PDL)  # before any load: an early weight tile was slower here
    for k0 in tl.range(k_lo, k_hi, BLOCK_K, num_stages=STAGES):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        w = _load_w(w_ptr, rows, stride_wn, offs_k, K, EVEN_K)
        x = _load_rows_x(x_ptr, offs_m, m_ok, stride_xm, offs_k, K, EVEN_K)
        acc = _dot_step(x, w, acc, DOT_FP32)
    if SPLIT:
        # fp32 partials [splits, BLOCK_M, N]; the last split of this N tile to arrive sums all of
        # them in split order (one launch, the same bits whichever program arrives last)
        splits = tl.num_programs(1)
        part = part_ptr + offs_m[:, None] * N + offs_n[None, :]
        tl.store(part + tl.program_id(1) * BLOCK_M * N, acc, mask=n_ok[None, :])
        tl.debug_barrier()  # every thread's partial stores precede the release below
        cnt = cnt_ptr + pid
        arrived = tl.atomic_add(cnt, 1, sem="acq_rel", scope="gpu")
        if arrived == splits - 1:
            acc = tl.load(part, mask=n_ok[None, :], other=0.0)
            for s in range(1, splits):
                acc += tl.load(part + s * BLOCK_M * N, mask=n_ok[None, :], other=0.0)
            _dot_epilogue(acc, b_ptr, y_ptr, offs_m, m_ok, offs_n, n_ok, N, stride_ym, pid,
                          HAS_BIAS, GLU, BLOCK_M, BLOCK_N)
            tl.store(cnt, 0)  # every split has arrived: ready for the next launch
    else:
        _dot_epilogue(acc, b_ptr, y_ptr, offs_m, m_ok, offs_n, n_ok, N, stride_ym, pid, HAS_BIAS, GLU, BLOCK_M, BLOCK_N)


@triton.jit
def _dot_epilogue(acc, b_ptr, y_ptr, offs_m, m_ok, offs_n, n_ok, N, stride_ym, pid,
                  HAS_BIAS: tl.constexpr, GLU: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Bias, the GLU gate, the store of a [BLOCK_M, BLOCK_N] fp32 product tile."""
    HALF: tl.constexpr = BLOCK_N // 2
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    if GLU:  # [BLOCK_M, BLOCK_N] = [gate | up] -> silu(gate) * up, [BLOCK_M, BLOCK_N / 2]
        gate, up = tl.split(tl.permute(tl.reshape(acc, [BLOCK_M, 2, HALF]), (0, 2, 1)))
        ty = y_ptr.dtype.element_ty  # gate and up rounded as the unfused path stores them, then one rounding
        h = silu_times(gate.to(ty).to(tl.float32), up.to(ty).to(tl.float32))
        offs_h = pid * HALF + tl.arange(0, HALF)
        tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_h[None, :], h.to(ty),
                 mask=m_ok[:, None] & (offs_h < N // 2)[None, :])
    else:
        tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=m_ok[:, None] & n_ok[None, :])


MAX_DOT_ROWS = 64
# The SiLU gate in the rows kernel's epilogue pays where launches dominate (the 68M draft's
# gate/up), larger matrices keep a second launch (H100 A/B, benchmarks/results/kernels_backed_out.md).
GLU_EPILOGUE_MAX = 1 << 23
_HALF_DTYPES = (torch.float16, torch.bfloat16)
# (N, K, BLOCK_M) -> (BLOCK_N, BLOCK_K, num_warps, stages[, splits]) measured per shape: the dict
# `python benchmarks/bench_gemv.py --sweep` prints (the LLaVA-1.5-7B target's projections on the
# H200, benchmarks/results/gemv_sweep_h200.json; the two split entries from
# benchmarks/results/gemv_sweep_split_h200.json, where splitting K won > 1%). Shapes not in it take
# `_dot_config`'s rules.
_DOT_CONFIGS: dict = {
    (4096, 4096, 16): (32, 256, 4, 5),
    (4096, 4096, 32): (32, 128, 4, 4, 2),
    (4096, 4096, 64): (32, 128, 4, 5),
    (4096, 11008, 16): (32, 256, 2, 5),
    (4096, 11008, 32): (64, 128, 8, 5, 2),
    (4096, 11008, 64): (32, 256, 4, 4),
    (12288, 4096, 16): (32, 128, 4, 4),
    (12288, 4096, 32): (64, 128, 2, 4),
    (12288, 4096, 64): (32, 128, 4, 3),
    (22016, 4096, 16): (64, 128, 4, 3),
    (22016, 4096, 32): (64, 128, 4, 3),
    (22016, 4096, 64): (64, 64, 4, 4),
    (32064, 4096, 16): (32, 128, 2, 2),
    (32064, 4096, 32): (64, 128, 2, 3),
    (32064, 4096, 64): (128, 128, 8, 4),
}


# Row-count-invariant products (`gemv_rows(..., invariant=True)`): every call tiles its rows by
# this many, whatever M, so a row's product is the same instruction sequence alone or among others.
# 64 (a warp group's wgmma tile): one row tile for an AR step of up to 64 requests, where 16-row
# tiles re-ran the weight stream per 16 rows on the slower mma.sync path
# (benchmarks/results/invariance_llava-1.5-7b.md)
INVARIANT_BLOCK_M = 64


def invariant_launch(N: int, K: int, dtype: torch.dtype):
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, stages) of the row-count-invariant product of an
    [N, K] weight: from the shape and dtype only, never from the number of rows, and never split
    over K (a row's sum runs over K in one order). float32 keeps two stages (4-byte tiles)."""
    BN, BK, warps, stages = _dot_config(N, K, INVARIANT_BLOCK_M)[:4]
    if dtype == torch.float32:
        stages = min(stages, 2)
    return INVARIANT_BLOCK_M, BN, BK, warps, stages


def dot_block_m(M: int) -> int:
    """The row tile for M rows: the next power of two, at least 16 (the tensor-core tile)."""
    return max(16, triton.next_power_of_2(M))


def dot_smem_bytes(block_m: int, config) -> int:
    """Shared memory the pipelined loop of `_gemv_dot_kernel` holds: STAGES buffers of an
    activation tile and a weight tile (2-byte elements)."""
    BN, BK, _, stages = config[:4]
    return stages * (block_m + BN) * BK * 2


def k_split(K: int, BK: int, splits: int):
    """(programs over K, columns each): `splits` chunks of K rounded up to whole BK tiles, as
    many as are non-empty."""
    chunk = triton.cdiv(triton.cdiv(K, max(1, splits)), BK) * BK
    return triton.cdiv(K, chunk), chunk


def _dot_config(N: int, K: int, block_m: int = 16):
    """(BLOCK_N, BLOCK_K, num_warps, stages) for the rows padded to block_m: the measured entry of
    `_DOT_CONFIGS`, else rules. 16 rows: H100 sweeps at 6 rows and inside the 4-row draft forward
    (benchmarks/results/gemv_h100.json, benchmarks/results/kernels_backed_out.md). 32 and 64 rows,
    until swept: the 16-row weight tiles, with a shorter BLOCK_K or fewer stages where the larger
    activation tile would take the pipeline past the 16-row configs' 96 KB of shared memory (two
    programs an SM); at 64 rows BLOCK_N of at least 32 (an activation tile read from L2 at most
    twice the weight tile) and 4 warps (a warp group: Hopper's wgmma)."""
    swept = _DOT_CONFIGS.get((N, K, block_m))
    if swept is not None:
        return swept
    small = N * K < (1 << 23)
    if block_m <= 16:
        if small and K >= 2048:
            return (16, 512, 2, 3)
        if small and N >= 4096:
            return (16, 128, 2, 4)
        return (64, 128, 4, 3) if N >= 16384 else (32, 256, 4, 4)
    if block_m <= 32:
        if small and K >= 2048:
            return (16, 256, 2, 4)
        if small and N >= 4096:
            return (16, 128, 2, 4)
        return (64, 128, 4, 3) if N >= 16384 else (32, 256, 4, 3)
    if small and K >= 2048:
        return (32, 128, 4, 4)
    if small and N >= 4096:
        return (32, 128, 4, 3)
    return (64, 128, 4, 3) if N >= 16384 else (32, 128, 4, 4)


def _checked_config(config):
    """`config` as a (BLOCK_N, BLOCK_K, num_warps, stages, splits) tuple of ints (splits 1 when
    given four), or ValueError."""
    try:
        values = tuple(int(v) for v in config)
    except (TypeError, ValueError):
        values = ()
    if len(values) not in (4, 5):
        raise ValueError(f"gemv_rows: config must be (BLOCK_N, BLOCK_K, num_warps, stages[, splits]), "
                         f"got {config!r}")
    BN, BK, warps, stages, splits = values + (1,) * (5 - len(values))
    pow2 = lambda v: v > 0 and v & (v - 1) == 0  # noqa: E731
    if not (pow2(BN) and BN >= 16 and pow2(BK) and BK >= 16):  # tensor-core tiles; glu's halves even
        raise ValueError(f"gemv_rows: BLOCK_N and BLOCK_K must be powers of two >= 16, got {BN}, {BK}")
    if warps not in (1, 2, 4, 8, 16) or stages < 1 or splits < 1:
        raise ValueError(f"gemv_rows: num_warps must be 1, 2, 4, 8 or 16, stages and splits >= 1, got {warps}, "
                         f"{stages}, {splits}")
    return BN, BK, warps, stages, splits


def gemv_rows(x: torch.Tensor, weight: torch.Tensor, bias=None, *, glu: bool = False, out=None,
              glu_epilogue: bool | None = None, config=None, invariant: bool = False):
    """y = x @ weight^T (+ bias) for 1-64 rows of activations on tensor cores.

    x [..., K] with at most `MAX_DOT_ROWS` rows in all, weight [N, K] with unit last stride,
    bias [N] or None -> y [..., N] in x's dtype. float16/bfloat16, one dtype for all.
    `glu`: weight is the MLP's [gate; up] (N = 2I) and y [..., I] = silu(gate) * up of the
    product (gate and up rounded to x's dtype first, as `silu_mul` sees them stored): in the
    epilogue (`glu_epilogue`; default: matrices under `GLU_EPILOGUE_MAX` elements), else by a
    `silu_mul` launch after the product. Bit-identical either way.
    `config`: (BLOCK_N, BLOCK_K, num_warps, stages[, splits]) instead of `_dot_config`'s (a
    benchmark's sweep); powers of two >= 16 for the blocks. `splits` > 1 splits K over that many
    programs per BLOCK_N tile (more programs, and each one's activation tile re-read for fewer
    weight bytes), the last to finish summing the fp32 partials in split order (and applying the
    GLU gate: split launches always take it in the epilogue). Results do not depend on the
    config beyond the fp32 summation order, and not on timing.
    `invariant`: any number of rows, tiled by `INVARIANT_BLOCK_M` with `invariant_launch`'s
    config (`config` is refused), so each row's output has the same bits whatever M is;
    float32 too (exact fp32 products, no TF32).
    """
    if invariant:
        return _gemv_rows_invariant(x, weight, bias, glu, out, config)
    N, K, M, y = _checked("gemv_rows", x, weight, bias, out, _HALF_DTYPES, "float16 or bfloat16", False, glu)
    if not 1 <= M <= MAX_DOT_ROWS:
        raise ValueError(f"gemv_rows: 1 to {MAX_DOT_ROWS} rows of activations, got {M} (shape {tuple(x.shape)})")
    block_m = dot_block_m(M)
    cfg = _dot_config(N, K, block_m) if config is None else _checked_config(config)
    BN, BK, warps, stages, splits = (*cfg, 1)[:5]     # a four-value config does not split
    splits, chunk = k_split(K, BK, splits)
    if glu_epilogue is None:
        glu_epilogue = N * K < GLU_EPILOGUE_MAX or splits > 1
    if glu and not glu_epilogue:
        return silu_mul(gemv_rows(x, weight, bias, config=config), out=y)
    x2, b, use_pdl = _launch_inputs(x, weight, bias, M, K)
    tiles = triton.cdiv(N // 2, BN // 2) if glu else triton.cdiv(N, BN)
    if splits > 1:
        part = torch.empty(splits, block_m, N, device=x.device, dtype=torch.float32)
        cnt = _counters(x.device, tiles)
    else:
        part = cnt = y  # unused
    _gemv_dot_kernel[(tiles, splits)](x2, weight, b, y, part, cnt, M, 1, N, K, chunk, x2.stride(0), weight.stride(0),
                                      y.shape[-1], HAS_BIAS=bias is not None, GLU=glu, BLOCK_M=block_m, BLOCK_N=BN,
                                      BLOCK_K=BK, STAGES=stages, EVEN_K=K % BK == 0, SPLIT=splits > 1,
                                      DOT_FP32=x.device.type != "cuda", PDL=use_pdl, num_warps=warps,
                                      launch_pdl=use_pdl)
    return y


def _launch_inputs(x, weight, bias, M: int, K: int):
    """(x as [M, K] with a unit last stride, the bias pointer or a never-read placeholder, PDL on)."""
    x2 = x.reshape(M, K)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    return x2, (bias if bias is not None else weight), pdl(x.device)


def _gemv_rows_invariant(x, weight, bias, glu, out, config):
    """`gemv_rows(..., invariant=True)`: M rows as M / INVARIANT_BLOCK_M row tiles of one launch
    config (`invariant_launch`); the GLU gate in the epilogue (the same bits as a `silu_mul`
    launch after the product, and no choice that could follow M)."""
    if config is not None:
        raise ValueError("gemv_rows: invariant products take no config (theirs depends on the shape only)")
    N, K, M, y = _checked("gemv_rows", x, weight, bias, out, _FLOAT_DTYPES, "a float dtype", False, glu)
    if M == 0:
        return y
    block_m, BN, BK, warps, stages = invariant_launch(N, K, x.dtype)
    x2, b, use_pdl = _launch_inputs(x, weight, bias, M, K)
    tiles = triton.cdiv(N // 2, BN // 2) if glu else triton.cdiv(N, BN)
    m_tiles = triton.cdiv(M, block_m)
    _gemv_dot_kernel[(tiles * m_tiles, 1)](x2, weight, b, y, y, y, M, m_tiles, N, K, K, x2.stride(0),
                                           weight.stride(0), y.shape[-1], HAS_BIAS=bias is not None, GLU=glu,
                                           BLOCK_M=block_m, BLOCK_N=BN, BLOCK_K=BK, STAGES=stages,
                                           EVEN_K=K % BK == 0, SPLIT=False,
                                           DOT_FP32=x.device.type != "cuda" or x.dtype == torch.float32,
                                           PDL=use_pdl, num_warps=warps, launch_pdl=use_pdl)
    return y
