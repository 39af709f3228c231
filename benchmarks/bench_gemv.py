"""Benchmark: few-row linear layers (Triton GEMV) vs cuBLAS and torch.compile at decode shapes.

    python benchmarks/bench_gemv.py [--out benchmarks/results/gemv.json]
    python benchmarks/bench_gemv.py --sweep [--out benchmarks/results/gemv_sweep.json]
    TRITON_INTERPRET=1 python benchmarks/bench_gemv.py --smoke [--sweep]   # CPU, tiny, no claims

Shapes: the LLaVA-1.5-7B target's projections at one row (an AR decode step; `gemv`) and
at 6, 16, 32 and 64 rows (verification of gamma + 1 = 6 tokens, of a draft tree's nodes or of
a batch's chains; `gemv_rows`, tensor cores): q/k/v 12288x4096, o 4096x4096, gate/up
22016x4096, down 4096x11008 with the SiLU gate (fused into the one-row GEMV; a separate
`silu_mul` launch before the several-row one), lm_head 32064x4096; and the LLaVA-68M-shape
draft's at one row and at 4 (a draft step over 4 views): q/k/v 2304x768, o 768x768, gate/up
6144x768 (at 4 rows with the SiLU gate in the GEMV's epilogue, `glu`), down 768x3072 (the
gate fused at one row), lm_head 32064x768; bf16 (`--model qwen2-7b`: LLaVA-OneVision-7B's /
Qwen2.5-VL-7B's Qwen2-7B and the OneVision 0.5B draft instead). Each timed call runs the projection over
several copies of the weight (>= 400 MB in all), so every byte comes from HBM, not L2.
Columns (us per projection, medians):
  fused     tabed_engine.kernels.gemv (gemv_rows at several rows)
  eager     the reference: F.linear (cuBLAS), after (gated) or before (glu) an eager SiLU*up
  model     what the decoder ran before: F.linear after the torch.compile'd SiLU*up
  compiled  torch.compile of the reference (static shapes)
GB/s counts the weight bytes over the graph time, next to a 1 GiB device-to-device copy
measured in the same run. The summary lines add up one decode step's projections (32
layers + lm_head; the draft: 2 layers + lm_head) for the GEMV and for the cuBLAS path the
decoder would otherwise run.

--sweep times `gemv_rows` block configs (BLOCK_N, BLOCK_K, num_warps, stages, splits over K) per target
projection, as the decoder runs it at several rows (gate/up with `glu`, down on the gated
activations), and per row tile (`--sweep-rows` 16, 32, 64: BLOCK_M 16, 32, 64), over a grid
pruned to the configs that fit a block's shared memory, hold at most 32 accumulator values a
thread and give each warp at least one 16x8 tensor-core tile. Every config is compiled first
(threads: Triton's compiler releases the GIL), then screened from one CUDA graph of a pass over
the weight copies (3 replays; a config whose first replay takes over twice the best so far is
dropped); the 3 fastest are re-timed as the table times, next to `_dot_config`'s default, the
16-row kernel (at 16 rows, and over the rows in 16-row calls) and cuBLAS (F.linear; the
model's SiLU*up kernel after it for gate/up). Prints the winners as the `_DOT_CONFIGS` dict literal
of tabed_engine/kernels/gemv.py.
"""
from __future__ import annotations

import argparse
import itertools
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import copy_bandwidth_gbs, event_ms, graph_ms, median_ms, provenance  # noqa: E402
from bench_rope_kv_write import (add_common_args, begin_table, compile_static, device_and_out,  # noqa: E402
                                 print_row, time_variants, write_result)
from tabed_engine.kernels import gemv as _k  # noqa: E402
from tabed_engine.models.layers import silu_mul  # noqa: E402
from tabed_engine.ops.gemv import linear_reference  # noqa: E402

# (name, N, K, SiLU gate on the input ("in", the one-row down projection; a silu_mul launch
# first at several rows) or on the output ("out", glu), layers per step)
TARGET = [("qkv", 12288, 4096, None, 32), ("o", 4096, 4096, None, 32), ("gate_up", 22016, 4096, None, 32),
          ("down", 4096, 11008, "in", 32), ("lm_head", 32064, 4096, None, 1)]
DRAFT_ONE = [("draft_qkv", 2304, 768, None, 2), ("draft_o", 768, 768, None, 2), ("draft_gate_up", 6144, 768, None, 2),
             ("draft_down", 768, 3072, "in", 2), ("draft_lm_head", 32064, 768, None, 1)]


def draft_rows(one: list) -> list:
    """A draft's projections at several rows from its one-row list: gate/up with the SiLU gate in
    the epilogue (glu), down on the gated activations."""
    return [(n, N, K, "out" if n.endswith("gate_up") else None, L) for n, N, K, _, L in one]


DRAFT_ROWS = draft_rows(DRAFT_ONE)


# --model qwen2-7b: LLaVA-OneVision-7B's / Qwen2.5-VL-7B's language model (Qwen2-7B: hidden 3584,
# 28 layers, 28 / 4 heads of 128, MLP 18944, vocabulary 152064 as published) and the OneVision
# 0.5B draft's (Qwen2-0.5B: hidden 896, 24 layers, 14 / 2 heads of 64, MLP 4864, vocabulary 151936)
QWEN2_TARGET = [("qkv", 4608, 3584, None, 28), ("o", 3584, 3584, None, 28), ("gate_up", 37888, 3584, None, 28),
                ("down", 3584, 18944, "in", 28), ("lm_head", 152064, 3584, None, 1)]
QWEN2_DRAFT_ONE = [("draft_qkv", 1152, 896, None, 24), ("draft_o", 896, 896, None, 24),
                   ("draft_gate_up", 9728, 896, None, 24), ("draft_down", 896, 4864, "in", 24),
                   ("draft_lm_head", 151936, 896, None, 1)]
MODELS = {"llava-7b": (TARGET, DRAFT_ONE, DRAFT_ROWS),
          "qwen2-7b": (QWEN2_TARGET, QWEN2_DRAFT_ONE, draft_rows(QWEN2_DRAFT_ONE))}


def over_weights(ws, fn):
    """One call that runs fn on each copy of the weight (the copies together pass L2)."""
    def run():
        for w in ws:
            fn(w)
    return run


def model_path(x, w, gate):
    """The cuBLAS path the decoder would run: F.linear with the model's SiLU*up (`model.silu_mul`) around it."""
    y = torch.nn.functional.linear(silu_mul(x) if gate == "in" else x, w)
    return silu_mul(y) if gate == "out" else y


# --sweep: the target's projections as the decoder runs them at several rows (the SiLU gate
# after the gate/up product, down on the gated activations), and the config grid
SWEEP_SHAPES = [("qkv", 12288, 4096, None), ("o", 4096, 4096, None), ("gate_up", 22016, 4096, "out"),
                ("down", 4096, 11008, None), ("lm_head", 32064, 4096, None)]
# --sweep --shapes draft_*: the draft's (LLaVA-68M shape) projections at the tree draft's rows
DRAFT_SWEEP_SHAPES = [(name, N, K, gate) for name, N, K, gate, _ in DRAFT_ROWS]
SWEEP_GRID = dict(BN=(16, 32, 64, 128), BK=(64, 128, 256, 512), warps=(2, 4, 8), stages=(2, 3, 4, 5), splits=(1,))
SMOKE_SHAPES = [("small", 96, 130, None), ("small_glu", 64, 70, "out")]
SMOKE_GRID = dict(BN=(16, 32), BK=(32,), warps=(2,), stages=(2,), splits=(1, 3))
SCREEN_REPS, RETIME = 3, 3


def sweep_configs(block_m: int, grid: dict, smem_budget: int) -> list:
    """The grid's (BLOCK_N, BLOCK_K, num_warps, stages, splits) worth timing at `block_m` rows: the
    pipeline's buffers within a block's shared memory, at most 32 fp32 accumulator values a
    thread (larger tiles spill on sm_90), at least one 16x8 tensor-core tile a warp."""
    keep = []
    for cfg in itertools.product(*grid.values()):
        BN, _, warps, _, _ = cfg
        cfg = cfg[:4] if cfg[4] == 1 else cfg  # an unsplit config as `_DOT_CONFIGS` writes it
        if (_k.dot_smem_bytes(block_m, cfg) <= smem_budget and block_m * BN <= 32 * 32 * warps
                and 16 * 8 * warps <= block_m * BN):
            keep.append(cfg)
    return keep


def replayable(fn, device):
    """fn captured in one CUDA graph (how the decoder runs it; warmed up on a side stream), or
    fn itself on the interpreter."""
    if device != "cuda":
        return fn
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def replay_us(replay, device, reps: int) -> float:
    """Median µs of replay() over reps (CUDA events; wall clock on the interpreter)."""
    return (event_ms(replay, reps) if device == "cuda" else median_ms(replay, device, reps)) * 1e3


def table_us(fn, device, args) -> float:
    """µs of fn() as the table times its graph column (`--inner` calls in one graph, `--reps`)."""
    return (graph_ms(fn, args.inner, args.reps) if device == "cuda" else median_ms(fn, device, args.reps)) * 1e3


def compile_configs(call, configs, workers: int) -> dict:
    """Run call(config) once per config, the first in this thread (a kernel's per-device state
    is set up once), the others `workers` at a time (Triton compiles mostly outside the GIL);
    returns {config: error text} for those that failed."""
    def one(cfg):
        try:
            call(cfg)
        except Exception as e:  # noqa: BLE001
            return f"{type(e).__name__}: {str(e).strip()[:160]}"
        return None
    errors = {configs[0]: one(configs[0])}
    with ThreadPoolExecutor(max(1, workers)) as pool:
        errors.update(zip(configs[1:], pool.map(one, configs[1:])))
    return {cfg: e for cfg, e in errors.items() if e is not None}


def screen(kernel, configs, device, copies: int):
    """({config: µs a projection} from one graph of kernel(config) each, SCREEN_REPS replays;
    configs whose first replay takes over twice the best so far left out, and their count)."""
    screened, stopped, top = {}, 0, float("inf")
    for cfg in configs:
        replay = replayable(kernel(cfg), device)
        if replay_us(replay, device, 1) > 2 * top:
            stopped += 1
            continue
        screened[cfg] = replay_us(replay, device, SCREEN_REPS) / copies
        top = min(top, screened[cfg] * copies)
    return screened, stopped


def sweep(args, device, copy_gbs: float):
    """Per sweep shape and row count: the best `gemv_rows` config of the grid next to the
    default, the 16-row kernel and cuBLAS. Returns (JSON rows, {(N, K, BLOCK_M): config})."""
    shapes, grid = (SMOKE_SHAPES, SMOKE_GRID) if args.smoke else (SWEEP_SHAPES, SWEEP_GRID)
    grid = {k: getattr(args, f"grid_{k}") or v for k, v in grid.items()}
    if args.shapes:   # the draft's shapes only by name
        shapes = [s for s in shapes + ([] if args.smoke else DRAFT_SWEEP_SHAPES) if s[0] in args.shapes]
    budget = 227 << 10  # sm_90's opt-in shared memory a block
    if device == "cuda":
        budget = getattr(torch.cuda.get_device_properties(device), "shared_memory_per_block_optin", budget)
    workers = args.compile_workers if device == "cuda" else 1  # the interpreter runs one program at a time
    dtype, rows, best = torch.bfloat16, [], {}
    torch.manual_seed(0)
    print(f"{'shape':>8} {'rows':>4} | {'best (BN, BK, warps, stages)':>28} {'us':>8} {'GB/s':>5} {'%copy':>5} | "
          f"{'default':>20} {'us':>8} | {'16-row kernel: 16 rows':>22} {'M rows':>8} | {'cuBLAS':>8} | timed")
    for name, N, K, gate in shapes:
        glu = gate == "out"
        nbytes = N * K * 2
        copies = max(1, -(-args.min_bytes // nbytes))
        ws = [torch.randn(N, K, device=device, dtype=dtype) / K ** 0.5 for _ in range(copies)]
        for M in args.sweep_rows:
            block_m = _k.dot_block_m(M)
            x = torch.randn(M, K, device=device, dtype=dtype)
            out = torch.empty(M, N // 2 if glu else N, device=device, dtype=dtype)

            def over_copies(fn):
                return over_weights(ws, fn)

            def kernel(cfg):
                return over_copies(lambda w: _k.gemv_rows(x, w, glu=glu, out=out, config=cfg))

            default = _k._dot_config(N, K, block_m)
            configs = [default] + [c for c in sweep_configs(block_m, grid, budget) if c != default]
            failed = compile_configs(lambda cfg: _k.gemv_rows(x, ws[0], glu=glu, config=cfg), configs, workers)
            screened, stopped = screen(kernel, [c for c in configs if c not in failed], device, copies)
            timed = {cfg: table_us(kernel(cfg), device, args) / copies
                     for cfg in sorted(screened, key=screened.get)[:RETIME]}
            if default not in timed and default in screened:
                timed[default] = table_us(kernel(default), device, args) / copies
            winner = min(timed, key=timed.get)
            best[(N, K, block_m)] = winner

            x16 = torch.randn(16, K, device=device, dtype=dtype)
            out16 = torch.empty(16, out.shape[1], device=device, dtype=dtype)
            base = {"cublas": table_us(over_copies(lambda w: model_path(x, w, gate)), device, args) / copies}
            if M > 16:
                base["rows16"] = table_us(over_copies(lambda w: _k.gemv_rows(x16, w, glu=glu, out=out16)),
                                          device, args) / copies
                base["split16"] = table_us(over_copies(lambda w: [
                    _k.gemv_rows(x[i:i + 16], w, glu=glu, out=out[i:i + 16]) for i in range(0, M, 16)]),
                    device, args) / copies
            _k.gemv_rows(x, ws[0], glu=glu, out=out, config=winner)
            err = (out.float() - model_path(x, ws[0], gate).float()).abs().max().item()
            gbs = nbytes / (timed[winner] * 1e-6) / 1e9
            rows.append(dict(name=name, kind="sweep", rows=M, block_m=block_m, N=N, K=K, gate=gate, dtype=str(dtype),
                             weight_bytes=nbytes, copies=copies, best=list(winner), best_us=timed[winner],
                             best_gbs=gbs, pct_copy=100 * gbs / copy_gbs, default=list(default),
                             default_us=timed.get(default), baseline_us=base,
                             top=[[list(c), us] for c, us in sorted(timed.items(), key=lambda kv: kv[1])],
                             screened=len(screened), stopped_early=stopped,
                             failed={str(c): e for c, e in failed.items()}, max_abs_err_vs_cublas=err))
            col = lambda v, w=8: f"{v:>{w}.2f}" if v is not None else f"{'-':>{w}}"  # noqa: E731
            print(f"{name:>8} {M:>4} | {str(winner):>28} {col(timed[winner])} {gbs:>5.0f} {100 * gbs / copy_gbs:>5.1f} "
                  f"| {str(default):>20} {col(timed.get(default))} | {col(base.get('rows16'), 22)} "
                  f"{col(base.get('split16'))} | {col(base['cublas'])} | {len(screened)} timed, {stopped} stopped, "
                  f"{len(failed)} failed   max err {err:.2g}", flush=True)
        ws.clear()
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows, best


def dot_configs_literal(best: dict) -> str:
    """{(N, K, BLOCK_M): (BLOCK_N, BLOCK_K, num_warps, stages[, splits]), ...} as Python source."""
    lines = [f"    {key}: {cfg}," for key, cfg in sorted(best.items())]
    return "{\n" + "\n".join(lines) + "\n}"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_args(ap, "gemv")
    ap.set_defaults(inner=4, reps=15)
    ap.add_argument("--min-bytes", type=int, default=400 << 20, help="weight bytes per timed call")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 6, 16, 32, 64],
                    help="activation rows per target projection")
    ap.add_argument("--draft-rows", type=int, nargs="*", default=[1, 4], help="activation rows per draft projection")
    ap.add_argument("--model", choices=sorted(MODELS), default="llava-7b",
                    help="the target and draft shapes (qwen2-7b: LLaVA-OneVision-7B / Qwen2.5-VL-7B and the 0.5B draft)")
    ap.add_argument("--sweep", action="store_true", help="time gemv_rows block configs instead of the table")
    ap.add_argument("--sweep-rows", type=int, nargs="+", default=None,
                    help="activation rows per sweep (default 16 32 64; --smoke: 6 20 40)")
    for k in SWEEP_GRID:
        ap.add_argument(f"--grid-{k}", type=int, nargs="+", default=None, help=f"--sweep: the grid's {k} values")
    ap.add_argument("--shapes", nargs="+", default=None,
                    help="--sweep: only these shapes (names; draft_qkv, draft_o, ... are the draft's)")
    ap.add_argument("--compile-workers", type=int, default=min(16, os.cpu_count() or 1),
                    help="threads compiling the sweep's configs")
    args = ap.parse_args(argv)
    t_start = time.perf_counter()

    device, out_path = device_and_out(args, "gemv_sweep" if args.sweep else "gemv")
    if args.sweep:
        args.sweep_rows = args.sweep_rows or ([6, 20, 40] if args.smoke else [16, 32, 64])
        if not all(1 <= M <= _k.MAX_DOT_ROWS for M in args.sweep_rows):
            ap.error(f"--sweep-rows: 1 to {_k.MAX_DOT_ROWS} rows")
        if args.smoke:
            args.reps, args.inner, args.min_bytes = 3, 1, 0
        copy_gbs = copy_bandwidth_gbs(device, (1 << 20) if args.smoke else 1 << 30)
        print(f"device: {provenance(device)['device']}  copy bandwidth {copy_gbs:.0f} GB/s")
        rows, best = sweep(args, device, copy_gbs)
        print("_DOT_CONFIGS = " + dot_configs_literal(best))
        rows.append(dict(name="dot_configs", literal=dot_configs_literal(best),
                         configs=[[*key, *cfg] for key, cfg in sorted(best.items())]))
        write_result("gemv_sweep", args, device, copy_gbs, rows, out_path, t_start)
        return
    target, draft_one, draft_many = MODELS[args.model]
    cases = [(*c, M) for M in args.rows for c in target]
    cases += [(*c, M) for M in args.draft_rows for c in (draft_one if M == 1 else draft_many)]
    if args.smoke:
        cases = [(*c, M) for M in args.rows for c in [("small", 96, 130, None, 1), ("small_gated", 64, 70, "in", 1),
                                                      ("small_glu", 64, 70, "out", 1)]]
        cases = [c for c in cases if not (c[3] == "out" and c[-1] == 1)]
        args.no_compile, args.reps, args.inner, args.min_bytes = True, 3, 1, 0
    dtype = torch.bfloat16
    compiled = None if args.no_compile else compile_static(
        lambda x, w, gi, go: linear_reference(x, w, gated=gi, glu=go))

    copy_gbs = begin_table(device, args, f"{'shape':>22}", 1 << 30)
    rows = []
    g = torch.Generator().manual_seed(0)
    for name, N, K, gate, layers, M in cases:
        gated, glu = gate == "in", gate == "out"
        nbytes = N * K * 2
        copies = max(1, -(-args.min_bytes // nbytes))
        ws = [(torch.randn(N, K, generator=g) / K ** 0.5).to(device=device, dtype=dtype) for _ in range(copies)]
        x = torch.randn(M, 2 * K if gated else K, generator=g).to(device=device, dtype=dtype)
        out = torch.empty(M, N // 2 if glu else N, device=device, dtype=dtype)

        def each(fn):
            return over_weights(ws, fn)

        def fused(w):
            if M == 1:
                return _k.gemv(x, w, gated=gated, out=out)
            return _k.gemv_rows(silu_mul(x) if gated else x, w, glu=glu, out=out)
        fns = {"fused": each(fused),
               "eager": each(lambda w: linear_reference(x, w, gated=gated, glu=glu))}
        if gate and not args.smoke:
            fns["model"] = each(lambda w: model_path(x, w, gate))
        if compiled is not None:
            fns["compiled"] = each(lambda w: compiled(x, w, gated, glu))

        fused(ws[0])
        err = (out.float() - linear_reference(x, ws[0], gated=gated, glu=glu).float()).abs().max().item()
        stream, graph = time_variants(fns, device, args)
        stream = {k: v / copies for k, v in stream.items()}
        graph = {k: v / copies for k, v in graph.items()}
        base = graph.get("fused", stream["fused"])
        gbs = nbytes / (base * 1e-6) / 1e9
        rows.append(dict(name=name, rows=M, N=N, K=K, gate=gate, layers=layers, dtype=str(dtype), weight_bytes=nbytes,
                         copies=copies, stream_us=stream, graph_us=graph, fused_gbs=gbs,
                         pct_copy=100 * gbs / copy_gbs, max_abs_err_vs_eager=err))
        print_row(f"{name + ' M=' + str(M):>22}", stream, graph, gbs, copy_gbs, err)
        del ws
        if device == "cuda":
            torch.cuda.empty_cache()

    summary = {}
    for model, M, shapes in ([("target", M, target) for M in args.rows]
                             + [("draft", M, draft_one if M == 1 else draft_many) for M in args.draft_rows]):
        sel = [r for r in rows if r["rows"] == M and r["name"] in {n for n, *_ in shapes}]
        if len(sel) == len(shapes) and all("eager" in r["graph_us"] for r in sel):
            # the baseline is what the decoder would run on cuBLAS: with the model's SiLU*up
            # kernel for the gated one ("model"), not the eager two-kernel gate
            base = {r["name"]: r["graph_us"].get("model", r["graph_us"]["eager"]) for r in sel}
            step = {"fused": sum(r["graph_us"]["fused"] * r["layers"] for r in sel) / 1e3,
                    "cublas": sum(base[r["name"]] * r["layers"] for r in sel) / 1e3}
            summary[f"{model}_step_rows{M}_ms"] = step
            print(f"one {model} step's projections at {M} row(s): GEMV {step['fused']:.4f} ms, "
                  f"cuBLAS path {step['cublas']:.4f} ms ({step['cublas'] / step['fused']:.2f}x)")
    rows.append(dict(name="summary", **summary))
    write_result("gemv", args, device, copy_gbs, rows, out_path, t_start)


if __name__ == "__main__":
    main()
