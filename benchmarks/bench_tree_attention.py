"""Benchmark: Triton tree attention vs SDPA with a dense boolean mask (eager and compiled).

    python benchmarks/bench_tree_attention.py [--out benchmarks/results/tree_attention.json]
    python benchmarks/bench_tree_attention.py --sweep --rows 1 --nodes 6 64 --out F.json
        # the N > 1 kernel's launch configs (query tile, splits, warps) in CUDA graphs
        # (with --causal: the causal mode's, query tiles up to 128, --out tree_attention_causal_sweep.json)
    TRITON_INTERPRET=1 python benchmarks/bench_tree_attention.py --smoke   # CPU, tiny, no claims
    python benchmarks/bench_tree_attention.py --causal [--out benchmarks/results/tree_attention_causal.json]
        # prompt chunks (causal mode, N = 128 / 512 / 1664 over prefixes 0 / 600 / 2000)
        # against FlashAttention through SDPA on contiguous K/V

Shapes: rows R (1 = target verification of one request, 4/8 = draft-like rows), H = Hkv = 32,
D = 128, bf16, every row with the same prefix and a causal chain of N nodes (tree slots
after the prefix). Columns (median of triton.testing.do_bench, which flushes L2 before each
call so K/V come from HBM):
  triton    the kernel (split-K included)
  sdpa      torch SDPA on the cache slice [0, prefix + N) with a dense bool mask, eager
  compiled  torch.compile of the same function (static shapes)
  ref       tabed_engine.ops.tree_attention_reference (fp32 upcast, poisoned-slot cleaning)
  *_graph   triton and compiled replayed inside a CUDA graph, as the engine runs them: 20
            calls per graph, each after a 256 MB L2-flushing memset, minus a graph of the
            memsets alone (without a graph a one-row call is mostly launch overhead)
GB/s counts the bytes the op must move: K/V over [0, prefix + N) once, q and out.
TFLOP/s counts QK^T and PV over each node's visible slots. The copy ceiling is a
device-to-device copy measured in the same run.

--causal (prompt chunks: R = 1, N new tokens after a cached prefix, node i seeing the prefix
and nodes j <= i; H = Hkv = 32, D = 128, bf16). Columns, each in a CUDA graph (as above):
  triton      the kernel's causal mode over the paged cache (shuffled pages)
  triton_inv  the same with invariant=True (16-query tiles, 4 splits: the invariant engine's)
  flash       SDPA forced to FlashAttention (sdpa_kernel(FLASH_ATTENTION)) on contiguous K/V
              [0, prefix + N) with the bottom-right causal bias (causal_lower_right): the
              ceiling, no paging, no per-row lengths
  sdpa_mask   SDPA with a dense bool [N, prefix + N] mask (the efficient/math backend)
and the floor: max(bytes / copy bandwidth, FLOPs / the bf16 matmul rate), both measured in
the same run (an 8192^3 bf16 matmul for the rate).
"""
import argparse
import datetime
import json
import os
import platform
import sys
import time

import torch
import triton

from tabed_engine.kernels import tree_attention as _k
from tabed_engine.ops.tree_attention import causal_attention_mask, tree_attention_mask, tree_attention_reference


def sdpa_dense(q, k_cache, v_cache, lengths, tree_mask, span: int):
    # q: [R, N, H, D]  caches: [R, Hkv, S, D] with H == Hkv here
    mask = tree_attention_mask(lengths, tree_mask, span)  # [R, N, span]
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k_cache[:, :, :span], v_cache[:, :, :span], attn_mask=mask[:, None])
    return out.transpose(1, 2)


def paged(k, v):
    """k, v [R, Hkv, S, D] as page pools of 64 slots in shuffled order + their block table (a busy
    engine's scattered pages)."""
    R, Hkv, S, D = k.shape
    W = -(-S // 64)
    perm = torch.randperm(R * W, device=k.device)
    pools = []
    for c in (k, v):
        pad = torch.zeros(R, Hkv, W * 64, D, device=c.device, dtype=c.dtype)
        pad[:, :, :S] = c
        pool = torch.empty(R * W, Hkv, 64, D, device=c.device, dtype=c.dtype)
        pool[perm] = pad.view(R, Hkv, W, 64, D).transpose(1, 2).reshape(R * W, Hkv, 64, D)
        pools.append(pool)
    return (*pools, perm.int().view(R, W))


def make_inputs(R, N, H, Hkv, D, prefix, S, dtype, device):
    q = torch.randn(R, N, H, D, device=device, dtype=dtype)
    cache = torch.randn(2, R, Hkv, S, D, device=device, dtype=dtype)  # one layer of K and of V
    lengths = torch.full((R,), prefix, device=device, dtype=torch.int32)
    if N > 64:  # no mask words: the causal mode only
        return q, cache[0], cache[1], lengths, None
    chain = [(1 << (i + 1)) - 1 for i in range(N)]
    tree_mask = torch.tensor([[w - (1 << 64) if w >= 1 << 63 else w for w in chain]] * R,
                             device=device, dtype=torch.int64)
    return q, cache[0], cache[1], lengths, tree_mask


def bytes_and_flops(R, N, H, Hkv, D, prefix, elt):
    kv = 2 * R * Hkv * (prefix + N) * D * elt
    qo = 2 * R * N * H * D * elt
    visible = N * prefix + N * (N + 1) // 2  # chain: node i sees prefix + i + 1 slots
    return kv + qo, 4 * R * H * D * visible


def timer(smoke):
    if not smoke:
        return lambda fn: triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")

    def wall_ms(fn):  # interpreter: one warm call, one timed call; numbers mean nothing
        fn()
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    return wall_ms


def graph_ms(fn, calls: int = 20, replays: int = 10) -> float:
    """Per-call ms of fn inside a CUDA graph, K/V from HBM (see the module docstring)."""
    flush = torch.empty(1 << 26, dtype=torch.int32, device="cuda")
    fn()  # compile / warm up outside the capture
    torch.cuda.synchronize()

    def capture(with_fn):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(calls):
                flush.zero_()
                if with_fn:
                    fn()
        return g

    def time_graph(g):
        g.replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        ts = []
        for _ in range(replays):
            start.record()
            g.replay()
            end.record()
            end.synchronize()
            ts.append(start.elapsed_time(end))
        return sorted(ts)[len(ts) // 2]

    both, only = time_graph(capture(True)), time_graph(capture(False))
    return (both - only) / calls


def copy_bandwidth(device, smoke):
    n = (1 << 20) if smoke else (1 << 29)  # 1 GiB bf16 each way on the GPU: far past L2
    src = torch.empty(n, device=device, dtype=torch.bfloat16).normal_()
    dst = torch.empty_like(src)
    ms = timer(smoke)(lambda: dst.copy_(src))
    return 2 * n * 2 / (ms * 1e-3) / 1e9


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (TRITON_INTERPRET=1)")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/tree_attention[_smoke].json)")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--prefix", type=int, nargs="+", default=None, help="default 600 1000 2000")
    ap.add_argument("--nodes", type=int, nargs="+", default=None, help="default 1 8 16 32 64")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile column")
    ap.add_argument("--sweep", action="store_true",
                    help="time the N > 1 kernel's launch configs (block_m x splits x num_warps) per shape instead")
    ap.add_argument("--causal", action="store_true",
                    help="prompt chunks through the causal mode vs FlashAttention instead (--nodes / --prefix "
                         "default to 128 512 1664 / 0 600 2000)")
    args = ap.parse_args(argv)
    if args.prefix is None:
        args.prefix = [0, 600, 2000] if args.causal else [600, 1000, 2000]
    if args.nodes is None:
        args.nodes = [128, 512, 1664] if args.causal else [1, 8, 16, 32, 64]
    if args.sweep:
        return sweep(args)
    if args.causal:
        return causal(args, argv)

    if args.smoke:
        device, H, Hkv, D, S = "cpu", 4, 4, 64, 160
        args.rows, args.prefix, args.nodes = [1, 2], [40, 70], [1, 5]
        args.no_compile = True
        if os.environ.get("TRITON_INTERPRET") != "1":
            sys.exit("--smoke runs the kernel under the interpreter: set TRITON_INTERPRET=1")
    else:
        if not torch.cuda.is_available():
            sys.exit("needs a CUDA GPU (or --smoke on CPU)")
        device, H, Hkv, D, S = "cuda", 32, 32, 128, 4096
    out_path = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                        "tree_attention_smoke.json" if args.smoke else "tree_attention.json")
    dtype = torch.bfloat16
    bench = timer(args.smoke)
    compiled = None
    if not args.no_compile:
        # One static-shape graph per (R, N, prefix): lift the recompile cap (default 8) so no
        # shape silently falls back to eager.
        for name in ("cache_size_limit", "recompile_limit", "accumulated_cache_size_limit",
                     "accumulated_recompile_limit"):
            if hasattr(torch._dynamo.config, name):
                setattr(torch._dynamo.config, name, 1024)
        compiled = torch.compile(sdpa_dense, dynamic=False)

    copy_gbs = copy_bandwidth(device, args.smoke)
    rows = []
    header = (f"{'R':>2} {'prefix':>6} {'N':>3} | {'triton':>8} {'sdpa':>8} {'compiled':>8} {'ref':>8} us"
              f" | {'GB/s':>6} {'%copy':>5} {'TF/s':>5} | {'x sdpa':>6} {'x comp':>6} {'max err':>8}")
    print(f"device: {torch.cuda.get_device_name() if device == 'cuda' else 'cpu (interpreter)'}"
          f"  copy bandwidth {copy_gbs:.0f} GB/s")
    print(header)
    for R in args.rows:
        for prefix in args.prefix:
            for N in args.nodes:
                q, k, v, lengths, tm = make_inputs(R, N, H, Hkv, D, prefix, S, dtype, device)
                pk = paged(k, v)
                span = prefix + N
                out = torch.empty_like(q)
                t = {"triton": bench(lambda: _k.tree_attention(q, *pk, lengths, tm, out=out)),
                     "sdpa": bench(lambda: sdpa_dense(q, k, v, lengths, tm, span)),
                     "ref": bench(lambda: tree_attention_reference(q, *pk, lengths, tm, span=span))}
                if compiled is not None:
                    t["compiled"] = bench(lambda: compiled(q, k, v, lengths, tm, span))
                if not args.smoke:
                    t["triton_graph"] = graph_ms(lambda: _k.tree_attention(q, *pk, lengths, tm, out=out))
                    if compiled is not None:
                        try:
                            t["compiled_graph"] = graph_ms(lambda: compiled(q, k, v, lengths, tm, span))
                        except Exception as e:  # noqa: BLE001 - recorded, not fatal
                            print(f"compiled graph capture failed: {type(e).__name__}")
                truth = tree_attention_reference(q, *pk, lengths, tm, span=span)
                err = (out.float() - truth.float()).abs().max().item()
                nbytes, flops = bytes_and_flops(R, N, H, Hkv, D, prefix, q.element_size())
                gbs = nbytes / (t["triton"] * 1e-3) / 1e9
                tfs = flops / (t["triton"] * 1e-3) / 1e12
                comp = t.get("compiled", float("nan"))
                rows.append(dict(R=R, H=H, Hkv=Hkv, D=D, prefix=prefix, N=N, dtype=str(dtype),
                                 ms=t, bytes=nbytes, flops=flops, triton_gbs=gbs, pct_copy=100 * gbs / copy_gbs,
                                 triton_tflops=tfs, speedup_vs_sdpa=t["sdpa"] / t["triton"],
                                 speedup_vs_ref=t["ref"] / t["triton"],
                                 speedup_vs_compiled=comp / t["triton"], max_abs_err=err,
                                 graph_gbs=nbytes / (t["triton_graph"] * 1e-3) / 1e9 if "triton_graph" in t else None,
                                 graph_speedup_vs_compiled=(t["compiled_graph"] / t["triton_graph"]
                                                            if "compiled_graph" in t else None)))
                print(f"{R:>2} {prefix:>6} {N:>3} | {t['triton'] * 1e3:>8.1f} {t['sdpa'] * 1e3:>8.1f} "
                      f"{comp * 1e3:>8.1f} {t['ref'] * 1e3:>8.1f}    | {gbs:>6.0f} {100 * gbs / copy_gbs:>5.1f} "
                      f"{tfs:>5.1f} | {t['sdpa'] / t['triton']:>6.2f} {comp / t['triton']:>6.2f} {err:>8.2g}"
                      + (f" | graph {t['triton_graph'] * 1e3:.1f} vs compiled "
                         f"{t.get('compiled_graph', float('nan')) * 1e3:.1f} us" if "triton_graph" in t else ""))

    result = dict(
        op="tree_attention", smoke=args.smoke,
        device=torch.cuda.get_device_name() if device == "cuda" else "cpu (TRITON_INTERPRET=1)",
        torch=torch.__version__, triton=triton.__version__, python=platform.python_version(),
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        command=" ".join([os.path.relpath(sys.argv[0])] + (sys.argv[1:] if argv is None else list(argv))),
        copy_gbs=copy_gbs, timer=("triton.testing.do_bench median (L2 flushed); *_graph: CUDA-graph replay, L2 flushed, "
               "memset graph subtracted") if not args.smoke else "wall clock",
        rows=rows,
    )
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    with open(out_path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {out_path}")


def matmul_tflops(device, smoke):
    """bf16 matmul rate of the device (8192^3 on the GPU): the FLOP side of the causal floor."""
    n = 256 if smoke else 8192
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    ms = timer(smoke)(lambda: a @ b)
    return 2 * n ** 3 / (ms * 1e-3) / 1e12


def causal(args, argv):
    """Prompt chunks through the causal mode against FlashAttention and the bytes/FLOPs floor."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    F = torch.nn.functional
    if args.smoke:
        if os.environ.get("TRITON_INTERPRET") != "1":
            sys.exit("--smoke runs the kernel under the interpreter: set TRITON_INTERPRET=1")
        device, H, D = "cpu", 2, 64
        args.prefix, args.nodes = [0, 40], [5, 70]
    else:
        if not torch.cuda.is_available():
            sys.exit("needs a CUDA GPU (or --smoke on CPU)")
        device, H, D = "cuda", 32, 128
    dtype, R = torch.bfloat16, 1
    S = -(-(max(args.prefix) + max(args.nodes)) // 64) * 64
    copy_gbs = copy_bandwidth(device, args.smoke)
    mm_tfs = matmul_tflops(device, args.smoke)
    bench = timer(args.smoke) if args.smoke else graph_ms
    flash = [SDPBackend.FLASH_ATTENTION] if device == "cuda" else [SDPBackend.MATH]
    print(f"device: {torch.cuda.get_device_name() if device == 'cuda' else 'cpu (interpreter)'}  copy bandwidth "
          f"{copy_gbs:.0f} GB/s, bf16 matmul {mm_tfs:.0f} TFLOP/s")
    print(f"{'prefix':>6} {'N':>5} | {'triton':>8} {'inv':>8} {'flash':>8} {'mask':>8} {'floor':>8} us"
          f" | {'TF/s':>5} {'x flash':>7} {'%floor':>6} {'max err':>8}")
    rows = []
    for prefix in args.prefix:
        for N in args.nodes:
            q, k, v, lengths, _ = make_inputs(R, N, H, H, D, prefix, S, dtype, device)
            pk = paged(k, v)
            span = prefix + N
            qt, kt, vt = q.transpose(1, 2), k[:, :, :span], v[:, :, :span]  # [R, H, *, D]
            bias = causal_lower_right(N, span)
            dense = causal_attention_mask(lengths, N, span)[:, None]  # [R, 1, N, span]
            out = torch.empty_like(q)
            out_inv = torch.empty_like(q)

            def run_flash():
                with sdpa_kernel(flash):
                    return F.scaled_dot_product_attention(qt, kt, vt, attn_mask=bias)

            t = {"triton": bench(lambda: _k.tree_attention(q, *pk, lengths, out=out, causal=True)),
                 "triton_inv": bench(lambda: _k.tree_attention(q, *pk, lengths, out=out_inv, causal=True,
                                                               invariant=True)),
                 "flash": bench(run_flash),
                 "sdpa_mask": bench(lambda: F.scaled_dot_product_attention(qt, kt, vt, attn_mask=dense))}
            ref = run_flash().transpose(1, 2).float()
            err = max((out.float() - ref).abs().max().item(), (out_inv.float() - ref).abs().max().item())
            nbytes, flops = bytes_and_flops(R, N, H, H, D, prefix, q.element_size())
            floor_ms = max(nbytes / (copy_gbs * 1e9), flops / (mm_tfs * 1e12)) * 1e3
            tfs = flops / (t["triton"] * 1e-3) / 1e12
            rows.append(dict(R=R, H=H, Hkv=H, D=D, prefix=prefix, N=N, dtype=str(dtype), ms=t, bytes=nbytes,
                             flops=flops, floor_ms=floor_ms, triton_tflops=tfs,
                             flash_tflops=flops / (t["flash"] * 1e-3) / 1e12,
                             speedup_vs_flash=t["flash"] / t["triton"], pct_of_floor=100 * floor_ms / t["triton"],
                             max_abs_err_vs_flash=err))
            print(f"{prefix:>6} {N:>5} | {t['triton'] * 1e3:>8.1f} {t['triton_inv'] * 1e3:>8.1f} "
                  f"{t['flash'] * 1e3:>8.1f} {t['sdpa_mask'] * 1e3:>8.1f} {floor_ms * 1e3:>8.1f}    | {tfs:>5.0f} "
                  f"{t['flash'] / t['triton']:>7.2f} {100 * floor_ms / t['triton']:>6.1f} {err:>8.2g}")
    out_path = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                        "tree_attention_causal_smoke.json" if args.smoke
                                        else "tree_attention_causal.json")
    result = dict(
        op="tree_attention causal (prompt chunks)", smoke=args.smoke,
        device=torch.cuda.get_device_name() if device == "cuda" else "cpu (TRITON_INTERPRET=1)",
        torch=torch.__version__, triton=triton.__version__, python=platform.python_version(),
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        command=" ".join([os.path.relpath(sys.argv[0])] + (sys.argv[1:] if argv is None else list(argv))),
        copy_gbs=copy_gbs, matmul_tflops=mm_tfs,
        timer="CUDA-graph replay, L2 flushed, memset graph subtracted" if not args.smoke else "wall clock",
        rows=rows,
    )
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    with open(out_path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {out_path}")


SWEEP_BLOCK_M, SWEEP_SPLITS, SWEEP_WARPS = (16, 32, 64), (1, 2, 3, 4, 6, 8), (4, 8)


def sweep(args):
    """Graph-replayed time of every launch config of the N > 1 kernel at each (R, prefix, N),
    against the default heuristic's, with its bandwidth and the copy ceiling of the same run
    (--causal: of the causal mode, prompt chunks)."""
    if not torch.cuda.is_available():
        sys.exit("--sweep needs a CUDA GPU")
    H, Hkv, D, S, dtype = 32, 32, 128, 4096, torch.bfloat16
    copy_gbs = copy_bandwidth("cuda", False)
    print(f"device: {torch.cuda.get_device_name()}  copy bandwidth {copy_gbs:.0f} GB/s")
    shapes = []
    for R in args.rows:
        for prefix in args.prefix:
            for N in [n for n in args.nodes if n > 1]:
                q, k, v, lengths, tm = make_inputs(R, N, H, Hkv, D, prefix, S, dtype, "cuda")
                tm = None if args.causal else tm
                pk = paged(k, v)
                out = torch.empty_like(q)
                truth = tree_attention_reference(q, *pk, lengths, tm, span=prefix + N, causal=args.causal).float()
                nbytes, _ = bytes_and_flops(R, N, H, Hkv, D, prefix, q.element_size())
                default_us = graph_ms(lambda: _k.tree_attention(q, *pk, lengths, tm, out=out,
                                                                causal=args.causal)) * 1e3
                configs = []
                tiles = SWEEP_BLOCK_M + (128,) if args.causal else SWEEP_BLOCK_M
                for bm in [b for b in tiles if b <= max(16, triton.next_power_of_2(N))]:
                    for sp in SWEEP_SPLITS if not args.causal else SWEEP_SPLITS[:2]:
                        for nw in SWEEP_WARPS:
                            cfg = {"block_m": bm, "splits": sp, "num_warps": nw}
                            fn = lambda: _k.tree_attention(q, *pk, lengths, tm, out=out, config=cfg,  # noqa: E731
                                                           causal=args.causal)
                            out.fill_(float("nan"))
                            fn()
                            err = (out.float() - truth).abs().max().item()
                            us = graph_ms(fn) * 1e3
                            configs.append({**cfg, "us": us, "gbs": nbytes / (us * 1e-6) / 1e9, "max_abs_err": err})
                best = min(configs, key=lambda c: c["us"])
                shapes.append({"R": R, "prefix": prefix, "N": N, "bytes": nbytes, "default_us": default_us,
                               "default_gbs": nbytes / (default_us * 1e-6) / 1e9, "best": best, "configs": configs})
                print(f"R={R} prefix={prefix} N={N}: default {default_us:.1f} us, best {best['us']:.1f} us "
                      f"(block_m {best['block_m']}, splits {best['splits']}, warps {best['num_warps']}; "
                      f"{best['gbs']:.0f} GB/s = {100 * best['gbs'] / copy_gbs:.0f}% of copy, err {best['max_abs_err']:.2g})")
    out_path = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                        "tree_attention_causal_sweep.json" if args.causal
                                        else "tree_attention_sweep.json")
    result = dict(op="tree_attention launch-config sweep" + (" (causal)" if args.causal else ""),
                  device=torch.cuda.get_device_name(),
                  torch=torch.__version__, triton=triton.__version__, python=platform.python_version(),
                  date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  command=" ".join([os.path.relpath(sys.argv[0])] + sys.argv[1:]), copy_gbs=copy_gbs,
                  timer="CUDA-graph replay, L2 flushed, memset graph subtracted", shapes=shapes)
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    with open(out_path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {out_path}")


if __name__ == "__main__":
    main()
