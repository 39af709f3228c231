"""End-to-end LLaVA benchmark against the memory-bandwidth floor, all in one run.

    python benchmarks/e2e.py --preset llava-1.5-7b --out DIR          # H100/H200, ~5 min
    python benchmarks/e2e.py --preset tiny --device cpu --out DIR     # CPU smoke, < 2 min
    python benchmarks/e2e.py --preset demo-pair [--prompts N --max-new N] --out DIR
                                          # the bundled pair, real acceptance: benchmarks/e2e_demo.py
    (--skip-hf omits the transformers baselines; --scenario-taus FILE, a tree_scenarios.py
    result, also times chain and tree SD at the tokens per target forward it measured)

Random bf16 weights built on the device (no checkpoints): target LLaVA-1.5-7B shape (CLIP
ViT-L/14-336, 576 image tokens; Llama 32 x 4096 MHA, vocab 32064), draft LLaVA-68M shape
(same vision tower, with the target's tower weights copied in as the real pair shares
them; Llama 2 x 768). One 336x336 random image + 40 text tokens, 128 new tokens, batch 1,
greedy. Writes DIR/e2e_<preset>.json (provenance + every number) and DIR/e2e_<preset>.md.

How each number is measured
* floor = target LM weight bytes (decoder layers + final norm + lm_head; the embedding
  read is one row) / device-to-device copy bandwidth (read + write bytes / median time of
  a 1 GiB copy) measured in this run.
* decode ms/token, engine AR and SD: the inter-token time from the engine's stats,
  (time_total - time_first_token) / 127 (wall clock from the first new token on the host to
  the 128th), median of `repeats` generations after a warm-up generation (which captures the
  CUDA graphs). transformers: (t(128 new) - t(1 new)) / 127, each t the median of `repeats`
  synchronized wall-clock generations after a warm-up (the prefill cancels in expectation;
  the JSON keeps this estimate for the engine rows too, `ms_per_token_diff`: the engine's
  prefill is host-bound and its run-to-run spread moves the difference by up to 0.3 ms).
* SD runs use the engine's benchmark-only hook `bench_accept_schedule(block, depth) -> accepted`
  with a deterministic floor/ceil pattern of mean tau - 1 accepted drafts per block, so
  the block efficiency is tau (the last block is cut at 128 tokens: `tau_realized`).
* draft step / verification: from the engine's own timing (`timing=True`: syncs around
  each phase; time_draft / (blocks * gamma), time_verify / blocks) and, on CUDA, from
  back-to-back replays of the captured draft-block graph (/ gamma) and verify graph.
  ensemble + history share, two ways: (a) host phases, time_ensemble / (draft + verify +
  ensemble), where every phase ends in a device sync (an empty phase measures ~0.04 ms:
  K = 1 has no history); (b) device, the work on the block's critical path: gamma
  ensemble_mix calls at the draft shape plus one replay of the captured history graph,
  over draft-block graph + verify graph + history graph. Without timing the host queues
  the history graph before it waits for the verification result, so its launches overlap
  the verification; (b) is what the target is checked against.
* trees: each shape's draft, verification and history graphs replayed back to back against
  the chain's, and ms/token at fixed accepted depths; with --scenario-taus also chain SD and
  each tree at the mean tokens per target forward of that run (the M+T view set), the tree
  SD vs chain SD speedup checked against 1.25x.
* prefill split: direct synchronized calls of the engine's pieces (vision tower +
  projector, `prefill_target`, `build_views`, `prefill_draft`) and host preprocessing.
"""
from __future__ import annotations

import argparse
import functools
import gc
import json
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass, field

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import copy_bandwidth_gbs, event_ms, graph_ms, wall_ms  # noqa: E402
from e2e_common import (E2EBench, add_common_args, build_hf_llava, check_limit, default_dtype,  # noqa: E402
                        fmt, header_lines, lm_weight_bytes, log, resolve_device)
from e2e_common import build_lvlm  # noqa: E402,F401  (profile_decode.py and bench_pdl.py import it from here)

CLIP_L336 = dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
                 image_size=336, patch_size=14, projection_dim=768)


@dataclass
class Preset:
    vision: dict
    target: dict           # Llama text config
    draft: dict
    text_tokens: int = 40
    new_tokens: int = 128
    repeats: int = 3
    gamma: int = 5
    max_len: int = 2048
    copy_bytes: int = 1 << 30
    replay_reps: int = 20  # CUDA-event samples of back-to-back graph replays
    init_std: float = 0.02
    taus: tuple = (1, 2, 3, 4, 5, 6)
    extra: dict = field(default_factory=dict)


PRESETS = {
    "llava-1.5-7b": Preset(
        vision=CLIP_L336,
        target=dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                    num_key_value_heads=32, vocab_size=32064, rms_norm_eps=1e-5, max_position_embeddings=4096),
        draft=dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=2, num_attention_heads=12,
                   num_key_value_heads=12, vocab_size=32064, rms_norm_eps=1e-6, max_position_embeddings=2048)),
    # CPU smoke: the same code path on small shapes (timings mean nothing)
    "tiny": Preset(
        vision=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                    image_size=28, patch_size=14, projection_dim=16),
        target=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=4, vocab_size=512, rms_norm_eps=1e-5, max_position_embeddings=2048),
        draft=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                   num_key_value_heads=4, vocab_size=512, rms_norm_eps=1e-6, max_position_embeddings=2048),
        new_tokens=32, repeats=2, max_len=512, copy_bytes=64 << 20, replay_reps=5, init_std=0.2),
}
VIEW_SETS = {1: ("M",), 2: ("M", "T"), 4: ("M", "T", "P", "C")}
CAPTION = "w1 w2 w3"
TAU_MAIN = 2.31
# tree shapes (depth x width x branch; 19, 37, 45, 64, 58 and 47 nodes) and accepted depths + 1 for tree_sweep
TREE_SHAPES = ("5x2x2", "5x4x2", "6x4x2", "5x3x5", "10x3x2", "12x2x2")
TREE_TAUS = (2.31, 3.0, 4.0)
METHOD = {
    "decode_ms_per_token": "engine: median over repeats of the inter-token time (time_total - time_first_token) / "
                           "(new_tokens - 1) from the engine's stats (wall clock, first new token on the host to "
                           "the last); transformers, and every row's ms_per_token_diff: (median t(new_tokens) - "
                           "median t(1)) / (new_tokens - 1), synchronized wall clock; one warm-up generation "
                           "first (graph capture / compile)",
    "floor": "target LM weight bytes (decoder layers + final norm + lm_head) / copy bandwidth",
    "copy_bandwidth": "2 x bytes / median CUDA-event time of a device-to-device copy",
    "sd": "engine.bench_accept_schedule: deterministic floor/ceil accepted counts with mean tau - 1; the SD "
          "engines run with adaptive=False (every block a gamma-chain: the cost model would shorten chains, "
          "which this schedule would credit with the same tau)",
    "draft_step_ms": "engine timing=True: time_draft / (blocks x gamma); *_graph_*: back-to-back replays of "
                     "the captured graph (CUDA events) / gamma",
    "verify_ms": "time_verify / blocks (includes acceptance and the block's host sync); verify_graph_ms: replay",
    "ensemble_share": "time_ensemble / (time_draft + time_verify + time_ensemble)",
}


# ---------------------------------------------------------------------------- timing
def decode_ms(gen, n_new: int, repeats: int, device, one_ms=None, warmup: bool = True, stats=None) -> dict:
    """Decode ms/token, medians of `repeats` after one warm-up. gen(n) runs one generation and
    returns how many tokens it produced.

    With `stats` (a callable returning the engine's GenerationStats of the generation just
    run): the inter-token time (time_total - time_first_token) / (n_new - 1), wall clock from
    the first new token on the host to the last. Always (and the only estimate for
    transformers): (t(n_new) - t(1)) / (n_new - 1) as `ms_per_token_diff`; t(1) holds a
    prefill whose host-bound time varies run to run (68-108 ms in one H100 run of the 7B
    preset), which moves this estimate by up to 0.3 ms/token. `one_ms` reuses an already
    measured t(1); warmup=False when the caller already ran this exact generation (graphs
    captured, compiled)."""
    if warmup:
        gen(n_new)                             # graph capture / compilation
    full, itl = [], []
    for _ in range(repeats):
        produced, ms = wall_ms(lambda: gen(n_new), device)
        if produced != n_new:
            raise RuntimeError(f"generation produced {produced} tokens, expected {n_new}")
        full.append(ms)
        if stats is not None:
            st = stats()
            itl.append((st.time_total - st.time_first_token) / (n_new - 1) * 1e3)
    if one_ms is None:
        gen(1)
        one_ms = statistics.median(wall_ms(lambda: gen(1), device)[1] for _ in range(repeats))
    t_full = statistics.median(full)
    diff = (t_full - one_ms) / (n_new - 1)
    r = {"ms_per_token": statistics.median(itl) if itl else diff, "ms_per_token_diff": diff,
         "t_full_ms": t_full, "t_one_ms": one_ms, "t_full_runs_ms": full}
    if itl:
        r["inter_token_ms_runs"] = itl
    return r


class FixedSchedule:
    """Deterministic accepted-count pattern with mean m per block (each block floor or ceil);
    the engine's hook also passes the block's depth: unused. A class, not a closure: a
    tensor-parallel engine sends it to its workers (pickled)."""

    def __init__(self, m: float):
        self.m = m

    def __call__(self, b: int, depth=None) -> int:
        return int(math.floor((b + 1) * self.m + 1e-9) - math.floor(b * self.m + 1e-9))


def accept_schedule(tau: float, gamma: int):
    """Deterministic accepted-count pattern with mean tau - 1 (each block floor or ceil), for
    blocks of `gamma` drafts."""
    m = tau - 1.0
    if not 0.0 <= m <= gamma:
        raise ValueError(f"tau must be in [1, gamma + 1] = [1, {gamma + 1}], got {tau}")
    return FixedSchedule(m)


def draft_acceptance(tau: float, gamma: int) -> float:
    """The per-draft acceptance rate alpha whose chains of `gamma` drafts give tau tokens per
    block when each draft is accepted with probability alpha until the first rejection:
    sum_{i <= gamma} alpha^i = tau (bisection)."""
    if not 1.0 <= tau <= gamma + 1:
        raise ValueError(f"tau must be in [1, gamma + 1] = [1, {gamma + 1}], got {tau}")
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if sum(mid ** i for i in range(gamma + 1)) < tau else (lo, mid)
    return (lo + hi) / 2


def geometric_schedule(tau: float, gamma: int, seed: int = 0):
    """Accepted drafts per block when each draft is accepted with the same probability alpha
    (`draft_acceptance(tau, gamma)`) until the first rejection, for any chain length: block b
    of depth d accepts min(run_b, d), run_b = floor(ln u_b / ln alpha) (P(run_b >= k) =
    alpha^k) with u_b a golden-ratio sequence (low discrepancy: a run of a few dozen blocks
    already averages tau). Chains of `gamma` drafts average tau tokens per block; shorter
    chains give what they would really give at that acceptance rate (the floor/ceil
    `accept_schedule` would credit a 2-draft chain with the same tau)."""
    return GeometricSchedule(draft_acceptance(tau, gamma), gamma, seed)


class GeometricSchedule:
    """`geometric_schedule`'s accepted drafts of block b (of depth `depth`); picklable, as
    `FixedSchedule`."""

    def __init__(self, alpha: float, gamma: int, seed: int = 0):
        self.alpha, self.gamma, self.seed = alpha, gamma, seed

    def __call__(self, b: int, depth: int = None) -> int:
        depth = self.gamma if depth is None else depth
        u = 1.0 - (self.seed * 0.5 + (b + 1) * (math.sqrt(5) - 1) / 2) % 1.0          # in (0, 1]
        if self.alpha <= 0.0:
            return 0
        return min(depth, int(math.log(u) / math.log(self.alpha)) if self.alpha < 1.0 else depth)


# ---------------------------------------------------------------------------- benchmark
class Bench(E2EBench):
    """Preset llava-1.5-7b (or tiny): engine AR and SD against the floor and transformers."""

    def __init__(self, args, preset: Preset):
        super().__init__(args, preset, METHOD)
        self.floor_ms = self.ar_ms = self.hf_eager_ms = None

    # ------------------------------------------------------------------ setup
    def setup(self) -> dict:
        from tabed_engine import Engine
        from tabed_engine.models.loader import lvlm_from_hf
        from tabed_engine.models.tiny import build_processor, random_image, words

        p, dev, dt = self.p, self.device, self.dtype
        vocab = p.target["vocab_size"]
        t0 = time.perf_counter()
        self.processor = build_processor(vocab, p.vision["image_size"], p.vision["patch_size"], "default")
        image_token = self.processor.tokenizer.convert_tokens_to_ids("<image>")
        self.hf_target = build_hf_llava(p.vision, p.target, dev, dt, p.init_std, 0, image_token)
        self.hf_draft = build_hf_llava(p.vision, p.draft, dev, dt, p.init_std, 1, image_token)
        with torch.no_grad():  # the real pair shares the CLIP tower: lets the engine encode once
            self.hf_draft.model.vision_tower.load_state_dict(self.hf_target.model.vision_tower.state_dict())
        with default_dtype(dt):   # lvlm_from_hf builds on meta, then to_empty: allocate in dt
            target, draft = lvlm_from_hf(self.hf_target, dev, dt), lvlm_from_hf(self.hf_draft, dev, dt)
        self.target_lvlm = target
        if self.args.skip_hf:
            del self.hf_target, self.hf_draft
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()
        self.engines = {K: Engine(target, self.processor, draft=draft, device=dev, dtype=dt, views=views,
                                  policy=self.args.policy, gamma=p.gamma, max_len=p.max_len, timing=False,
                                  max_batch=1, adaptive=False,   # every block a gamma-chain (see METHOD)
                                  prefix_cache=False)   # repeated prompts: every prefill after the first would hit
                        for K, views in VIEW_SETS.items()}
        # "<image>\n" + words: the newline and the words are the text tokens (BOS apart)
        self.prompt = "<image>\n " + words(0, p.text_tokens - 1, vocab)
        self.image = random_image(0, p.vision["image_size"])
        enc = self.processor(text=self.prompt, images=[self.image], return_tensors="pt")
        self.hf_inputs = {k: v.to(dev) for k, v in enc.items()}
        self.hf_inputs["pixel_values"] = self.hf_inputs["pixel_values"].to(dt)
        ids = enc["input_ids"][0]
        n_img = int((ids == image_token).sum())
        if self.cuda:
            torch.cuda.synchronize()
        mem = torch.cuda.memory_allocated() / 2 ** 30 if self.cuda else None
        peak = torch.cuda.max_memory_allocated() / 2 ** 30 if self.cuda else None
        return {"build_s": time.perf_counter() - t0, "prompt_tokens": len(ids), "image_tokens": n_img,
                "text_tokens": len(ids) - n_img, "new_tokens": p.new_tokens, "gamma": p.gamma,
                "repeats": p.repeats, "batch": 1, "greedy": True, "dtype": str(dt), "max_len": p.max_len,
                "ensemble_policy": self.args.policy,
                "target": {"vision": p.vision, "text": p.target}, "draft": {"vision": p.vision, "text": p.draft},
                "draft_shares_target_vision_weights": True, "init": f"N(0, {p.init_std}), norms 1",
                "gpu_mem_allocated_GiB_after_build": mem, "gpu_mem_peak_GiB_during_build": peak,
                "hf_attn_implementation": None if self.args.skip_hf else
                getattr(self.hf_target.config, "_attn_implementation", None)}

    # ------------------------------------------------------------------ engine pieces
    def gen_engine(self, eng, n: int, speculative: bool) -> int:
        from tabed_engine import SamplingParams

        out = eng.generate(self.prompt, images=[self.image], caption=CAPTION, speculative=speculative,
                           sampling=SamplingParams(max_new_tokens=n, stop_at_eos=False))
        if n == self.p.new_tokens:   # the stats / tokens of the last full-length generation
            self.last_stats, self.last_tokens = out.stats, out.token_ids
        return len(out.token_ids)

    def bandwidth(self) -> dict:
        gbs = copy_bandwidth_gbs(self.device, self.p.copy_bytes, reps=10)
        wbytes = lm_weight_bytes(self.target_lvlm)
        cfg = self.target_lvlm.lm.cfg
        ctx = self.result["setup"]["prompt_tokens"] + self.p.new_tokens / 2
        kv_bytes = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * ctx * self.dtype.itemsize
        self.floor_ms = wbytes / (gbs * 1e9) * 1e3
        return {"copy_GBs": gbs, "copy_bytes": self.p.copy_bytes, "target_lm_weight_bytes": wbytes,
                "floor_ms_per_token": self.floor_ms,
                "kv_read_bytes_at_mean_context": kv_bytes, "mean_context_tokens": ctx,
                "floor_with_kv_ms_per_token": (wbytes + kv_bytes) / (gbs * 1e9) * 1e3}

    def engine_ar(self) -> dict:
        eng = self.engines[1]
        r = decode_ms(lambda n: self.gen_engine(eng, n, False), self.p.new_tokens, self.p.repeats, self.device,
                      stats=lambda: self.last_stats)
        self.ar_tokens = self.last_tokens
        self.ar_ms = r["ms_per_token"]
        r["ratio_to_floor"] = self.ar_ms / self.floor_ms if self.floor_ms else None
        if eng.graphs is not None and ("ar", 1) in eng.graphs.graphs:
            g = eng.graphs.graphs[("ar", 1)].graph
            r["step_graph_replay_ms"] = event_ms(g.replay, self.p.replay_reps, inner=10)
            r["step_graph_ratio_to_floor"] = r["step_graph_replay_ms"] / self.floor_ms
        return r

    def prefill_split(self) -> dict:
        from tabed_engine.engine.prompt import prepare
        from tabed_engine.models.decoder import cache_rows
        from tabed_engine.speculation.chain import prefill_draft
        from tabed_engine.speculation.views import build_views

        out = {}
        for K, eng in self.engines.items():
            samples: dict[str, list] = {}

            def add(name, ms):
                samples.setdefault(name, []).append(ms)

            with torch.inference_mode():
                for rep in range(self.p.repeats + 1):          # first pass = warm-up
                    prep, ms = wall_ms(lambda: prepare(self.processor, self.prompt, [self.image],
                                                       eng.target.image_token_id, eng.tokens_per_image),
                                       self.device)
                    add("host_preprocess_ms", ms)
                    pv = prep.pixel_values.to(self.device)
                    sel, ms = wall_ms(lambda: eng.target.vision.select(pv), self.device)
                    add("vision_tower_ms", ms)
                    _, ms = wall_ms(lambda: eng.target.vision.project(sel), self.device)
                    add("projector_ms", ms)
                    (_, _, sel2), ms = wall_ms(lambda: eng.prefill_target(prep), self.device)
                    add("prefill_target_total_ms", ms)
                    rows, ms = wall_ms(lambda: build_views(eng, prep, sel2, CAPTION), self.device)
                    add("build_views_ms", ms)
                    dcache = cache_rows(eng.runner.dcache, 0, len(rows))
                    _, ms = wall_ms(lambda: prefill_draft(eng.runner, rows, dcache), self.device)
                    add("prefill_draft_ms", ms)
            r = {k: statistics.median(v[1:]) for k, v in samples.items()}
            r["target_lm_prefill_ms"] = r["prefill_target_total_ms"] - r["vision_tower_ms"] - r["projector_ms"]
            r["draft_views_total_ms"] = r["build_views_ms"] + r["prefill_draft_ms"]
            r["draft_rows_tokens"] = [len(x.ids) for x in rows]
            out[f"K={K}"] = r
        return out

    def sd_sweep(self) -> dict:
        out = {}
        taus = [TAU_MAIN] + [t for t in self.p.taus if t != TAU_MAIN]
        for K in (1, 2):
            eng = self.engines[K]
            res = {}
            for tau, r in self.schedule_sweep(eng, taus, self.p.gamma):
                st = self.last_stats
                r["tau_realized"] = st.block_efficiency
                r["blocks"] = st.target_forwards
                r["speedup_vs_engine_ar"] = self.ar_ms / r["ms_per_token"] if self.ar_ms else None
                r["ratio_to_floor"] = r["ms_per_token"] / self.floor_ms if self.floor_ms else None
                res[f"tau={tau}"] = r
                log(f"  SD K={K} tau={tau}: {r['ms_per_token']:.3f} ms/token "
                    f"(tau realized {r['tau_realized']:.2f}, {r['speedup_vs_engine_ar'] or 0:.2f}x vs AR)")
            out[f"K={K}"] = res
        return out

    def schedule_sweep(self, eng, taus, depth: int):
        """(tau, decode_ms result) for each tau, the engine's acceptance fixed by the benchmark
        schedule (at most `depth` drafts accepted per block); t(1) is measured once."""
        one_ms = None
        for tau in taus:
            eng.bench_accept_schedule = accept_schedule(tau, depth)
            try:
                r = decode_ms(lambda n: self.gen_engine(eng, n, True), self.p.new_tokens, self.p.repeats,
                              self.device, one_ms=one_ms, warmup=one_ms is None, stats=lambda: self.last_stats)
            finally:
                eng.bench_accept_schedule = None
            one_ms = r["t_one_ms"]
            yield tau, r

    def sd_breakdown(self) -> dict:
        """Per-phase times from the engine's own timing (timing=True) at tau = 2.31, and the
        captured draft / verify graphs replayed back to back."""
        out = {}
        g = self.p.gamma
        for K, eng in self.engines.items():
            eng.bench_accept_schedule = accept_schedule(TAU_MAIN, g)
            eng.timing = True
            runs = []
            try:
                self.gen_engine(eng, self.p.new_tokens, True)       # warm-up / capture
                for _ in range(self.p.repeats):
                    self.gen_engine(eng, self.p.new_tokens, True)
                    runs.append(self.last_stats)
            finally:
                eng.timing = False
                eng.bench_accept_schedule = None

            def med(f):
                return statistics.median(f(s) for s in runs)

            r = {"views": list(eng.views),
                 "blocks": runs[0].target_forwards,
                 "draft_step_ms": med(lambda s: s.time_draft / (s.target_forwards * g) * 1e3),
                 "draft_block_ms": med(lambda s: s.time_draft / s.target_forwards * 1e3),
                 "verify_ms": med(lambda s: s.time_verify / s.target_forwards * 1e3),
                 "ensemble_history_ms_per_block": med(lambda s: s.time_ensemble / s.target_forwards * 1e3),
                 "ensemble_share": med(lambda s: s.time_ensemble / (s.time_draft + s.time_verify + s.time_ensemble)),
                 "time_prefill_ms": med(lambda s: s.time_prefill * 1e3),
                 "weights_last_block": runs[0].weights[-1] if runs[0].weights else None}
            if eng.graphs is not None:
                for key, cap in eng.graphs.graphs.items():
                    if key[0] == "draft":
                        ms = event_ms(cap.graph.replay, self.p.replay_reps, inner=10)
                        r["draft_graph_block_ms"], r["draft_graph_step_ms"] = ms, ms / g
                    elif key[0] == "verify":
                        r["verify_graph_ms"] = event_ms(cap.graph.replay, self.p.replay_reps, inner=10)
                hist = [cap for key, cap in eng.graphs.graphs.items() if key[0] == "hist"]
                hist_ms = event_ms(hist[0].graph.replay, self.p.replay_reps, inner=10) if hist else 0.0
                mix_ms = self.mix_graph_ms(K, eng)
                r["history_graph_ms"], r["ensemble_mix_graph_ms"] = hist_ms, mix_ms
                if "verify_graph_ms" in r and "draft_graph_block_ms" in r:
                    dev_ms = g * mix_ms + hist_ms
                    r["ensemble_device_ms_per_block"] = dev_ms
                    r["ensemble_device_share"] = dev_ms / (r["draft_graph_block_ms"] + r["verify_graph_ms"] + hist_ms)
                if "verify_graph_ms" in r and "draft_graph_block_ms" in r:
                    # what one token would cost if only the graphs ran (no host work between them)
                    r["device_bound_sd_ms_per_token_at_tau"] = \
                        (r["verify_graph_ms"] + r["draft_graph_block_ms"]) / TAU_MAIN
            out[f"K={K}"] = r
            log(f"  K={K} {eng.views}: draft step {r['draft_step_ms']:.4f} ms "
                f"(graph {r.get('draft_graph_step_ms', float('nan')):.4f}), verify {r['verify_ms']:.3f} ms "
                f"(graph {r.get('verify_graph_ms', float('nan')):.3f}), ensemble share {r['ensemble_share']:.3%}")
        return out

    def tree_sweep(self) -> dict:
        """Draft trees against the chain, K = 2 (M, T): each tree block's graphs replayed back to
        back (draft, verification with the walk and compaction, history) and decode ms/token at
        fixed accepted depths (tau = mean accepted + 1)."""
        from tabed_engine import Engine

        base = self.engines[2]
        out = {}
        taus = self.scenario_taus()
        for shape in TREE_SHAPES:
            eng = Engine(base.target, base.processor, draft=base.draft, device=base.device, dtype=base.dtype,
                         views=base.views, policy=self.args.policy, max_len=self.p.max_len, tree=shape,
                         max_batch=1, adaptive=False, prefix_cache=False)
            depth, r = eng.tree.depth, {"nodes": eng.tree.nodes, "depth": eng.tree.depth}
            extra = [taus["trees"][shape]] if shape in taus.get("trees", {}) else []
            for tau, d in self.schedule_sweep(eng, [t for t in (*TREE_TAUS, *extra) if t - 1 <= depth], depth):
                r[f"tau={tau}"] = {"ms_per_token": d["ms_per_token"], "tau_realized": self.last_stats.block_efficiency,
                                   "speedup_vs_engine_ar": self.ar_ms / d["ms_per_token"] if self.ar_ms else None}
            if eng.graphs is not None:
                for key, cap in eng.graphs.graphs.items():
                    name = {"draft": "draft_graph_ms", "verify": "verify_graph_ms", "hist": "history_graph_ms"}.get(key[0])
                    if name:
                        r[name] = event_ms(cap.graph.replay, self.p.replay_reps, inner=10)
                if {"draft_graph_ms", "verify_graph_ms"} <= set(r):
                    r["block_graphs_ms"] = r["draft_graph_ms"] + r["verify_graph_ms"] + r.get("history_graph_ms", 0.0)
            out[shape] = r
            log(f"  tree {shape} ({r['nodes']} nodes): block graphs {r.get('block_graphs_ms', float('nan')):.3f} ms, "
                + ", ".join(f"{k} {v['ms_per_token']:.3f} ms/token" for k, v in r.items() if k.startswith("tau=")))
            del eng
        chain = self.result.get("sd_breakdown", {}).get("K=2", {})
        if {"draft_graph_block_ms", "verify_graph_ms"} <= set(chain):
            chain_block = chain["draft_graph_block_ms"] + chain["verify_graph_ms"] + chain.get("history_graph_ms", 0.0)
            out["chain_block_graphs_ms"] = chain_block
            for shape in TREE_SHAPES:
                if "block_graphs_ms" in out[shape]:
                    out[shape]["block_vs_chain_block"] = out[shape]["block_graphs_ms"] / chain_block
        if taus:  # chain SD vs tree SD, each at the tokens per target forward the scenario run measured
            tau_c = taus["chain"]
            (_, d), = self.schedule_sweep(base, [tau_c], self.p.gamma)
            sc = {"source": taus["source"], "view_set": taus["view_set"],
                  "chain": {"tau": tau_c, "ms_per_token": d["ms_per_token"]}, "trees": {}}
            for shape, tau in taus["trees"].items():
                r = out.get(shape, {}).get(f"tau={tau}")
                if r:
                    sc["trees"][shape] = {"tau": tau, "ms_per_token": r["ms_per_token"],
                                          "speedup_vs_chain_sd": d["ms_per_token"] / r["ms_per_token"]}
            out["at_scenario_tau"] = sc
            log(f"  at the scenario run's tau: chain {tau_c:.2f} -> {d['ms_per_token']:.3f} ms/token; "
                + ", ".join(f"{k} {v['tau']:.2f} -> {v['ms_per_token']:.3f} ({v['speedup_vs_chain_sd']:.2f}x)"
                            for k, v in sc["trees"].items()))
        return out

    def scenario_taus(self) -> dict:
        """The chain's and each tree shape's tokens per target forward from `tree_scenarios.py`
        results (`--scenario-taus`; mean over scenarios, the K = 2 M+T view set; several runs,
        e.g. seeds: the mean of their means), or {}."""
        paths = self.args.scenario_taus
        if not paths:
            return {}
        view_set = f"{self.args.policy}[M+T]"
        runs = []
        for path in paths:
            with open(path) as fh:
                means = json.load(fh)["mean_over_scenarios"]
            trees = {name.split()[-1]: tau for name, tau in means.items()
                     if name.startswith(view_set + " tree ") and name.split()[-1] in TREE_SHAPES}
            if f"{view_set} chain" not in means or not trees:
                raise ValueError(f"--scenario-taus {path}: no '{view_set} chain' and tree rows of {TREE_SHAPES}")
            runs.append((means[f"{view_set} chain"], trees))
        shapes = [t for t in runs[0][1] if all(t in trees for _, trees in runs)]
        if not shapes:
            raise ValueError(f"--scenario-taus: no tree shape of {TREE_SHAPES} in every file")
        return {"source": paths if len(paths) > 1 else paths[0], "view_set": view_set,
                "chain": sum(c for c, _ in runs) / len(runs),
                "trees": {t: sum(trees[t] for _, trees in runs) / len(runs) for t in shapes}}

    def mix_graph_ms(self, K: int, eng) -> float:
        """One ensemble_mix at the draft loop's shape (1 request x K views, greedy), replayed
        from a CUDA graph of 10 calls: the mixing inside each draft step."""
        from tabed_engine.ops.ensemble_mix import ensemble_mix

        V = eng.draft.lm.cfg.vocab_size
        logits = torch.randn(K, V, device=self.device).to(eng.dtype)
        w = torch.full((1, K), 1.0 / K, device=self.device)
        seed = torch.zeros(1, dtype=torch.long, device=self.device)
        fn = functools.partial(ensemble_mix, logits, w, greedy=True, seed=seed, offset=seed)
        return graph_ms(fn, 10, self.p.replay_reps)

    # ------------------------------------------------------------------ transformers
    def hf_gen(self, n: int, **kw) -> int:
        with torch.inference_mode():
            out = self.hf_target.generate(**self.hf_inputs, max_new_tokens=n, do_sample=False, **kw)
        new = out[0, self.hf_inputs["input_ids"].shape[1]:]
        if n == self.p.new_tokens:
            self.hf_tokens = new.tolist()
        return len(new)

    def hf_eager(self) -> dict:
        r = decode_ms(lambda n: self.hf_gen(n), self.p.new_tokens, self.p.repeats, self.device)
        self.hf_eager_ms = r["ms_per_token"]
        r["cache"] = "dynamic (default)"
        # same weights, same greedy decoding: how far the two agree (exact in fp32; bf16
        # rounding differences may flip a near-tie of random weights' flat logits)
        a, b = getattr(self, "ar_tokens", None), self.hf_tokens
        if a is not None:
            r["greedy_prefix_agreeing_with_engine_ar"] = next(
                (i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        return r

    def hf_static(self) -> dict:
        if self.args.hf_static_compile == "off":
            self.hf_target.generation_config.disable_compile = True
        _, first = wall_ms(lambda: self.hf_gen(self.p.new_tokens, cache_implementation="static"), self.device)
        r = decode_ms(lambda n: self.hf_gen(n, cache_implementation="static"), self.p.new_tokens,
                      self.p.repeats, self.device)
        r["first_call_s"] = first / 1e3   # includes transformers' automatic torch.compile on CUDA
        r["auto_compile"] = self.cuda and not getattr(self.hf_target.generation_config, "disable_compile", False)
        return r

    def hf_assisted(self) -> dict:
        gc_d = self.hf_draft.generation_config
        gc_d.num_assistant_tokens = self.p.gamma          # same γ as the engine, fixed
        gc_d.num_assistant_tokens_schedule = "constant"
        gc_d.assistant_confidence_threshold = 0.0
        calls = {"target": 0, "draft": 0}
        hooks = [self.hf_target.register_forward_hook(lambda *a: calls.__setitem__("target", calls["target"] + 1)),
                 self.hf_draft.register_forward_hook(lambda *a: calls.__setitem__("draft", calls["draft"] + 1))]
        try:
            r = decode_ms(lambda n: self.hf_gen(n, assistant_model=self.hf_draft), self.p.new_tokens,
                          self.p.repeats, self.device)
            calls.update(target=0, draft=0)
            self.hf_gen(self.p.new_tokens, assistant_model=self.hf_draft)
        finally:
            for h in hooks:
                h.remove()
        r["target_forwards_per_generation"] = calls["target"]
        r["draft_forwards_per_generation"] = calls["draft"]
        if calls["target"] > 1:
            # the prefill forward is one of them; every other forward verifies one block
            r["ms_per_block"] = r["ms_per_token"] * (self.p.new_tokens - 1) / (calls["target"] - 1)
            r["tau"] = (self.p.new_tokens - 1) / (calls["target"] - 1)
        r["num_assistant_tokens"] = self.p.gamma
        return r

    # ------------------------------------------------------------------ verdict + report
    def targets(self) -> dict:
        get = self.number
        check = check_limit
        floor = get("bandwidth", "floor_ms_per_token")
        ar = get("engine_ar", "ms_per_token")
        d1 = get("sd_breakdown", "K=1", "draft_graph_step_ms") or get("sd_breakdown", "K=1", "draft_step_ms")
        d4 = get("sd_breakdown", "K=4", "draft_graph_step_ms") or get("sd_breakdown", "K=4", "draft_step_ms")
        sd = get("sd_sweep", "K=2", f"tau={TAU_MAIN}", "ms_per_token")
        sd1 = get("sd_sweep", "K=1", f"tau={TAU_MAIN}", "ms_per_token")
        hf = get("hf_eager", "ms_per_token")
        shares = [get("sd_breakdown", f"K={K}", "ensemble_device_share") or get("sd_breakdown", f"K={K}", "ensemble_share")
                  for K in VIEW_SETS]
        shares = [s for s in shares if s is not None]
        t = {
            "engine_ar_le_1.15x_floor": check(ar / floor if ar and floor else None, 1.15),
            "draft_step_K4_le_1.2x_K1": check(d4 / d1 if d4 and d1 else None, 1.2),
            "draft_step_K4_le_0.15ms": check(d4, 0.15),
            "ensemble_history_le_2pct_of_block": check(max(shares) if shares else None, 0.02),
            "sd_K2_tau2.31_speedup_vs_engine_ar_ge_1.8x": check(ar / sd if ar and sd else None, 1.8, le=False),
            "sd_K1_tau2.31_speedup_vs_engine_ar_ge_1.8x": check(ar / sd1 if ar and sd1 else None, 1.8, le=False),
            "sd_K2_tau2.31_speedup_vs_hf_eager_ge_10x": check(hf / sd if hf and sd else None, 10.0, le=False),
        }
        t64 = get("tree_sweep", "5x3x5", "block_vs_chain_block")
        t["tree_64_nodes_block_le_1.1x_chain_block"] = check(t64, 1.1)
        at = self.result.get("tree_sweep", {}).get("at_scenario_tau", {}).get("trees", {})
        t["tree_sd_at_scenario_tau_ge_1.25x_chain_sd"] = check(
            max((v["speedup_vs_chain_sd"] for v in at.values()), default=None), 1.25, le=False)
        t["_notes"] = ("draft step uses the graph-replay number on CUDA, engine timing elsewhere; "
                       "ensemble share is the worst over K = 1, 2, 4 of the device share on CUDA (gamma "
                       "ensemble_mix + history graph over the block's graphs), the host-phase share elsewhere")
        return t

    def markdown(self) -> str:
        R = self.result
        su, f, sec = R.get("setup", {}), fmt, self.measured
        lines = header_lines(R) + [
            f"prompt {su.get('prompt_tokens')} tokens ({su.get('image_tokens')} image), "
            f"{su.get('new_tokens')} new, batch 1, greedy, γ={su.get('gamma')}, "
            f"ensemble policy {su.get('ensemble_policy')}, "
            f"median of {su.get('repeats')}; decode ms/token: engine = inter-token time (first to last new "
            f"token), transformers = (t(n) − t(1)) / (n − 1)", ""]
        bw, ar = sec("bandwidth"), sec("engine_ar")
        lines += ["| decode (ms/token) | ms/token | × floor | speedup vs engine AR |", "|---|---|---|---|"]
        floor = bw.get("floor_ms_per_token")
        ar_ms = ar.get("ms_per_token")

        def row(label, ms):
            if not isinstance(ms, (int, float)):
                return f"| {label} | {f(ms)} | | |"
            return (f"| {label} | {ms:.3f} | {f(ms / floor if floor else None, '.2f')} | "
                    f"{f(ar_ms / ms if ar_ms else None, '.2f')} |")

        lines.append(f"| bandwidth floor ({f(bw.get('target_lm_weight_bytes', 0) / 1e9, '.2f')} GB "
                     f"@ {f(bw.get('copy_GBs'), '.0f')} GB/s copy) | {f(floor)} | 1.00 | |")
        lines.append(row("engine AR", ar_ms))
        if "ms_per_token_diff" in ar:
            lines.append(row("engine AR, (t(n) − t(1)) / (n − 1)", ar["ms_per_token_diff"]))
        if "step_graph_replay_ms" in ar:
            lines.append(row("engine AR step (graph replay only)", ar["step_graph_replay_ms"]))
        for name, label in (("hf_eager", "transformers AR, dynamic cache"),
                            ("hf_static", "transformers AR, static cache"),
                            ("hf_assisted", "transformers assisted (random pair)")):
            v = R.get(name)
            if v is None:
                continue
            if "error" in v:
                lines.append(f"| {label} | error: {v['error'][:80]} | | |")
            else:
                extra = f" (τ={v['tau']:.2f})" if "tau" in v else ""
                lines.append(row(label + extra, v["ms_per_token"]))
        sweep = sec("sd_sweep")
        for K, res in sweep.items():
            r = res.get(f"tau={TAU_MAIN}")
            if r:
                lines.append(row(f"engine SD {K} τ={TAU_MAIN}", r["ms_per_token"]))
        if sweep:
            taus = list(next(iter(sweep.values())).keys())
            lines += ["", "| SD ms/token (speedup vs AR) | " + " | ".join(t.replace("tau=", "τ=") for t in taus) + " |",
                      "|---|" + "---|" * len(taus)]
            for K, res in sweep.items():
                cells = [f"{res[t]['ms_per_token']:.3f} ({f(res[t].get('speedup_vs_engine_ar'), '.2f')}×)"
                         if t in res else "—" for t in taus]
                lines.append(f"| {K} {'+'.join(VIEW_SETS[int(K[2:])])} | " + " | ".join(cells) + " |")
        bd = sec("sd_breakdown")
        if bd:
            lines += ["", "| block at τ=2.31 | draft step ms (graph) | verify γ+1 ms (graph) | ensemble+history "
                      "ms/block: host phase (device) | share: host phase (device) | graph-only ms/token |",
                      "|---|---|---|---|---|---|"]
            for K, r in bd.items():
                dev_share = r.get("ensemble_device_share")
                lines.append(f"| {K} {'+'.join(r['views'])} | {f(r['draft_step_ms'], '.4f')} "
                             f"({f(r.get('draft_graph_step_ms'), '.4f')}) | {f(r['verify_ms'])} "
                             f"({f(r.get('verify_graph_ms'))}) | {f(r['ensemble_history_ms_per_block'])} "
                             f"({f(r.get('ensemble_device_ms_per_block'), '.4f')}) | "
                             f"{f(100 * r['ensemble_share'], '.2f')}% "
                             f"({f(100 * dev_share if dev_share is not None else None, '.2f')}%) | "
                             f"{f(r.get('device_bound_sd_ms_per_token_at_tau'))} |")
        ts = sec("tree_sweep")
        if ts:
            lines += ["", f"| trees, K=2 (M,T) | nodes | block graphs ms (× chain block "
                      f"{f(ts.get('chain_block_graphs_ms'))}) | "
                      + " | ".join(f"ms/token τ={t} (× AR)" for t in TREE_TAUS) + " |",
                      "|---|---|---|" + "---|" * len(TREE_TAUS)]
            for shape in TREE_SHAPES:
                r = ts.get(shape)
                if not isinstance(r, dict):
                    continue
                cells = [f"{r[k]['ms_per_token']:.3f} ({f(r[k].get('speedup_vs_engine_ar'), '.2f')}×)"
                         if k in r else "—" for k in (f"tau={t}" for t in TREE_TAUS)]
                lines.append(f"| {shape} | {r['nodes']} | {f(r.get('block_graphs_ms'))} "
                             f"({f(r.get('block_vs_chain_block'), '.2f')}×) | " + " | ".join(cells) + " |")
            at = ts.get("at_scenario_tau")
            if at:
                one = isinstance(at["source"], str)
                src, over = (at["source"], "scenarios") if one else (" ".join(at["source"]), "scenarios and runs")
                lines += ["", f"at the tokens per target forward of `{src}` ({at['view_set']}, mean over {over}): "
                          f"chain SD τ={at['chain']['tau']:.2f} {at['chain']['ms_per_token']:.3f} ms/token; "
                          + "; ".join(f"tree {k} τ={v['tau']:.2f} {v['ms_per_token']:.3f} ms/token "
                                      f"(**{v['speedup_vs_chain_sd']:.2f}×** chain SD)"
                                      for k, v in at["trees"].items())]
        ps = sec("prefill_split")
        if ps:
            lines += ["", "| prefill ms | host preprocess | vision tower | projector | target LM | draft views "
                      "(build + prefill) | draft rows |", "|---|---|---|---|---|---|---|"]
            for K, r in ps.items():
                lines.append(f"| {K} | {f(r['host_preprocess_ms'], '.2f')} | {f(r['vision_tower_ms'], '.2f')} | "
                             f"{f(r['projector_ms'], '.2f')} | {f(r['target_lm_prefill_ms'], '.2f')} | "
                             f"{f(r['build_views_ms'], '.2f')} + {f(r['prefill_draft_ms'], '.2f')} | "
                             f"{r['draft_rows_tokens']} |")
        tg = R.get("targets", {})
        lines += ["", "| target | value | limit | pass |", "|---|---|---|---|"]
        for k, v in tg.items():
            if isinstance(v, dict):
                mark = {True: "PASS", False: "FAIL", None: "n/a"}[v["pass"]]
                lines.append(f"| {k} | {f(v['value'], '.4f')} | {v['limit']} | {mark} |")
        errs = [k for k, v in R.items() if isinstance(v, dict) and "error" in v]
        if errs:
            lines += ["", "errors: " + "; ".join(f"{k}: {R[k]['error'][:200]}" for k in errs)]
        if self.device.type == "cpu":
            lines += ["", "(CPU smoke: timings mean nothing)"]
        return "\n".join(lines) + "\n"

    def stages(self):
        """(section name, function) in run order, after setup."""
        yield from (("bandwidth", self.bandwidth), ("engine_ar", self.engine_ar),
                    ("prefill_split", self.prefill_split), ("sd_sweep", self.sd_sweep),
                    ("sd_breakdown", self.sd_breakdown), ("tree_sweep", self.tree_sweep))
        if not self.args.skip_hf:
            yield from (("hf_eager", self.hf_eager), ("hf_assisted", self.hf_assisted),
                        ("hf_static", self.hf_static))   # last: auto torch.compile may be slow


def main(argv=None):
    import e2e_demo

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=sorted([*PRESETS, e2e_demo.PRESET]), default="llava-1.5-7b")
    add_common_args(ap)
    ap.add_argument("--policy", default="hedge", help="ensemble policy of the SD engines (preset llava-1.5-7b; "
                    "default: the engine's default, hedge)")
    ap.add_argument("--hf-static-compile", choices=("auto", "off"), default="auto",
                    help="auto: transformers' own torch.compile of static-cache decoding on CUDA (default); "
                         "off: static cache without compilation")
    ap.add_argument("--scenario-taus", nargs="+", default=None, metavar="JSON",
                    help="tree_scenarios.py results: also time chain and tree SD at their measured tokens per "
                         "target forward (the M+T view set; several files: the mean of their means)")
    e2e_demo.add_args(ap)
    args = ap.parse_args(argv)
    if args.preset == e2e_demo.PRESET:
        return e2e_demo.run(args)
    if args.prompts or args.max_new or args.invariant:
        ap.error("--prompts, --max-new and --invariant belong to the demo-pair preset")
    preset = PRESETS[args.preset]
    if args.repeats:
        preset.repeats = args.repeats
    torch.manual_seed(0)
    Bench(resolve_device(args), preset).run()


if __name__ == "__main__":
    main()
