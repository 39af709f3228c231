"""Where a tree block's time goes at the LLaVA-1.5-7B shape: the captured draft, verification
and history graphs of tree engines (and of the K = 2 chain engine) replayed under
torch.profiler, CUDA kernel time grouped by kernel name, next to each graph's event time.

    python benchmarks/profile_tree.py [--trees 5x3x5 10x3x2] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import event_ms  # noqa: E402
from e2e import CAPTION, PRESETS, Bench, accept_schedule  # noqa: E402
from e2e_common import add_common_args, log, resolve_device  # noqa: E402
from profile_decode import profile  # noqa: E402


def graph_profiles(eng, reps: int) -> dict:
    """Per captured graph of `eng` (draft / verify / hist, every key): event ms and the top
    kernels by device time per replay."""
    out = {}
    for key, cap in (eng.graphs.graphs.items() if eng.graphs is not None else ()):   # CPU: no graphs
        if key[0] not in ("draft", "verify", "hist"):
            continue
        kernels = profile(cap.graph.replay, steps=5)
        total = sum(us for _, us in kernels)
        out[" ".join(map(str, key))[:120]] = {
            "event_ms": event_ms(cap.graph.replay, reps, inner=10), "kernels_ms": total / 1e3,
            "launches_named": len(kernels),
            "top": [{"kernel": k[:140], "ms": us / 1e3, "share": us / total} for k, us in kernels[:25]]}
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(ap)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="llava-1.5-7b")
    ap.add_argument("--trees", nargs="+", default=["5x3x5", "10x3x2"])
    ap.add_argument("--policy", default="hedge")
    args = resolve_device(ap.parse_args(argv))
    args.skip_hf = True
    from tabed_engine import Engine, SamplingParams

    bench = Bench(args, PRESETS[args.preset])
    bench.result["setup"] = bench.setup()
    base = bench.engines[2]
    result = {"provenance": bench.result["provenance"], "command": " ".join(sys.argv), "shapes": {}}
    sp = SamplingParams(max_new_tokens=64, stop_at_eos=False)
    for name in ["chain"] + list(args.trees):
        tree = None if name == "chain" else name
        eng = base if tree is None else Engine(
            base.target, base.processor, draft=base.draft, device=base.device, dtype=base.dtype, views=base.views,
            policy=args.policy, max_len=bench.p.max_len, tree=tree, max_batch=1, adaptive=False, prefix_cache=False)
        depth = eng.tree.depth if tree else bench.p.gamma
        eng.bench_accept_schedule = accept_schedule(2.31, depth)
        eng.generate(bench.prompt, images=[bench.image], caption=CAPTION, sampling=sp)
        r = {"nodes": eng.tree.nodes if tree else depth + 1, "graphs": graph_profiles(eng, bench.p.replay_reps)}
        result["shapes"][name] = r
        log(f"{name}: " + ", ".join(f"{k}: {v['event_ms']:.3f} ms (kernels {v['kernels_ms']:.3f})"
                                    for k, v in r["graphs"].items()))
        for k, v in r["graphs"].items():
            for t in v["top"][:8]:
                log(f"    {k[:20]:20s} {t['ms']:.4f} ms {100 * t['share']:5.1f}%  {t['kernel'][:90]}")
        if tree:
            del eng
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "profile_tree.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1, default=str)
    log(f"wrote {path}")


if __name__ == "__main__":
    main()
