"""Time to first token (issue 39) at the LLaVA-1.5-7B shape, against the compute floor and
transformers, in one run.

    python benchmarks/ttft.py --out DIR                              # H100/H200, ~3 min
    python benchmarks/ttft.py --preset tiny --device cpu --out DIR   # CPU smoke, < 1 min
    (--skip-hf omits transformers)

Random bf16 weights built on the device (benchmarks/e2e_common.py): target LLaVA-1.5-7B shape,
draft LLaVA-68M shape sharing the target's CLIP tower weights. Two prompts: one 336x336 image
+ 40 text tokens (616 tokens) and three images + text (1,800 tokens). Greedy, batch 1. Writes
DIR/ttft_<preset>.json and DIR/ttft_<preset>.md.

How each number is measured
* ttft: `Engine.generate(prompt, images, max_new_tokens=1)`: `wall_ms` is the host wall clock
  from the call to its return, the device synchronized before (not after: the draft's views
  may still run on their stream when the first token is back); `stat_ms` is the engine's own
  `stats.time_first_token`. Medians of `repeats` after two warm-up calls (graph capture).
  AR; SD with K = 1, 2, 4 views (M / M+T / M+T+P+C), the draft's views on a second stream
  (`overlap_draft`, the default) and on the main stream after the target's prefill; AR with
  the eager target prefill (`prefill_graphs` off) for contrast.
* split: each piece alone, synchronized wall clock, medians: host request building
  (validation, tokenization, and on the host path the image processor), device image
  preprocessing, vision tower, projector, target LM prefill (graph), draft views (build_views
  + prefill_draft) per K; `rest_ms` = AR ttft wall - the pieces on its path.
* floor: 2 x target LM parameters (no embedding table) x prompt tokens + 2 x projector
  parameters x image tokens + the vision tower's FLOPs (benchmarks/ttft_vision.py
  `tower_flops`), at the bf16 GEMM rate of an 8192^3 matrix product measured in this run.
* target_prefill: the LM prefill alone at each prompt's length, CUDA events: the bucket's
  graph replay (its static inputs already written) against the eager prefill at the exact
  length; ratio to the LM's FLOP floor at the real token count.
* hf: `LlavaForConditionalGeneration.generate(max_new_tokens=1)` on the processor's inputs
  (already on the device), synchronized wall clock, median after a warm-up; `with_processor`
  adds the processor call.
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import copy_bandwidth_gbs, event_ms, sync, wall_ms  # noqa: E402
from e2e import PRESETS, VIEW_SETS  # noqa: E402
from e2e_common import (E2EBench, add_common_args, build_hf_llava, check_limit, default_dtype, fmt,  # noqa: E402
                        log, resolve_device)
from ttft_vision import gemm_tflops, tower_flops  # noqa: E402

CAPTION = "w1 w2 w3"
PROMPT_TOKENS = {"llava-1.5-7b": (616, 1800), "tiny": (44, 120)}   # 1 image, 3 images
TTFT_GOAL_MS = 25.0          # 616-token prompt, SD K = 2
HF_SPEEDUP_GOAL = 2.0
PREFILL_FLOOR_GOAL = 1.3     # target LM prefill graph / its FLOP floor


def host_ms(fn, device) -> tuple:
    """(fn(), ms until fn returns), the device synchronized before only."""
    sync(device)
    t = time.perf_counter()
    out = fn()
    ms = (time.perf_counter() - t) * 1e3
    sync(device)
    return out, ms


class Bench(E2EBench):
    def __init__(self, args, preset):
        super().__init__(args, preset, {"doc": __doc__.split("How each number is measured")[1].strip()})
        self.json_path = os.path.join(args.out, f"ttft_{args.preset}.json")
        self.md_path = os.path.join(args.out, f"ttft_{args.preset}.md")
        self.reps = args.repeats or preset.repeats

    # ------------------------------------------------------------------ setup
    def _prompt(self, n_images: int, tokens: int):
        """A prompt of n_images images and text words, `tokens` tokens long (or as near as the
        words make it) and its images."""
        from tabed_engine.models.tiny import random_image, words

        vocab = self.p.target["vocab_size"]
        imgs = [random_image(i, self.p.vision["image_size"]) for i in range(n_images)]

        def build(n_words):
            text = "<image>\n" * n_images + " " + words(0, n_words, vocab)
            return text, len(self.processor(text=text, images=imgs, return_tensors="pt")["input_ids"][0])

        base = build(1)[1]
        text, n = build(max(1, tokens - base + 1))
        return text, imgs, n

    def setup(self) -> dict:
        from tabed_engine import Engine
        from tabed_engine.models.loader import lvlm_from_hf
        from tabed_engine.models.tiny import build_processor

        p, dev, dt = self.p, self.device, self.dtype
        t0 = time.perf_counter()
        self.processor = build_processor(p.target["vocab_size"], p.vision["image_size"], p.vision["patch_size"],
                                         "default")
        image_token = self.processor.tokenizer.convert_tokens_to_ids("<image>")
        self.hf_target = build_hf_llava(p.vision, p.target, dev, dt, p.init_std, 0, image_token)
        hf_draft = build_hf_llava(p.vision, p.draft, dev, dt, p.init_std, 1, image_token)
        with torch.no_grad():
            hf_draft.model.vision_tower.load_state_dict(self.hf_target.model.vision_tower.state_dict())
        with default_dtype(dt):
            target, draft = lvlm_from_hf(self.hf_target, dev, dt), lvlm_from_hf(hf_draft, dev, dt)
        del hf_draft
        self.target = target
        if self.args.skip_hf:
            del self.hf_target
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()
        self.engines = {K: Engine(target, self.processor, draft=draft, device=dev, dtype=dt, views=views,
                                  gamma=p.gamma, max_len=p.max_len, max_batch=1, prefix_cache=False)
                        for K, views in VIEW_SETS.items()}
        one, three = PROMPT_TOKENS[self.args.preset]
        self.prompts = {"1_image": self._prompt(1, one), "3_images": self._prompt(3, three)}
        lm = target.lm
        self.lm_params = sum(q.numel() for q in lm.parameters()) - lm.embed_tokens.weight.numel()
        self.proj_params = sum(q.numel() for q in target.vision.projector.parameters())
        from transformers import CLIPVisionConfig

        self.tower_flops_per_image = tower_flops(CLIPVisionConfig(**p.vision), max(target.vision.tower.layers))
        self.rate = gemm_tflops(dev, dt)
        return {"build_s": time.perf_counter() - t0, "dtype": str(dt), "max_len": p.max_len, "gamma": p.gamma,
                "repeats": self.reps, "prompts": {k: {"tokens": v[2], "images": len(v[1])}
                                                  for k, v in self.prompts.items()},
                "target_lm_params_no_embedding": self.lm_params, "projector_params": self.proj_params,
                "tower_flops_per_image": self.tower_flops_per_image, "bf16_gemm_tflops": self.rate,
                "copy_GBs": copy_bandwidth_gbs(dev, p.copy_bytes),
                "target": {"vision": p.vision, "text": p.target}, "draft": {"text": p.draft}}

    def floor_ms(self, name: str, lm_only: bool = False):
        if self.rate is None:
            return None
        _, imgs, n = self.prompts[name]
        n_img = len(imgs) * self.engines[1].tokens_per_image      # a fixed grid (LLaVA-1.5 shape)
        flops = 2 * self.lm_params * n
        if not lm_only:
            flops += 2 * self.proj_params * n_img + len(imgs) * self.tower_flops_per_image
        return flops / (self.rate * 1e12) * 1e3

    # ------------------------------------------------------------------ engine
    def gen(self, eng, name: str, speculative: bool):
        from tabed_engine import SamplingParams

        text, imgs, _ = self.prompts[name]
        return eng.generate(text, images=imgs, caption=CAPTION, speculative=speculative,
                            sampling=SamplingParams(max_new_tokens=1, stop_at_eos=False))

    def measure(self, eng, name, speculative) -> dict:
        for _ in range(2):
            self.gen(eng, name, speculative)
        walls, stats, tokens = [], [], set()
        for _ in range(self.reps):
            out, ms = host_ms(lambda: self.gen(eng, name, speculative), self.device)
            walls.append(ms)
            stats.append(out.stats.time_first_token * 1e3)
            tokens.add(out.token_ids[0])
        if len(tokens) != 1:
            raise RuntimeError(f"greedy first tokens differ between runs: {tokens}")
        return {"wall_ms": statistics.median(walls), "stat_ms": statistics.median(stats), "wall_runs_ms": walls,
                "first_token": tokens.pop()}

    def ttft(self) -> dict:
        out = {}
        for name in self.prompts:
            r = {}
            ar_eng = self.engines[1]
            r["AR"] = self.measure(ar_eng, name, False)
            ar_eng.runner.prefill_graphs = False
            r["AR eager prefill"] = self.measure(ar_eng, name, False)
            ar_eng.runner.prefill_graphs = ar_eng.graphs is not None
            for K, eng in self.engines.items():
                r[f"SD K={K}"] = self.measure(eng, name, True)
                if self.cuda:
                    eng.runner.overlap_draft = False
                    r[f"SD K={K} one stream"] = self.measure(eng, name, True)
                    eng.runner.overlap_draft = True
            floor = self.floor_ms(name)
            for v in r.values():
                v["ratio_to_floor"] = None if floor is None else v["wall_ms"] / floor
            r["floor_ms"] = floor
            out[name] = r
        return out

    def split(self) -> dict:
        from tabed_engine import SamplingParams
        from tabed_engine.models.image_ops import device_pixels
        from tabed_engine.models.decoder import cache_rows
        from tabed_engine.speculation.chain import prefill_draft
        from tabed_engine.speculation.views import build_views

        out = {}
        sp = SamplingParams(max_new_tokens=1)
        for name, (text, imgs, n) in self.prompts.items():
            eng = self.engines[1]
            run = eng.runner
            samples: dict = {}

            def add(key, ms):
                samples.setdefault(key, []).append(ms)

            with torch.inference_mode():
                for _ in range(self.reps + 1):                 # the first pass warms up
                    req, ms = wall_ms(lambda: eng._request(text, imgs, sp, CAPTION, True), self.device)
                    add("host_request_ms", ms)
                    prep = req.prep
                    if prep.pixel_values is None:
                        pv, ms = wall_ms(lambda: device_pixels(prep.images, eng.processor.image_processor,
                                                               self.device), self.device)
                        prep.pixel_values = pv
                        add("device_preprocess_ms", ms)
                    else:
                        add("device_preprocess_ms", 0.0)
                    vision = eng.target.vision
                    sel, ms = wall_ms(lambda: vision.select_images(prep.pixel_values.to(self.device),
                                                                   prep.image_sizes), self.device)
                    add("vision_tower_ms", ms)
                    feats, ms = wall_ms(lambda: vision.image_features(sel, prep.image_sizes), self.device)
                    add("projector_ms", ms)
                    _, ms = wall_ms(lambda: run.prefill_lm(prep, feats, 0), self.device)
                    add("target_prefill_ms", ms)
                    for K, e in self.engines.items():
                        e.runner.allocate()
                        rows, ms1 = wall_ms(lambda: build_views(e, prep, sel, CAPTION), self.device)
                        dcache = cache_rows(e.runner.dcache, 0, len(rows))
                        _, ms2 = wall_ms(lambda: prefill_draft(e.runner, rows, dcache), self.device)
                        add(f"draft_views_K{K}_ms", ms1 + ms2)
            r = {k: statistics.median(v[1:]) for k, v in samples.items()}
            ttft = self.result.get("ttft", {}).get(name, {}).get("AR", {}).get("wall_ms")
            path = sum(r[k] for k in ("host_request_ms", "device_preprocess_ms", "vision_tower_ms",
                                      "projector_ms", "target_prefill_ms"))
            r["ar_path_sum_ms"] = path
            r["rest_ms"] = None if ttft is None else ttft - path
            r["tokens"] = n
            out[name] = r
        return out

    def target_prefill(self) -> dict:
        from tabed_engine.engine.prefill import prefill_bucket
        from tabed_engine.models.decoder import cache_rows

        out = {}
        run = self.engines[1].runner
        lm = self.target.lm
        for name, (_, _, n) in self.prompts.items():
            x = torch.randn(1, n, lm.cfg.hidden_size, device=self.device, dtype=self.dtype) * 0.02
            pos = torch.arange(n, device=self.device)[None]
            last = torch.tensor([[n - 1]], device=self.device)
            cache = cache_rows(run.tcache, 0, 1)

            def eager():
                return lm(cache, pos, embeds=x, logits_index=last, kv_len=run.kv_bucket(n), fresh=True)

            P = prefill_bucket(n, run.max_len, max(run.prefill_graph_max, n))   # a graph here even above the limit
            buf, slot_t, last_t = run._prefill_inputs()
            buf[0, :n].copy_(x[0])
            buf[0, n:P].zero_()
            slot_t.zero_()
            last_t.fill_(n - 1)
            with torch.inference_mode():
                if self.cuda:
                    run._prefill_padded(P)                      # captured on first use
                    g = run.graphs.graphs[("prefill", P)].graph
                    graph_ms, eager_ms = event_ms(g.replay, self.reps + 2), event_ms(eager, self.reps + 2)
                else:
                    graph_ms = statistics.median(wall_ms(lambda: run._prefill_padded(P), self.device)[1]
                                                 for _ in range(self.reps))
                    eager_ms = statistics.median(wall_ms(eager, self.device)[1] for _ in range(self.reps))
            floor = self.floor_ms(name, lm_only=True)
            path = "graph" if prefill_bucket(n, run.max_len, run.prefill_graph_max) else "eager"
            out[name] = {"tokens": n, "bucket": P, "graph_ms": graph_ms, "eager_ms": eager_ms, "engine_path": path,
                         "engine_ratio_to_floor": None if floor is None else
                         (graph_ms if path == "graph" else eager_ms) / floor,
                         "speedup": eager_ms / graph_ms, "flop_floor_ms": floor,
                         "graph_ratio_to_floor": None if floor is None else graph_ms / floor,
                         "eager_ratio_to_floor": None if floor is None else eager_ms / floor}
        return out

    # ------------------------------------------------------------------ transformers
    def hf(self) -> dict:
        if self.args.skip_hf:
            return {"skipped": True}
        out = {}
        for name, (text, imgs, n) in self.prompts.items():
            def inputs():
                enc = self.processor(text=text, images=imgs, return_tensors="pt")
                enc = {k: v.to(self.device) for k, v in enc.items()}
                enc["pixel_values"] = enc["pixel_values"].to(self.dtype)
                return enc

            enc = inputs()

            def gen(e):
                with torch.inference_mode():
                    return self.hf_target.generate(**e, max_new_tokens=1, do_sample=False)

            for _ in range(2):
                first = int(gen(enc)[0, -1])
            out[name] = {"first_token": first,
                         "generate_ms": statistics.median(wall_ms(lambda: gen(enc), self.device)[1]
                                                          for _ in range(self.reps)),
                         "with_processor_ms": statistics.median(wall_ms(lambda: gen(inputs()), self.device)[1]
                                                                for _ in range(self.reps)),
                         "tokens": n}
        return out

    # ------------------------------------------------------------------ report
    def targets(self) -> dict:
        t = self.result.get("ttft", {}).get("1_image", {})
        sd2 = t.get("SD K=2", {}).get("wall_ms")
        hf = self.result.get("hf", {}).get("1_image", {}).get("generate_ms")
        tp = self.result.get("target_prefill", {})
        real = self.args.preset == "llava-1.5-7b" and self.cuda      # the goals are for that shape
        out = {"ttft_616_sd_k2_le_25ms": check_limit(sd2, TTFT_GOAL_MS if real else None),
               "speedup_vs_transformers_616_sd_k2_ge_2x": check_limit(
                   None if sd2 is None or hf is None else hf / sd2, HF_SPEEDUP_GOAL if real else None, le=False)}
        for name, r in tp.items():
            if isinstance(r, dict) and "engine_ratio_to_floor" in r:   # the path the engine takes at that length
                out[f"target_prefill_{r['engine_path']}_{r['tokens']}_le_1.3x_floor"] = check_limit(
                    r["engine_ratio_to_floor"], PREFILL_FLOOR_GOAL if real else None)
        # greedy: every engine mode's first token and transformers' (equal in float32; bf16
        # rounding may flip a near-tie of random weights' flat logits)
        firsts = {(n, m): v.get("first_token") for n, r in self.result.get("ttft", {}).items()
                  if isinstance(r, dict) for m, v in r.items() if isinstance(v, dict)}
        for n, v in self.result.get("hf", {}).items():
            if isinstance(v, dict) and "first_token" in v:
                firsts[(n, "transformers")] = v["first_token"]
        out["first_tokens_agree"] = {"value": len({(n, t) for (n, _), t in firsts.items()}) ==
                                     len({n for n, _ in firsts}) if firsts else None, "limit": None, "pass": None}
        return out

    def markdown(self) -> str:
        R = self.result
        pv = R["provenance"]
        su = R.get("setup", {})
        lines = [f"## ttft {R['preset']} — {pv['device']}",
                 f"torch {pv['torch']}, triton {pv['triton']}, transformers {pv['transformers']}, CUDA {pv['cuda']}, "
                 f"{pv['date_utc']}, commit {pv['git']['commit'][:10]}{' (dirty)' if pv['git'].get('dirty') else ''}; "
                 f"bf16 GEMM {fmt(su.get('bf16_gemm_tflops'), '.0f')} TFLOP/s, "
                 f"copy {fmt(su.get('copy_GBs'), '.0f')} GB/s",
                 f"`{pv['command']}`", ""]
        tt, hf = R.get("ttft", {}), R.get("hf", {})
        if tt and "error" not in tt:
            lines += ["| TTFT ms (wall / stat) | " + " | ".join(tt) + " |", "|---" * (len(tt) + 1) + "|"]
            modes = [k for k in next(iter(tt.values())) if k != "floor_ms"]
            for m in modes:
                lines.append(f"| {m} | " + " | ".join(f"{fmt(tt[n][m]['wall_ms'], '.2f')} / "
                                                      f"{fmt(tt[n][m]['stat_ms'], '.2f')}" for n in tt) + " |")
            lines.append("| floor | " + " | ".join(fmt(tt[n]["floor_ms"], ".2f") for n in tt) + " |")
            if hf and "skipped" not in hf and "error" not in hf:
                cells = [f"{fmt(hf[n]['generate_ms'], '.2f')} ({fmt(hf[n]['with_processor_ms'], '.2f')})" for n in tt]
                lines.append("| transformers generate (+ processor) | " + " | ".join(cells) + " |")
        sp = R.get("split", {})
        if sp and "error" not in sp:
            keys = [k for k in next(iter(sp.values())) if k.endswith("_ms")]
            lines += ["", "| split ms | " + " | ".join(sp) + " |", "|---" * (len(sp) + 1) + "|"]
            lines += [f"| {k[:-3]} | " + " | ".join(fmt(sp[n][k], ".2f") for n in sp) + " |" for k in keys]
        tp = R.get("target_prefill", {})
        if tp and "error" not in tp:
            lines += ["", "| target LM prefill | tokens (bucket) | graph ms | eager ms | graph / floor | "
                      "eager / floor |", "|---|---|---|---|---|---|"]
            for n, r in tp.items():
                lines.append(f"| {n} | {r['tokens']} ({r['bucket']}) | {fmt(r['graph_ms'], '.2f')} | "
                             f"{fmt(r['eager_ms'], '.2f')} | {fmt(r['graph_ratio_to_floor'], '.2f')} | "
                             f"{fmt(r['eager_ratio_to_floor'], '.2f')} |")
        gw = R.get("graph_warmup", {})
        if gw and "error" not in gw:
            lines += ["", f"Warm-up: {gw['target_prefill_graphs']} target prefill graphs captured in "
                      f"{fmt(gw['target_capture_s'], '.2f')} s, draft views' prefill at {gw['draft_buckets']} "
                      f"buckets in {fmt(gw['draft_warm_s'], '.2f')} s."]
        lines += ["", "| goal | value | limit | pass |", "|---|---|---|---|"]
        for k, v in R.get("targets", {}).items():
            lines.append(f"| {k} | {fmt(v['value'], '.3f')} | {fmt(v['limit'])} | {v['pass']} |")
        return "\n".join(lines) + "\n"

    def graph_warmup(self) -> dict:
        """Seconds `Engine.warmup` spends capturing the target's prefill graph buckets not yet
        captured and running the draft views' prefill once per bucket."""
        run = self.engines[1].runner
        t0 = time.perf_counter()
        n_target = run.capture_prefill()
        t1 = time.perf_counter()
        n_draft = run.warm_draft_prefill()
        if self.cuda:
            torch.cuda.synchronize()
        return {"target_prefill_graphs": n_target, "target_capture_s": t1 - t0, "draft_buckets": n_draft,
                "draft_warm_s": time.perf_counter() - t1}

    def stages(self):
        return [("ttft", self.ttft), ("split", self.split), ("target_prefill", self.target_prefill),
                ("hf", self.hf), ("graph_warmup", self.graph_warmup)]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", choices=tuple(PROMPT_TOKENS), default="llava-1.5-7b")
    add_common_args(ap)
    args = resolve_device(ap.parse_args(argv))
    torch.manual_seed(0)
    log(f"ttft {args.preset} on {args.device}")
    bench = Bench(args, PRESETS[args.preset])
    bench.run()
    return bench.result


if __name__ == "__main__":
    main()
