"""End-to-end benchmark of the Qwen2-based families (LLaVA-OneVision, Qwen2.5-VL) with their
published drafts, every preset side by side in one run.

    python benchmarks/e2e_families.py --out DIR                  # H200: the three presets, ~6-7 min
    python benchmarks/e2e_families.py --presets tiny --device cpu --out DIR   # CPU smoke, < 90 s
    (--presets NAME...: onevision-7b qwen2.5-vl-7b qwen2.5-vl-32b tiny-onevision tiny-qwen2.5-vl, or
    tiny = both tiny ones; --skip-hf omits transformers everywhere; --new-tokens N; --budget-s S skips
    the sections that would start after S seconds)

Random bf16 weights of the published shapes built directly on the device (no checkpoints): a
target with transformers baselines is built as a transformers model on the device and wrapped
(`loader.lvlm_from_hf`, the same weights in both); drafts, and targets without baselines
(the 32B: two copies would not fit one GPU), fill our modules directly (`loader.lvlm_from_config`).
Matrices ~ N(0, 0.02), norm weights 1. Tokenizer: tiny_bpe's byte-level BPE with the family's
special tokens and published chat template; the configs' image / video token ids are its ids
(the embedding rows past it are padding, as the published 152,000-152,128 rows are). Image
processors as published (written offline, read by the family's `load_processor`):
OneVision: SigLIP normalisation, 384-px tiles, the 36 anyres pinpoints (1..6 tiles a side),
anyres_max_9; Qwen2.5-VL: patch 14, merge 2, min / max pixels 3,136 / 12,845,056.

Shapes (config.json values as llava-hf / Qwen publish them, transformers' config classes):
* onevision-7b: target llava-onevision-qwen2-7b-ov-hf = Qwen2-7B (28 layers, hidden 3584, 28 / 4
  heads, intermediate 18944, vocab 152128, rope θ 1e6, untied) + SigLIP-so400m tower (hidden 1152,
  16 heads, intermediate 4304, 384 px, patch 14, no head; 26 layers: the published config keeps
  26 of the so400m's 27, its feature layer -1 being the original's -2, as transformers'
  LlavaOnevisionConfig default), strategy "full", image_newline. Draft -0.5b-ov-hf = Qwen2-0.5B
  (24 layers, hidden 896, 14 / 2 heads, intermediate 4864, vocab 152000, tied) with its own tower
  of the same shape (other weights). One 384x384 image.
* qwen2.5-vl-7b: Qwen2.5-VL-7B-Instruct (28 layers, 3584, 28 / 4, 18944, vocab 152064, mrope_section
  [16, 24, 24], θ 1e6; vision depth 32, hidden 1280, 16 heads, intermediate 3420, out_hidden 3584,
  window 112, full attention in blocks 7/15/23/31, silu). Draft Qwen2.5-VL-3B-Instruct (36 layers,
  2048, 16 / 2, 11008, vocab 151936, tied; its own vision tower, out_hidden 2048). One 672x672 image
  (48 x 48 patches, 576 tokens).
* qwen2.5-vl-32b: Qwen2.5-VL-32B-Instruct (64 layers, 5120, 40 / 8, 27648, vocab 152064; vision
  intermediate 3456, out_hidden 5120), draft the 3B; no transformers baselines by default.
* tiny-onevision / tiny-qwen2.5-vl: the tiny_onevision.py / tiny_qwen2_5_vl.py builders' shapes.

Sections per preset, each saved as it ends (a failing one records its error, the rest run):
setup -> bandwidth -> engine_ar -> ttft -> sd_gamma -> hf (transformers, then freed). How each
number is measured: METHOD (also in the JSON). Writes DIR/e2e_families.json and .md (with
another preset list: e2e_families_<presets>.json / .md).
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import inspect
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import e2e  # noqa: E402
from _common import copy_bandwidth_gbs, event_ms, provenance, wall_ms  # noqa: E402
from e2e import TAU_MAIN, accept_schedule, decode_ms, geometric_schedule  # noqa: E402
from e2e_common import (build_hf_random, check_limit, default_dtype, fmt, lm_weight_bytes, log,  # noqa: E402
                        random_fill, ttft_runs)

# ---------------------------------------------------------------------------- shapes
SIGLIP_OV = dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=26, num_attention_heads=16,
                 image_size=384, patch_size=14)
QWEN2_7B = dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                num_key_value_heads=4, vocab_size=152128, tie=False)
QWEN2_05B = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, vocab_size=152000, tie=True)
QVL_VISION = dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, patch_size=14,
                  window_size=112, fullatt_block_indexes=[7, 15, 23, 31])
QVL_7B = dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
              num_key_value_heads=4, vocab_size=152064, tie=False)
QVL_3B = dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
              num_key_value_heads=2, vocab_size=151936, tie=True)
QVL_32B = dict(hidden_size=5120, intermediate_size=27648, num_hidden_layers=64, num_attention_heads=40,
               num_key_value_heads=8, vocab_size=152064, tie=False)
QVL_PIXELS = dict(patch=14, min_pixels=3136, max_pixels=12845056)


@dataclass
class FamilyPreset:
    family: str                  # "onevision" or "qwen2_5_vl"
    target: dict                 # text shape (+ "vision": the tower's)
    draft: dict
    vision: dict                 # the target's tower (the draft's: the same, out_hidden its own)
    image_px: int
    pixels: dict = field(default_factory=dict)   # Qwen2.5-VL: patch, min / max pixels of the processor
    rope_theta: float = 1e6
    mrope_section: tuple = (16, 24, 24)
    new_tokens: int = 64
    repeats: int = 2
    gammas: tuple = (1, 2, 3, 5)
    max_len: int = 2048
    copy_bytes: int = 1 << 30
    replay_reps: int = 10
    init_std: float = 0.02
    hf: bool = True              # transformers baselines (False: too large for a second copy)
    bpe_vocab: int = 400
    sd_goal: bool = False        # the SD >= 1.8x AR goal applies (the OneVision pair)


PRESETS = {
    "onevision-7b": FamilyPreset("onevision", QWEN2_7B, QWEN2_05B, SIGLIP_OV, image_px=384, sd_goal=True),
    "qwen2.5-vl-7b": FamilyPreset("qwen2_5_vl", QVL_7B, QVL_3B, QVL_VISION, image_px=672, pixels=QVL_PIXELS),
    "qwen2.5-vl-32b": FamilyPreset("qwen2_5_vl", QVL_32B, QVL_3B, dict(QVL_VISION, intermediate_size=3456),
                                   image_px=672, pixels=QVL_PIXELS, hf=False),
    # CPU smoke (timings mean nothing): the tiny builders' shapes; fp32 makes transformers' greedy
    # tokens equal the engine's
    "tiny-onevision": FamilyPreset(
        "onevision", dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, vocab_size=448, tie=False),
        dict(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=416, tie=True),
        dict(hidden_size=32, intermediate_size=67, num_hidden_layers=2, num_attention_heads=4, image_size=35,
             patch_size=7), image_px=35, new_tokens=16, gammas=(1, 2, 3), max_len=512, copy_bytes=16 << 20,
        replay_reps=3, init_std=0.2, sd_goal=True),
    "tiny-qwen2.5-vl": FamilyPreset(
        "qwen2_5_vl", dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=448, tie=False),
        dict(hidden_size=64, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=432, tie=True),         # head_dim 16: M-RoPE's 2 + 3 + 3
        dict(depth=2, hidden_size=32, intermediate_size=56, num_heads=2, patch_size=4, window_size=16,
             fullatt_block_indexes=[1]), image_px=40, pixels=dict(patch=4, min_pixels=256, max_pixels=2304),
        rope_theta=100.0, mrope_section=(2, 3, 3), new_tokens=16, gammas=(1, 2, 3), max_len=512,
        copy_bytes=16 << 20, replay_reps=3, init_std=0.2),
}
ALIASES = {"tiny": ("tiny-onevision", "tiny-qwen2.5-vl")}
DEFAULT_PRESETS = ("onevision-7b", "qwen2.5-vl-7b", "qwen2.5-vl-32b")
GEO_GAMMA = 5          # the geometric schedule's acceptance rate: 5-draft chains average tau tokens a block
# the acceptance the bundled world gives: its pair's tau with the default views and policy (hedge
# over M + T, 5-chains, bf16 on the H200: benchmarks/results/demo_tau_bf16.json, "all")
WORLD_TAU = 4.06
TTFT_REPEATS = 5       # timed first tokens per engine mode and for transformers (medians)
TEXT = ("Describe the image in detail. What is shown in this picture? A red square, two blue circles and "
        "a green triangle sit on the table; how many cats and dogs are there?")
METHOD = {
    "decode_ms_per_token": e2e.METHOD["decode_ms_per_token"],
    "floor": "weight floor = target LM weight bytes (decoder layers + final norm + lm_head; the embedding "
             "read is one row) / copy bandwidth; floor_with_kv adds the KV-cache bytes one step reads at the "
             "mean decode context (informational)",
    "copy_bandwidth": e2e.METHOD["copy_bandwidth"],
    "ttft": "Engine.generate(max_new_tokens=1) synchronized wall clock, median of TTFT_REPEATS (5) after a "
            "warm-up (AR: speculative=False; SD: the default views M+T, the draft's rows prefilled too); "
            "transformers: generate(max_new_tokens=1), median of 5 after the hf section's runs; "
            "time_first_token_of_8_ms: the engine's "
            "time_first_token in generate(max_new_tokens=8) (a streaming client's first token; where the draft's "
            "views wait for the first block, views_deferred, the one-token generation runs none)",
    "sd": "one engine with the default views (M, T) and policy, adaptive=False (every block a gamma-chain), "
          "configure(gamma=g) for each g; acceptance fixed by bench_accept_schedule (NOT lossless, benchmark "
          "only). tau=2.31: e2e.accept_schedule, floor/ceil accepted counts with mean 1.31 a block (g >= 2; "
          "a 1-chain gives at most 2 tokens a block). geometric: e2e.geometric_schedule(2.31, 5), each draft "
          "accepted with the same probability alpha (5-chains average 2.31 tokens a block), so a shorter "
          "chain gets what it would really give at that acceptance; world: the same with the acceptance the "
          "bundled world gives (WORLD_TAU = 4.06 tokens a 5-chain block: the demo pair's tau with the default "
          "views and policy in bf16, benchmarks/results/demo_tau_bf16.json); best_gamma_* = the fastest g of each",
    "sd_default": "the same engine with the defaults a user gets: configure(adaptive=True, gamma=5) (the "
                  "cost model picks an AR step or a chain of 1..5 each block from the block times it measures), "
                  "the geometric schedule's acceptance; blocks_by_kind counts the measured generations' blocks",
    "draft_step_ms": "engine timing=True (syncs around each phase), geometric schedule: time_draft / (blocks x g); "
                     "verify_ms = time_verify / blocks; on CUDA also the captured graphs replayed back to back "
                     "(draft block graph / g, verify graph)",
    "hf": "transformers' generate (eager, dynamic cache, greedy, the same prompt ids and pixels from the "
          "family's processor), decode by (t(n) - t(1)) / (n - 1); the model is freed afterwards",
}


# ---------------------------------------------------------------------------- configs and processors
def hf_config(p: FamilyPreset, text: dict, ids: dict, draft: bool = False):
    """The transformers config of a preset's target (or draft) with the tokenizer's token ids."""
    text = dict(text)
    tie = text.pop("tie")
    if p.family == "onevision":
        from transformers import LlavaOnevisionConfig, Qwen2Config, SiglipVisionConfig

        from tabed_engine.models.tiny_onevision import pinpoints

        vc = SiglipVisionConfig(**p.vision, vision_use_head=False)
        tc = Qwen2Config(**text, max_position_embeddings=32768, rope_theta=p.rope_theta, rms_norm_eps=1e-6,
                         tie_word_embeddings=tie, use_sliding_window=False, eos_token_id=ids["<|im_end|>"],
                         bos_token_id=ids["<|endoftext|>"])
        cfg = LlavaOnevisionConfig(vision_config=vc, text_config=tc, image_token_index=ids["<image>"],
                                   video_token_index=ids["<video>"], vision_feature_layer=-1,
                                   vision_feature_select_strategy="full", vision_aspect_ratio="anyres_max_9",
                                   image_grid_pinpoints=pinpoints(p.vision["image_size"]), tie_word_embeddings=tie)
        cfg.architectures = ["LlavaOnevisionForConditionalGeneration"]
        return cfg
    from transformers import Qwen2_5_VLConfig

    tc = dict(text, max_position_embeddings=128000, rms_norm_eps=1e-6, hidden_act="silu", use_sliding_window=False,
              rope_parameters={"rope_type": "default", "mrope_section": list(p.mrope_section),
                               "rope_theta": p.rope_theta},
              bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"])
    vc = dict(p.vision, spatial_merge_size=2, temporal_patch_size=2, tokens_per_second=2, hidden_act="silu",
              out_hidden_size=text["hidden_size"])
    cfg = Qwen2_5_VLConfig(text_config=tc, vision_config=vc, image_token_id=ids["<|image_pad|>"],
                           video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
                           vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=tie)
    cfg.architectures = ["Qwen2_5_VLForConditionalGeneration"]
    return cfg


def build_processor(p: FamilyPreset, out_dir: str):
    """The family's processor read back from files written offline as published (the tiny
    BPE tokenizer with the family's special tokens and chat template) and the token ids."""
    from tabed_engine.models import llava_onevision, qwen2_5_vl, tiny_onevision, tiny_qwen2_5_vl
    from tabed_engine.models.tiny_bpe import (ONEVISION_CHAT_TEMPLATE, ONEVISION_SPECIALS, QWEN_VL_CHAT_TEMPLATE,
                                              QWEN_VL_SPECIALS, build_bpe_tokenizer)

    if p.family == "onevision":
        tok = build_bpe_tokenizer(p.bpe_vocab, specials=ONEVISION_SPECIALS, chat_template=ONEVISION_CHAT_TEMPLATE,
                                  out_dir=out_dir)
        tiny_onevision.write_processor_files(out_dir, p.vision["image_size"], p.vision["patch_size"])
        proc = llava_onevision.load_processor(out_dir)
    else:
        tok = build_bpe_tokenizer(p.bpe_vocab, specials=QWEN_VL_SPECIALS, chat_template=QWEN_VL_CHAT_TEMPLATE,
                                  out_dir=out_dir)
        tiny_qwen2_5_vl.write_processor_files(out_dir, p.pixels["patch"], p.pixels["min_pixels"],
                                              p.pixels["max_pixels"])
        proc = qwen2_5_vl.load_processor(out_dir)
    names = ("<|endoftext|>", "<|im_end|>", "<image>", "<video>", "<|image_pad|>", "<|video_pad|>",
             "<|vision_start|>", "<|vision_end|>")
    ids = {t: tok.convert_tokens_to_ids(t) for t in names if t in tok.get_vocab()}
    return proc, ids


# ---------------------------------------------------------------------------- benchmark
class FamilyBench(e2e.Bench):
    """One preset: engine AR against the floor, TTFT, SD over chain lengths, transformers.
    Reuses e2e.Bench's generation helper, AR section and transformers generation; the run
    (`Run`) owns the files."""

    def __init__(self, args, name: str, preset: FamilyPreset, run: "Run"):
        super().__init__(argparse.Namespace(**{**vars(args), "preset": name}), preset)
        self.result = {"preset": name, "family": preset.family}
        self.run_owner = run
        self.hf_target = None

    def save(self):
        self.result["targets"] = self.targets()
        self.run_owner.save()

    def section(self, name, fn):
        if self.run_owner.out_of_time():
            self.result[name] = {"error": f"skipped: past --budget-s {self.args.budget_s}"}
            log(f"{name} skipped (time budget)")
            self.save()
            return
        super().section(name, fn)

    def run(self):
        t0 = time.perf_counter()
        log(f"preset {self.args.preset}")
        self.section("setup", self.setup)
        if "error" not in self.result["setup"]:
            for name, fn in self.stages():
                self.section(name, fn)
        self.result["total_s"] = time.perf_counter() - t0
        self.save()

    # ------------------------------------------------------------------ setup
    def setup(self) -> dict:
        from tabed_engine import Engine
        from tabed_engine.models.loader import lvlm_from_config, lvlm_from_hf
        from tabed_engine.models.tiny import random_image

        p, dev, dt = self.p, self.device, self.dtype
        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="e2e_families_") as tmp:
            self.processor, ids = build_processor(p, tmp)
        tcfg, dcfg = hf_config(p, p.target, ids), hf_config(p, p.draft, ids, draft=True)
        hf_wanted = p.hf and not self.args.skip_hf
        if hf_wanted:
            from transformers import LlavaOnevisionForConditionalGeneration, Qwen2_5_VLForConditionalGeneration

            cls = (LlavaOnevisionForConditionalGeneration if p.family == "onevision"
                   else Qwen2_5_VLForConditionalGeneration)
            self.hf_target = build_hf_random(cls, tcfg, dev, dt, p.init_std, 0)
            self.hf_target.generation_config.pad_token_id = ids["<|endoftext|>"]
            with default_dtype(dt):
                target = lvlm_from_hf(self.hf_target, dev, dt)
        else:
            with default_dtype(dt):
                target = lvlm_from_config(tcfg, dev, dt, random_fill(p.init_std, 0, dev))
        with default_dtype(dt):
            draft = lvlm_from_config(dcfg, dev, dt, random_fill(p.init_std, 1, dev))
        self.target_lvlm, self.draft_lvlm = target, draft
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()
        # the default views and policy; every block a gamma-chain (see METHOD["sd"])
        self.engine = Engine(target, self.processor, draft=draft, draft_processor=self.processor, device=dev,
                             dtype=dt, max_len=p.max_len, timing=False, max_batch=1, adaptive=False,
                             prefix_cache=False)   # TTFT of a first turn: the prompt repeats, measured cold
        self.engines = {1: self.engine}          # e2e.Bench.engine_ar's engine (speculative=False)
        msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": TEXT}]}]
        self.prompt = self.processor.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        self.image = random_image(0, p.image_px)
        enc = self.processor(text=self.prompt, images=[self.image], return_tensors="pt")
        image_token = target.image_token_id
        ids_ = enc["input_ids"][0]
        n_img = int((ids_ == image_token).sum())
        size = (self.image.height, self.image.width)
        counted = target.vision.tokens_per_image([size])[0]
        if n_img != counted:
            raise RuntimeError(f"the processor expands the image to {n_img} tokens, the engine counts {counted}")
        if hf_wanted:
            self.hf_inputs = self.transformers_inputs(enc, image_token)
        eng = self.engine
        r = {"build_s": time.perf_counter() - t0, "prompt_tokens": len(ids_), "image_tokens": n_img,
             "text_tokens": len(ids_) - n_img, "image_size": list(size),
             "draft_image_tokens": draft.vision.tokens_per_image([size])[0],
             "new_tokens": p.new_tokens, "repeats": p.repeats, "gammas": list(p.gammas), "batch": 1,
             "greedy": True, "dtype": str(dt), "max_len": p.max_len, "views": list(eng.views),
             "ensemble_policy": eng.ensemble.policy, "sd_adaptive": False, "init": f"N(0, {p.init_std}), norms 1",
             "target": {"config": tcfg.to_dict(), "built_from": "transformers model" if hf_wanted else "config"},
             "draft": {"config": dcfg.to_dict(), "built_from": "config"},
             "target_lm_params": sum(x.numel() for x in target.lm.parameters()),
             "draft_lm_params": sum(x.numel() for x in draft.lm.parameters()),
             "draft_shares_target_tower": target.vision_sd_hash == draft.vision_sd_hash,
             "device_images": bool(eng.device_images), "transformers_baselines": hf_wanted,
             "image_processor": type(self.processor.image_processor).__name__}
        if self.cuda:
            torch.cuda.synchronize()
            r["gpu_mem_allocated_GiB_after_build"] = torch.cuda.memory_allocated() / 2 ** 30
            r["gpu_mem_peak_GiB_during_build"] = torch.cuda.max_memory_allocated() / 2 ** 30
        if hf_wanted:
            r["hf_attn_implementation"] = getattr(self.hf_target.config, "_attn_implementation", None)
        return r

    def transformers_inputs(self, enc, image_token: int) -> dict:
        """generate()'s inputs from the processor's output, on the device (pixels in the dtype);
        Qwen2.5-VL's mm_token_type_ids where the installed transformers' rope index takes them."""
        inputs = {k: v.to(self.device) for k, v in enc.items() if isinstance(v, torch.Tensor)}
        inputs["pixel_values"] = inputs["pixel_values"].to(self.dtype)
        if self.p.family == "qwen2_5_vl":
            inputs.pop("image_sizes", None)
            if "mm_token_type_ids" in inspect.signature(self.hf_target.model.get_rope_index).parameters:
                inputs["mm_token_type_ids"] = (inputs["input_ids"] == image_token).int()
        return inputs

    # ------------------------------------------------------------------ sections
    def bandwidth(self) -> dict:
        gbs = copy_bandwidth_gbs(self.device, self.p.copy_bytes, reps=10)
        wbytes, dbytes = lm_weight_bytes(self.target_lvlm), lm_weight_bytes(self.draft_lvlm)
        cfg = self.target_lvlm.lm.cfg
        ctx = self.result["setup"]["prompt_tokens"] + self.p.new_tokens / 2
        kv_bytes = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * ctx * self.dtype.itemsize
        self.floor_ms = wbytes / (gbs * 1e9) * 1e3
        return {"copy_GBs": gbs, "copy_bytes": self.p.copy_bytes, "target_lm_weight_bytes": wbytes,
                "floor_ms_per_token": self.floor_ms, "kv_read_bytes_at_mean_context": kv_bytes,
                "mean_context_tokens": ctx, "floor_with_kv_ms_per_token": (wbytes + kv_bytes) / (gbs * 1e9) * 1e3,
                "draft_lm_weight_bytes": dbytes, "draft_over_target_bytes": dbytes / wbytes,
                "draft_floor_ms_per_step": dbytes / (gbs * 1e9) * 1e3}

    def ttft(self) -> dict:
        """Time to first token through Engine.generate(max_new_tokens=1), AR and SD."""
        from tabed_engine import SamplingParams

        sp = SamplingParams(max_new_tokens=1, stop_at_eos=False)
        out = {}
        for name, speculative in (("engine_ar", False), ("engine_sd", True)):
            def gen():
                return self.engine.generate(self.prompt, images=[self.image], speculative=speculative, sampling=sp)

            out[name] = ttft_runs(gen, TTFT_REPEATS, self.device, name)
            # a generation of 8 tokens: its first token's time as a streaming client sees it (a
            # one-token generation of a draft whose views wait for the first block runs none)
            sp8 = SamplingParams(max_new_tokens=8, stop_at_eos=False)
            firsts = [self.engine.generate(self.prompt, images=[self.image], speculative=speculative,
                                           sampling=sp8).stats.time_first_token * 1e3 for _ in range(self.p.repeats)]
            out[name].update(time_first_token_of_8_ms=statistics.median(firsts),
                             views_deferred=speculative and self.engine.runner.views_deferred(),
                             views_share=self.engine.runner.views_share() if speculative else None)
        return out

    def sd_gamma(self) -> dict:
        """Chain lengths g: ms/token at tau 2.31 (floor/ceil) and at a fixed per-draft
        acceptance (geometric), the draft step and verification times."""
        eng, p = self.engine, self.p
        geo = geometric_schedule(TAU_MAIN, GEO_GAMMA)
        out = {"alpha": geo.alpha, "geometric_reference_gamma": GEO_GAMMA}
        one_ms = None
        for g in p.gammas:
            eng.configure(gamma=g)
            r = {}
            runs = [("geometric", geometric_schedule(TAU_MAIN, GEO_GAMMA)),
                    ("world", geometric_schedule(WORLD_TAU, GEO_GAMMA))]
            if g + 1 >= TAU_MAIN:
                runs.insert(0, (f"tau={TAU_MAIN}", accept_schedule(TAU_MAIN, g)))
            for i, (key, schedule) in enumerate(runs):
                eng.bench_accept_schedule = schedule
                try:
                    d = decode_ms(lambda n: self.gen_engine(eng, n, True), p.new_tokens, p.repeats, self.device,
                                  one_ms=one_ms, warmup=i == 0, stats=lambda: self.last_stats)
                finally:
                    eng.bench_accept_schedule = None
                one_ms = d["t_one_ms"]
                d["tau_realized"] = self.last_stats.block_efficiency
                d["blocks"] = self.last_stats.target_forwards
                d["speedup_vs_engine_ar"] = self.ar_ms / d["ms_per_token"] if self.ar_ms else None
                r[key] = d
            r.update(self.block_times(eng, g))
            out[f"gamma={g}"] = r
            log(f"  g={g}: " + ", ".join(f"{k} {v['ms_per_token']:.3f} ms/token (tau {v['tau_realized']:.2f})"
                                         for k, v in r.items() if isinstance(v, dict))
                + f"; draft step {r['draft_step_ms']:.3f} ms, verify {r['verify_ms']:.3f} ms")
        out["world_alpha"] = geometric_schedule(WORLD_TAU, GEO_GAMMA).alpha
        for key in (f"tau={TAU_MAIN}", "geometric", "world"):
            cand = {g: out[f"gamma={g}"][key]["ms_per_token"] for g in p.gammas if key in out[f"gamma={g}"]}
            if cand:
                best = min(cand, key=cand.get)
                out[f"best_gamma_{key}"] = {"gamma": best, "ms_per_token": cand[best],
                                            "speedup_vs_engine_ar": self.ar_ms / cand[best] if self.ar_ms else None}
        eng.configure(gamma=max(p.gammas))
        return out

    def sd_default(self) -> dict:
        """The engine as a user gets it: adaptive (the cost model picks an AR step or a chain of
        1..γ each block, γ = 5), the geometric schedule's acceptance per draft; ms/token, the
        blocks by kind, speed against engine AR (a draft that cannot pay should leave AR's)."""
        eng, p = self.engine, self.p
        eng.configure(adaptive=True, gamma=GEO_GAMMA)
        # as a server starts: every block kind's graphs captured and its time measured (a
        # re-configured γ rebuilt the runner and the scheduler, graphs and block times gone)
        warm_s = eng.warmup()
        eng.bench_accept_schedule = geometric_schedule(TAU_MAIN, GEO_GAMMA)
        try:
            kinds0 = dict(eng.scheduler.kinds)
            d = decode_ms(lambda n: self.gen_engine(eng, n, True), p.new_tokens, p.repeats, self.device,
                          stats=lambda: self.last_stats)
            kinds = {("ar" if g == 0 else f"chain{g}"): n - kinds0.get(g, 0)
                     for g, n in sorted(eng.scheduler.kinds.items()) if n > kinds0.get(g, 0)}
        finally:
            eng.bench_accept_schedule = None
            eng.configure(adaptive=False)
        d.update(adaptive=True, gamma=GEO_GAMMA, blocks_by_kind=kinds, warmup_s=warm_s,
                 tau_realized=self.last_stats.block_efficiency,
                 speedup_vs_engine_ar=self.ar_ms / d["ms_per_token"] if self.ar_ms else None)
        log(f"  default engine (adaptive): {d['ms_per_token']:.3f} ms/token, "
            f"{fmt(d['speedup_vs_engine_ar'], '.2f')}x AR, blocks {kinds}")
        return d

    def block_times(self, eng, g: int) -> dict:
        """One timed generation (timing=True, geometric schedule) and, on CUDA, graph replays."""
        eng.bench_accept_schedule, eng.timing = geometric_schedule(TAU_MAIN, GEO_GAMMA), True
        try:
            self.gen_engine(eng, self.p.new_tokens, True)
            st = self.last_stats
        finally:
            eng.bench_accept_schedule, eng.timing = None, False
        r = {"draft_step_ms": st.time_draft / (st.target_forwards * g) * 1e3,
             "verify_ms": st.time_verify / st.target_forwards * 1e3,
             "ensemble_ms_per_block": st.time_ensemble / st.target_forwards * 1e3}
        if eng.graphs is not None:
            for key, cap in eng.graphs.graphs.items():
                if key[0] == "draft":
                    r["draft_graph_step_ms"] = event_ms(cap.graph.replay, self.p.replay_reps, inner=5) / g
                elif key[0] == "verify":
                    r["verify_graph_ms"] = event_ms(cap.graph.replay, self.p.replay_reps, inner=5)
        return r

    def hf(self) -> dict:
        """transformers' generate: TTFT (t(1)) and decode ms/token; the model is freed afterwards."""
        try:
            r = self.hf_eager()
            # TTFT alone: more runs than decode's t(1) (a cold prefill's time varies run to run)
            r["ttft_runs_ms"] = [wall_ms(lambda: self.hf_gen(1), self.device)[1] for _ in range(TTFT_REPEATS)]
            r["ttft_ms"] = statistics.median(r["ttft_runs_ms"])
            return r
        finally:
            self.hf_target = self.hf_inputs = None
            gc.collect()
            if self.cuda:
                torch.cuda.empty_cache()

    def stages(self):
        yield from (("bandwidth", self.bandwidth), ("engine_ar", self.engine_ar), ("ttft", self.ttft),
                    ("sd_gamma", self.sd_gamma), ("sd_default", self.sd_default))
        if self.hf_target is not None:
            yield "hf", self.hf

    # ------------------------------------------------------------------ verdict + report
    def targets(self) -> dict:
        get = self.number
        floor, ar = get("bandwidth", "floor_ms_per_token"), get("engine_ar", "ms_per_token")
        sd_best = self.result.get("sd_gamma", {}).get(f"best_gamma_tau={TAU_MAIN}", {})
        sd, sd_g = sd_best.get("ms_per_token"), sd_best.get("gamma")
        hf, hf_ttft = get("hf", "ms_per_token"), get("hf", "ttft_ms")
        tt_ar, tt_sd = get("ttft", "engine_ar", "ttft_ms"), get("ttft", "engine_sd", "ttft_ms")

        def ratio(a, b):
            return a / b if a and b else None

        sd_check = check_limit(ratio(ar, sd), 1.8, le=False)
        if not self.p.sd_goal:
            sd_check["pass"] = None              # reported; the goal is the OneVision pair's
        return {
            "engine_ar_le_1.15x_floor": check_limit(ratio(ar, floor), 1.15),
            f"sd_tau{TAU_MAIN}_best_gamma_speedup_vs_engine_ar_ge_1.8x": {**sd_check, "gamma": sd_g},
            "ttft_engine_ar_speedup_vs_hf_ge_2x": check_limit(ratio(hf_ttft, tt_ar), 2.0, le=False),
            "ttft_engine_sd_speedup_vs_hf_ge_2x": check_limit(ratio(hf_ttft, tt_sd), 2.0, le=False),
            f"sd_tau{TAU_MAIN}_speedup_vs_hf_decode_ge_10x": check_limit(ratio(hf, sd), 10.0, le=False),
            "engine_ar_speedup_vs_hf_decode": {"value": ratio(hf, ar), "limit": None, "pass": None},
            "sd_world_acceptance_best_gamma_speedup_vs_engine_ar": {
                "value": ratio(ar, self.result.get("sd_gamma", {}).get("best_gamma_world", {}).get("ms_per_token")),
                "limit": None, "pass": None},
        }

    def markdown_lines(self) -> list[str]:
        R, f, sec = self.result, fmt, self.measured
        su, bw, ar = sec("setup"), sec("bandwidth"), sec("engine_ar")
        lines = [f"### {R['preset']} ({R['family']})", ""]
        if su:
            lines += [f"prompt {su['prompt_tokens']} tokens ({su['image_tokens']} image, {su['image_size']} px; "
                      f"draft M row {su['draft_image_tokens']} image tokens), {su['new_tokens']} new, batch 1, "
                      f"greedy, views {'+'.join(su['views'])}, policy {su['ensemble_policy']}, median of "
                      f"{su['repeats']}; LM params target {su['target_lm_params'] / 1e9:.2f} B, draft "
                      f"{su['draft_lm_params'] / 1e9:.3f} B; built in {su['build_s']:.0f} s", ""]
        floor, ar_ms = bw.get("floor_ms_per_token"), ar.get("ms_per_token")

        def row(label, ms):
            if not isinstance(ms, (int, float)):
                return f"| {label} | {f(ms)} | | |"
            return (f"| {label} | {ms:.3f} | {f(ms / floor if floor else None, '.2f')} | "
                    f"{f(ar_ms / ms if ar_ms else None, '.2f')} |")

        lines += ["| decode | ms/token | × floor | speedup vs engine AR |", "|---|---|---|---|",
                  f"| weight floor ({f(bw.get('target_lm_weight_bytes', 0) / 1e9, '.2f')} GB @ "
                  f"{f(bw.get('copy_GBs'), '.0f')} GB/s copy) | {f(floor)} | 1.00 | |",
                  row("floor + KV at the mean context", bw.get("floor_with_kv_ms_per_token")),
                  row("engine AR", ar_ms)]
        if "step_graph_replay_ms" in ar:
            lines.append(row("engine AR step (graph replay only)", ar["step_graph_replay_ms"]))
        hf = R.get("hf")
        if hf is not None:
            lines.append(f"| transformers AR | error: {hf['error'][:80]} | | |" if "error" in hf
                         else row("transformers AR (eager, dynamic cache)", hf["ms_per_token"]))
        sg = sec("sd_gamma")
        if sg:
            lines += ["", f"SD chain length γ (draft {f(bw.get('draft_lm_weight_bytes', 0) / 1e9, '.2f')} GB = "
                      f"{f(100 * bw['draft_over_target_bytes'] if 'draft_over_target_bytes' in bw else None, '.1f')}% "
                      f"of the target's bytes; draft floor {f(bw.get('draft_floor_ms_per_step'))} ms/step); "
                      f"geometric: α = {f(sg.get('alpha'))} per draft (γ=5 chains average τ {TAU_MAIN})", "",
                      f"| γ | τ={TAU_MAIN} ms/token (× AR) | geometric τ | geometric ms/token (× AR) | world τ | "
                      f"world ms/token (× AR) | draft step ms (graph) | verify ms (graph) |",
                      "|---|---|---|---|---|---|---|---|"]
            for key, r in sg.items():
                if not key.startswith("gamma="):
                    continue
                fx, geo, world = r.get(f"tau={TAU_MAIN}"), r.get("geometric", {}), r.get("world", {})
                cell = f"{fx['ms_per_token']:.3f} ({f(fx.get('speedup_vs_engine_ar'), '.2f')}×)" if fx else "—"
                lines.append(f"| {key[6:]} | {cell} | {f(geo.get('tau_realized'), '.2f')} | "
                             f"{f(geo.get('ms_per_token'))} ({f(geo.get('speedup_vs_engine_ar'), '.2f')}×) | "
                             f"{f(world.get('tau_realized'), '.2f')} | "
                             f"{f(world.get('ms_per_token'))} ({f(world.get('speedup_vs_engine_ar'), '.2f')}×) | "
                             f"{f(r['draft_step_ms'])} ({f(r.get('draft_graph_step_ms'))}) | "
                             f"{f(r['verify_ms'])} ({f(r.get('verify_graph_ms'))}) |")
            for key in (f"tau={TAU_MAIN}", "geometric", "world"):
                b = sg.get(f"best_gamma_{key}")
                if b:
                    lines.append(f"\nbest γ ({key}): {b['gamma']}, {b['ms_per_token']:.3f} ms/token, "
                                 f"{f(b['speedup_vs_engine_ar'], '.2f')}× engine AR")
        sdd = sec("sd_default")
        if sdd:
            lines.append(f"\ndefault engine (adaptive, γ = {sdd['gamma']}, geometric acceptance): "
                         f"{sdd['ms_per_token']:.3f} ms/token, {f(sdd.get('speedup_vs_engine_ar'), '.2f')}× engine "
                         f"AR, τ {f(sdd.get('tau_realized'), '.2f')}, blocks {sdd['blocks_by_kind']}")
        tt = sec("ttft")
        if tt:
            lines += ["", "| TTFT, generate(max_new_tokens=1) | wall ms | engine time_first_token ms | "
                      "time_first_token of 8 tokens ms | views deferred |", "|---|---|---|---|---|"]
            for name, r in tt.items():
                lines.append(f"| {name} | {f(r['ttft_ms'], '.2f')} | {f(r['time_first_token_ms'], '.2f')} | "
                             f"{f(r.get('time_first_token_of_8_ms'), '.2f')} | {r.get('views_deferred')} |")
            if hf and "error" not in hf:
                lines.append(f"| transformers | {f(hf.get('ttft_ms'), '.2f')} | | | |")
        tg = R.get("targets", {})
        lines += ["", "| goal | value | limit | pass |", "|---|---|---|---|"]
        for k, v in tg.items():
            if isinstance(v, dict):
                mark = {True: "PASS", False: "FAIL", None: "n/a"}[v["pass"]]
                lines.append(f"| {k} | {f(v['value'], '.3f')} | {v['limit']} | {mark} |")
        errs = [k for k, v in R.items() if isinstance(v, dict) and "error" in v]
        if errs:
            lines += ["", "errors: " + "; ".join(f"{k}: {R[k]['error'][:200]}" for k in errs)]
        return lines + [""]

    def markdown(self) -> str:
        return "\n".join(self.markdown_lines())

    def release(self):
        """Drop the preset's models, engine, graphs and caches before the next preset."""
        for name in ("engine", "engines", "target_lvlm", "draft_lvlm", "hf_target", "hf_inputs", "processor"):
            if hasattr(self, name):
                setattr(self, name, None)


class Run:
    """The presets of one invocation, side by side in one JSON and one markdown file."""

    def __init__(self, args, names):
        self.args, self.names, self.t0 = args, names, time.perf_counter()
        self.benches: list[FamilyBench] = []
        device = torch.device(args.device)
        self.result = {"provenance": provenance(device), "presets": list(names), "method": METHOD, "results": {}}
        stem = "e2e_families" if tuple(names) == DEFAULT_PRESETS else "e2e_families_" + "_".join(names)
        self.json_path = os.path.join(args.out, stem + ".json")
        self.md_path = os.path.join(args.out, stem + ".md")

    def out_of_time(self) -> bool:
        return self.args.budget_s is not None and time.perf_counter() - self.t0 > self.args.budget_s

    def save(self):
        """JSON and markdown after every section: a run cut short keeps what it measured."""
        os.makedirs(self.args.out, exist_ok=True)
        for b in self.benches:
            self.result["results"][b.result["preset"]] = b.result
        self.result["total_s"] = time.perf_counter() - self.t0
        with open(self.json_path, "w") as fh:
            json.dump(self.result, fh, indent=1, default=str)
        try:
            md = self.markdown()
        except Exception as e:  # a report bug must not end the run: the JSON holds every number
            md = f"markdown failed: {type(e).__name__}: {e}\n"
        with open(self.md_path, "w") as fh:
            fh.write(md)

    def markdown(self) -> str:
        pv = self.result["provenance"]
        lines = [f"## e2e families — {pv['device']}",
                 f"torch {pv['torch']}, triton {pv['triton']}, transformers {pv['transformers']}, CUDA {pv['cuda']}, "
                 f"{pv['date_utc']}, commit {pv['git']['commit'][:10]}{' (dirty)' if pv['git'].get('dirty') else ''}",
                 f"`{pv['command']}`", "",
                 "decode ms/token: engine = inter-token time (first to last new token), transformers = "
                 "(t(n) − t(1)) / (n − 1); random weights of the published shapes; SD acceptance scheduled "
                 "(bench_accept_schedule), see METHOD in the JSON", ""]
        for b in self.benches:
            lines += b.markdown_lines()
        if torch.device(self.args.device).type == "cpu":
            lines += ["(CPU smoke: timings mean nothing)"]
        return "\n".join(lines) + "\n"

    def run(self):
        for name in self.names:
            p = dataclasses.replace(PRESETS[name], new_tokens=self.args.new_tokens or PRESETS[name].new_tokens,
                                    repeats=self.args.repeats or PRESETS[name].repeats)
            torch.manual_seed(0)
            bench = FamilyBench(self.args, name, p, self)
            self.benches.append(bench)
            try:
                bench.run()
            finally:
                bench.release()
                gc.collect()
                if bench.cuda:
                    torch.cuda.empty_cache()
        self.save()
        with open(self.md_path) as fh:
            print(fh.read(), flush=True)
        log(f"wrote {self.json_path} and {self.md_path} in {time.perf_counter() - self.t0:.0f}s")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", nargs="+", default=list(DEFAULT_PRESETS),
                    choices=sorted([*PRESETS, *ALIASES]))
    ap.add_argument("--out", default=os.path.join("benchmarks", "results"))
    ap.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    ap.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default=None,
                    help="default: bf16 on CUDA, fp32 on the CPU")
    ap.add_argument("--skip-hf", action="store_true", help="omit the transformers baselines")
    ap.add_argument("--new-tokens", type=int, default=None, help="new tokens a generation (default: preset's, 64)")
    ap.add_argument("--repeats", type=int, default=None, help="timed runs per measurement (default: preset's, 2)")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="skip (record as skipped) the sections that would start after this many seconds")
    args = ap.parse_args(argv)
    if args.new_tokens is not None and args.new_tokens < 2:
        ap.error("--new-tokens must be at least 2")
    names = [n for x in args.presets for n in ALIASES.get(x, (x,))]
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    args.dtype = args.dtype or ("bf16" if args.device.startswith("cuda") else "fp32")
    Run(args, names).run()


if __name__ == "__main__":
    main()
