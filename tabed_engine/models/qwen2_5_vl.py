"""Qwen2.5-VL (`Qwen2_5_VLForConditionalGeneration`): a Qwen2 decoder (q/k/v bias, GQA, rope θ
1e6) with M-RoPE (`rope_scaling` {type: mrope / default, mrope_section}), the Qwen2.5-VL vision
transformer with its patch merger (qwen2_5_vl_vision.py) and dynamic resolution.

config.json holds the text fields at its top level (as the Hub's checkpoints were saved) or
under `text_config` (later transformers); both are read. Both key layouts load: the published
one (`model.*` language model, `visual.*` vision tower, `lm_head.*`) and the one of
transformers 4.5x's save_pretrained (`model.language_model.*`, `model.visual.*`, `lm_head.*`).

transformers' `Qwen2_5_VLProcessor` cannot be built without torchvision (its video processor),
so the family's processor is `QwenVLProcessor`: the checkpoint's tokenizer, its PIL image
processor and chat template, expanding each `<|image_pad|>` to the image's token count as the
published processor does. On CUDA the engine preprocesses images on the device by default
(`image_ops`, bit-exact with this PIL processor: the flattened patches and grids of
`Qwen2VLImageProcessorPil`); elsewhere, or with device_images=False, the processor does. Videos
(`<|video_pad|>`), on the host: the video processor's steps reproduced with the PIL image processor
(`QwenVLProcessor.video_pixels`, the temporal grouping in `qwen2_5_vl_vision.patchify_video`), its
settings read as transformers reads them (`video_settings`).
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Optional

from tabed_engine.models.config import LMConfig
from tabed_engine.models.decoder import LlamaLM
from tabed_engine.models.loader import chat_template
from tabed_engine.models.qwen2_5_vl_vision import QwenVision
from tabed_engine.models.registry import Family, register

if TYPE_CHECKING:
    import torch

_VISION_KEYS = ("text_config", "vision_config")


def text_config(config: dict) -> dict:
    """The text fields of a config dict: its top level, overridden by `text_config` if any."""
    return {**{k: v for k, v in config.items() if k not in _VISION_KEYS}, **(config.get("text_config") or {})}


def lm_config(config: dict) -> LMConfig:
    """The decoder's shape, with M-RoPE's sections (ValueError for a RoPE type or a sliding
    window the decoder does not run)."""
    tc = text_config(config)
    rope = tc.get("rope_parameters") or tc.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("mrope", "default"):
        raise ValueError(f"unsupported Qwen2.5-VL RoPE type {rope_type!r} (supported: mrope, default)")
    if tc.get("use_sliding_window"):
        raise ValueError("Qwen2.5-VL checkpoints with use_sliding_window=true are not supported")
    theta = rope.get("rope_theta", tc.get("rope_theta", 1000000.0))
    plain = {**tc, "model_type": "qwen2", "rope_scaling": None, "rope_parameters": {"rope_theta": theta}}
    cfg = LMConfig.from_text_config(plain, config)
    section = rope.get("mrope_section")
    return dataclasses.replace(cfg, mrope_section=None if section is None else tuple(section))


def canonical_key(key: str) -> Optional[tuple[str, str]]:
    """(part, key) of a checkpoint tensor in either layout: "lm" with `LlamaLM`'s names,
    "vision" with the vision tower's (merger included); None if not Qwen2.5-VL's."""
    if key.startswith("lm_head."):
        return "lm", key
    for prefix in ("model.visual.", "visual."):
        if key.startswith(prefix):
            return "vision", key[len(prefix):]
    for prefix in ("model.language_model.", "model."):
        if key.startswith(prefix):
            return "lm", key[len(prefix):]
    return None


def build_vision(hf_config, config: dict) -> QwenVision:
    return QwenVision(hf_config)


def image_layout(config: dict) -> tuple:
    """What the image preprocessing and token counts depend on in config.json: the patch,
    temporal patch and merge sizes."""
    vc = config.get("vision_config") or {}
    return vc.get("patch_size", 14), vc.get("temporal_patch_size", 2), vc.get("spatial_merge_size", 2)


def image_token_id(config: dict) -> Optional[int]:
    token = config.get("image_token_id", 151655)
    return None if token is None else int(token)


def video_token_id(config: dict) -> Optional[int]:
    """`<|video_pad|>`'s id (151656 as published)."""
    token = config.get("video_token_id", 151656)
    return None if token is None else int(token)


# transformers' Qwen2VLVideoProcessor class defaults (a video config without `size` / min / max pixels)
VIDEO_SIZE = {"shortest_edge": 128 * 28 * 28, "longest_edge": 28 * 28 * 768}


def video_settings(path: str) -> dict:
    """The video preprocessing of a checkpoint, read as transformers' video processor reads it:
    `processor_config.json`'s "video_processor", else `video_preprocessor_config.json`, else
    `preprocessor_config.json` (the published Qwen2.5-VL repositories ship only this one: videos
    then take the images' min / max pixels). Returns min_pixels, max_pixels, image_mean,
    image_std, rescale_factor, resample and the patch sizes; ValueError for settings the engine
    does not reproduce."""
    import json
    import os

    def load(name):
        f = os.path.join(path, name)
        return json.load(open(f)) if os.path.isfile(f) else None

    d = (load("processor_config.json") or {}).get("video_processor") or load("video_preprocessor_config.json") \
        or load("preprocessor_config.json") or {}
    size = dict(d.get("size") or VIDEO_SIZE)
    lo = d.get("min_pixels", size.get("shortest_edge"))
    hi = d.get("max_pixels", size.get("longest_edge"))
    off = [k for k in ("do_resize", "do_rescale", "do_normalize") if d.get(k) is False]
    if off or d.get("cap_pixels_per_frame") or lo is None or hi is None:
        raise ValueError(f"unsupported Qwen2.5-VL video preprocessing in {path} ({', '.join(off) or ''} off, "
                         f"cap_pixels_per_frame={d.get('cap_pixels_per_frame')}, min/max pixels {lo}/{hi}): the "
                         "engine resizes between min and max pixels, rescales and normalises every frame")
    from transformers.image_utils import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD
    return dict(min_pixels=int(lo), max_pixels=int(hi), image_mean=d.get("image_mean", list(OPENAI_CLIP_MEAN)),
                image_std=d.get("image_std", list(OPENAI_CLIP_STD)), rescale_factor=d.get("rescale_factor", 1 / 255),
                resample=d.get("resample", 3), patch_size=d.get("patch_size", 14),
                temporal_patch_size=d.get("temporal_patch_size", 2), merge_size=d.get("merge_size", 2))


class QwenVLProcessor:
    """Tokenizer + image processor + chat template of a Qwen2.5-VL checkpoint, with the call
    the engine's prompt path uses: `processor(text=..., images=..., return_tensors="pt")`
    expands every `<|image_pad|>` to its image's grid_t * grid_h * grid_w / merge² tokens."""

    image_token = "<|image_pad|>"
    video_token = "<|video_pad|>"

    def __init__(self, tokenizer, image_processor, chat_template: Optional[str] = None,
                 video: Optional[dict] = None):
        self.tokenizer, self.image_processor = tokenizer, image_processor
        self.chat_template = chat_template or getattr(tokenizer, "chat_template", None)
        self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
        self.video = video          # `video_settings` (None: the image processor's own)

    def video_pixels(self, frames) -> "torch.Tensor":
        """A video's frames (RGB PIL images of one size) preprocessed as transformers'
        Qwen2-VL video processor does, without torchvision: each frame resized to
        `smart_resize` of its size between the video min / max pixels, rescaled and normalised,
        by this checkpoint's PIL image processor (so a frame's pixels are bit-identical to an
        image's of the same size under the same settings). Returns [frames, 3, H, W] float32;
        `QwenVision.video_features` groups the frames in temporal patches and flattens them."""
        import torch

        ip, v = self.image_processor, self.video
        kw = {} if v is None else dict(size={"shortest_edge": v["min_pixels"], "longest_edge": v["max_pixels"]},
                                       image_mean=v["image_mean"], image_std=v["image_std"],
                                       rescale_factor=v["rescale_factor"], resample=v["resample"])
        out = ip(list(frames), return_tensors="pt", **kw)
        # the image processor's patch rows of each frame (repeated over the temporal patch) back
        # to the frame: rows (gh/m, gw/m, m, m), columns (C, T, p, p)
        p, m, T = ip.patch_size, ip.merge_size, ip.temporal_patch_size
        _, gh, gw = (int(x) for x in out["image_grid_thw"][0])
        x = torch.as_tensor(out["pixel_values"]).reshape(len(frames), gh // m, gw // m, m, m, -1, T, p, p)[:, :, :, :, :, :, 0]
        return x.permute(0, 5, 1, 3, 6, 2, 4, 7).reshape(len(frames), -1, gh * p, gw * p).float().contiguous()

    def apply_chat_template(self, messages, **kwargs):
        """The chat template rendered by the tokenizer (text with one `<|image_pad|>` per image)."""
        if self.chat_template is None:
            raise ValueError("the checkpoint has no chat template (chat_template.json or the tokenizer's)")
        return self.tokenizer.apply_chat_template(messages, chat_template=self.chat_template, **kwargs)

    def __call__(self, text: str, images=None, return_tensors: str = "pt"):
        out = {}
        if images:
            out = dict(self.image_processor(images, return_tensors=return_tensors))
            pieces = text.split(self.image_token)
            if len(pieces) - 1 != len(images):
                raise ValueError(f"the prompt has {len(pieces) - 1} image placeholder(s) but {len(images)} "
                                 "image(s) were given")
            merge = self.image_processor.merge_size ** 2
            counts = [int(g.prod()) // merge for g in out["image_grid_thw"]]
            text = pieces[0] + "".join(self.image_token * n + p for n, p in zip(counts, pieces[1:]))
        out.update(self.tokenizer(text, return_tensors=return_tensors))
        return out


def load_processor(path: str) -> QwenVLProcessor:
    """The checkpoint's tokenizer, PIL image processor (preprocessor_config.json as published:
    min / max pixels) and chat template, offline, without torchvision."""
    import transformers
    from transformers import AutoTokenizer

    # 5.x: the PIL class (its default class needs torchvision); 4.x: the default class is the PIL one
    image_cls = getattr(transformers, "Qwen2VLImageProcessorPil", None) or transformers.Qwen2VLImageProcessor
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    image_processor = image_cls.from_pretrained(path, local_files_only=True)
    template = chat_template(path, tok)
    video = video_settings(path)
    theirs = (video["patch_size"], video["temporal_patch_size"], video["merge_size"])
    mine = (image_processor.patch_size, image_processor.temporal_patch_size, image_processor.merge_size)
    if theirs != mine:
        raise ValueError(f"the video processor's patch, temporal patch and merge sizes {theirs} differ from the "
                         f"image processor's {mine}")
    return QwenVLProcessor(tok, image_processor, template, video)


FAMILY = register(Family(
    name="qwen2_5_vl", architectures=("Qwen2_5_VLForConditionalGeneration",), model_types=("qwen2_5_vl",),
    lm_config=lm_config, build_lm=LlamaLM, build_vision=build_vision, canonical_key=canonical_key,
    image_layout=image_layout, image_token_id=image_token_id, load_processor=load_processor,
    video_token_id=video_token_id))
