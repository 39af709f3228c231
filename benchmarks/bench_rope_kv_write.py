"""Benchmark: fused RoPE + KV-cache write (one Triton launch) vs the unfused decode and
prefill paths.

    python benchmarks/bench_rope_kv_write.py [--out benchmarks/results/rope_kv_write.json]
    TRITON_INTERPRET=1 python benchmarks/bench_rope_kv_write.py --smoke   # CPU, tiny, no claims

Decode: one layer of LLaVA-1.5-7B decode, R = 1 row, T in {1, 6} new tokens, H = Hkv = 32,
D = 128, cache S = 2048, bf16. Columns (per call, medians):
  fused     tabed_engine.kernels.rope_kv_write
  eager     split, rotate q and k eagerly, two index_put writes (slots precomputed per
            forward, as the model does)
  model     what Attention.forward ran before the fused kernel: the torch.compile'd
            apply_rope twice, then the two eager index_put writes
  compiled  torch.compile of the whole eager path (static shapes)
Prefill: one fresh row of T in {616, 1800} tokens into row `slot` (a device index) of a
4-row cache, H = 32, Hkv in {32, 8 (GQA)}. fused = the kernel with rows=slot, q written in
SDPA's [R, H, T, D] layout and dense k/v out for SDPA; eager / model / compiled = the chain
Attention.forward runs without it (rotate q and k, the transposed contiguous copies of q, k
and v, index_copy_ of k and v into the cache row), with rope_reference / apply_rope.
Each prefill row also times the kernel at the head tiles next to the launch plan's choice.
Two timings of each: `stream`, CUDA events around `--inner` back-to-back calls (includes
the host's launch cost when that is the bottleneck), and `graph`, the same calls captured
in one CUDA graph and replayed (the way the decode step runs them: launch gaps only).
GB/s counts the bytes the op must move (qkv and cos/sin read, q, k, v written; k and v
twice in the prefill) over the graph time, next to a device-to-device copy of 256 MiB
measured in the same run.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import copy_bandwidth_gbs, event_ms, graph_ms, median_ms, provenance  # noqa: E402
from tabed_engine.kernels import rope_kv_write as _k  # noqa: E402
from tabed_engine.models.layers import apply_rope, rope_tables  # noqa: E402
from tabed_engine.ops.rope_kv_write import rope_reference  # noqa: E402


def unfused(rope, qkv, cos, sin, k_cache, v_cache, rows, slots, H, KV):
    # qkv: [R, T, (H + 2 KV) D]; cos/sin: [R, T, 1, D]; rows [R, 1], slots [R, T]
    R, T, _ = qkv.shape
    q, k, v = qkv.view(R, T, -1, k_cache.shape[-1]).split([H, KV, KV], dim=2)
    q, k = rope(q, cos, sin), rope(k, cos, sin)
    k_cache[rows, :, slots] = k
    v_cache[rows, :, slots] = v
    return q


def eager_path(*args):
    return unfused(rope_reference, *args)


def model_path(*args):
    return unfused(apply_rope, *args)


def prefill_unfused(rope, qkv, cos, sin, k_cache, v_cache, slot, H, KV):
    # the fresh prefill into cache row `slot` ([1] int64) without the kernel, as
    # tabed_engine.models.layers.sdpa_qkv runs it; returns SDPA's q [R, H, T, D] and new k, v [R, KV, T, D]
    R, T, _ = qkv.shape
    q, k, v = qkv.view(R, T, -1, k_cache.shape[-1]).split([H, KV, KV], dim=2)
    q, k = rope(q, cos, sin), rope(k, cos, sin)
    new_k, new_v = k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()
    k_cache.narrow(2, 0, T).index_copy_(0, slot, new_k)
    v_cache.narrow(2, 0, T).index_copy_(0, slot, new_v)
    return q.transpose(1, 2).contiguous(), new_k, new_v


def prefill_eager(*args):
    return prefill_unfused(rope_reference, *args)


def prefill_model(*args):
    return prefill_unfused(apply_rope, *args)


def one_page(cache):
    """The block table of a [R, KV, S, D] cache read as a paged pool of one S-slot page per row
    (the kernel writes it as the eager chains do)."""
    return torch.arange(cache.shape[0], dtype=torch.int32, device=cache.device)[:, None]


def make_inputs(R, T, H, KV, D, S, length, dtype, device):
    g = torch.Generator().manual_seed(0)
    cfg = argparse.Namespace(head_dim=D, rope_theta=10000.0, rope_scaling_factor=1.0)
    cos_t, sin_t = rope_tables(cfg, S, device)
    lengths = torch.full((R,), length, dtype=torch.int32, device=device)
    slots = lengths.long()[:, None] + torch.arange(T, device=device)               # [R, T]
    cos, sin = cos_t[slots][:, :, None], sin_t[slots][:, :, None]                   # [R, T, 1, D]
    qkv = torch.randn(R, T, (H + 2 * KV) * D, generator=g).to(device=device, dtype=dtype)
    cache = torch.zeros(2, R, KV, S, D, device=device, dtype=dtype)
    return qkv, cos, sin, cache[0], cache[1], lengths, torch.arange(R, device=device)[:, None], slots


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 6])
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--kv-heads", type=int, default=32)
    ap.add_argument("--prefill-tokens", type=int, nargs="*", default=[616, 1800], help="none: skip the prefill")
    ap.add_argument("--prefill-kv-heads", type=int, nargs="+", default=[32, 8])
    add_common_args(ap, "rope_kv_write")
    args = ap.parse_args(argv)
    t_start = time.perf_counter()

    device, out_path = device_and_out(args, "rope_kv_write")
    if args.smoke:
        H, D, S, args.kv_heads, args.tokens, args.no_compile, args.reps = 4, 16, 64, 2, [1, 3], True, 3
        args.prefill_tokens, args.prefill_kv_heads = [20], [4, 2]
    else:
        H, D, S = 32, 128, 2048
    KV, R, dtype = args.kv_heads, args.rows, torch.bfloat16
    compiled = None if args.no_compile else compile_static(eager_path)  # one static graph per T

    copy_gbs = begin_table(device, args, f"{'R':>2} {'T':>2}")
    rows = []
    for T in args.tokens:
        qkv, cos, sin, k_cache, v_cache, lengths, row_index, slots = make_inputs(
            R, T, H, KV, D, S, S - 48, dtype, device)
        q_out = torch.empty(R, T, H, D, device=device, dtype=dtype)
        cos3, sin3 = cos[:, :, 0], sin[:, :, 0]
        path_args = (qkv, cos, sin, k_cache, v_cache, row_index, slots, H, KV)
        fns = {
            "fused": lambda: _k.rope_kv_write(qkv, cos3, sin3, k_cache, v_cache, one_page(k_cache), lengths, H, KV,
                                              out=q_out),
            "eager": lambda: eager_path(*path_args),
        }
        if not args.smoke:
            fns["model"] = lambda: model_path(*path_args)
        if compiled is not None:
            fns["compiled"] = lambda: compiled(*path_args)

        # correctness at this shape: fused vs eager, q and the written cache slots
        ref_k, ref_v = k_cache.clone(), v_cache.clone()
        q_ref = eager_path(qkv, cos, sin, ref_k, ref_v, row_index, slots, H, KV)
        fns["fused"]()
        err = max((q_out.float() - q_ref.float()).abs().max().item(),
                  (k_cache.float() - ref_k.float()).abs().max().item(),
                  (v_cache.float() - ref_v.float()).abs().max().item())

        stream, graph = time_variants(fns, device, args)
        elt = qkv.element_size()
        nbytes = qkv.numel() * elt + 2 * cos3.numel() * 4 + R * T * (H + 2 * KV) * D * elt
        base = graph.get("fused", stream["fused"])
        gbs = nbytes / (base * 1e-6) / 1e9
        row = dict(kind="decode", R=R, T=T, H=H, Hkv=KV, D=D, S=S, dtype=str(dtype), bytes=nbytes,
                   stream_us=stream, graph_us=graph, fused_gbs=gbs, pct_copy=100 * gbs / copy_gbs,
                   max_abs_err_vs_eager=err)
        rows.append(row)
        print_row(f"{R:>2} {T:>2}", stream, graph, gbs, copy_gbs, err)

    if args.prefill_tokens:
        print_header(f"{'prefill T':>9} {'Hkv':>3}")
        compiled = None if args.no_compile else compile_static(prefill_eager)
        for KV in args.prefill_kv_heads:
            for T in args.prefill_tokens:
                rows.append(prefill_row(T, H, KV, D, S, dtype, device, args, copy_gbs, compiled))

    write_result("rope_kv_write", args, device, copy_gbs, rows, out_path, t_start)


def prefill_row(T, H, KV, D, S, dtype, device, args, copy_gbs, compiled) -> dict:
    """Time one prefill shape (R = 1 into row 2 of a 4-row cache): the kernel, the unfused
    chain, and the kernel at the head tiles around the launch plan's; returns the JSON row."""
    qkv, cos, sin, _, _, _, _, _ = make_inputs(1, T, H, KV, D, S, 0, dtype, device)
    k_cache, v_cache = torch.zeros(2, 4, KV, S, D, device=device, dtype=dtype).unbind(0)
    slot = torch.tensor([2], device=device)
    table = one_page(k_cache)
    starts = torch.zeros(1, dtype=torch.int32, device=device)
    q_buf = torch.empty(1, H, T, D, device=device, dtype=dtype)
    k_out, v_out = torch.empty(2, 1, KV, T, D, device=device, dtype=dtype).unbind(0)
    cos3, sin3 = cos[:, :, 0], sin[:, :, 0]

    def fused():
        return _k.rope_kv_write(qkv, cos3, sin3, k_cache, v_cache, table, starts, H, KV, out=q_buf.transpose(1, 2),
                                rows=slot, k_out=k_out, v_out=v_out)

    path_args = (qkv, cos, sin, k_cache, v_cache, slot, H, KV)
    fns = {"fused": fused, "eager": lambda: prefill_eager(*path_args)}
    if not args.smoke:
        fns["model"] = lambda: prefill_model(*path_args)
    if compiled is not None:
        fns["compiled"] = lambda: compiled(*path_args)

    # correctness at this shape: fused vs eager, q, the dense k/v and the whole cache
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    want = prefill_eager(qkv, cos, sin, ref_k, ref_v, slot, H, KV) + (ref_k, ref_v)
    fused()
    err = max((a.float() - b.float()).abs().max().item()
              for a, b in zip((q_buf, k_out, v_out, k_cache, v_cache), want))

    elt = qkv.element_size()
    nbytes = qkv.numel() * elt + 2 * cos3.numel() * 4 + T * (H + 4 * KV) * D * elt
    row = measured_row(f"{T:>9} {KV:>3}", fns, device, args, nbytes, copy_gbs, err, kind="prefill", R=1, T=T, H=H,
                       Hkv=KV, D=D, S=S, cache_rows=4, dtype=str(dtype))
    row["block_heads"] = _k._block_heads(H, KV, triton.next_power_of_2(D // 2), T)
    if device == "cuda":
        row["tile_sweep_graph_us"] = tile_sweep(fused, H, KV, device, args)
        print(f"{'':>13} | graph us by head tile: " + "  ".join(
            f"{b}: {us:.2f}" for b, us in row["tile_sweep_graph_us"].items()) + f"  (plan: {row['block_heads']})")
    return row


def tile_sweep(fused, H, KV, device, args) -> dict:
    """Graph-replay µs of the fused call at each power-of-two head tile from 4 to 32 dividing
    H and Hkv (the launch plan `_block_heads` overridden here, in the benchmark only)."""
    plan, times = _k._block_heads, {}
    try:
        for b in (4, 8, 16, 32):
            if H % b == 0 and KV % b == 0:
                _k._block_heads = lambda *_, b=b: b
                stream, graph = time_variants({"fused": fused}, device, args)
                if "fused" in graph:
                    times[b] = graph["fused"]
    finally:
        _k._block_heads = plan
    return times


def device_and_out(args, name: str):
    """(device, JSON path) of a layer-kernel benchmark run: the CPU interpreter for --smoke
    (TRITON_INTERPRET=1 required), else a CUDA GPU; exits with the reason otherwise."""
    if args.smoke:
        if os.environ.get("TRITON_INTERPRET") != "1":
            sys.exit("--smoke runs the kernel under the interpreter: set TRITON_INTERPRET=1")
        device = "cpu"
    else:
        if not torch.cuda.is_available():
            sys.exit("needs a CUDA GPU (or --smoke on CPU)")
        device = "cuda"
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                   f"{name}_smoke.json" if args.smoke else f"{name}.json")
    return device, out


def compile_static(fn, limit: int = 64, fullgraph: bool = True):
    """torch.compile(fn) with static shapes and the recompile cap raised to `limit` (one
    graph per benchmarked shape, none silently falling back to eager)."""
    for name in ("cache_size_limit", "recompile_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, limit)
    return torch.compile(fn, dynamic=False, fullgraph=fullgraph)


def time_variants(fns: dict, device, args) -> tuple[dict, dict]:
    """(plain-launch us, graph-replay us) per variant after 5 warm-up calls (compile,
    autotune caches, allocator); graph times on CUDA only. A variant that fails is reported
    and left out, not fatal."""
    stream, graph = {}, {}
    for name, fn in fns.items():
        try:
            for _ in range(5):
                fn()
            if device == "cuda":
                stream[name] = event_ms(fn, args.reps, args.inner) * 1e3
                graph[name] = graph_ms(fn, args.inner, args.reps) * 1e3
            else:
                stream[name] = median_ms(fn, device, args.reps) * 1e3
        except Exception as e:  # noqa: BLE001
            print(f"  {name} failed: {type(e).__name__}: {str(e)[:120]}")
    return stream, graph


def measured_row(label: str, fns: dict, device, args, nbytes: int, copy_gbs: float, err: float, **fields) -> dict:
    """Time the variants (`time_variants`), print the table line and return the JSON row:
    `fields` plus bytes, per-variant µs, the fused kernel's GB/s over its graph time (plain
    launches off CUDA) and its share of the copy bandwidth, and the error against eager."""
    stream, graph = time_variants(fns, device, args)
    gbs = nbytes / (graph.get("fused", stream["fused"]) * 1e-6) / 1e9
    print_row(label, stream, graph, gbs, copy_gbs, err)
    return dict(fields, bytes=nbytes, stream_us=stream, graph_us=graph, fused_gbs=gbs,
                pct_copy=100 * gbs / copy_gbs, max_abs_err_vs_eager=err)


def add_common_args(ap, name: str):
    """Options shared by the layer-kernel benchmarks (smoke mode, output, timing, compile)."""
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (TRITON_INTERPRET=1)")
    ap.add_argument("--out", default=None, help=f"JSON path (default benchmarks/results/{name}[_smoke].json)")
    ap.add_argument("--inner", type=int, default=50, help="calls per timed CUDA-event window / graph")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--no-compile", action="store_true", help="skip the two torch.compile columns")


def begin_table(device, args, label: str, copy_bytes: int = 256 << 20) -> float:
    """Measure the copy bandwidth (1 MiB in smoke mode), print the device line and the table
    header (`label` already padded); returns the bandwidth in GB/s."""
    copy_gbs = copy_bandwidth_gbs(device, (1 << 20) if args.smoke else copy_bytes)
    print(f"device: {provenance(device)['device']}  copy bandwidth {copy_gbs:.0f} GB/s")
    print_header(label)
    return copy_gbs


def print_header(label: str):
    """The table header matching `print_row`, with `label` (already padded) as the first column."""
    print(f"{label} | {'stream us: fused':>16} {'eager':>7} {'model':>7} {'compiled':>8} "
          f"| {'graph us: fused':>15} {'eager':>7} {'model':>7} {'compiled':>8} | {'GB/s':>5} {'%copy':>5}")


def print_row(label: str, stream: dict, graph: dict, gbs: float, copy_gbs: float, err: float):
    """One table line: plain-launch and graph-replay µs per variant, GB/s, % of copy, error."""
    def col(d, k, w):
        return f"{d[k]:>{w}.2f}" if k in d else f"{'-':>{w}}"
    print(f"{label} | {col(stream, 'fused', 16)} {col(stream, 'eager', 7)} {col(stream, 'model', 7)} "
          f"{col(stream, 'compiled', 8)} | {col(graph, 'fused', 15)} {col(graph, 'eager', 7)} "
          f"{col(graph, 'model', 7)} {col(graph, 'compiled', 8)} | {gbs:>5.0f} {100 * gbs / copy_gbs:>5.1f}"
          f"   max err {err:.2g}")


def write_result(op: str, args, device, copy_gbs: float, rows: list, out_path: str, t_start: float):
    """Write the benchmark's JSON (rows + provenance + timing method) to out_path."""
    result = dict(op=op, smoke=args.smoke, provenance=provenance(device), copy_gbs=copy_gbs,
                  timer="CUDA events, median over reps of (inner calls)/inner; graph = same calls "
                        "replayed from one CUDA graph" if device == "cuda" else "wall clock (interpreter)",
                  inner=args.inner, reps=args.reps, rows=rows)
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    with open(out_path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {out_path} ({time.perf_counter() - t_start:.0f} s)")


if __name__ == "__main__":
    main()
