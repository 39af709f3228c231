"""LLaVA-OneVision (`LlavaOnevisionForConditionalGeneration`, llava-hf/llava-onevision-qwen2-
{0.5b,7b,72b}-ov-hf): a Qwen2 decoder (q/k/v bias, GQA, RoPE θ 1e6; tied embeddings on the
0.5B), a SigLIP tower (no CLS: 27 x 27 = 729 features a 384-px tile, the configured feature
layer, strategy "full"), LLaVA's two-layer GELU projector, `image_newline`, and any-resolution
tiles under the "anyres_max_9" budget (anyres.py: tiles from `image_grid_pinpoints`, unpadded,
scaled down bilinearly past 9 x 729 features).

Several images in one prompt: the engine hands the processor a flat list of images, for which
transformers' `LlavaOnevisionProcessor` (`batch_num_images` all 1) and model tile and count every
image on its own, so each image gets its own anyres token count, as here.

Weight names as LLaVA's in both layouts (`language_model.model.*` / `model.language_model.*`,
`vision_tower.vision_model.*` / `model.vision_tower.*`, `multi_modal_projector.*`,
`image_newline`). The processor is transformers' `LlavaOnevisionProcessor` without its video
processor (which needs torchvision): the image processor's PIL backend and the tokenizer, read
from the published files offline. On CUDA the engine preprocesses images on the device by
default (`image_ops`, bit-exact with this PIL processor: `supports(image_processor,
vision.anyres)`); elsewhere, or with device_images=False, the processor does.
"""
from __future__ import annotations

import json
import os
from typing import Optional

from tabed_engine.models import llava
from tabed_engine.models.config import LMConfig
from tabed_engine.models.decoder import LlamaLM
from tabed_engine.models.loader import chat_template
from tabed_engine.models.registry import Family, register
from tabed_engine.models.vision import VisionEncoder


def lm_config(config: dict) -> LMConfig:
    """The Qwen2 decoder's shape from `text_config` (Qwen2 where the config leaves it out)."""
    tc = config.get("text_config") or {}
    return LMConfig.from_text_config({"model_type": "qwen2", **tc}, config)


def build_vision(hf_config, config: dict) -> VisionEncoder:
    """SigLIP tower + projector + anyres_max packing (published: feature layer -1, "full")."""
    return VisionEncoder(hf_config, config.get("vision_feature_layer", -1),
                         config.get("vision_feature_select_strategy", "full"), video=True)


def image_layout(config: dict) -> tuple:
    """Tile side, patch, grid pinpoints and the anyres_max budget."""
    vc = config.get("vision_config") or {}
    pins = config.get("image_grid_pinpoints")
    return (vc.get("image_size", 384), vc.get("patch_size", 14), None if pins is None else tuple(map(tuple, pins)),
            config.get("vision_aspect_ratio", "anyres_max_9"))


def video_token_id(config: dict) -> Optional[int]:
    token = config.get("video_token_index", config.get("video_token_id"))
    return None if token is None else int(token)


def _processor_class():
    """transformers' LlavaOnevisionProcessor with the image processor and tokenizer only."""
    from transformers import LlavaOnevisionProcessor

    class OnevisionImageProcessor(LlavaOnevisionProcessor):
        attributes = ["image_processor", "tokenizer"]          # transformers 4.x reads this

        def __init__(self, image_processor=None, tokenizer=None, **kwargs):   # 5.x: the signature
            super().__init__(image_processor=image_processor, tokenizer=tokenizer, video_processor=None, **kwargs)

    return OnevisionImageProcessor


def load_processor(path: str):
    """The checkpoint's tokenizer, PIL image processor and processor settings, offline, as
    transformers' `LlavaOnevisionProcessor` (no video processor: it needs torchvision)."""
    import transformers
    from transformers import AutoTokenizer

    image_cls = getattr(transformers, "LlavaOnevisionImageProcessorPil", None) or transformers.LlavaOnevisionImageProcessor
    image_processor = image_cls.from_pretrained(path, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    settings = {}
    if os.path.isfile(os.path.join(path, "processor_config.json")):
        with open(os.path.join(path, "processor_config.json")) as f:
            settings = json.load(f)
    template = chat_template(path, tokenizer)
    keep = ("num_image_tokens", "vision_feature_select_strategy", "image_token", "video_token", "vision_aspect_ratio")
    return _processor_class()(image_processor=image_processor, tokenizer=tokenizer, chat_template=template,
                              **{k: settings[k] for k in keep if k in settings})


FAMILY = register(Family(
    name="llava_onevision", architectures=("LlavaOnevisionForConditionalGeneration",),
    model_types=("llava_onevision",), lm_config=lm_config, build_lm=LlamaLM, build_vision=build_vision,
    canonical_key=llava.canonical_key, image_layout=image_layout, image_token_id=llava.image_token_id,
    load_processor=load_processor, video_token_id=video_token_id))
