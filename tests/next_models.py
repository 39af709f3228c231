"""Tiny random LLaVA-NeXT checkpoints whose files look published (llava-hf/llava-v1.6-*-hf):
`LlavaNextForConditionalGeneration` weights with `image_newline`, `image_grid_pinpoints` in the
config, `LlavaNextProcessor` / `LlavaNextImageProcessor` files and a Vicuna chat template,
around the Llama-2 SentencePiece tokenizer of tests/realistic.py.

Each fixture is a target and a draft (same seed, perturbed language model):

vicuna   Llama LM (GQA 4/2), 28-px tiles of 7-px patches (4x4 grid), pinpoints
         [[28,56],[56,28],[56,56]], feature layer -2, legacy (transformers 4.x) key names;
         the draft's tower is the target's (one encoding serves both).
mistral  Mistral LM (GQA 4/1, head_dim 16 != hidden/heads, 3 layers), 30-px tiles of 6-px
         patches (5x5 grid), five pinpoints up to 1x3 tiles, feature layer -1, today's key
         names, sharded; the draft has a tower of its own.
llama3   Llama LM (MHA, 2 layers) with a Llama-3-style byte-level BPE tokenizer ("\n" is one
         token), 42-px tiles of 14-px patches (3x3 grid), pinpoints up to 3x1 tiles, today's
         key names in one file.
yi       llava-v1.6-34b's shape: a Llama LM with 7 query heads to 1 KV head (Yi-34B's 56 : 8),
         five pinpoints, legacy key names, sharded.
qwen     llava-next-72b / -110b's shape: a Qwen2 (Qwen1.5) LM with q/k/v bias and as many KV heads
         as query heads (the 72B's 64 / 64), RoPE θ 1e6, a Qwen2 byte-level BPE with `<image>`.
mixed    the vicuna target with a LLaVA-1.5-style draft (`LlavaForConditionalGeneration`,
         CLIP preprocessing at 28 px: 16 image tokens an image, the target's tower).

Built once per test session under $TABED_TEST_MODELS (or a temporary directory).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile

import realistic

# realistic.py's recipes: its "llama" SentencePiece and its "bytelevel" BPE
TOKENIZERS = {"sentencepiece": dict(vocab=700, corpus_seed=0, legacy=False, tokenizer_json=True),
              "bytelevel": dict(vocab=800, corpus_seed=2, newline=True),
              "qwen": dict(vocab=600, specials=["<image>"])}      # tiny_bpe's (see _write_qwen_tokenizer)
FIXTURES = {
    "vicuna": dict(text="llama", hidden=48, layers=2, heads=4, kv_heads=2, head_dim=None, intermediate=83,
                   vision_hidden=32, vision_layers=2, tile=28, patch=7,
                   pinpoints=[[28, 56], [56, 28], [56, 56]], feature_layer=-2, layout="legacy",
                   shard_bytes=None, seed=21, draft="next", draft_tower_seed=None, tokenizer="sentencepiece"),
    "mistral": dict(text="mistral", hidden=40, layers=3, heads=4, kv_heads=1, head_dim=16, intermediate=71,
                    vision_hidden=24, vision_layers=3, tile=30, patch=6,
                    pinpoints=[[30, 60], [60, 30], [60, 60], [90, 30], [30, 90]], feature_layer=-1,
                    layout="current", shard_bytes=40000, seed=22, draft="next", draft_tower_seed=5,
                    tokenizer="sentencepiece"),
    "llama3": dict(text="llama", hidden=32, layers=2, heads=4, kv_heads=4, head_dim=None, intermediate=61,
                   vision_hidden=32, vision_layers=2, tile=42, patch=14,
                   pinpoints=[[42, 84], [84, 42], [84, 84], [126, 42]], feature_layer=-2, layout="current",
                   shard_bytes=None, seed=23, draft="next", draft_tower_seed=None, tokenizer="bytelevel"),
}
# the large published checkpoints' shapes at tiny sizes: llava-v1.6-34b (Yi-34B: a Llama LM with 56
# query heads to 8 KV heads, 7 : 1) and llava-next-72b / -110b (Qwen1.5 = a Qwen2 LM: q/k/v bias,
# as many KV heads as query heads on the 72B; a ChatML byte-level BPE)
FIXTURES["yi"] = dict(text="llama", hidden=56, layers=2, heads=7, kv_heads=1, head_dim=None, intermediate=90,
                      vision_hidden=32, vision_layers=2, tile=28, patch=7,
                      pinpoints=[[28, 56], [56, 28], [56, 56], [84, 28], [28, 84]], feature_layer=-2,
                      layout="legacy", shard_bytes=60000, seed=24, draft="next", draft_tower_seed=None,
                      tokenizer="sentencepiece")
FIXTURES["qwen"] = dict(text="qwen2", hidden=48, layers=2, heads=4, kv_heads=4, head_dim=None, intermediate=83,
                        vision_hidden=32, vision_layers=2, tile=28, patch=7,
                        pinpoints=[[28, 56], [56, 28], [56, 56], [84, 28], [28, 84]], feature_layer=-2,
                        layout="current", shard_bytes=None, seed=25, draft="next", draft_tower_seed=None,
                        tokenizer="qwen")
FIXTURES["mixed"] = {**FIXTURES["vicuna"], "draft": "llava"}
DRAFT_PERTURB = 0.03
INIT_STD = 0.3           # larger than HF's 0.02: decisive, varied greedy tokens (0.2: loops of one token)

# llava-hf/llava-v1.6-vicuna-7b-hf's chat template (a system turn's text, then USER/ASSISTANT)
VICUNA_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'system' %}{{ message['content'][0]['text'] }}"
    "{% else %}{{ message['role'].upper() + ': '}}{% endif %}{# Render all images first #}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}{{ '<image>\n' }}"
    "{% endfor %}{# Render all text next #}{% if message['role'] != 'assistant' %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{{ content['text'] + ' '}}{% endfor %}{% else %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}{% generation %}"
    "{{ content['text'] + ' '}}{% endgeneration %}{% endfor %}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}")
_CLIP_NORM = {"image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711]}

_ROOT = os.path.join(os.environ.get("TABED_TEST_MODELS") or tempfile.mkdtemp(prefix="tabed_models_"), "next")


def _dump(out_dir, name, obj):
    realistic._dump(out_dir, name, obj)


def write_processor_files(out_dir: str, spec: dict, next_: bool):
    """preprocessor_config.json, processor_config.json and chat_template.json as llava-hf
    publishes them for LLaVA-NeXT (next_) or LLaVA-1.5, at the fixture's tile size."""
    tile, cls = spec["tile"], "LlavaNextProcessor" if next_ else "LlavaProcessor"
    pre = {"crop_size": {"height": tile, "width": tile}, "do_center_crop": True, "do_convert_rgb": True,
           "do_normalize": True, "do_rescale": True, "do_resize": True, **_CLIP_NORM,
           "processor_class": cls, "resample": 3, "rescale_factor": 0.00392156862745098,
           "size": {"shortest_edge": tile}}
    if next_:
        pre.update(aspect_ratio_setting="anyres", image_grid_pinpoints=spec["pinpoints"], do_pad=True,
                   image_processor_type="LlavaNextImageProcessor")
    else:
        pre.update(image_processor_type="CLIPImageProcessor")
    _dump(out_dir, "preprocessor_config.json", pre)
    _dump(out_dir, "processor_config.json", {
        "image_token": "<image>", "num_additional_image_tokens": 1, "patch_size": spec["patch"],
        "processor_class": cls, "vision_feature_select_strategy": "default"})
    _dump(out_dir, "chat_template.json", {"chat_template": VICUNA_TEMPLATE})
    cfg_file = os.path.join(out_dir, "tokenizer_config.json")
    with open(cfg_file) as f:
        cfg = json.load(f)
    cfg["processor_class"] = cls
    _dump(out_dir, "tokenizer_config.json", cfg)


def _configs(spec: dict, vocab: int, ids: dict, next_: bool):
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaNextConfig, MistralConfig, Qwen2Config

    vc = CLIPVisionConfig(hidden_size=spec["vision_hidden"], intermediate_size=spec["vision_hidden"] * 2 + 3,
                          num_hidden_layers=spec["vision_layers"], num_attention_heads=4,
                          image_size=spec["tile"], patch_size=spec["patch"], projection_dim=16)
    text = dict(hidden_size=spec["hidden"], intermediate_size=spec["intermediate"],
                num_hidden_layers=spec["layers"], num_attention_heads=spec["heads"],
                num_key_value_heads=spec["kv_heads"], vocab_size=vocab, max_position_embeddings=1024,
                bos_token_id=ids["bos"], eos_token_id=ids["eos"], pad_token_id=ids["pad"],
                tie_word_embeddings=False, **({"head_dim": spec["head_dim"]} if spec["head_dim"] else {}))
    if spec["text"] == "mistral":
        tc = MistralConfig(sliding_window=None, **text)
    elif spec["text"] == "qwen2":
        tc = Qwen2Config(use_sliding_window=False, rope_theta=1e6, **text)
    else:
        tc = LlamaConfig(**text)
    common = dict(vision_config=vc, text_config=tc, image_token_index=ids["image"], pad_token_id=ids["pad"],
                  vision_feature_layer=spec["feature_layer"], vision_feature_select_strategy="default",
                  tie_word_embeddings=False)
    if next_:
        return LlavaNextConfig(image_grid_pinpoints=spec["pinpoints"], **common)
    return LlavaConfig(image_seq_length=(spec["tile"] // spec["patch"]) ** 2, **common)


def _build(out_dir: str, tok_dir: str, spec: dict, vocab: int, ids: dict, *, next_: bool, perturb: float,
           tower_seed=None, like=None):
    """Save one random model (`like`: copy its weights first, the image newline aside)."""
    import torch
    from transformers import LlavaForConditionalGeneration, LlavaNextForConditionalGeneration

    from tabed_engine.models.tiny import _rewrite_layout

    cfg = _configs(spec, vocab, ids, next_)
    torch.manual_seed(spec["seed"])
    model = (LlavaNextForConditionalGeneration if next_ else LlavaForConditionalGeneration)(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if (p.dim() >= 2 and "vision_tower" not in name) or "image_newline" in name:
                p.normal_(0.0, INIT_STD if p.dim() >= 2 else 1.0)
        if like is not None:
            model.load_state_dict({k: v for k, v in like.state_dict().items() if "image_newline" not in k},
                                  strict=False)
        if tower_seed is not None:
            g = torch.Generator().manual_seed(tower_seed)
            for name, p in model.named_parameters():
                if "vision_tower" in name and p.dim() >= 2:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.05)
        if perturb:
            g = torch.Generator().manual_seed(1)
            for name, p in model.named_parameters():
                if "language_model" in name or "lm_head" in name:
                    p.add_(torch.randn(p.shape, generator=g) * perturb * p.std().clamp_min(1e-3))
    model.generation_config.pad_token_id = ids["pad"]
    model.save_pretrained(out_dir)
    _rewrite_layout(out_dir, spec["layout"], spec["shard_bytes"])
    for name in os.listdir(tok_dir):
        shutil.copy(os.path.join(tok_dir, name), out_dir)
    write_processor_files(out_dir, spec, next_)
    return model


def _write_qwen_tokenizer(tok_dir: str) -> int:
    """A Qwen2-style byte-level BPE (tiny_bpe) with `<image>` after the Qwen2 specials, as
    llava-next-72b-hf's; returns its length."""
    from tabed_engine.models.tiny_bpe import build_bpe_tokenizer

    spec = TOKENIZERS["qwen"]
    return len(build_bpe_tokenizer(spec["vocab"], specials=tuple(spec["specials"]), out_dir=tok_dir))


def _qwen_ids(tok_dir: str) -> dict:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tok_dir, local_files_only=True)
    pad = tok.convert_tokens_to_ids("<|endoftext|>")
    return {"image": tok.convert_tokens_to_ids("<image>"), "pad": pad, "bos": pad, "eos": tok.eos_token_id}


def checkpoint(name: str) -> tuple[str, str]:
    """(target_dir, draft_dir) of the named fixture, built on first use."""
    spec = FIXTURES[name]
    key = json.dumps([spec, TOKENIZERS[spec["tokenizer"]], DRAFT_PERTURB, INIT_STD, VICUNA_TEMPLATE], sort_keys=True)
    path = os.path.join(_ROOT, f"{name}-{hashlib.sha1(key.encode()).hexdigest()[:10]}")
    if not os.path.isfile(os.path.join(path, "draft", "config.json")):
        os.makedirs(_ROOT, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=name + ".", dir=_ROOT)
        tok_dir = os.path.join(tmp, "tokenizer")
        if spec["tokenizer"] == "sentencepiece":
            n = realistic.write_sentencepiece_tokenizer(tok_dir, **TOKENIZERS["sentencepiece"])
        elif spec["tokenizer"] == "qwen":
            n = _write_qwen_tokenizer(tok_dir)
        else:
            n = realistic.write_byte_level_tokenizer(tok_dir, **TOKENIZERS["bytelevel"])
        ids = _qwen_ids(tok_dir) if spec["tokenizer"] == "qwen" else realistic._ids(tok_dir)
        vocab = -(-n // 64) * 64
        target = _build(os.path.join(tmp, "target"), tok_dir, spec, vocab, ids, next_=True, perturb=0.0)
        _build(os.path.join(tmp, "draft"), tok_dir, spec, vocab, ids, next_=spec["draft"] == "next",
               perturb=DRAFT_PERTURB, tower_seed=spec["draft_tower_seed"], like=target)
        shutil.rmtree(tok_dir)
        try:
            os.rename(tmp, path)
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
    return os.path.join(path, "target"), os.path.join(path, "draft")
