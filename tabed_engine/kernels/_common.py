"""Building blocks shared by the ensemble kernels (ensemble_mix, chain_verify,
window_divergence): the V split rule, fast exp2/log2, element-wise running reductions
and thread-owned groups.

Element-wise running reductions: a kernel that streams V in [R, BLOCK] tiles keeps one
accumulator per tile element (running max and sum-exp, or running best and the step that
found it) and reduces across the tile once, after the loop: no barrier in a loop.

`@triton.jit` helpers are inlined into the kernels that call them (constexpr arguments
pass through).
"""
import functools
import os

import torch
import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)
# Start of a running max: -FLT_MAX instead of -inf, so that (m - x) is never
# (-inf) - (-inf) = NaN when x is -inf (masked or a -inf logit): exp2 of it is just 0.
NEG_BIG = tl.constexpr(-3.4028234663852886e38)
BIG_IDX = tl.constexpr(2147483647)
# the kernels run under the CPU interpreter (TRITON_INTERPRET=1): numpy arrays, each value
# evaluated once
INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1")

# V split: each request's vocabulary is cut into chunks, one program per (request, chunk),
# so that a launch fills the device whatever B is (B = 1, V = 32064: 32 chunks of 1008). A
# chunk has at least _MIN_CHUNK columns (the per-program fixed cost stays small) and a row at
# most _MAX_SPLITS chunks (bounds the [splits] tiles of the combines).
_MIN_CHUNK = 1024
_MAX_SPLITS = 128
_INTERPRETER_SMS = 4  # CPU interpreter: programs run one after another


@functools.lru_cache(maxsize=None)
def _num_sms(index):
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device) -> int:
    """Streaming multiprocessors of `device` (host query, no sync); a small constant for the
    CPU interpreter. The launch plans take it as an argument."""
    device = torch.device(device)
    if device.type != "cuda":
        return _INTERPRETER_SMS
    return _num_sms(device.index if device.index is not None else torch.cuda.current_device())


# Programmatic dependent launch (PDL, sm_90+): a decode step is a chain of ~260 short
# kernels, each waiting for the one before it. A kernel launched with `launch_pdl=True`
# may be scheduled while its predecessor still runs; it calls `pdl_wait` (griddepcontrol:
# wait for the previous grid to finish and flush its writes) before it touches anything
# that kernel could write, and then lets its own successor be scheduled. What it reads
# before the wait must not be written by the launches it may overlap: only model weights
# (written once, at load) are read early. Results are unchanged: every read and write of
# dynamic data still happens after the predecessor completed and flushed.
_PDL = {}


def pdl(device) -> bool:
    """Whether launches on `device` use programmatic dependent launch: a CUDA device of
    compute capability 9.0 or newer, a Triton with the griddepcontrol ops, and
    `TABED_PDL` not set to 0 (the switch for A/B timing; results are the same either way)."""
    device = torch.device(device)
    if device.type != "cuda" or os.environ.get("TABED_PDL") == "0":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _PDL:
        cuda = getattr(getattr(tl, "extra", None), "cuda", None)
        _PDL[index] = (torch.cuda.get_device_capability(index)[0] >= 9
                       and hasattr(cuda, "gdc_wait") and hasattr(cuda, "gdc_launch_dependents"))
    return _PDL[index]


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """With PDL: wait until the previous kernel in the stream has finished and its writes are
    visible, then allow the next kernel to be scheduled (it waits the same way)."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


COUNTERS = {}   # (device, stream) -> int32 arrival counters, all zero between launches
_OUTGROWN = []  # earlier workspaces: CUDA graphs captured with them still count in them


def counters(device, n):
    """n zeroed int32 arrival counters of the current stream's workspace on `device`, for
    kernels whose last program to arrive combines the others' partials and resets its
    counter (every launch leaves them zero). Each stream has its own: launches on one
    stream run in order and may share counters, launches on two streams may run at once,
    and two kernels counting arrivals in one counter would each miss a program's partials
    or fold early (the draft's view prefill on a second stream beside the target's prefill
    does this). A graph counts in the workspace of the stream it was captured on, so graphs
    captured on one stream must not be replayed on two streams at once (`engine.graphs`
    replays a cache's graphs on one stream). Grown outside CUDA-graph capture only (a graph's
    warm-up call runs first, on the capture stream); an outgrown workspace is kept, never
    freed, for the graphs that captured its address. During a capture that needs more, the
    graph gets its own zeroed buffer (a captured memset)."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (device, stream)
    buf = COUNTERS.get(key)
    if buf is not None and buf.numel() >= n:
        return buf
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return torch.zeros(n, dtype=torch.int32, device=device)
    if buf is not None:
        _OUTGROWN.append(buf)
    COUNTERS[key] = buf = torch.zeros(max(n, 1024, 2 * (0 if buf is None else buf.numel())), dtype=torch.int32,
                                      device=device)
    return buf


def n_vsplit(rows, V, programs):
    """Chunks per row for a launch of about `programs` programs over `rows` rows."""
    want = triton.cdiv(programs, max(rows, 1))
    return max(1, min(triton.cdiv(V, _MIN_CHUNK), _MAX_SPLITS, want))


def chunking(V, S, align=16):
    """(S, chunk): `S` requested chunks of V, each a multiple of `align` (>= 16) columns
    but the last, all non-empty."""
    if S <= 1:
        return 1, V
    align = max(16, align)
    chunk = triton.cdiv(triton.cdiv(V, S), align) * align
    return triton.cdiv(V, chunk), chunk


ONE_STEP = 1024


def chunk_block(chunk, cap, one_step=ONE_STEP):
    """Columns per loop step over a V chunk: the whole chunk when it has at most `one_step`
    columns (B = 1 at V = 32064: chunks of 1008, one step), else the chunk's power of two
    capped at `cap`, at least 16."""
    n = triton.next_power_of_2(chunk)
    return n if chunk <= one_step else max(16, min(n, cap))


def tile_warps(elements, per_thread=16):
    """Warps for a tile of `elements`, about `per_thread` each (16: no spills with 2-3
    element-wise accumulators): a power of two from 4 to 16."""
    n = max(1, elements // (32 * per_thread))
    return max(4, min(16, 1 << (n.bit_length() - 1)))


@triton.jit
def _mufu(x, OP: tl.constexpr):
    """One special-function-unit instruction `OP` (e.g. "ex2.approx.ftz.f32") per element."""
    return tl.inline_asm_elementwise(OP + " $0, $1;", "=r,r", [x], dtype=tl.float32,
                                     is_pure=True, pack=1)


@triton.jit
def exp2(x, FAST: tl.constexpr):
    if FAST:  # one MUFU op, flushing subnormal results to 0 (tl.exp adds a fix-up)
        return _mufu(x, "ex2.approx.ftz.f32")
    else:
        return tl.math.exp2(x)


@triton.jit
def log2(x, FAST: tl.constexpr):
    if FAST:  # one MUFU op; tl.math.log2 is a libdevice polynomial
        return _mufu(x, "lg2.approx.ftz.f32")
    else:
        return tl.math.log2(x)


@triton.jit
def load_rows(rows_ptr, offs, row_mask, col_mask):
    """[R, BLOCK] fp32 tile of the rows `rows_ptr` ([R] pointers) at columns `offs`;
    -inf where masked."""
    x = tl.load(rows_ptr[:, None] + offs[None, :], mask=row_mask[:, None] & col_mask[None, :],
                other=float("-inf"))
    return x.to(tl.float32)


@triton.jit
def lse_reduce(m, s, scale, axis: tl.constexpr, FAST: tl.constexpr):
    """Reduce running (m, s) pairs over `axis`: (max, sum of exp2((x - max) * scale)).
    log2-sum-exp2 of x * scale is then max * scale + log2(sum)."""
    top = tl.max(m, axis=axis)
    return top, tl.sum(s * exp2((m - tl.expand_dims(top, axis)) * scale, FAST), axis=axis)


# Thread-owned groups: a streaming pass reads [R, RPT, NT, VEC] tiles per step, VEC
# contiguous columns (16 bytes) forming a group that one thread loads and reduces alone, NT
# slots (threads) per row, RPT groups per slot and step. Running values live per slot
# ([R, NT]): no step needs another thread's data, so the loop has no barrier. `slot_cols`
# lays a step out slot-major ([NT, RPT, VEC]) so that a slot's RPT groups stay in one thread.


@triton.jit
def group_cols(RPT: tl.constexpr, NT: tl.constexpr, VEC: tl.constexpr):
    """[RPT, NT, VEC] column offsets of one step: slot t's r-th group starts at (r * NT + t) * VEC."""
    return (tl.arange(0, RPT)[:, None, None] * (NT * VEC) + tl.arange(0, NT)[None, :, None] * VEC
            + tl.arange(0, VEC)[None, None, :])


@triton.jit
def slot_cols(RPT: tl.constexpr, NT: tl.constexpr, VEC: tl.constexpr):
    """The columns of `group_cols` slot-major: [NT, RPT, VEC]. With RPT > 1, triton 3.6 lays
    the [RPT, NT, VEC] tile out with a slot's RPT groups on neighbouring lanes (threadsPerWarp
    [2, 16, 1] at RPT = 2, 4 warps: a shuffle per reduction over the groups) and this one with
    each slot's groups in one thread ([32, 1, 1]); with RPT = 1 both are the same layout."""
    return (tl.arange(0, NT)[:, None, None] * VEC + tl.arange(0, RPT)[None, :, None] * (NT * VEC)
            + tl.arange(0, VEC)[None, None, :])


@triton.jit
def group_lse_step(x, m, s, scale, FAST: tl.constexpr):
    """Fold a [R, RPT, NT, VEC] tile x into per-slot running (m, s) ([R, NT]; m starts at
    NEG_BIG, s at 0; s = sum of exp2((x - m) * scale)). Returns (m, s, take, g): take where
    a slot's group max g beats its old max (strict: earlier steps keep ties)."""
    g = tl.max(tl.max(x, axis=3), axis=1)
    take = g > m
    m_new = tl.maximum(m, g)
    c = tl.maximum(m_new * scale, NEG_BIG)  # finite: x * scale - c is never NaN
    e = exp2(x * scale - c[:, None, :, None], FAST)
    return m_new, s * exp2((m - m_new) * scale, FAST) + tl.sum(tl.sum(e, axis=3), axis=1), take, g


@triton.jit
def group_best_cols(bx, m, b_v0, cols):
    """Per slot ([R, NT]) the column of its max m: the first column equal to m in the kept
    best step's values bx ([R, RPT, NT, VEC], read at step b_v0; cols from `group_cols`)."""
    bcol = cols[None] + b_v0[:, None, :, None]
    return tl.min(tl.min(tl.where(bx == m[:, None, :, None], bcol, BIG_IDX), axis=3), axis=1)


@triton.jit
def uniforms(seed, base, v0, BLOCK: tl.constexpr):
    """U[0, 1) for the columns v0 + arange(BLOCK), v0 a multiple of 4: column v takes
    output v % 4 of Philox(seed, counter base + v // 4).  One Philox call (~60
    instructions) serves 4 columns; with one call per column it was most of a sampling
    pass's instructions.  The draw of a column does not depend on the tiling."""
    r0, r1, r2, r3 = tl.randint4x(seed, base + v0 // 4 + tl.arange(0, BLOCK // 4))
    # [BLOCK // 4, 2, 2] with [i, a, c] = r_(2a + c)[i]: row-major order is column 4i + t
    r = tl.reshape(tl.join(tl.join(r0, r2), tl.join(r1, r3)), [BLOCK])
    return tl.uint_to_uniform_float(r)


@triton.jit
def best_step(score, val, v0, best, best_v0, best_val):
    """Element-wise running best score (strictly greater: the earlier step keeps ties),
    the step start v0 that gave it, and its `val`."""
    take = score > best
    return tl.where(take, score, best), tl.where(take, v0, best_v0), tl.where(take, val, best_val)


@triton.jit
def _max_lowest(v1, i1, v2, i2):
    """`argmax_lowest`'s combine: the larger value, the lower index between equal values; a
    NaN loses to any number (as tl.max ignores it), the lower index between two NaNs."""
    nan1 = v1 != v1
    take = (v2 > v1) | ((v2 == v1) & (i2 < i1)) | (nan1 & ((v2 == v2) | (i2 < i1)))
    return tl.where(take, v2, v1), tl.where(take, i2, i1)


@triton.jit
def argmax_lowest(values, indices, axis: tl.constexpr):
    """(max of `values`, the lowest of `indices` where it is) along `axis`, in ONE reduction.
    Not a max and then an equality test against it: the compiler may evaluate a computed
    tensor more than once (a rematerialisation in another layout), and a value that rounds
    differently there equals no element of the max it was compared with (the H200 returned
    the no-match sentinel that way). NaNs lose to numbers; all NaN gives NaN (-inf under the
    interpreter). Under the interpreter the max and the lowest index where it is, the same
    result from numpy arrays evaluated once, at a 35th of the time of a reduction with a Python
    combine."""
    if INTERPRETED:
        v = tl.where(values == values, values, float("-inf"))
        top = tl.max(v, axis=axis)
        return top, tl.min(tl.where(v == tl.expand_dims(top, axis), indices, BIG_IDX), axis=axis)
    return tl.reduce((values, indices), axis, _max_lowest)


@triton.jit
def best_combine(best, best_v0, best_val, cols, axis: tl.constexpr):
    """Reduce element-wise running bests over `axis` (columns v0 + cols): best score,
    its lowest index (as torch.argmax), its val."""
    top = tl.max(best, axis=axis)
    idx = tl.min(tl.where(best == tl.expand_dims(top, axis), best_v0 + cols, BIG_IDX), axis=axis)
    val = tl.sum(tl.where(best_v0 + cols == tl.expand_dims(idx, axis), best_val, 0.0), axis=axis)
    return top, idx, val
