"""Hunt for speculative outputs that leave the target's float32 greedy tokens on the GPU.

    python benchmarks/fp32_mismatch.py cpu-ar  [--prompts 8] [--seeds 0]
    python benchmarks/fp32_mismatch.py poison  [--prompts 8] [--seeds 3 0] [--check-cache] [--max-new 8]
                                               [--no-overlap] [--shared-capture-stream]
    python benchmarks/fp32_mismatch.py repeat  [--runs 24] [--cases S5:3:1:10x3x2 S2:0:0:5x3x5]

With the bundled demo pair in float32 on the procedural world's scenarios:
* cpu-ar: the engine's autoregressive tokens on the GPU against the same engine on the CPU,
  and the largest difference of their prefill logits (float rounding: ~1e-5).
* poison: before every generation each engine's KV caches are filled with a large finite
  value (K +P, V -P); a kernel that reads a slot it must not see then changes the output,
  correct ones cannot (masked scores are -inf, their weights exactly 0). The chain and three
  trees (hedge over M and T) and the AR engine itself are compared with unpoisoned AR.
* repeat: one (scenario, seed, prompt, tree) case many times per engine setting: default,
  adaptive off (no cost model), the draft views' prefill on the main stream, no block queued
  ahead (`timing=True`), no CUDA graphs, no programmatic dependent launch (TABED_PDL=0);
  with --poison, poisoned caches before every run.
With --emulate-graphs (poison, --device cpu) the CPU runs the speculative engines with the CUDA
graphs' static buffers emulated and the cost model on (--random-blocks: kinds drawn at random):
the host logic the GPU runs, without its streams and kernels.
With --check-cache (poison, repeat) every speculative generation's target KV cache is compared
with the AR engine's after the same prompt: the prompt's slots (the same prefill: equal bit for
bit) and the slots of the tokens both generated (different kernels: within float rounding), so
an output that leaves AR's also tells whether the cache it read was already wrong, and where.
Writes fp32_mismatch_<mode>.json under --out.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import random
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.scenarios import DEMO, MAX_NEW, git_commit  # noqa: E402
from benchmarks.world.scenarios import SCENARIOS, examples  # noqa: E402
from tabed_engine import Engine, SamplingParams  # noqa: E402
from tabed_engine.engine.prompt import prepare  # noqa: E402

TREES = (None, "10x3x2", "5x3x5", "12x2x2")
SETTINGS = {"default": {}, "no_adaptive": dict(adaptive=False), "no_overlap": {}, "no_queue": dict(timing=True),
            "no_graphs": dict(cuda_graphs=False), "pdl0": {}}


def ar_engine(device):
    """The bundled pair in float32, decoding autoregressively (the reference) or with the M view."""
    return Engine.from_pretrained(os.path.join(DEMO, "target"), os.path.join(DEMO, "draft"), device=device,
                                  views=("M",), policy="uniform", dtype=torch.float32)


def sd_engine(base, tree, **kw):
    """A speculative engine over `base`'s models: hedge over M and T, chains of 5 or `tree`."""
    return Engine(base.target, base.processor, draft=base.draft, device=base.device, dtype=base.dtype,
                  views=("M", "T"), policy="hedge", gamma=5, tree=tree, **kw)


def first_difference(ref: list, got: list) -> int:
    return next((j for j, (a, b) in enumerate(zip(ref, got)) if a != b), min(len(ref), len(got)))


def prefill_logits(eng, ex, tokens) -> torch.Tensor:
    prep = prepare(eng.processor, ex.prompt, ex.images, eng.target.image_token_id, eng.tokens_per_image)
    return eng.prefill_target(dataclasses.replace(prep, ids=prep.ids + list(tokens)))[1][0].double().cpu()


def each_example(args):
    """(seed, scenario, prompt index, example, sampling) over --seeds x S1-S5 x --prompts."""
    for seed in args.seeds:
        for sc in SCENARIOS:
            sp = SamplingParams(max_new_tokens=min(MAX_NEW[sc], args.max_new or MAX_NEW[sc]))
            for k, ex in enumerate(examples(sc, args.prompts, seed=seed)):
                yield seed, sc, k, ex, sp


def cpu_ar(args) -> list:
    gpu, cpu = ar_engine("cuda"), ar_engine("cpu")
    rows = []
    for seed, sc, k, ex, sp in each_example(args):
        tg = gpu.generate(ex.prompt, images=ex.images, sampling=sp, speculative=False).token_ids
        tc = cpu.generate(ex.prompt, images=ex.images, sampling=sp, speculative=False).token_ids
        row = dict(seed=seed, scenario=sc, prompt=k, same=tg == tc,
                   prefill_max_abs_diff=(prefill_logits(gpu, ex, []) - prefill_logits(cpu, ex, []))
                   .abs().max().item())
        if tg != tc:
            row["position"] = first_difference(tc, tg)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def cache_diff(ref_eng, eng, n_prompt: int, ref: list, got: list) -> dict:
    """Target KV of `eng` against `ref_eng` (row 0, both just generated the same prompt): the
    largest |difference| over the prompt's slots (and the first slot that differs), and the
    largest relative one over the slots of the tokens both generated, but their last."""
    if eng.device.type == "cuda":
        torch.cuda.synchronize()    # a block queued ahead may still write (past these slots)
    a, b = ref_eng.runner.tcache, eng.runner.tcache
    out = {}
    for name, x, y in (("k", a.k[:, 0], b.k[:, 0]), ("v", a.v[:, 0], b.v[:, 0])):
        d = (x[:, :, :n_prompt] - y[:, :, :n_prompt]).abs().amax(dim=(0, 1, 3))      # [n_prompt]
        bad = (d > 0).nonzero()
        out[f"prompt_{name}_max_abs"] = d.max().item()
        out[f"prompt_{name}_first_slot"] = int(bad[0]) if len(bad) else None
        upto = n_prompt + min(first_difference(ref, got), len(ref) - 1, len(got) - 1)
        if upto > n_prompt:
            xs, ys = x[:, :, n_prompt:upto].double(), y[:, :, n_prompt:upto].double()
            out[f"gen_{name}_max_rel"] = ((xs - ys).abs().max() / xs.abs().max().clamp_min(1e-30)).item()
    return out


def graphs_of(eng) -> int:
    """CUDA graphs the engine has captured so far (a generation that captures one runs it
    eagerly once first)."""
    return len(eng.runner.graphs) if eng.runner.graphs is not None else 0


def poison(eng, value: float):
    r = eng.runner
    r.allocate()
    for cache in (r.tcache, r.dcache):
        if cache is not None:
            cache.k.fill_(value)
            cache.v.fill_(-value)


def emulate(eng, rng=None):
    """The CPU run as the GPU's would be: the CUDA graphs' static buffers emulated
    (`GraphCache(emulate=True)`), the prefill padded to its bucket, the cost model on; with
    `rng`, each block's kind (AR, a chain length or the tree) drawn at random instead."""
    from tabed_engine.engine.graphs import GraphCache

    eng.runner.graphs, eng.runner.prefill_graphs = GraphCache(emulate=True), True
    cost = eng.scheduler.cost
    cost.enabled = True
    if rng is not None:
        kinds = [0] + (list(range(1, eng.gamma + 1)) if eng.tree is None else [eng.gamma])
        cost.choose = lambda b, counts: rng.choice(kinds)


def share_capture_stream():
    """Every graph cache warms up and captures on one stream (so its graphs share one cuBLAS
    workspace), the draft views on another: the engine before 7439cd7, for an A/B."""
    from tabed_engine.engine import graphs as graphs

    shared, private = torch.cuda.Stream(), graphs.private_stream
    graphs.private_stream = lambda owner, device=None: (shared if isinstance(owner, graphs.GraphCache)
                                                       else private(owner, device))


def poisoned(args) -> list:
    if args.shared_capture_stream:
        share_capture_stream()
    base = ar_engine(args.device)
    ar = Engine(base.target, base.processor, draft=base.draft, device=base.device, dtype=base.dtype,
                views=("M",), policy="uniform")
    engines = {t or "chain": sd_engine(base, t) for t in TREES}
    if args.emulate_graphs:
        rng = None if args.random_blocks is None else random.Random(args.random_blocks)
        for eng in engines.values():
            emulate(eng, rng)
    if args.no_overlap:           # the draft views' prefill on the main stream, after the target's
        for eng in engines.values():
            eng.runner.overlap_draft = False
    rows = []
    for seed, sc, k, ex, sp in each_example(args):
        ref = base.generate(ex.prompt, images=ex.images, sampling=sp, speculative=False).token_ids
        row = dict(seed=seed, scenario=sc, prompt=k, left_ar={})
        for name, eng in [("AR", ar)] + list(engines.items()):
            poison(eng, args.poison or 1000.0)
            before = graphs_of(eng)
            o = eng.generate(ex.prompt, images=ex.images, sampling=sp, caption=ex.captions,
                             **({"speculative": False} if name == "AR" else {}))
            cd = cache_diff(base, eng, o.stats.prompt_tokens, ref, o.token_ids) if args.check_cache else {}
            if cd and (cd["prompt_k_max_abs"] > 0 or cd["prompt_v_max_abs"] > 0
                       or max(cd.get("gen_k_max_rel", 0), cd.get("gen_v_max_rel", 0)) > 1e-4):
                row.setdefault("cache_differs", {})[name] = cd
            if o.token_ids != ref:
                row["left_ar"][name] = dict(position=first_difference(ref, o.token_ids),
                                            accepted_lengths=o.stats.accepted_lengths,
                                            target_forwards=o.stats.target_forwards, cache=cd,
                                            graphs_captured=graphs_of(eng) - before)
        if row["left_ar"] or "cache_differs" in row:
            print(json.dumps(row), flush=True)
        rows.append(row)
    args.block_kinds = {name: {str(k): n for k, n in sorted(eng.scheduler.kinds.items())}
                        for name, eng in engines.items()}
    return rows


def repeat(args) -> list:
    base = ar_engine(args.device)
    rows = []
    for case in args.cases:
        sc, seed, k, tree = case.split(":")
        ex = examples(sc, int(k) + 1, seed=int(seed))[int(k)]
        sp = SamplingParams(max_new_tokens=MAX_NEW[sc])
        ref = base.generate(ex.prompt, images=ex.images, sampling=sp, speculative=False).token_ids
        for name in args.settings:
            if args.check_cache:   # the reference cache: AR on this prompt just before each setting
                base.generate(ex.prompt, images=ex.images, sampling=sp, speculative=False)
            if name == "pdl0":
                os.environ["TABED_PDL"] = "0"          # read at each launch: the graphs captured below
            try:
                eng = sd_engine(base, None if tree == "chain" else tree, **SETTINGS[name])
                if name == "no_overlap":
                    eng.runner.overlap_draft = False
                left, t0 = [], time.perf_counter()
                for i in range(args.runs):
                    if args.poison is not None:
                        poison(eng, args.poison)
                    o = eng.generate(ex.prompt, images=ex.images, sampling=sp, caption=ex.captions)
                    if o.token_ids != ref:
                        left.append(dict(run=i, position=first_difference(ref, o.token_ids),
                                         accepted_lengths=o.stats.accepted_lengths,
                                         cache=cache_diff(base, eng, o.stats.prompt_tokens, ref, o.token_ids)
                                         if args.check_cache else {}))
            finally:
                os.environ.pop("TABED_PDL", None)
            row = dict(case=case, setting=name, runs=args.runs, left_ar=len(left), where=left[:8],
                       wall_s=round(time.perf_counter() - t0, 1))
            print(json.dumps(row), flush=True)
            rows.append(row)
            del eng
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("mode", choices=("cpu-ar", "poison", "repeat"))
    ap.add_argument("--prompts", type=int, default=8, help="cpu-ar, poison: prompts per scenario")
    ap.add_argument("--seeds", type=int, nargs="+", default=[3, 0], help="cpu-ar, poison: example seeds")
    ap.add_argument("--max-new", type=int, default=None,
                    help="cpu-ar, poison: cap on new tokens (e.g. 8: mostly the first block, many prompts)")
    ap.add_argument("--poison", type=float, default=None,
                    help="the value the caches are filled with (poison: default 1000; repeat: none unless given)")
    ap.add_argument("--cases", nargs="+", default=["S5:3:1:10x3x2", "S2:0:0:5x3x5"],
                    help="repeat: SCENARIO:SEED:PROMPT:TREE (TREE DxWxB or chain)")
    ap.add_argument("--settings", nargs="+", choices=list(SETTINGS), default=list(SETTINGS), help="repeat")
    ap.add_argument("--runs", type=int, default=24, help="repeat: generations per case and setting")
    ap.add_argument("--check-cache", action="store_true",
                    help="poison, repeat: compare each speculative run's target KV cache with AR's")
    ap.add_argument("--shared-capture-stream", action="store_true",
                    help="poison: all graphs captured on one stream, as before 7439cd7 (an A/B)")
    ap.add_argument("--no-overlap", action="store_true",
                    help="poison: the draft views' prefill on the main stream (no second stream)")
    ap.add_argument("--emulate-graphs", action="store_true",
                    help="poison on the CPU: the CUDA graphs' buffers emulated, the cost model on")
    ap.add_argument("--random-blocks", type=int, default=None, metavar="SEED",
                    help="with --emulate-graphs: each block's kind drawn at random (seeded)")
    ap.add_argument("--device", default="cuda", help="poison, repeat: cuda, or cpu (a smoke run of the script)")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"))
    args = ap.parse_args()
    if not torch.cuda.is_available() and (args.mode == "cpu-ar" or args.device == "cuda"):
        sys.exit("fp32_mismatch.py needs a CUDA device (cpu-ar compares it with the CPU)")
    t0 = time.perf_counter()
    rows = {"cpu-ar": cpu_ar, "poison": poisoned, "repeat": repeat}[args.mode](args)
    device = torch.cuda.get_device_name() if args.mode == "cpu-ar" or args.device == "cuda" else "cpu"
    rep = {"provenance": {"device": device, "torch": torch.__version__,
                          "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                          "command": "python " + " ".join([os.path.relpath(sys.argv[0], ROOT)] + sys.argv[1:]),
                          "git": {"commit": git_commit()}, "wall_s": round(time.perf_counter() - t0, 1)},
           "mode": args.mode, "rows": rows}
    if args.mode == "poison":
        names = ["AR"] + [t or "chain" for t in TREES]
        rep["outputs_per_decoder"] = len(rows)
        rep["left_ar"] = {n: sum(n in r["left_ar"] for r in rows) for n in names}
        rep["block_kinds"] = args.block_kinds     # blocks run per engine: 0 AR, g a chain of g (trees: γ)
        print("outputs per decoder", len(rows), "left AR's tokens:", rep["left_ar"], flush=True)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"fp32_mismatch_{args.mode.replace('-', '_')}.json")
    with open(path, "w") as f:
        json.dump(rep, f, indent=1)
    print("wrote", path)


if __name__ == "__main__":
    main()
