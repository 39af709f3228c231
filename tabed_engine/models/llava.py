"""LLaVA-1.5 (`LlavaForConditionalGeneration`): a Llama / Vicuna / Mistral decoder, a CLIP (or
other transformers) vision tower at one fixed resolution, the two-layer projector.

Both key layouts load: the one of checkpoints published for transformers 4.x
(`language_model.model.*`, `language_model.lm_head.*`, `vision_tower.vision_model.*`,
`multi_modal_projector.*`) and what today's `save_pretrained` writes (`model.language_model.*`,
`lm_head.*`, `model.vision_tower.*`, `model.multi_modal_projector.*`).
"""
from __future__ import annotations

from typing import Optional

from tabed_engine.models.config import LMConfig
from tabed_engine.models.decoder import LlamaLM
from tabed_engine.models.registry import Family, register
from tabed_engine.models.vision import VisionEncoder


def lm_config(config: dict) -> LMConfig:
    """The decoder's shape from `text_config` (Llama defaults where the config leaves them out)."""
    tc = config.get("text_config") or {}
    return LMConfig.from_text_config({"model_type": "llama", **tc}, config)


def canonical_key(key: str) -> Optional[tuple[str, str]]:
    """(part, key) of a checkpoint tensor in either layout: part "lm" with keys as in
    `LlamaLM` (`layers.0.self_attn.q_proj.weight`, `lm_head.weight`, ...), "vision" without any
    `vision_model.` prefix, "proj" as in the projector (`linear_1.weight`) and LLaVA-NeXT's
    `image_newline` (the connector's other learned tensor); None if not LLaVA's."""
    k = key[len("model."):] if key.startswith("model.") and not key.startswith("model.layers") else key
    if k.startswith("language_model."):
        k = k[len("language_model."):]
        if k.startswith("lm_head."):
            return "lm", k
        return "lm", k[len("model."):] if k.startswith("model.") else k
    if k.startswith("lm_head."):
        return "lm", k
    if k.startswith("vision_tower."):
        k = k[len("vision_tower."):]
        return "vision", k[len("vision_model."):] if k.startswith("vision_model.") else k
    if k.startswith("multi_modal_projector."):
        return "proj", k[len("multi_modal_projector."):]
    if k == "image_newline":
        return "proj", k
    return None


def build_vision(hf_config, config: dict) -> VisionEncoder:
    """The tower + projector, with the configured feature layer and selection strategy."""
    return VisionEncoder(hf_config, config.get("vision_feature_layer", -2),
                         config.get("vision_feature_select_strategy", "default"))


def image_layout(config: dict) -> tuple:
    """The tower's input size and patch (the processor's output depends on nothing else)."""
    vc = config.get("vision_config") or {}
    return vc.get("image_size", 336), vc.get("patch_size", 14), None


def image_token_id(config: dict) -> Optional[int]:
    token = config.get("image_token_index", config.get("image_token_id"))
    return None if token is None else int(token)


FAMILY = register(Family(
    name="llava", architectures=("LlavaForConditionalGeneration",), model_types=("llava",),
    lm_config=lm_config, build_lm=LlamaLM, build_vision=build_vision, canonical_key=canonical_key,
    image_layout=image_layout, image_token_id=image_token_id))
