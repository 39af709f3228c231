"""Benchmark: the ensemble-history update + next weights (one Triton launch) vs the PyTorch path.

    python benchmarks/bench_history_update.py [--out benchmarks/results/history_update.json]
    TRITON_INTERPRET=1 python benchmarks/bench_history_update.py --smoke   # CPU, tiny, no claims

Engine shapes: B = 1, gamma = 5 positions per block, capacity 5 * 129 slots with the row's
cursor half way (322 recorded positions), K in {2, 4} views; policies w-grid (0.1 grid: G = 11 or
286 weight vectors), hedge, kld. Columns (per call, medians):
  fused     tabed_engine.kernels.history_update
  eager     tabed_engine.ops.history_update.history_update_reference (the previous engine path)
  compiled  torch.compile of the reference (static shapes)
`stream` = plain launches timed with CUDA events, `graph` = the same calls replayed from one
CUDA graph (how the engine runs it). GB/s counts the history read (valid flags, per-view
divergences, and for w-grid the match and KL rows) and the block written, over the graph
time of the fused kernel, next to a 256 MiB device-to-device copy measured in the same run.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_rope_kv_write import (add_common_args, begin_table, compile_static, device_and_out,  # noqa: E402
                                 print_row, time_variants, write_result)
from tabed_engine.speculation.ensemble import HEDGE_CLIP, EnsembleConfig  # noqa: E402
from tabed_engine.kernels import history_update as _k  # noqa: E402
from tabed_engine.ops.history_update import (POLICY_DIV, POLICY_GRID, POLICY_HEDGE,  # noqa: E402
                                             history_update_reference)

POLICIES = {"w-grid": POLICY_GRID, "hedge": POLICY_HEDGE, "kld": POLICY_DIV}


def make_state(B, K, G, cap, cursor, P, device, gen):
    valid = torch.zeros(B, cap, dtype=torch.bool)
    valid[:, :cursor] = torch.rand(B, cursor, generator=gen) < 0.7
    st = dict(valid=valid, div=torch.rand(B, K, cap, generator=gen) * 2,
              match=(torch.rand(B, G, cap, generator=gen) < 0.4).float(), gkl=torch.rand(B, G, cap, generator=gen))
    new = dict(div_new=torch.rand(B, K, P, generator=gen), match_new=(torch.rand(B, G, P, generator=gen) < 0.4).to(torch.uint8),
               gkl_new=torch.rand(B, G, P, generator=gen), n_acc=torch.full((B,), 2, dtype=torch.long),
               cursor=torch.full((B,), cursor, dtype=torch.long))
    return ({k: v.to(device) for k, v in st.items()}, {k: v.to(device) for k, v in new.items()})


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--views", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--gamma", type=int, default=5)
    ap.add_argument("--capacity", type=int, default=5 * 129)
    add_common_args(ap, "history_update")
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    device, out_path = device_and_out(args, "history_update")
    if args.smoke:
        args.capacity, args.no_compile, args.reps, args.views = 40, True, 3, [2, 3]
    compiled = None if args.no_compile else compile_static(history_update_reference, fullgraph=False)

    copy_gbs = begin_table(device, args, f"{'case':>16}")
    gen = torch.Generator().manual_seed(0)
    rows = []
    B, P, cap = 1, args.gamma, args.capacity
    cursor = cap // 2
    for K in args.views:
        grid = EnsembleConfig(policy="w-grid", num_views=K, grid_step=0.1 if not args.smoke else 0.25).grid(device)
        for name, policy in POLICIES.items():
            g = grid if policy == POLICY_GRID else None
            G = g.shape[0] if g is not None else 0
            st, new = make_state(B, K, G, cap, cursor, P, device, gen)
            kw = dict(policy=policy, window=0, temperature=1.0, clip=HEDGE_CLIP, all_positions=policy == POLICY_HEDGE)
            pos = (new["div_new"], new["match_new"] if G else None, new["gkl_new"] if G else None, new["n_acc"],
                   new["cursor"], st["valid"], st["div"], st["match"], st["gkl"], g)
            w_out = torch.empty(B, K, device=device)
            fns = {"fused": lambda: _k.history_update(*pos, out=w_out, **kw),
                   "eager": lambda: history_update_reference(*pos, **kw)}
            if compiled is not None:
                fns["compiled"] = lambda: compiled(*pos, **kw)
            fns["fused"]()
            w_ref, _ = history_update_reference(*pos, **kw)
            err = (w_out - w_ref).abs().max().item()
            stream, graph = time_variants(fns, device, args)
            nbytes = cap + 4 * K * (cursor + P) + 8 * G * (cursor + P) + 4 * (K + G) * P
            base = graph.get("fused", stream["fused"])
            gbs = nbytes / (base * 1e-6) / 1e9
            rows.append(dict(case=f"{name} K={K}", views=K, policy=name, G=G, gamma=P, capacity=cap, cursor=cursor,
                             bytes=nbytes, stream_us=stream, graph_us=graph, fused_gbs=gbs,
                             pct_copy=100 * gbs / copy_gbs, max_abs_err_vs_eager=err))
            print_row(f"{name + ' K=' + str(K):>16}", stream, graph, gbs, copy_gbs, err)
    write_result("history_update", args, device, copy_gbs, rows, out_path, t_start)


if __name__ == "__main__":
    main()
