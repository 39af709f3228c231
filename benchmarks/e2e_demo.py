"""End-to-end benchmark of the bundled demo pair with real acceptance.

    python benchmarks/e2e_demo.py --out DIR                                   # GPU
    python benchmarks/e2e_demo.py --device cpu --prompts 1 --max-new 8 --out DIR
    (also `python benchmarks/e2e.py --preset demo-pair ...`; --skip-hf omits transformers)

Writes DIR/e2e_demo-pair.json (provenance + every number) and DIR/e2e_demo-pair.md.

The bundled trained pair (tabed_engine/assets/demo, whatever is installed there, through the
normal loader) on the procedural world's scenarios S1-S5, `--prompts` examples each
(`world.examples(sc, n, seed=0)`), greedy, gamma 5, stopping at EOS, with the
engine's real acceptance (no `bench_accept_schedule`; checked before every scenario).
Per scenario: engine AR, engine SD with the demo's views/policy (M+T, hedge), with view
M alone and with the default draft tree over M+T (`TreeConfig()`), and transformers
`generate` greedy on the target (dynamic cache, no compilation).
Every prompt is timed with its token budget and with 1 new token (medians of `repeats`
interleaved passes after an untimed pass over all prompts that captures the graphs):
decode ms/token = (sum t(budget) - sum t(1)) / sum (n - 1); real block efficiency tau =
sum (n - 1) / sum target forwards from the engine's stats; SD tokens are compared with the
engine's AR tokens (mismatches must be 0: the script exits with status 1 otherwise).
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass, field

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import copy_bandwidth_gbs, wall_ms  # noqa: E402
from e2e_common import (E2EBench, add_common_args, check_limit, fmt, header_lines, lm_weight_bytes,  # noqa: E402
                        log, resolve_device)

PRESET = "demo-pair"


@dataclass
class DemoPreset:
    """The bundled synthetic-world pair (tabed_engine/assets/demo) on the scenarios S1-S5,
    with the engine's real acceptance (no schedule override)."""
    prompts: int = 10       # per scenario: world.examples(scenario, prompts, seed=0)
    repeats: int = 3        # timed passes over a scenario's prompts (engine)
    hf_repeats: int = 1     # timed passes for transformers (the slowest per token, reference only)
    gamma: int = 5
    # a little above the longest reference answer (incl. "</s>"), as benchmarks/scenarios.py;
    # generation stops at EOS, as a user's would
    max_new: dict = field(default_factory=lambda: {"S1": 48, "S2": 16, "S3": 16, "S4": 48, "S5": 48})
    copy_bytes: int = 1 << 30


DEMO_VIEWS, DEMO_POLICY = ("M", "T"), "hedge"     # `make demo`'s defaults (tabed_engine/demo.py)
DEMO_METHOD = {
    "timing": "per prompt: median synchronized wall clock of `repeats` passes over the scenario's prompts, "
              "after an untimed pass over all of them (graph capture, caches); transformers: one warm-up "
              "generation, `hf_repeats` passes. Every time includes host preprocessing (processor)",
    "decode_ms_per_token": "(sum t(max_new) - sum t(1)) / sum (new_tokens - 1) over the scenario's prompts; "
                           "generation stops at EOS; t(1) = prefill (+ draft views) and the first token",
    "e2e_ms_per_token": "sum t(max_new) / sum new_tokens (prefill included)",
    "tau": "real block efficiency: sum (new_tokens - 1) / sum target verify forwards (engine stats)",
    "speedup": "engine AR / engine SD, decode ms/token (speedup_decode) and whole generations (speedup_e2e)",
    "mismatches_vs_engine_ar": "prompts whose SD tokens differ from the engine's AR tokens (must be 0)",
    "floor": "target LM weight bytes / copy bandwidth (tiny model: launch and host costs dominate)",
}


def prompt_medians(fn, items, repeats: int, device):
    """Per item: median synchronized ms of fn(item) over `repeats` passes over all items
    (interleaved, so a slow moment spreads over every item); and fn's outputs of pass one."""
    runs, outs = [[] for _ in items], []
    for rep in range(repeats):
        for i, item in enumerate(items):
            out, ms = wall_ms(lambda: fn(item), device)
            runs[i].append(ms)
            if rep == 0:
                outs.append(out)
    return [statistics.median(r) for r in runs], outs


def sha256_16(path: str) -> str:
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()[:16]


class DemoBench(E2EBench):
    """Preset demo-pair: engine AR, engine SD (the demo's views/policy, view M alone, the default
    tree over the demo's views) and transformers greedy generation on the bundled pair, per
    scenario S1-S5."""

    def __init__(self, args, preset: DemoPreset):
        super().__init__(args, preset, DEMO_METHOD)

    def stages(self):
        yield "bandwidth", self.bandwidth
        for sc in self.examples:
            yield sc, functools.partial(self.scenario, sc)
        yield "all", self.overall

    def setup(self) -> dict:
        from tabed_engine import Engine, TreeConfig
        from tabed_engine.demo import ASSETS
        from benchmarks.world.scenarios import SCENARIOS, examples

        p, dev, dt = self.p, self.device, self.dtype
        if dev.type == "cpu":   # tiny ops: thread hand-offs cost more than the ops (tests/conftest.py)
            torch.set_num_threads(1)
        dirs = {k: os.path.join(ASSETS, k) for k in ("target", "draft")}
        for d in dirs.values():
            if not os.path.isfile(os.path.join(d, "config.json")):
                raise FileNotFoundError(f"no bundled checkpoint at {d}")
        t0 = time.perf_counter()
        inv = self.args.invariant
        base = Engine.from_pretrained(dirs["target"], dirs["draft"], device=dev, dtype=dt, views=DEMO_VIEWS,
                                      policy=DEMO_POLICY, gamma=p.gamma, timing=False, prefix_cache=False,
                                      invariant=inv)
        single = Engine(base.target, base.processor, draft=base.draft, device=dev, dtype=dt, views=("M",),
                        policy="uniform", gamma=p.gamma, timing=False,    # shares the loaded weights
                        prefix_cache=False, invariant=inv)
        self.ar_engine, self.target_lvlm, self.processor = base, base.target, base.processor
        name = f"{DEMO_POLICY}[{'+'.join(DEMO_VIEWS)}]"
        self.engines = {name: base, "M": single}
        tree = TreeConfig()                 # the default tree, over the demo's ensemble
        self.engines[f"{name} tree {tree.depth}x{tree.width}x{tree.branch}"] = Engine(
            base.target, base.processor, draft=base.draft, device=dev, dtype=dt, views=DEMO_VIEWS,
            policy=DEMO_POLICY, gamma=p.gamma, timing=False, tree=tree, prefix_cache=False, invariant=inv)
        self.check_no_override()
        self.examples = {sc: examples(sc, p.prompts, seed=0) for sc in SCENARIOS}
        self.hf = None
        if not self.args.skip_hf:
            from transformers import LlavaForConditionalGeneration

            self.hf = LlavaForConditionalGeneration.from_pretrained(dirs["target"], dtype=dt).to(dev).eval()
        if self.cuda:
            torch.cuda.synchronize()

        def shape(lvlm):
            c = lvlm.lm.cfg
            return {"layers": c.num_layers, "hidden": c.hidden_size, "kv_heads": c.num_kv_heads,
                    "vocab": c.vocab_size, "params": sum(x.numel() for x in lvlm.lm.parameters())}

        training = {}
        tj = os.path.join(ASSETS, "training.json")
        if os.path.isfile(tj):
            with open(tj) as f:
                t = json.load(f)
            training = {k: t.get(k) for k in ("command", "seed", "target_steps", "draft_steps", "final_loss")}
        return {"build_s": time.perf_counter() - t0, "checkpoints": "tabed_engine/assets/demo/{target,draft}",
                "safetensors_sha256_16": {k: sha256_16(os.path.join(d, "model.safetensors"))
                                          for k, d in dirs.items()},
                "training": training, "target_lm": shape(base.target), "draft_lm": shape(base.draft),
                "image_tokens": base.tokens_per_image, "dtype": str(dt), "invariant": inv, "gamma": p.gamma, "greedy": True,
                "stop_at_eos": True, "batch": 1, "max_len": base.max_len, "acceptance_override": None,
                "prompts_per_scenario": p.prompts, "example_seeds": "world.examples(sc, n, seed=0)",
                "max_new_tokens": self.max_new, "repeats": p.repeats,
                "hf_repeats": None if self.args.skip_hf else p.hf_repeats,
                "sd_configs": {k: {"views": list(e.views), "policy": e.ensemble.policy,
                                   "tree": None if e.tree is None else
                                   {"depth": e.tree.depth, "width": e.tree.width, "branch": e.tree.branch,
                                    "nodes": e.tree.nodes}} for k, e in self.engines.items()},
                "cpu_threads": torch.get_num_threads() if dev.type == "cpu" else None,
                "hf_attn_implementation": None if self.hf is None else self.hf.config._attn_implementation}

    @property
    def max_new(self) -> dict:
        cap = self.args.max_new or 1 << 30
        return {sc: min(n, cap) for sc, n in self.p.max_new.items()}

    def check_no_override(self):
        for name, eng in self.engines.items():
            if eng.bench_accept_schedule is not None:
                raise RuntimeError(f"engine {name} has an acceptance override: not a real-acceptance run")

    def bandwidth(self) -> dict:
        nbytes = self.p.copy_bytes if self.cuda else min(self.p.copy_bytes, 64 << 20)
        gbs = copy_bandwidth_gbs(self.device, nbytes, reps=10)
        wbytes = lm_weight_bytes(self.target_lvlm)
        return {"copy_GBs": gbs, "copy_bytes": nbytes, "target_lm_weight_bytes": wbytes,
                "floor_ms_per_token": wbytes / (gbs * 1e9) * 1e3}

    # ------------------------------------------------------------------ one scenario
    def measure(self, gen, exs, n_max: int, repeats: int, warm_all: bool = True):
        """gen(example, n) -> (token ids, stats or None). Times each prompt with n_max and with
        1 new token; returns (sums and per-prompt numbers, outputs of the first timed pass)."""
        t = time.perf_counter()
        for e in (exs if warm_all else exs[:1]):
            gen(e, n_max)
        full, outs = prompt_medians(lambda e: gen(e, n_max), exs, repeats, self.device)
        gen(exs[0], 1)
        one, _ = prompt_medians(lambda e: gen(e, 1), exs, repeats, self.device)
        ntok = [len(o[0]) for o in outs]
        dec = sum(ntok) - len(ntok)
        return {"new_tokens": sum(ntok), "decode_tokens": dec, "t_full_ms": sum(full), "t_one_ms": sum(one),
                "decode_ms_per_token": (sum(full) - sum(one)) / dec if dec > 0 else None,
                "e2e_ms_per_token": sum(full) / sum(ntok), "ms_per_generation": sum(full) / len(exs),
                "per_prompt": {"new_tokens": ntok, "t_full_ms": full, "t_one_ms": one},
                "wall_s": time.perf_counter() - t}, outs

    def scenario(self, sc: str) -> dict:
        from tabed_engine import SamplingParams

        exs, n_max = self.examples[sc], self.max_new[sc]
        self.check_no_override()

        def engine_gen(eng, speculative: bool):
            def gen(e, n):
                out = eng.generate(e.prompt, images=e.images, caption=e.captions, speculative=speculative,
                                   sampling=SamplingParams(max_new_tokens=n))
                return out.token_ids, out.stats
            return gen

        res = {"n_prompts": len(exs), "max_new_tokens": n_max,
               "prompt_tokens": [len(self.processor(text=e.prompt, images=e.images)["input_ids"][0])
                                 for e in exs]}
        ar, ar_outs = self.measure(engine_gen(self.ar_engine, False), exs, n_max, self.p.repeats)
        ar_tokens = [o[0] for o in ar_outs]
        res["engine_ar"] = ar
        res["sd"] = {}
        for name, eng in self.engines.items():
            r, outs = self.measure(engine_gen(eng, True), exs, n_max, self.p.repeats)
            st = [o[1] for o in outs]
            if not all(s.speculative for s in st):
                raise RuntimeError(f"{name}: a generation did not run speculatively")
            acc = [a for s in st for a in s.accepted_lengths]
            fwd = sum(s.target_forwards for s in st)
            r.update(views=list(eng.views), policy=eng.ensemble.policy, target_forwards=fwd,
                     tau=r["decode_tokens"] / fwd if fwd else None,
                     mean_accepted_drafts=statistics.mean(acc) if acc else None,
                     mismatches_vs_engine_ar=sum(o[0] != a for o, a in zip(outs, ar_tokens)),
                     speedup_e2e=ar["t_full_ms"] / r["t_full_ms"])
            r["speedup_decode"] = (ar["decode_ms_per_token"] / r["decode_ms_per_token"]
                                   if ar["decode_ms_per_token"] and r["decode_ms_per_token"] else None)
            r["per_prompt"]["tau"] = [s.block_efficiency for s in st]
            if len(eng.views) > 1:
                last = [s.weights[-1] for s in st if s.weights]
                r["final_weights_mean"] = dict(zip(eng.views, [statistics.mean(c) for c in zip(*last)])) \
                    if last else None
            res["sd"][name] = r
            log(f"  {sc} SD {name}: {fmt(r['decode_ms_per_token'])} vs AR {fmt(ar['decode_ms_per_token'])} "
                f"ms/token ({fmt(r['speedup_decode'], '.2f')}x), tau {fmt(r['tau'], '.2f')}, "
                f"mismatches {r['mismatches_vs_engine_ar']}")
        if self.hf is not None:
            res["hf_eager"] = self.hf_scenario(exs, n_max, ar, ar_tokens)
        return res

    def hf_scenario(self, exs, n_max: int, ar: dict, ar_tokens: list) -> dict:
        """transformers greedy `generate` on the target (dynamic cache, no compilation)."""
        def gen(e, n):
            enc = self.processor(text=e.prompt, images=e.images, return_tensors="pt")
            enc = {k: v.to(self.device) for k, v in enc.items()}
            enc["pixel_values"] = enc["pixel_values"].to(self.dtype)
            with torch.inference_mode():
                out = self.hf.generate(**enc, max_new_tokens=n, do_sample=False)
            return out[0, enc["input_ids"].shape[1]:].tolist(), None

        r, outs = self.measure(gen, exs, n_max, self.p.hf_repeats, warm_all=False)
        # same weights, same greedy decoding: identical in fp32; bf16 may flip a near-tie
        r["agrees_with_engine_ar"] = sum(o[0] == a for o, a in zip(outs, ar_tokens))
        d, a = r["decode_ms_per_token"], ar["decode_ms_per_token"]
        r["engine_ar_speedup_decode"] = d / a if d and a else None
        return r

    def overall(self) -> dict:
        """All scenarios together: sums of times, tokens and forwards."""
        scs = [sc for sc in self.examples if "error" not in self.result.get(sc, {"error": 1})]
        if not scs:
            raise RuntimeError("no scenario finished")

        def total(get):
            keys = ("new_tokens", "decode_tokens", "t_full_ms", "t_one_ms", "target_forwards",
                    "mismatches_vs_engine_ar", "agrees_with_engine_ar")
            parts = [get(self.result[sc]) for sc in scs]
            if any(x is None for x in parts):
                return None
            r = {k: sum(x[k] for x in parts) for k in keys if k in parts[0]}
            dec = r["decode_tokens"]
            r["decode_ms_per_token"] = (r["t_full_ms"] - r["t_one_ms"]) / dec if dec > 0 else None
            r["e2e_ms_per_token"] = r["t_full_ms"] / r["new_tokens"]
            r["ms_per_generation"] = r["t_full_ms"] / sum(self.result[sc]["n_prompts"] for sc in scs)
            if "target_forwards" in r:
                r["tau"] = dec / r["target_forwards"] if r["target_forwards"] else None
            return r

        out = {"scenarios": scs, "n_prompts": sum(self.result[sc]["n_prompts"] for sc in scs),
               "engine_ar": total(lambda x: x["engine_ar"]), "sd": {}}
        ar = out["engine_ar"]
        for name in self.engines:
            r = total(lambda x: x["sd"][name])
            r["speedup_e2e"] = ar["t_full_ms"] / r["t_full_ms"]
            r["speedup_decode"] = (ar["decode_ms_per_token"] / r["decode_ms_per_token"]
                                   if ar["decode_ms_per_token"] and r["decode_ms_per_token"] else None)
            out["sd"][name] = r
        if self.hf is not None:
            r = total(lambda x: x.get("hf_eager"))
            if r is not None:
                d, a = r["decode_ms_per_token"], ar["decode_ms_per_token"]
                r["engine_ar_speedup_decode"] = d / a if d and a else None
                out["hf_eager"] = r
        return out

    # ------------------------------------------------------------------ verdict + report
    def mismatches(self):
        """SD-vs-AR token mismatches over every finished scenario and SD config (None: none ran)."""
        counts = [r["mismatches_vs_engine_ar"] for sc in getattr(self, "examples", ())
                  if "error" not in self.result.get(sc, {"error": 1}) for r in self.result[sc]["sd"].values()]
        return sum(counts) if counts else None

    def targets(self) -> dict:
        t = {"sd_tokens_identical_to_engine_ar (mismatches)": check_limit(self.mismatches(), 0)}
        for name, r in (self.result.get("all") or {}).get("sd", {}).items():
            t[f"sd_{name}_speedup_vs_engine_ar (decode, reported)"] = check_limit(r.get("speedup_decode"), None)
        return t

    def markdown(self) -> str:
        R, f = self.result, fmt
        su, bw = (R.get(k) if "error" not in R.get(k, {"error": 1}) else {} for k in ("setup", "bandwidth"))
        names = list(su.get("sd_configs", {}))
        tl, dl = su.get("target_lm", {}), su.get("draft_lm", {})
        lines = header_lines(R) + [
            f"bundled pair (`{su.get('checkpoints')}`, safetensors sha256 "
            f"{', '.join(f'{k} {v}…' for k, v in su.get('safetensors_sha256_16', {}).items())}): "
            f"target LM {tl.get('layers')}×{tl.get('hidden')} ({f(tl.get('params', 0) / 1e6, '.2f')} M params), "
            f"draft LM {dl.get('layers')}×{dl.get('hidden')} ({f(dl.get('params', 0) / 1e6, '.2f')} M), "
            f"{su.get('image_tokens')} tokens per image; {su.get('dtype')}, batch 1, greedy, γ={su.get('gamma')}, "
            f"real acceptance (no override), stop at EOS; {su.get('prompts_per_scenario')} prompts per scenario "
            f"(`world.examples(sc, n, seed=0)`), max new tokens "
            f"{', '.join(f'{k} {v}' for k, v in su.get('max_new_tokens', {}).items())}; medians of "
            f"{su.get('repeats')} passes after a warm-up pass.", "",
            "decode ms/token = (Σ t(max_new) − Σ t(1)) / Σ (n − 1); τ = Σ (n − 1) / Σ target forwards; "
            f"speedup = engine AR / engine SD. Copy bandwidth {f(bw.get('copy_GBs'), '.0f')} GB/s, target LM "
            f"weights {f(bw.get('target_lm_weight_bytes', 0) / 1e6, '.2f')} MB: floor "
            f"{f(bw.get('floor_ms_per_token'), '.4f')} ms/token (this model is launch- and host-bound).", ""]
        rows = [sc for sc in (*getattr(self, "examples", ()), "all") if sc in R]
        hf_on = any(isinstance(R[sc], dict) and "hf_eager" in R[sc] for sc in rows)
        decode = ["scenario", "prompts", "new tokens", "engine AR"]
        for n in names:
            decode += [f"SD {n} (speedup)", "τ", "SD ≠ AR"]
        if hf_on:
            decode += ["transformers (engine AR faster ×)", "= engine AR"]
        per_gen = ["scenario", "engine AR"] + [f"SD {n} (speedup)" for n in names] + \
            (["transformers (engine AR faster ×)"] if hf_on else [])
        tables = {"decode": ["**decode ms/token**", "", "| " + " | ".join(decode) + " |", "|" + "---|" * len(decode)],
                  "gen": ["**ms per generation** (prefill and host preprocessing included)", "",
                          "| " + " | ".join(per_gen) + " |", "|" + "---|" * len(per_gen)]}
        for sc in rows:
            r = R[sc]
            if "error" in r:
                for tab in tables.values():
                    tab.append(f"| {sc} | error: {r['error'][:100]} |")
                continue
            ar, n_prompts = r.get("engine_ar") or {}, r.get("n_prompts")
            h = r.get("hf_eager") or {}
            cells = {"decode": [sc, str(n_prompts), str(ar.get("new_tokens"))], "gen": [sc]}
            for tab, key, spd in (("decode", "decode_ms_per_token", "speedup_decode"),
                                  ("gen", "ms_per_generation", "speedup_e2e")):
                c = cells[tab]
                c.append(f(ar.get(key)))
                for n in names:
                    sd = r["sd"].get(n) or {}
                    c.append(f"{f(sd.get(key))} ({f(sd.get(spd), '.2f')}×)")
                    if tab == "decode":
                        c += [f(sd.get("tau"), ".2f"), str(sd.get("mismatches_vs_engine_ar"))]
                if hf_on:
                    ratio = h[key] / ar[key] if h.get(key) and ar.get(key) else None
                    c.append(f"{f(h.get(key))} ({f(ratio, '.2f')}×)" if h else "—")
                    if tab == "decode":
                        c.append(f"{h.get('agrees_with_engine_ar')}/{n_prompts}" if h else "—")
                tables[tab].append("| " + " | ".join(c) + " |")
        for tab in tables.values():
            lines += tab + [""]
        per_sc = [sc for sc in rows if sc != "all" and "error" not in R[sc]]
        if per_sc:
            for n in names:
                fw = [R[sc]["sd"][n].get("final_weights_mean") for sc in per_sc]
                if any(fw):
                    lines.append(f"final {n} weights (mean over prompts): " + "; ".join(
                        f"{sc} " + " ".join(f"{k}:{v:.2f}" for k, v in x.items()) for sc, x in zip(per_sc, fw) if x))
            lines.append("mean accepted drafts per block: " + ", ".join(
                f"{n} " + " / ".join(f(R[sc]["sd"][n].get("mean_accepted_drafts"), ".2f") for sc in per_sc)
                for n in names) + f" ({' / '.join(per_sc)})")
        lines += ["", "| target | value | limit | pass |", "|---|---|---|---|"]
        for k, v in R.get("targets", {}).items():
            mark = {True: "PASS", False: "FAIL", None: "n/a"}[v["pass"]]
            lines.append(f"| {k} | {f(v['value'], '.4g')} | {f(v['limit'], 'g')} | {mark} |")
        errs = [k for k, v in R.items() if isinstance(v, dict) and "error" in v]
        if errs:
            lines += ["", "errors: " + "; ".join(f"{k}: {R[k]['error'][:200]}" for k in errs)]
        if not self.cuda:
            lines += ["", "(CPU: timings are for a smoke test, not the GPU result)"]
        return "\n".join(lines) + "\n"

    def run(self):
        super().run()
        bad = self.mismatches()
        if bad:
            log(f"LOSSLESS CHECK FAILED: {bad} SD generations differ from engine AR")
            raise SystemExit(1)


def add_args(ap: argparse.ArgumentParser):
    """The demo benchmark's own options."""
    ap.add_argument("--prompts", type=int, default=None,
                    help="demo-pair: prompts per scenario (default: preset's, 10)")
    ap.add_argument("--max-new", type=int, default=None,
                    help="demo-pair: cap on new tokens per generation (default: per scenario, 16-48)")
    ap.add_argument("--invariant", action="store_true",
                    help="demo-pair: the engines with invariant=True (the tree engine too)")


def run(args):
    """Run the benchmark with parsed options (this module's and e2e_common's)."""
    preset = DemoPreset()
    if args.repeats:
        preset.repeats = args.repeats
    if args.prompts:
        preset.prompts = args.prompts
    args.preset = PRESET
    torch.manual_seed(0)
    DemoBench(resolve_device(args), preset).run()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(ap)
    add_args(ap)
    run(ap.parse_args(argv))


if __name__ == "__main__":
    main()
