"""End-to-end LLaVA benchmark against the memory-bandwidth floor, all in one run.

    python benchmarks/e2e.py --preset llava-1.5-7b --out DIR          # H100/H200, ~5 min
    python benchmarks/e2e.py --preset tiny --device cpu --out DIR     # CPU smoke, < 2 min
    (--skip-hf omits the transformers baselines)

Random bf16 weights built on the device (no checkpoints): target LLaVA-1.5-7B shape (CLIP
ViT-L/14-336, 576 image tokens; Llama 32 x 4096 MHA, vocab 32064), draft LLaVA-68M shape
(same vision tower, with the target's tower weights copied in as the real pair shares
them; Llama 2 x 768). One 336x336 random image + 40 text tokens, 128 new tokens, batch 1,
greedy. Writes DIR/e2e_<preset>.json (provenance + every number) and DIR/e2e_<preset>.md.

How each number is measured
* floor = target LM weight bytes (decoder layers + final norm + lm_head; the embedding
  read is one row) / device-to-device copy bandwidth (read + write bytes / median time of
  a 1 GiB copy) measured in this run.
* decode ms/token (engine AR, engine SD, transformers) = (t(128 new) - t(1 new)) / 127,
  each t the median of `repeats` synchronized wall-clock generations after a warm-up
  generation (which captures the CUDA graphs / compiles). The prefill cancels.
* SD runs use the engine's benchmark-only hook `bench_accept_schedule(block) -> accepted`
  with a deterministic floor/ceil pattern of mean tau - 1 accepted drafts per block, so
  the block efficiency is tau (the last block is cut at 128 tokens: `tau_realized`).
* draft step / verification: from the engine's own timing (`timing=True`: syncs around
  each phase; time_draft / (blocks * gamma), time_verify / blocks) and, on CUDA, from
  back-to-back replays of the captured draft-block graph (/ gamma) and verify graph.
  ensemble + history share = time_ensemble / (draft + verify + ensemble).
* prefill split: direct synchronized calls of the engine's pieces (vision tower +
  projector, `prefill_target`, `build_views`, `prefill_draft`) and host preprocessing.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import statistics
import sys
import time
import traceback
from dataclasses import dataclass, field

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from _common import copy_bandwidth_gbs, event_ms, provenance, wall_ms  # noqa: E402

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
METHOD = {
    "decode_ms_per_token": "(median t(new_tokens) - median t(1)) / (new_tokens - 1); synchronized wall clock; "
                           "one warm-up generation first (graph capture / compile)",
    "floor": "target LM weight bytes (decoder layers + final norm + lm_head) / copy bandwidth",
    "copy_bandwidth": "2 x bytes / median CUDA-event time of a device-to-device copy",
    "sd": "engine.bench_accept_schedule: deterministic floor/ceil accepted counts with mean tau - 1",
    "draft_step_ms": "engine timing=True: time_draft / (blocks x gamma); *_graph_*: back-to-back replays of "
                     "the captured graph (CUDA events) / gamma",
    "verify_ms": "time_verify / blocks (includes acceptance and the block's host sync); verify_graph_ms: replay",
    "ensemble_share": "time_ensemble / (time_draft + time_verify + time_ensemble)",
}


def log(msg: str):
    print(f"[e2e {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---------------------------------------------------------------------------- models
@contextlib.contextmanager
def default_dtype(dtype):
    """Modules created inside get `dtype` parameters directly (no float32 copy first: a
    float32 7B would be 27 GB on top of the bf16 one)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def build_hf_llava(vision: dict, text: dict, device, dtype, std: float, seed: int, image_token_id: int):
    """A random `LlavaForConditionalGeneration` built directly on `device` in `dtype`:
    matrices ~ N(0, std), norm weights 1, other vectors ~ N(0, std) (never zeros)."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    tc = LlamaConfig(**text, bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    grid = (vision["image_size"] // vision["patch_size"]) ** 2
    cfg = LlavaConfig(vision_config=CLIPVisionConfig(**vision), text_config=tc, image_token_index=image_token_id,
                      vision_feature_layer=-2, vision_feature_select_strategy="default",
                      image_seq_length=grid, tie_word_embeddings=False)
    with default_dtype(dtype), torch.device(device):
        model = LlavaForConditionalGeneration(cfg)
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and "norm" in name and name.endswith("weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, std, generator=g)
    model.eval()
    model.generation_config.eos_token_id = None   # never stop early: every run makes exactly n tokens
    model.generation_config.pad_token_id = 0
    return model


def lm_weight_bytes(lvlm) -> int:
    """Bytes the target LM reads per decode step: all LM weights except the embedding table."""
    lm = lvlm.lm
    emb = lm.embed_tokens.weight
    seen = {emb.data_ptr()}
    total = 0
    for p in lm.parameters():
        if p.data_ptr() in seen:
            continue
        seen.add(p.data_ptr())
        total += p.numel() * p.element_size()
    return total


# ---------------------------------------------------------------------------- timing
def decode_ms(gen, n_new: int, repeats: int, device, one_ms=None, warmup: bool = True) -> dict:
    """Decode ms/token = (t(n_new) - t(1)) / (n_new - 1), medians of `repeats` after one
    warm-up each. gen(n) runs one generation and returns how many tokens it produced.
    `one_ms` reuses an already measured t(1); warmup=False when the caller already ran
    this exact generation (graphs captured, compiled)."""
    if warmup:
        gen(n_new)                             # graph capture / compilation
    full = []
    for _ in range(repeats):
        produced, ms = wall_ms(lambda: gen(n_new), device)
        if produced != n_new:
            raise RuntimeError(f"generation produced {produced} tokens, expected {n_new}")
        full.append(ms)
    if one_ms is None:
        gen(1)
        one_ms = statistics.median(wall_ms(lambda: gen(1), device)[1] for _ in range(repeats))
    t_full = statistics.median(full)
    return {"ms_per_token": (t_full - one_ms) / (n_new - 1), "t_full_ms": t_full, "t_one_ms": one_ms,
            "t_full_runs_ms": full}


def accept_schedule(tau: float, gamma: int):
    """Deterministic accepted-count pattern with mean tau - 1 (each block floor or ceil)."""
    m = tau - 1.0
    if not 0.0 <= m <= gamma:
        raise ValueError(f"tau must be in [1, gamma + 1] = [1, {gamma + 1}], got {tau}")
    return lambda b: int(math.floor((b + 1) * m + 1e-9) - math.floor(b * m + 1e-9))


# ---------------------------------------------------------------------------- benchmark
class Bench:
    def __init__(self, args, preset: Preset):
        self.args, self.p = args, preset
        self.device = torch.device(args.device)
        self.cuda = self.device.type == "cuda"
        self.dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
        self.result: dict = {"provenance": provenance(self.device), "preset": args.preset,
                             "method": METHOD}
        self.json_path = os.path.join(args.out, f"e2e_{args.preset}.json")
        self.md_path = os.path.join(args.out, f"e2e_{args.preset}.md")

    def save(self):
        """JSON and markdown after every section: a run cut short keeps what it measured."""
        os.makedirs(self.args.out, exist_ok=True)
        self.result["targets"] = self.targets()
        with open(self.json_path, "w") as f:
            json.dump(self.result, f, indent=1, default=str)
        with open(self.md_path, "w") as f:
            f.write(self.markdown())

    def section(self, name: str, fn):
        """Run one section; record (not raise) its failure so the other numbers survive."""
        log(f"{name} ...")
        t = time.perf_counter()
        try:
            self.result[name] = fn()
        except Exception as e:  # a failing section is a result too
            traceback.print_exc()
            self.result[name] = {"error": f"{type(e).__name__}: {e}"[:2000]}
        log(f"{name} done in {time.perf_counter() - t:.1f}s")
        self.save()

    # ------------------------------------------------------------------ setup
    def setup(self) -> dict:
        from tabed_engine import Engine
        from tabed_engine.loader import lvlm_from_hf
        from tabed_engine.tiny import build_processor, random_image, words

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
                                  policy="w-grid", gamma=p.gamma, max_len=p.max_len, timing=False)
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
        r = decode_ms(lambda n: self.gen_engine(eng, n, False), self.p.new_tokens, self.p.repeats, self.device)
        self.ar_tokens = self.last_tokens
        self.ar_ms = r["ms_per_token"]
        r["ratio_to_floor"] = self.ar_ms / self.floor_ms if self.floor_ms else None
        if eng.graphs is not None and ("ar", 1) in eng.graphs.graphs:
            g = eng.graphs.graphs[("ar", 1)].graph
            r["step_graph_replay_ms"] = event_ms(g.replay, self.p.replay_reps, inner=10)
            r["step_graph_ratio_to_floor"] = r["step_graph_replay_ms"] / self.floor_ms
        return r

    def prefill_split(self) -> dict:
        from tabed_engine.prompt import prepare
        from tabed_engine.speculative import prefill_draft
        from tabed_engine.views import build_views

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
                    _, ms = wall_ms(lambda: prefill_draft(eng, rows), self.device)
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
            res, one_ms = {}, None
            for tau in taus:
                eng.bench_accept_schedule = accept_schedule(tau, self.p.gamma)
                try:
                    r = decode_ms(lambda n: self.gen_engine(eng, n, True), self.p.new_tokens, self.p.repeats,
                                  self.device, one_ms=one_ms, warmup=one_ms is None)
                finally:
                    eng.bench_accept_schedule = None
                one_ms = r["t_one_ms"]
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
                if "verify_graph_ms" in r and "draft_graph_block_ms" in r:
                    # what one token would cost if only the graphs ran (no host work between them)
                    r["device_bound_sd_ms_per_token_at_tau"] = \
                        (r["verify_graph_ms"] + r["draft_graph_block_ms"]) / TAU_MAIN
            out[f"K={K}"] = r
            log(f"  K={K} {eng.views}: draft step {r['draft_step_ms']:.4f} ms "
                f"(graph {r.get('draft_graph_step_ms', float('nan')):.4f}), verify {r['verify_ms']:.3f} ms "
                f"(graph {r.get('verify_graph_ms', float('nan')):.3f}), ensemble share {r['ensemble_share']:.3%}")
        return out

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
        R = self.result

        def get(*path):
            x = R
            for k in path:
                if not isinstance(x, dict) or k not in x:
                    return None
                x = x[k]
            return x if isinstance(x, (int, float)) else None

        def check(value, limit, le=True):
            ok = None if value is None or limit is None else (value <= limit if le else value >= limit)
            return {"value": value, "limit": limit, "pass": ok}

        floor = get("bandwidth", "floor_ms_per_token")
        ar = get("engine_ar", "ms_per_token")
        d1 = get("sd_breakdown", "K=1", "draft_graph_step_ms") or get("sd_breakdown", "K=1", "draft_step_ms")
        d4 = get("sd_breakdown", "K=4", "draft_graph_step_ms") or get("sd_breakdown", "K=4", "draft_step_ms")
        sd = get("sd_sweep", "K=2", f"tau={TAU_MAIN}", "ms_per_token")
        sd1 = get("sd_sweep", "K=1", f"tau={TAU_MAIN}", "ms_per_token")
        hf = get("hf_eager", "ms_per_token")
        shares = [get("sd_breakdown", f"K={K}", "ensemble_share") for K in VIEW_SETS]
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
        t["_notes"] = ("draft step uses the graph-replay number on CUDA, engine timing elsewhere; "
                       "ensemble share is the worst over K = 1, 2, 4")
        return t

    def markdown(self) -> str:
        R = self.result
        pv, su = R["provenance"], R.get("setup", {})

        def f(x, spec=".3f"):
            return format(x, spec) if isinstance(x, (int, float)) else ("—" if x is None else str(x))

        def sec(name):
            v = R.get(name)
            return v if isinstance(v, dict) and "error" not in v else {}

        lines = [f"## e2e {R['preset']} — {pv['device']}",
                 f"torch {pv['torch']}, triton {pv['triton']}, transformers {pv['transformers']}, "
                 f"CUDA {pv['cuda']}, {pv['date_utc']}, commit {pv['git']['commit'][:10]}"
                 f"{' (dirty)' if pv['git'].get('dirty') else ''}",
                 f"`{pv['command']}`", "",
                 f"prompt {su.get('prompt_tokens')} tokens ({su.get('image_tokens')} image), "
                 f"{su.get('new_tokens')} new, batch 1, greedy, γ={su.get('gamma')}, "
                 f"median of {su.get('repeats')}; decode ms/token = (t(n) − t(1)) / (n − 1)", ""]
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
                      "ms/block | share | graph-only ms/token |", "|---|---|---|---|---|---|"]
            for K, r in bd.items():
                lines.append(f"| {K} {'+'.join(r['views'])} | {f(r['draft_step_ms'], '.4f')} "
                             f"({f(r.get('draft_graph_step_ms'), '.4f')}) | {f(r['verify_ms'])} "
                             f"({f(r.get('verify_graph_ms'))}) | {f(r['ensemble_history_ms_per_block'])} | "
                             f"{f(100 * r['ensemble_share'], '.2f')}% | "
                             f"{f(r.get('device_bound_sd_ms_per_token_at_tau'))} |")
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

    def run(self):
        t0 = time.perf_counter()
        self.floor_ms = self.ar_ms = self.hf_eager_ms = None
        log(f"preset {self.args.preset} on {self.result['provenance']['device']}")
        self.section("setup", self.setup)
        if "error" in self.result["setup"]:
            raise SystemExit(f"setup failed: {self.result['setup']['error']}")
        self.section("bandwidth", self.bandwidth)
        self.section("engine_ar", self.engine_ar)
        self.section("prefill_split", self.prefill_split)
        self.section("sd_sweep", self.sd_sweep)
        self.section("sd_breakdown", self.sd_breakdown)
        if not self.args.skip_hf:
            self.section("hf_eager", self.hf_eager)
            self.section("hf_assisted", self.hf_assisted)
            self.section("hf_static", self.hf_static)   # last: auto torch.compile may be slow
        self.result["total_s"] = time.perf_counter() - t0
        self.save()
        print(self.markdown(), flush=True)
        log(f"wrote {self.json_path} and {self.md_path} in {self.result['total_s']:.0f}s")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="llava-1.5-7b")
    ap.add_argument("--out", default=os.path.join("benchmarks", "results"))
    ap.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    ap.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default=None,
                    help="default: bf16 on CUDA, fp32 on the CPU")
    ap.add_argument("--skip-hf", action="store_true", help="omit the transformers baselines")
    ap.add_argument("--hf-static-compile", choices=("auto", "off"), default="auto",
                    help="auto: transformers' own torch.compile of static-cache decoding on CUDA (default); "
                         "off: static cache without compilation")
    ap.add_argument("--repeats", type=int, default=None, help="timed runs per measurement (default: preset's)")
    args = ap.parse_args(argv)
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    args.dtype = args.dtype or ("bf16" if args.device.startswith("cuda") else "fp32")
    preset = PRESETS[args.preset]
    if args.repeats:
        preset.repeats = args.repeats
    torch.manual_seed(0)
    Bench(args, preset).run()


if __name__ == "__main__":
    main()
