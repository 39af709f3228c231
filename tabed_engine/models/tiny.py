"""Build small random LLaVA checkpoints (config + safetensors + tokenizer + processor)
entirely offline. Used by the tests, the GPU smoke test and the fallback demo.

The tokenizer is word-level over `w0 w1 ...` plus `<pad> <s> </s> <unk> <image>`, a
newline token and the chat-role words, so any vocabulary size works.
"""
from __future__ import annotations

import json
import os
from typing import Optional

SPECIALS = ["<pad>", "<s>", "</s>", "<unk>", "<image>", "\n", "user:", "assistant:", "image:"]
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: "
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for c in m['content'] %}{% if c['type'] == 'image' %}<image> \n {% else %}{{ c['text'] }} {% endif %}"
    "{% endfor %}{% endif %} \n {% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"
)


def build_tokenizer(vocab_size: int, out_dir: Optional[str] = None):
    """Word-level fast tokenizer with `vocab_size` entries (ids of specials fixed first)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < len(SPECIALS) + 4:
        raise ValueError(f"vocab_size must be at least {len(SPECIALS) + 4}")
    vocab = {t: i for i, t in enumerate(SPECIALS)}
    for i in range(vocab_size - len(SPECIALS)):
        vocab[f"w{i}"] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    # the newline is a token of its own (the T view's image escape), not whitespace
    tok.add_tokens([AddedToken("\n", normalized=False, single_word=False)])
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>", pad_token="<pad>")
    fast.add_special_tokens({"additional_special_tokens": ["<image>"]})
    fast.chat_template = CHAT_TEMPLATE
    if out_dir:
        fast.save_pretrained(out_dir)
    return fast


def build_tiny_llava(out_dir: str, *, vocab_size: int = 173, hidden: int = 48, layers: int = 2,
                     heads: int = 4, kv_heads: int = 2, intermediate: int = 83,
                     head_dim: Optional[int] = None, tie: bool = False,
                     vision_hidden: int = 32, vision_layers: int = 2, image_size: int = 30,
                     patch_size: int = 6, feature_layer=-2, strategy: str = "default",
                     rope_theta: float = 10000.0, max_positions: int = 2048, seed: int = 0,
                     dtype=None, layout: str = "current", shard_bytes: Optional[int] = None,
                     vision_seed: Optional[int] = None, init_std: float = 0.2,
                     perturb: float = 0.0, perturb_seed: int = 1):
    """Save a random `LlavaForConditionalGeneration` with its processor into `out_dir`.

    perturb: relative noise added to the language-model weights after the seeded init, so a
    checkpoint built with the same seed and a small perturb is a close "draft" of it (same
    vision tower, mostly the same greedy tokens).
    layout: "current" (what this transformers' save_pretrained writes) or "legacy" (the
    transformers-4.x published key names). shard_bytes: shard the safetensors.
    init_std: weight init scale; larger than HF's 0.02 so random models have decisive,
    varied next-token distributions (tiny near-uniform logits make greedy ties likely).
    Returns the transformers model (float32, eval mode).
    """
    import torch
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    os.makedirs(out_dir, exist_ok=True)
    tok = build_tokenizer(vocab_size)
    vc = CLIPVisionConfig(hidden_size=vision_hidden, intermediate_size=vision_hidden * 2 + 3,
                          num_hidden_layers=vision_layers, num_attention_heads=4,
                          image_size=image_size, patch_size=patch_size, projection_dim=16)
    tc = LlamaConfig(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                     num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=vocab_size,
                     max_position_embeddings=max_positions, rope_theta=rope_theta,
                     tie_word_embeddings=tie, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                     **({"head_dim": head_dim} if head_dim else {}))
    grid = (image_size // patch_size) ** 2
    n_img = grid + (1 if strategy == "full" else 0)
    cfg = LlavaConfig(vision_config=vc, text_config=tc, image_token_index=tok.convert_tokens_to_ids("<image>"),
                      vision_feature_layer=feature_layer, vision_feature_select_strategy=strategy,
                      image_seq_length=n_img, tie_word_embeddings=tie)
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2 and "vision" not in name:
                p.normal_(0.0, init_std)
        if vision_seed is not None:
            g = torch.Generator().manual_seed(vision_seed)
            for name, p in model.named_parameters():
                if "vision_tower" in name and p.dim() >= 2:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.02)
        if perturb:
            g = torch.Generator().manual_seed(perturb_seed)
            for name, p in model.named_parameters():
                if "vision_tower" not in name and "multi_modal" not in name:
                    p.add_(torch.randn(p.shape, generator=g) * perturb * p.std().clamp_min(1e-3))
    if tie:
        model.tie_weights()
    model.eval()
    model.generation_config.pad_token_id = 0
    (model.to(dtype) if dtype is not None else model).save_pretrained(out_dir)
    _rewrite_layout(out_dir, layout, shard_bytes)
    proc = build_processor(tok, image_size, patch_size, strategy)
    proc.save_pretrained(out_dir)
    return model


def build_processor(tokenizer, image_size: int, patch_size: int, strategy: str = "default"):
    """A `LlavaProcessor` (CLIP image preprocessing at `image_size`) around `tokenizer`;
    `tokenizer` may be an int vocabulary size, for a word-level tokenizer of that size."""
    from transformers import CLIPImageProcessor, LlavaProcessor

    if isinstance(tokenizer, int):
        tokenizer = build_tokenizer(tokenizer)
    image_proc = CLIPImageProcessor(size={"shortest_edge": image_size},
                                    crop_size={"height": image_size, "width": image_size},
                                    do_center_crop=True, do_resize=True)
    return LlavaProcessor(image_processor=image_proc, tokenizer=tokenizer, patch_size=patch_size,
                          vision_feature_select_strategy=strategy, chat_template=CHAT_TEMPLATE,
                          num_additional_image_tokens=1)


_CURRENT = {"language_model.model.": "model.language_model.", "language_model.lm_head.": "lm_head.",
            "vision_tower.": "model.vision_tower.", "multi_modal_projector.": "model.multi_modal_projector.",
            "image_newline": "model.image_newline"}     # LLaVA-NeXT's


def _canonical(key: str) -> str:
    for old, new in (("model.language_model.", "language_model.model."), ("lm_head.", "language_model.lm_head."),
                     ("model.vision_tower.", "vision_tower."), ("model.multi_modal_projector.", "multi_modal_projector."),
                     ("model.image_newline", "image_newline")):
        if key.startswith(old):
            return new + key[len(old):]
    return key


def _rewrite_layout(out_dir: str, layout: str, shard_bytes: Optional[int]):
    """Rewrite the saved tensors (LLaVA or LLaVA-NeXT) into the requested key layout and
    sharding."""
    from safetensors.torch import load_file, save_file

    single = os.path.join(out_dir, "model.safetensors")
    index = os.path.join(out_dir, "model.safetensors.index.json")
    if os.path.isfile(single):
        sd = load_file(single)
        os.remove(single)
    else:
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
        sd = {}
        for fn in files:
            sd.update(load_file(os.path.join(out_dir, fn)))
            os.remove(os.path.join(out_dir, fn))
        os.remove(index)
    sd = {_canonical(k): v.contiguous() for k, v in sd.items()}
    if layout == "legacy":
        sd = {("vision_tower.vision_model." + k[len("vision_tower."):]
               if k.startswith("vision_tower.") and not k.startswith("vision_tower.vision_model.") else k): v
              for k, v in sd.items()}
    elif layout == "current":
        out = {}
        for k, v in sd.items():
            for old, new in _CURRENT.items():
                if k.startswith(old):
                    k = new + k[len(old):]
                    break
            out[k] = v
        sd = out
    else:
        raise ValueError(f"unknown layout {layout!r}")
    meta = {"format": "pt"}
    if not shard_bytes:
        save_file(sd, single, metadata=meta)
        return
    shards: list[dict] = [{}]
    size = 0
    for k, v in sd.items():
        nbytes = v.numel() * v.element_size()
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][k] = v
        size += nbytes
    weight_map = {}
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(out_dir, name), metadata=meta)
        weight_map.update({k: name for k in shard})
    with open(index, "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=1)


def random_image(seed: int, size: int = 30):
    """A deterministic random RGB PIL image."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8))


def words(seed: int, n: int, vocab_size: int) -> str:
    """A random prompt of `n` plain words from the tiny vocabulary."""
    import random

    rng = random.Random(seed)
    return " ".join(f"w{rng.randrange(vocab_size - len(SPECIALS))}" for _ in range(n))
