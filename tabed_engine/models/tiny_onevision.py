"""Build small random LLaVA-OneVision checkpoints offline, laid out as
llava-hf/llava-onevision-qwen2-*-ov-hf publishes them: `LlavaOnevisionForConditionalGeneration`
weights (Qwen2 decoder with q/k/v bias and GQA, a SigLIP tower without CLS, the two-layer GELU
projector, `image_newline`), config.json with the grid pinpoints, `vision_aspect_ratio`
"anyres_max_9" and strategy "full", and the processor files (preprocessor_config.json with the
pinpoints, processor_config.json with `num_image_tokens`, chat_template.json) around the
byte-level BPE of tiny_bpe.py (the image and video tokens are its own small ids).

The published pinpoints are every (i, j) multiple of the 384-px tile for i, j in 1..6; here of
the tiny tile. Used by the tests.
"""
from __future__ import annotations

import json
import os
from tabed_engine.models.tiny_bpe import ONEVISION_CHAT_TEMPLATE, ONEVISION_SPECIALS, build_bpe_tokenizer

SIGLIP_NORM = {"image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}


def pinpoints(tile: int, n: int = 6) -> list[list[int]]:
    """The published OneVision pinpoints (1..6 tiles a side, 36 entries) at tile side `tile`."""
    return [[tile * i, tile * j] for i in range(1, n + 1) for j in range(1, n + 1)]


def _dump(out_dir: str, name: str, obj) -> None:
    with open(os.path.join(out_dir, name), "w") as f:
        json.dump(obj, f, indent=2)


def write_processor_files(out_dir: str, tile: int, patch: int, chat_template: str = ONEVISION_CHAT_TEMPLATE):
    """preprocessor_config.json, processor_config.json and chat_template.json as published."""
    _dump(out_dir, "preprocessor_config.json", {
        "do_convert_rgb": True, "do_normalize": True, "do_pad": True, "do_rescale": True, "do_resize": True,
        "image_grid_pinpoints": pinpoints(tile), **SIGLIP_NORM,
        "image_processor_type": "LlavaOnevisionImageProcessor", "processor_class": "LlavaOnevisionProcessor",
        "resample": 3, "rescale_factor": 0.00392156862745098, "size": {"height": tile, "width": tile}})
    _dump(out_dir, "processor_config.json", {
        "image_token": "<image>", "num_image_tokens": (tile // patch) ** 2,
        "processor_class": "LlavaOnevisionProcessor", "video_token": "<video>",
        "vision_feature_select_strategy": "full"})
    _dump(out_dir, "chat_template.json", {"chat_template": chat_template})


def build_tiny_onevision(out_dir: str, *, bpe_vocab: int = 400, model_vocab: int = 448, hidden: int = 64,
                         layers: int = 2, heads: int = 4, kv_heads: int = 2, intermediate: int = 96,
                         tie: bool = False, vision_hidden: int = 32, vision_layers: int = 2, tile: int = 35,
                         patch: int = 7, seed: int = 0, init_std: float = 0.3, perturb: float = 0.0,
                         like=None, vision_perturb: float = 0.0, layout: str = "current"):
    """Save a random `LlavaOnevisionForConditionalGeneration` with its tokenizer and processor
    files into `out_dir`; returns the transformers model (float32, eval).

    model_vocab: embedding rows (past the tokenizer's bpe_vocab + 5 tokens: padding, as the
    published 152000 / 152128 rows). like: a model whose weights are copied first (a draft of
    the same shape); perturb: relative noise on the language model then; vision_perturb: on the
    vision tower (a tower of its own, close to the copied one). layout: "current" or "legacy" key names (tiny._rewrite_layout)."""
    import torch
    from transformers import LlavaOnevisionConfig, LlavaOnevisionForConditionalGeneration, Qwen2Config, SiglipVisionConfig

    from tabed_engine.models.tiny import _rewrite_layout

    os.makedirs(out_dir, exist_ok=True)
    tok = build_bpe_tokenizer(bpe_vocab, specials=ONEVISION_SPECIALS, chat_template=ONEVISION_CHAT_TEMPLATE,
                              out_dir=out_dir)
    ids = {t: tok.convert_tokens_to_ids(t) for t in ("<image>", "<video>", "<|im_end|>", "<|endoftext|>")}
    vc = SiglipVisionConfig(hidden_size=vision_hidden, intermediate_size=vision_hidden * 2 + 3,
                            num_hidden_layers=vision_layers, num_attention_heads=4, image_size=tile,
                            patch_size=patch, vision_use_head=False)
    tc = Qwen2Config(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                     num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=model_vocab,
                     max_position_embeddings=2048, rope_theta=1e6, tie_word_embeddings=tie,
                     eos_token_id=ids["<|im_end|>"], bos_token_id=ids["<|endoftext|>"], use_sliding_window=False)
    cfg = LlavaOnevisionConfig(vision_config=vc, text_config=tc, image_token_index=ids["<image>"],
                               video_token_index=ids["<video>"], vision_feature_layer=-1,
                               vision_feature_select_strategy="full", vision_aspect_ratio="anyres_max_9",
                               image_grid_pinpoints=pinpoints(tile), tie_word_embeddings=tie)
    torch.manual_seed(seed)
    model = LlavaOnevisionForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if (p.dim() >= 2 and "vision_tower" not in name) or "image_newline" in name:
                p.normal_(0.0, init_std if p.dim() >= 2 else 1.0)
        if like is not None:             # (rows of embeddings of another size: the shared ones)
            own = model.state_dict()
            for k, v in like.state_dict().items():
                n = min(v.shape[0], own[k].shape[0])
                if v.shape[1:] == own[k].shape[1:]:
                    own[k][:n].copy_(v[:n])
        if vision_perturb:
            g = torch.Generator().manual_seed(seed + 2)
            for name, p in model.named_parameters():
                if "vision_tower" in name and p.dim() >= 2:
                    p.add_(torch.randn(p.shape, generator=g) * vision_perturb * p.std().clamp_min(1e-3))
        if perturb:
            g = torch.Generator().manual_seed(seed + 1)
            for name, p in model.named_parameters():
                if "language_model" in name or "lm_head" in name:
                    p.add_(torch.randn(p.shape, generator=g) * perturb * p.std().clamp_min(1e-3))
    if tie:
        model.tie_weights()
    model.generation_config.pad_token_id = ids["<|endoftext|>"]
    model.generation_config.eos_token_id = ids["<|im_end|>"]
    model.save_pretrained(out_dir)
    _rewrite_layout(out_dir, layout, None)
    write_processor_files(out_dir, tile, patch)
    cfg_file = os.path.join(out_dir, "tokenizer_config.json")
    with open(cfg_file) as f:
        tcfg = json.load(f)
    tcfg["processor_class"] = "LlavaOnevisionProcessor"
    _dump(out_dir, "tokenizer_config.json", tcfg)
    return model
