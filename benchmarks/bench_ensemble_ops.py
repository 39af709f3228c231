"""Benchmark of the ensemble ops against their PyTorch references: ensemble_mix,
window_divergence, chain_verify (writes benchmarks/results/ensemble_ops.json).

For each op at the engine's shapes (one request and up to 64, K in {1, 2, 4}, V = 32064,
P = gamma in {5, 6}) times the Triton op, the eager PyTorch reference and torch.compile of
the reference (triton.testing.do_bench, median; plus CUDA-graph replays, as the engine runs
them), and reports achieved GB/s from the bytes each op must move next to the copy bandwidth
measured in the same run. Inputs of 4 MB or more are also timed on rotating copies
(`*_graph_cold_us`: 256 MB or more read in turn, every call's input from DRAM). The
pytest-benchmark suite (`pytest benchmarks/ --benchmark-only`, bench_kernels.py) times
every kernel alone; this script adds the reference baselines and the committed JSON.

    python benchmarks/bench_ensemble_ops.py [--out benchmarks/results/ensemble_ops.json]
    TRITON_INTERPRET=1 python benchmarks/bench_ensemble_ops.py --smoke   # CPU check, no timings

The run keeps to --time-budget seconds (default 150): once half of it is spent the
torch.compile baselines are skipped (each costs a compilation per shape), past 80% the eager
baselines and graph replays too; skipped cells say so in the JSON.
"""
import argparse
import datetime
import itertools
import json
import os
import platform
import sys
import time

import torch

if "--smoke" in sys.argv and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first triton import

import triton  # noqa: E402
import triton.testing  # noqa: E402

from tabed_engine.kernels import chain_verify as k_cv  # noqa: E402
from tabed_engine.kernels import ensemble_mix as k_em  # noqa: E402
from tabed_engine.kernels import window_divergence as k_wd  # noqa: E402
from tabed_engine.ops.chain_verify import chain_verify_reference  # noqa: E402
from tabed_engine.ops.ensemble_mix import ensemble_mix_reference  # noqa: E402
from tabed_engine.ops.window_divergence import window_divergence_reference  # noqa: E402


def simplex_grid(K, steps=10):
    pts = [c for c in itertools.product(range(steps + 1), repeat=K) if sum(c) == steps]
    return torch.tensor(pts, dtype=torch.float32) / steps


OPS = {  # op: (Triton launcher, PyTorch reference)
    "ensemble_mix": (k_em.ensemble_mix, ensemble_mix_reference),
    "window_divergence": (k_wd.window_divergence, window_divergence_reference),
    "chain_verify": (k_cv.chain_verify, chain_verify_reference),
}


def cases(smoke, device):
    """(op, label, bytes it must move, args, kwargs, reference comparable) per configuration."""
    V = 64 if smoke else 32064
    dt, es = torch.bfloat16, 2
    g = torch.Generator().manual_seed(0)

    def rnd(*shape):
        return (torch.randn(*shape, generator=g) * 2.0).to(dt).to(device)

    out = []
    # ensemble_mix: logits read once from DRAM (pass 2 re-reads from L2).  Greedy is compared
    # with the reference; the reference's sampling syncs the host, so sampling is Triton-only.
    em_shapes = [(1, 1), (1, 4)] if smoke else [(1, 1), (1, 2), (1, 4), (16, 4), (64, 1), (64, 4)]
    for B, K in em_shapes:
        logits = rnd(B * K, V)
        w = torch.full((B, K), 1.0 / K, device=device)
        seed = torch.zeros(1, dtype=torch.int64, device=device)
        off = torch.zeros(1, dtype=torch.int64, device=device)
        nbytes = B * K * V * es
        out.append(("ensemble_mix", f"greedy B={B} K={K} V={V}", nbytes, (logits, w),
                    {"greedy": True}, True))
        out.append(("ensemble_mix", f"sample B={B} K={K} V={V}", nbytes, (logits, w),
                    {"greedy": False, "seed": seed, "offset": off}, False))
        # the engine's sampled draft step: the mixture row is kept for the verification (bytes
        # counted: logits read once + the fp32 mixture written)
        out.append(("ensemble_mix", f"sample+mixture B={B} K={K} V={V}", nbytes + B * V * 4, (logits, w),
                    {"greedy": False, "seed": seed, "offset": off, "return_mixture": True}, False))
    # Independent random views (above) rarely share an argmax, so greedy K > 1 takes the
    # second pass there. The draft's views are one model on views of one request and mostly
    # agree: "agree" rows are a shared random row plus 0.3-scale noise per view, where pass
    # 1's certificate decides the token (the row reports the certified fraction).
    agree_shapes = [(1, 4)] if smoke else [(1, 2), (1, 4), (16, 4), (64, 4)]
    for B, K in agree_shapes:
        base = torch.randn(B, 1, V, generator=g) * 2.0
        logits = (base + 0.3 * torch.randn(B, K, V, generator=g)).reshape(B * K, V).to(dt).to(device)
        w = torch.full((B, K), 1.0 / K, device=device)
        out.append(("ensemble_mix", f"greedy agree B={B} K={K} V={V}", B * K * V * es, (logits, w),
                    {"greedy": True}, True))
    # window_divergence: P history positions of the [P, B, K(+1), V] buffer, as the engine
    # passes them; grid = the w-grid policy's 0.1-step simplex grid.
    wd_shapes = [(1, 2, 5, False), (1, 2, 5, True)] if smoke else [
        (1, 1, 5, False), (1, 2, 5, False), (1, 4, 6, False), (16, 4, 6, False),
        (64, 1, 6, False), (64, 4, 6, False), (1, 2, 5, True), (1, 4, 6, True)]
    for B, K, P, with_grid in wd_shapes:
        buf = rnd(P, B, K + 1, V)
        p_l, q_l = buf[:, :, 0].permute(1, 0, 2), buf[:, :, 1:].permute(1, 2, 0, 3)
        grid = simplex_grid(K, 2 if smoke else 10).to(device) if with_grid else None
        tag = f" G={grid.shape[0]}" if with_grid else ""
        out.append(("window_divergence", f"B={B} K={K} P={P} V={V}{tag}", B * (K + 1) * P * V * es,
                    (p_l, q_l), {"grid": grid}, True))
        if not with_grid and (smoke or K > 1 or B > 1):  # KL alone (kld/hedge): one pass
            out.append(("window_divergence", f"KL only B={B} K={K} P={P} V={V}", B * (K + 1) * P * V * es,
                        (p_l, q_l), {"grid": None, "tv": False}, True))
        if not with_grid:
            # the engine's tvd history (KL and TV): the rows' normalisers come from the
            # verification and the draft loop (q's as a permuted [P, B, K] buffer): one pass
            # (the reference takes them too)
            p_lse = torch.logsumexp(p_l.float(), -1)
            q_lse = torch.logsumexp(q_l.float(), -1).permute(2, 0, 1).contiguous().permute(1, 2, 0)
            norms = {"p_lse": p_lse, "q_lse": q_lse}
            out.append(("window_divergence", f"lse given B={B} K={K} P={P} V={V}",
                        B * (K + 1) * P * V * es, (p_l, q_l), {"grid": None, **norms}, True))
    # chain_verify: greedy on bf16 logits with every token accepted (all gamma+1 rows read);
    # sampling on fp32 probabilities with q == p (all accepted, bonus drawn from p_gamma: one
    # row of p read) and, at 64+ requests, with q peaked at the drafts (rejected at position
    # 0: the residual p_0 - q_0, a row of p and one of q).
    cv_shapes = [(1, 5)] if smoke else [(1, 5), (1, 6), (64, 5)]
    for B, gamma in cv_shapes:
        logits = rnd(B, gamma + 1, V)
        draft = logits[:, :gamma].argmax(-1)
        out.append(("chain_verify", f"greedy B={B} gamma={gamma} V={V}", B * (gamma + 1) * V * es,
                    (draft, None, logits), {"greedy": True}, True))
        # the tvd policy's verification: the target rows' logsumexp from the same pass
        lse = torch.empty(B, gamma + 1, device=device)
        out.append(("chain_verify", f"greedy+lse B={B} gamma={gamma} V={V}", B * (gamma + 1) * V * es,
                    (draft, None, logits), {"greedy": True, "lse_out": lse}, True))
        p = torch.softmax(logits.float(), dim=-1)
        q = p[:, :gamma].contiguous()
        u = torch.rand(B, gamma + 1, generator=g).to(device)
        out.append(("chain_verify", f"sample B={B} gamma={gamma} V={V}", B * V * 4,
                    (draft, q, p), {"greedy": False, "uniforms": u}, True))
        if B >= 64:
            q_l = torch.randn(B, gamma, V, generator=g) * 2.0
            q_l.scatter_add_(2, draft.cpu()[..., None], torch.full((B, gamma, 1), 20.0))
            q_rej = torch.softmax(q_l, dim=-1).to(device)
            out.append(("chain_verify", f"sample rejected@0 B={B} gamma={gamma} V={V}", 2 * B * V * 4,
                        (draft, q_rej, p), {"greedy": False, "uniforms": u}, True))
    return out


_COMPILED = {}


def compiled_reference(op):
    """torch.compile of the reference, specialised per shape.  Dynamo's default limit of 8
    recompilations per function would silently fall back to eager for later shapes."""
    for knob in ("cache_size_limit", "recompile_limit"):
        if hasattr(torch._dynamo.config, knob):
            setattr(torch._dynamo.config, knob, 256)
    if op not in _COMPILED:
        _COMPILED[op] = torch.compile(OPS[op][1], dynamic=False)
    return _COMPILED[op]


def time_us(fn, smoke):
    if smoke:  # interpreter: run once, no timing claim
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e6
    return triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median") * 1e3


def rotating(fn_of, args, kwargs, nbytes, min_bytes=256 << 20):
    """A no-argument callable for do_bench_cudagraph that calls fn_of(*args, **kwargs) on
    the next of n copies of the large (>= 1 MB) input tensors (same strides), n such that
    the calls in one round read `min_bytes` or more (`nbytes` each: what the op reads, which
    can be a small part of its inputs, e.g. chain_verify's one row of p): each captured call
    reads inputs no recent call read."""
    def big(t):
        return torch.is_tensor(t) and t.numel() * t.element_size() >= (1 << 20)

    def copy(t):
        if not big(t):
            return t
        c = torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device=t.device)
        return c.copy_(t)

    size = sum(t.numel() * t.element_size() for t in list(args) + list(kwargs.values()) if big(t))
    n = max(1, -(-min_bytes // max(min(size, nbytes), 1)))
    copies = [([copy(t) for t in args], {k: copy(v) for k, v in kwargs.items()}) for _ in range(n)]
    turn = itertools.count()

    def call():
        a, kw = copies[next(turn) % n]
        return fn_of(*a, **kw)
    return call


def graph_time_us(fn):
    try:
        return triton.testing.do_bench_cudagraph(fn, rep=60, return_mode="median") * 1e3
    except Exception as e:  # an implementation that cannot be captured is recorded as such
        return f"not capturable: {type(e).__name__}"


def copy_bandwidth_gbs(device, smoke):
    n = (1 << 20) if smoke else (1 << 28)  # 1 GiB of fp32 each way on the GPU
    x = torch.empty(n, dtype=torch.float32, device=device).normal_()
    y = torch.empty_like(x)
    t_us = time_us(lambda: y.copy_(x), smoke)
    return 2 * x.numel() * 4 / (t_us * 1e-6) / 1e9


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results/ensemble_ops.json")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on CPU/interpreter, no timing claims")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile baseline")
    ap.add_argument("--time-budget", type=float, default=150.0,
                    help="seconds: baselines are skipped as the run nears it (see the docstring)")
    ap.add_argument("--ops", nargs="+", choices=sorted(OPS), default=None, help="only these ops (default: all)")
    args = ap.parse_args()
    t_start = time.perf_counter()
    cuda = torch.cuda.is_available()
    if not cuda and not args.smoke:
        sys.exit("needs a CUDA GPU (or --smoke)")
    device = "cuda" if cuda else "cpu"
    smoke = args.smoke
    copy_gbs = copy_bandwidth_gbs(device, smoke)
    rows = []
    for op, label, nbytes, a, kw, comparable in cases(smoke, device):
        if args.ops and op not in args.ops:
            continue
        launcher, reference = OPS[op]
        spent = (time.perf_counter() - t_start) / args.time_budget
        row = {"op": op, "case": label, "bytes": nbytes}
        impls = {"triton": lambda: launcher(*a, **kw)}
        if comparable:
            if spent < 0.8:
                impls["eager"] = lambda: reference(*a, **kw)
            else:
                row["eager_us"] = "skipped: time budget"
            if args.no_compile:
                pass
            elif spent < 0.5:
                impls["compile"] = lambda: compiled_reference(op)(*a, **kw)
            else:
                row["compile_us"] = "skipped: time budget"
        for name, fn in impls.items():
            try:
                us = time_us(fn, smoke)
            except Exception as e:  # e.g. torch.compile failing on this stack: record, go on
                row[f"{name}_us"] = f"failed: {type(e).__name__}: {e}"[:200]
                continue
            row[f"{name}_us"] = us
            if not smoke:
                row[f"{name}_GBs"] = nbytes / (us * 1e-6) / 1e9
                if cuda and (name == "triton" or spent < 0.8):
                    row[f"{name}_graph_us"] = graph_time_us(fn)
        if cuda and not smoke and nbytes >= (4 << 20) and isinstance(row.get("triton_graph_us"), float):
            row["triton_graph_cold_us"] = graph_time_us(rotating(launcher, a, kw, nbytes))
            cold = row["triton_graph_cold_us"]
            if isinstance(cold, float):
                row["triton_graph_cold_pct_of_copy"] = 100 * nbytes / (cold * 1e-6) / 1e9 / copy_gbs
        if op == "ensemble_mix" and kw["greedy"] and a[1].shape[1] > 1:
            certified = torch.zeros(a[1].shape[0], dtype=torch.int32, device=device)
            launcher(*a, **kw, certified_out=certified)
            row["certified_fraction"] = certified.float().mean().item()
        if isinstance(row.get("triton_graph_us"), float):
            row["triton_graph_GBs"] = nbytes / (row["triton_graph_us"] * 1e-6) / 1e9
            row["triton_graph_pct_of_copy"] = 100 * row["triton_graph_GBs"] / copy_gbs
        if not smoke and isinstance(row.get("triton_us"), float):
            row["triton_pct_of_copy"] = 100 * row["triton_GBs"] / copy_gbs
            for base in ("eager", "compile"):
                if isinstance(row.get(f"{base}_us"), float):
                    row[f"speedup_vs_{base}"] = row[f"{base}_us"] / row["triton_us"]
        rows.append(row)
    print_table(rows, copy_gbs, smoke)
    result = {
        "gpu": torch.cuda.get_device_name() if cuda else f"cpu ({platform.processor() or platform.machine()})",
        "torch": torch.__version__, "triton": triton.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "smoke": smoke, "interpreter": bool(os.environ.get("TRITON_INTERPRET")),
        "copy_bandwidth_GBs": copy_gbs, "timer": "triton.testing.do_bench median (us); *_graph_us: do_bench_cudagraph; "
                 "*_graph_cold_us: do_bench_cudagraph over rotating input copies (>= 256 MB)",
        "wall_s": time.perf_counter() - t_start,
        "rows": rows,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out}")


def print_table(rows, copy_gbs, smoke):
    print(f"copy bandwidth: {copy_gbs:.0f} GB/s" + ("  (smoke: no timing claims)" if smoke else ""))
    cols = ["triton_us", "eager_us", "compile_us", "triton_graph_us", "triton_graph_cold_us", "triton_pct_of_copy",
            "triton_graph_pct_of_copy", "triton_graph_cold_pct_of_copy", "speedup_vs_eager", "speedup_vs_compile"]
    widths = [max(20, len(c) + 2) for c in cols]
    print(f"{'op':<18}{'case':<34}" + "".join(f"{c:>{w}}" for c, w in zip(cols, widths)))
    for r in rows:
        cells = []
        for c, w in zip(cols, widths):
            v = r.get(c, "")
            cells.append(f"{v:>{w}.2f}" if isinstance(v, float) else f"{str(v)[:w - 1]:>{w}}")
        print(f"{r['op']:<18}{r['case']:<34}" + "".join(cells))


if __name__ == "__main__":
    main()
