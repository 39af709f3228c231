"""Acceptance of seeded sampling's Gumbel coupling against rejection sampling, with the bundled
demo target/draft LLaVA pair on the CPU (float32), per scenario of the procedural world.

    python benchmarks/coupling_acceptance.py [--prompts 3] [--seeds 2] [--top-k K] [--top-p P]
                                             [--out benchmarks/results]

For each scenario S1-S5 (`benchmarks.world.examples(sc, n, seed=0)`, the prompts
benchmarks/scenarios.py uses), each temperature (1.0, 0.7) and each mode, every prompt is decoded
with `--seeds` seeds: `coupling` = SamplingParams(seed=s) (the default for a seeded request:
tokens independent of batch, draft and tree), `rejection` = the same with reproducible=False
(speculative rejection sampling against the draft mixture). The engine runs the views (M, T)
with the w-grid policy, chains of gamma = 5 on every block (adaptive=False: the cost model does
not switch to AR on the CPU); `--tree DxWxB` runs trees instead. τ (tokens per target forward)
= Σ(new_tokens - 1) / Σ target_forwards over a cell's generations (the prefill's token excluded,
as `GenerationStats.block_efficiency`). Both modes sample the same target distribution, so
their τ differ only by the acceptance rule (and sampling noise: the generations differ).
With `--top-k` / `--top-p` every request carries that filter, and a third mode `coupling-blind`
runs the coupling with the draft's filter switched off (`blocks.draft_filter` patched here: the
draft proposing from its whole mixture, as before the draft applied the request's filter).

Writes coupling_acceptance_cpu[_tree].json and .md under --out.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tabed_engine.config import SamplingParams  # noqa: E402
from tabed_engine.engine import blocks  # noqa: E402
from tabed_engine.engine.engine import Engine  # noqa: E402
from tabed_engine.speculation.sampling import draft_filter  # noqa: E402
from benchmarks.scenarios import DEMO, MAX_NEW, git_commit  # noqa: E402
from benchmarks.world.scenarios import SCENARIOS, examples  # noqa: E402

TEMPERATURES = (1.0, 0.7)
MODES = {"coupling": True, "rejection": False}      # SamplingParams.reproducible
BLIND = "coupling-blind"                             # with a filter: the draft ignores it (benchmark only)


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown"


def modes(top_k: int, top_p: float) -> dict:
    """The modes a run compares: coupling and rejection, plus the filter-blind coupling when the
    requests filter."""
    return {**MODES, BLIND: True} if top_k or top_p < 1.0 else dict(MODES)


def run(n_prompts: int, n_seeds: int, tree, top_k: int = 0, top_p: float = 1.0) -> dict:
    torch.set_num_threads(1)
    t_start = time.perf_counter()
    eng = Engine.from_pretrained(os.path.join(DEMO, "target"), os.path.join(DEMO, "draft"), device="cpu",
                                 dtype=torch.float32, views=("M", "T"), policy="w-grid", gamma=5, tree=tree,
                                 adaptive=False)
    results: dict = {}
    for sc in SCENARIOS:
        exs = examples(sc, n_prompts, seed=0)
        results[sc] = {}
        for temp in TEMPERATURES:
            for mode, reproducible in modes(top_k, top_p).items():
                new = fwd = 0
                t0 = time.perf_counter()
                blocks.draft_filter = (lambda sp: {}) if mode == BLIND else draft_filter
                for i, e in enumerate(exs):
                    for s in range(n_seeds):
                        sp = SamplingParams(max_new_tokens=MAX_NEW[sc], temperature=temp, seed=1000 * i + s,
                                            reproducible=reproducible, top_k=top_k, top_p=top_p)
                        o = eng.generate(e.prompt, images=e.images, sampling=sp, caption=e.captions)
                        new += o.stats.new_tokens - 1
                        fwd += o.stats.target_forwards
                blocks.draft_filter = draft_filter
                tau = new / fwd if fwd else 1.0
                results[sc][f"T={temp} {mode}"] = {"tau": round(tau, 4), "new_tokens_excl_prefill": new,
                                                   "target_forwards": fwd, "generations": len(exs) * n_seeds,
                                                   "wall_s": round(time.perf_counter() - t0, 1)}
                print(f"[{sc}] T={temp} {mode:9s} tau {tau:.3f} ({new} tokens / {fwd} forwards)", flush=True)
    return {
        "provenance": {
            "device": "cpu", "cpu": cpu_model(), "threads": torch.get_num_threads(), "torch": torch.__version__,
            "transformers": __import__("transformers").__version__, "python": platform.python_version(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": "python " + " ".join([os.path.relpath(sys.argv[0], ROOT)] + sys.argv[1:]),
            "git_commit": git_commit(), "wall_s": round(time.perf_counter() - t_start, 1),
        },
        "setup": {"models": "tabed_engine/assets/demo/{target,draft}", "dtype": "float32", "views": ["M", "T"],
                  "policy": "w-grid", "blocks": "tree " + str(tree) if tree else "chains, gamma 5",
                  "adaptive": False, "top_k": top_k, "top_p": top_p, "prompts_per_scenario": n_prompts, "seeds_per_prompt": n_seeds,
                  "example_seeds": "world.examples(sc, n, seed=0)", "max_new_tokens": MAX_NEW,
                  "tau": "sum(new_tokens - 1) / sum(target_forwards) over the cell's generations"},
        "results": results,
    }


def markdown(rep: dict) -> str:
    pv, st = rep["provenance"], rep["setup"]
    cols = [f"T={t} {m}" for t in TEMPERATURES for m in modes(st.get("top_k", 0), st.get("top_p", 1.0))]
    lines = [f"# Seeded coupling vs rejection sampling: τ on the bundled pair ({st['blocks']})", "",
             f"{pv['date']}, {pv['cpu']}, {pv['threads']} thread, torch {pv['torch']}, transformers "
             f"{pv['transformers']}, commit {pv['git_commit'][:10]}, `{pv['command']}`, {pv['wall_s']} s.",
             f"{st['prompts_per_scenario']} prompts x {st['seeds_per_prompt']} seeds per scenario, views M+T, "
             f"w-grid, float32, adaptive=False, top-k {st.get('top_k', 0)}, top-p {st.get('top_p', 1.0)}. "
             "τ = tokens per target forward (prefill token excluded).", "",
             "| scenario | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    tot = {c: [0, 0] for c in cols}
    for sc, r in rep["results"].items():
        lines.append(f"| {sc} | " + " | ".join(f"{r[c]['tau']:.3f}" for c in cols) + " |")
        for c in cols:
            tot[c][0] += r[c]["new_tokens_excl_prefill"]
            tot[c][1] += r[c]["target_forwards"]
    lines.append("| all | " + " | ".join(f"{tot[c][0] / tot[c][1]:.3f}" for c in cols) + " |")
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--tree", default=None, help="DxWxB: trees instead of chains")
    ap.add_argument("--top-k", type=int, default=0, help="every request's top-k (0: none)")
    ap.add_argument("--top-p", type=float, default=1.0, help="every request's top-p (1: none)")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"))
    args = ap.parse_args()
    rep = run(args.prompts, args.seeds, args.tree, args.top_k, args.top_p)
    name = "coupling_acceptance_cpu" + ("_tree" if args.tree else "") + (f"_topk{args.top_k}" if args.top_k else "") \
        + (f"_topp{args.top_p:g}" if args.top_p < 1.0 else "")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, name + ".json"), "w") as f:
        json.dump(rep, f, indent=1)
    md = markdown(rep)
    with open(os.path.join(args.out, name + ".md"), "w") as f:
        f.write(md)
    print(md)


if __name__ == "__main__":
    main()
