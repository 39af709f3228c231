"""Build small random Qwen2.5-VL checkpoints (config + safetensors + tokenizer + processor
files as published) entirely offline, for tests and fixtures.

The tokenizer is `tiny_bpe`'s byte-level BPE with the Qwen2-VL special tokens and the published
Qwen2.5-VL chat template; the config's image / video / vision-start ids are that tokenizer's
own ids. `preprocessor_config.json` is written as the published one is (min / max pixels at the
top level, `Qwen2VLImageProcessor`, `Qwen2_5_VLProcessor`), scaled down to tiny images.
"""
from __future__ import annotations

import json
import os

from tabed_engine.models.tiny_bpe import QWEN_VL_CHAT_TEMPLATE, QWEN_VL_SPECIALS, build_bpe_tokenizer

CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]


def build_tiny_qwen2_5_vl(out_dir: str, *, hidden: int = 64, layers: int = 2, heads: int = 4, kv_heads: int = 2,
                          intermediate: int = 96, mrope_section=(2, 3, 3), rope_theta: float = 100.0,
                          tie: bool = False, vision_hidden: int = 32, vision_heads: int = 2,
                          vision_depth: int = 2, fullatt_block_indexes=(1,), patch_size: int = 4,
                          window_size: int = 16, min_pixels: int = 256, max_pixels: int = 2304,
                          tokens_per_second: int = 2, max_positions: int = 2048, seed: int = 0,
                          perturb: float = 0.0, perturb_seed: int = 1, init_std: float = 0.2,
                          layout: str = "published", vocab_pad: int = 0):
    """Save a random `Qwen2_5_VLForConditionalGeneration` with its tokenizer and processor
    files into `out_dir`; returns the transformers model (float32, eval mode).

    rope_theta: 100 rather than the published 1e6, so that with head_dim 16 every M-RoPE
    section (temporal, height, width) rotates measurably at the tiny prompts' positions and a
    wrong position id changes the logits. window_size 16 with patch 4 is a 2x2-token window
    (the published 112 with patch 14 is 4x4): the vision tower's window attention really
    splits a tiny image. perturb: relative noise on the language model after the seeded init
    (the same seed and a small perturb give a close draft with the same vision tower).
    layout: "published" (`model.*`, `visual.*`, `lm_head.*` and a flat config.json, as on the
    Hub) or "nested" (`model.language_model.*`, `model.visual.*`, `lm_head.*` and the text
    fields under `text_config`, as transformers 4.5x's save_pretrained writes). vocab_pad: extra
    embedding rows past the tokenizer (the published checkpoints' padded vocabularies).
    """
    import torch
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    os.makedirs(out_dir, exist_ok=True)
    tok = build_bpe_tokenizer(specials=QWEN_VL_SPECIALS, chat_template=QWEN_VL_CHAT_TEMPLATE, out_dir=out_dir)
    ids = {t: tok.convert_tokens_to_ids(t) for t in ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>",
                                                     "<|vision_end|>", "<|endoftext|>", "<|im_end|>")}
    vocab = len(tok) + vocab_pad
    text = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=max_positions,
                rms_norm_eps=1e-6, hidden_act="silu", use_sliding_window=False,
                rope_parameters={"rope_type": "default", "mrope_section": list(mrope_section),
                                 "rope_theta": rope_theta},
                bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"])
    vision = dict(depth=vision_depth, hidden_size=vision_hidden, intermediate_size=vision_hidden * 2 - 8,
                  num_heads=vision_heads, patch_size=patch_size, spatial_merge_size=2, temporal_patch_size=2,
                  window_size=window_size, fullatt_block_indexes=list(fullatt_block_indexes),
                  out_hidden_size=hidden, tokens_per_second=tokens_per_second, hidden_act="silu")
    cfg = Qwen2_5_VLConfig(text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
                           video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
                           vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=tie)
    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2 and "visual" not in name:
                p.normal_(0.0, init_std)
        if perturb:
            g = torch.Generator().manual_seed(perturb_seed)
            for name, p in model.named_parameters():
                if "visual" not in name:
                    p.add_(torch.randn(p.shape, generator=g) * perturb * p.std().clamp_min(1e-3))
    if tie:
        model.tie_weights()
    model.eval()
    model.generation_config.pad_token_id = ids["<|endoftext|>"]
    model.generation_config.eos_token_id = [ids["<|im_end|>"], ids["<|endoftext|>"]]
    model.save_pretrained(out_dir)
    if layout not in ("published", "nested"):
        raise ValueError(f"unknown layout {layout!r}")
    _rewrite_layout(out_dir, layout)
    write_processor_files(out_dir, patch_size, min_pixels, max_pixels)
    return model


def write_processor_files(out_dir: str, patch_size: int = 14, min_pixels: int = 3136, max_pixels: int = 12845056):
    """preprocessor_config.json and chat_template.json as Qwen/Qwen2.5-VL-*-Instruct publish
    them (defaults: the published patch and min / max pixels)."""
    with open(os.path.join(out_dir, "preprocessor_config.json"), "w") as f:
        json.dump({"min_pixels": min_pixels, "max_pixels": max_pixels, "patch_size": patch_size,
                   "temporal_patch_size": 2, "merge_size": 2, "image_mean": CLIP_MEAN, "image_std": CLIP_STD,
                   "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2_5_VLProcessor"},
                  f, indent=2)
    with open(os.path.join(out_dir, "chat_template.json"), "w") as f:
        json.dump({"chat_template": QWEN_VL_CHAT_TEMPLATE}, f)


def _rewrite_layout(out_dir: str, layout: str):
    """Rewrite a save_pretrained checkpoint in `layout`: "published" as the Hub's Qwen2.5-VL
    repositories hold it (the language model under `model.`, the vision tower under `visual.`,
    the text fields of config.json at its top level with `rope_scaling` {type: mrope,
    mrope_section}), "nested" under `model.language_model.` and `model.visual.`."""
    from safetensors.torch import load_file, save_file

    path = os.path.join(out_dir, "model.safetensors")
    sd = load_file(path)
    out = {}
    for k, v in sd.items():
        if k.startswith("model.language_model."):
            k = "model." + k[len("model.language_model."):]
        elif k.startswith("model.visual."):
            k = k[len("model."):]
        if layout == "nested":
            k = ("model." + k) if k.startswith("visual.") else k.replace("model.", "model.language_model.", 1)
        out[k] = v.contiguous()
    save_file(out, path, metadata={"format": "pt"})
    if layout == "nested":
        return
    cfg_path = os.path.join(out_dir, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    text = cfg.pop("text_config")
    rope = text.pop("rope_parameters", None) or {}
    for k in ("model_type", "architectures", "dtype", "layer_types"):
        text.pop(k, None)
    flat = {**cfg, **{k: v for k, v in text.items() if k not in cfg}}
    flat["rope_theta"] = rope.get("rope_theta", 1e6)
    flat["rope_scaling"] = {"type": "mrope", "mrope_section": rope.get("mrope_section")}
    flat["vision_config"].pop("architectures", None)
    with open(cfg_path, "w") as f:
        json.dump(flat, f, indent=2)


def tiny_video(seed: int, frames: int = 4, height: int = 24, width: int = 32):
    """A deterministic random video: `frames` RGB frames as a uint8 array [frames, H, W, 3]."""
    import numpy as np

    return np.random.default_rng(seed).integers(0, 256, (frames, height, width, 3), dtype=np.uint8)


def tiny_pair(root: str):
    """(target dir, draft dir): a tiny Qwen2.5-VL target and a perturbed copy of it as its draft
    (same tokenizer, vision tower and processor; equal vocabularies)."""
    t, d = os.path.join(root, "target"), os.path.join(root, "draft")
    if not os.path.isfile(os.path.join(t, "config.json")):
        build_tiny_qwen2_5_vl(t, seed=0)
    if not os.path.isfile(os.path.join(d, "config.json")):
        build_tiny_qwen2_5_vl(d, seed=0, perturb=0.2, layout="nested")
    return t, d
