"""Block efficiency of TABED's views and ensembles on the procedural world's scenarios S1-S5,
with the bundled demo target/draft LLaVA pair, greedy, gamma = 5, on the CPU.

    python benchmarks/scenarios.py [--prompts 50] [--out benchmarks/results] [--seed 0]

For every scenario, `--prompts` deterministic examples (`benchmarks.world.examples(sc, n,
seed)`) are decoded with one Engine per configuration:

* single views M, T, P, C;
* uniform / kld / w-grid / hedge ensembles over (M, T) and over (M, T, P, C), as the engine
  runs them by default: kld and hedge verify every view's own chain as a branch of one tree
  in the first block (no evidence for the weights yet), then draft mixture chains; uniform
  and w-grid draft mixture chains throughout;
* hedge-chain: hedge with mixture chains from the first block (`view_tree=False`), for
  comparison (not used by the checks).

The C view gets the world's caption of each image (`caption=[...]`, one per image).
Block efficiency is aggregated over the prompts of a scenario:
Σ(new_tokens − 1) / Σ target_forwards (the prefill's token is excluded, as in
`GenerationStats.block_efficiency`). Every speculative generation is compared with the
target's autoregressive greedy tokens (one AR run per prompt); mismatches are counted.

Headline set (fixed before running): the adaptive-ensemble checks use the ensembles over
all four views (M, T, P, C), the same views the single-view baselines cover; the (M, T)
ensembles are reported alongside with the same checks.

Writes scenarios.json, scenarios.md and scenarios.png under --out.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tabed_engine.config import SamplingParams  # noqa: E402
from tabed_engine.engine.engine import Engine  # noqa: E402
from benchmarks.world.scenarios import SCENARIOS, examples  # noqa: E402

DEMO = os.path.join(ROOT, "tabed_engine", "assets", "demo")
GAMMA = 5
# max new tokens per scenario: a little above the longest reference answer (incl. "</s>"),
# 42 tokens for descriptions (S1, S4 "say it again", S5), 12 for S2, 10 for S3
MAX_NEW = {"S1": 48, "S2": 16, "S3": 16, "S4": 48, "S5": 48}
SINGLES = ("M", "T", "P", "C")
ADAPTIVE = ("kld", "w-grid", "hedge")
SETS = {"MT": ("M", "T"), "MTPC": ("M", "T", "P", "C")}
HEADLINE = "MTPC"   # chosen before running (see the module docstring)


def configs() -> list[tuple[str, tuple[str, ...], str]]:
    out = [(v, (v,), "uniform") for v in SINGLES]
    for tag, views in SETS.items():
        for pol in ("uniform",) + ADAPTIVE + ("hedge-chain",):
            out.append((f"{pol}[{'+'.join(views)}]", views, pol))
    return out


def git_commit() -> str:
    try:
        return subprocess.check_output(["git", "rev-parse", "HEAD"], cwd=ROOT, text=True).strip()
    except Exception:  # noqa: BLE001
        return "unknown"


def run(n_prompts: int, out_dir: str, seed: int = 0) -> dict:
    torch.set_num_threads(1)
    t_start = time.perf_counter()
    tgt, drf = os.path.join(DEMO, "target"), os.path.join(DEMO, "draft")
    base = Engine.from_pretrained(tgt, drf, device="cpu", views=("M",), policy="uniform", gamma=GAMMA)
    engines = {}
    for name, views, pol in configs():
        # one Engine per configuration; the loaded weights are shared (read-only)
        # "hedge-chain": hedge without the first block's view tree (a mixture chain from the start)
        engines[name] = Engine(base.target, base.processor, draft=base.draft, device=base.device,
                               dtype=base.dtype, views=views, policy=pol.removesuffix("-chain"), gamma=GAMMA,
                               view_tree=not pol.endswith("-chain"))
    results: dict = {}
    mismatches: dict = {}
    for sc in SCENARIOS:
        exs = examples(sc, n_prompts, seed=seed)
        sp = SamplingParams(max_new_tokens=MAX_NEW[sc], temperature=0.0)
        t0 = time.perf_counter()
        ar = [base.generate(e.prompt, images=e.images, sampling=sp, speculative=False).token_ids for e in exs]
        print(f"[{sc}] {len(exs)} prompts, AR reference in {time.perf_counter() - t0:.1f}s, "
              f"mean length {np.mean([len(a) for a in ar]):.1f}", flush=True)
        results[sc] = {}
        for name, views, pol in configs():
            eng = engines[name]
            t0 = time.perf_counter()
            new = fwd = 0
            acc: list[int] = []
            final_w = []
            bad = 0
            per_prompt = []
            for e, ref in zip(exs, ar):
                o = eng.generate(e.prompt, images=e.images, sampling=sp, caption=e.captions)
                s = o.stats
                bad += o.token_ids != ref
                new += s.new_tokens - 1
                fwd += s.target_forwards
                acc += list(s.accepted_lengths)
                per_prompt.append(s.block_efficiency)
                if len(views) > 1 and s.weights:
                    final_w.append(list(s.weights[-1]))
            be = new / fwd if fwd else 1.0
            mismatches.setdefault(name, 0)
            mismatches[name] += bad
            rec = {"block_efficiency": be, "mean_accepted_length": float(np.mean(acc)) if acc else 0.0,
                   "n_prompts": len(exs), "new_tokens_excl_prefill": new, "target_forwards": fwd,
                   "blocks": len(acc), "mean_per_prompt_block_efficiency": float(np.mean(per_prompt)),
                   "ar_mismatches": int(bad), "views": list(views), "policy": pol,
                   "wall_s": time.perf_counter() - t0}
            if final_w:
                rec["final_mean_weights"] = dict(zip(views, np.mean(final_w, 0).round(4).tolist()))
            results[sc][name] = rec
            wtxt = f" w={rec['final_mean_weights']}" if final_w else ""
            print(f"  [{sc}] {name:22s} BE {be:.3f}  acc {rec['mean_accepted_length']:.2f}  "
                  f"mismatch {bad}  {rec['wall_s']:.1f}s{wtxt}", flush=True)
    checks = {tag: compute_checks(results, tag) for tag in SETS}
    report = {
        "provenance": {
            "device": "cpu", "threads": torch.get_num_threads(), "torch": torch.__version__,
            "transformers": __import__("transformers").__version__, "python": platform.python_version(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": "python " + " ".join([os.path.relpath(sys.argv[0], ROOT)] + sys.argv[1:]),
            "git_commit": git_commit(), "wall_s": None,
        },
        "setup": {"models": "tabed_engine/assets/demo/{target,draft}", "greedy": True, "gamma": GAMMA,
                  "prompts_per_scenario": n_prompts, "example_seeds": f"world.examples(sc, n, seed={seed})",
                  "max_new_tokens": MAX_NEW, "caption_for_C": "world caption of each image (list)",
                  "block_efficiency": "sum(new_tokens - 1) / sum(target_forwards) over prompts",
                  "headline_set": HEADLINE},
        "ar_mismatches": mismatches,
        "results": results,
        "checks": checks,
    }
    report["provenance"]["wall_s"] = round(time.perf_counter() - t_start, 1)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "scenarios.json"), "w") as f:
        json.dump(report, f, indent=1)
    with open(os.path.join(out_dir, "scenarios.md"), "w") as f:
        f.write(markdown(report))
    plot(report, os.path.join(out_dir, "scenarios.png"))
    return report


def compute_checks(results: dict, tag: str) -> dict:
    views = SETS[tag]
    names = {p: f"{p}[{'+'.join(views)}]" for p in ("uniform",) + ADAPTIVE}
    be = {sc: {k: r["block_efficiency"] for k, r in results[sc].items()} for sc in results}
    # (1) M and T each trail the other by >= 15% somewhere
    trail_m = {sc: 1 - be[sc]["M"] / be[sc]["T"] for sc in be}   # > 0: M trails T
    trail_t = {sc: 1 - be[sc]["T"] / be[sc]["M"] for sc in be}   # > 0: T trails M
    c1 = max(trail_m.values()) >= 0.15 and max(trail_t.values()) >= 0.15
    # (2) best adaptive within 2% of the best single view, every scenario
    gap, gap_policy = {}, {p: {} for p in ADAPTIVE}
    for sc in be:
        best_single = max(be[sc][v] for v in SINGLES)
        for p in ADAPTIVE:
            gap_policy[p][sc] = be[sc][names[p]] / best_single - 1
        gap[sc] = max(gap_policy[p][sc] for p in ADAPTIVE)
    c2 = all(g >= -0.02 for g in gap.values())
    # (3) adaptive >= 5% above the mean of the single views, averaged over scenarios
    gain = {}
    per_policy = {p: {} for p in ADAPTIVE}
    for sc in be:
        mean_single = float(np.mean([be[sc][v] for v in SINGLES]))
        gain[sc] = max(be[sc][names[p]] for p in ADAPTIVE) / mean_single - 1
        for p in ADAPTIVE:
            per_policy[p][sc] = be[sc][names[p]] / mean_single - 1
    avg_gain = float(np.mean(list(gain.values())))
    c3 = avg_gain >= 0.05
    return {
        "ensemble_views": list(views),
        "check1_M_T_trail_15pct": {"pass": bool(c1), "M_trails_T_rel": trail_m, "T_trails_M_rel": trail_t},
        "check2_adaptive_within_2pct_of_best_single": {"pass": bool(c2), "rel_gap": gap,
                                                        "rel_gap_per_policy": gap_policy},
        "check3_adaptive_5pct_above_mean_single": {
            "pass": bool(c3), "avg_rel_gain_best_of": avg_gain, "rel_gain_best_of": gain,
            "avg_rel_gain_per_policy": {p: float(np.mean(list(v.values()))) for p, v in per_policy.items()},
            "rel_gain_per_policy": per_policy},
    }


def markdown(rep: dict) -> str:
    res = rep["results"]
    scs = list(res)
    names = list(next(iter(res.values())))
    pv, st = rep["provenance"], rep["setup"]
    L = ["# TABED views and ensembles on the procedural world (S1-S5)", "",
         f"Bundled demo pair (`tabed_engine/assets/demo`), greedy, γ = {st['gamma']}, "
         f"{st['prompts_per_scenario']} prompts per scenario (`{st['example_seeds']}`), "
         f"max new tokens {st['max_new_tokens']}. CPU ({pv['threads']} thread), torch {pv['torch']}, "
         f"transformers {pv['transformers']}, {pv['date']}, commit `{pv['git_commit'][:12]}`, "
         f"`{pv['command']}` ({pv['wall_s']} s).", "",
         "Block efficiency = Σ(new tokens − 1) / Σ target forwards over the scenario's prompts "
         "(tokens per target forward; the prefill token excluded).", "",
         "kld and hedge run as the engine does by default: their first block verifies every view's own "
         "greedy chain as a branch of one tree (shared prefixes merged), at most 1 + Kγ tokens in that "
         "forward (11 with two views, 21 with four) instead of γ + 1 = 6 (the draft work is the same: the "
         "views are rows of one batch either way); block efficiency counts forwards. `hedge-chain` is hedge with a mixture chain from the "
         "first block. uniform and w-grid draft mixture chains throughout.", "",
         f"Headline ensemble set (fixed before running): **{'+'.join(SETS[st['headline_set']])}**; "
         "the M+T ensembles are reported with the same checks.", "",
         "## Block efficiency", "",
         "| config | " + " | ".join(scs) + " | mean |", "|---|" + "---|" * (len(scs) + 1)]
    for n in names:
        vals = [res[sc][n]["block_efficiency"] for sc in scs]
        L.append(f"| {n} | " + " | ".join(f"{v:.2f}" for v in vals) + f" | {np.mean(vals):.2f} |")
    L += ["", "For reference (not used by the checks): the mean over prompts of each prompt's own block "
          "efficiency, which weights short answers (S2-S4) as much as long ones:", "",
          "| config | " + " | ".join(scs) + " |", "|---|" + "---|" * len(scs)]
    for n in names:
        L.append(f"| {n} | " + " | ".join(f"{res[sc][n]['mean_per_prompt_block_efficiency']:.2f}" for sc in scs) + " |")
    L += ["", "## Mean accepted draft tokens per block", "",
          "| config | " + " | ".join(scs) + " |", "|---|" + "---|" * len(scs)]
    for n in names:
        L.append(f"| {n} | " + " | ".join(f"{res[sc][n]['mean_accepted_length']:.2f}" for sc in scs) + " |")
    L += ["", "## Final ensemble weights (mean over prompts of the last block's weights)", "",
          "| config | " + " | ".join(scs) + " |", "|---|" + "---|" * len(scs)]
    for n in names:
        if "final_mean_weights" in res[scs[0]][n]:
            L.append(f"| {n} | " + " | ".join(
                " ".join(f"{k}:{v:.2f}" for k, v in res[sc][n]["final_mean_weights"].items()) for sc in scs) + " |")
    mm = rep["ar_mismatches"]
    L += ["", f"Lossless check: SD tokens vs. AR tokens on every generation of every config: "
          f"{sum(mm.values())} mismatches out of {len(mm) * len(scs) * st['prompts_per_scenario']} generations.", ""]
    for tag in (st["headline_set"],) + tuple(t for t in SETS if t != st["headline_set"]):
        ch = rep["checks"][tag]
        head = " (headline)" if tag == st["headline_set"] else ""
        c1, c2, c3 = (ch["check1_M_T_trail_15pct"], ch["check2_adaptive_within_2pct_of_best_single"],
                      ch["check3_adaptive_5pct_above_mean_single"])
        f = lambda d: ", ".join(f"{k} {100 * v:+.1f}%" for k, v in d.items())  # noqa: E731
        L += [f"## Required-phenomenon checks, ensembles over {'+'.join(ch['ensemble_views'])}{head}", "",
              f"1. **{'PASS' if c1['pass'] else 'FAIL'}** — M and T each trail the other by ≥ 15% "
              "(relative block efficiency) in at least one scenario.  ",
              f"   M behind T (1 − M/T): {f(c1['M_trails_T_rel'])}.  ",
              f"   T behind M (1 − T/M): {f(c1['T_trails_M_rel'])}.",
              f"2. **{'PASS' if c2['pass'] else 'FAIL'}** — best of {' / '.join(ADAPTIVE)} within 2% of the best "
              "single view in every scenario (best adaptive / best single − 1 ≥ −2%).  ",
              f"   {f(c2['rel_gap'])}.  ",
              "   per policy: " + "; ".join(f"{p}: {f(g)}" for p, g in c2["rel_gap_per_policy"].items()) + ".",
              f"3. **{'PASS' if c3['pass'] else 'FAIL'}** — best of {' / '.join(ADAPTIVE)} ≥ 5% above the mean "
              f"of the four single views, averaged over scenarios: {100 * c3['avg_rel_gain_best_of']:+.1f}%.  ",
              f"   per scenario: {f(c3['rel_gain_best_of'])}.  ",
              "   per policy (avg): " + ", ".join(f"{p} {100 * v:+.1f}%" for p, v in c3["avg_rel_gain_per_policy"].items())
              + ".", ""]
    return "\n".join(L) + "\n"


def plot(rep: dict, path: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = rep["results"]
    scs = list(res)
    names = list(next(iter(res.values())))
    x = np.arange(len(scs))
    w = 0.8 / len(names)
    fig, ax = plt.subplots(figsize=(13, 5))
    cmap = plt.get_cmap("tab10")
    for i, n in enumerate(names):
        ax.bar(x + (i - (len(names) - 1) / 2) * w, [res[sc][n]["block_efficiency"] for sc in scs], w,
               label=n, color=cmap(i % 10), hatch="//" if i >= 10 else None)
    ax.set_xticks(x, scs)
    ax.set_ylabel("block efficiency (tokens / target forward)")
    st = rep["setup"]
    ax.set_title(f"Bundled demo pair, greedy, γ={st['gamma']}, {st['prompts_per_scenario']} prompts per scenario (CPU)")
    ax.legend(ncol=5, fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.08))
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=50)
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"))
    ap.add_argument("--seed", type=int, default=0,
                    help="example seed (the committed table uses 0; other seeds check robustness)")
    a = ap.parse_args()
    rep = run(a.prompts, a.out, a.seed)
    print(markdown(rep))


if __name__ == "__main__":
    main()
