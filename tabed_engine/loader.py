"""Load a local HF LLaVA checkpoint (`LlavaForConditionalGeneration`) into our modules.

Accepts single-file and sharded safetensors, both key layouts (the transformers-4.x
published one: `language_model.model.*`, `language_model.lm_head.*`,
`vision_tower.vision_model.*`, `multi_modal_projector.*`; and today's
`model.language_model.*`, `lm_head.*`, `model.vision_tower.*`, ...), and reads the
tokenizer/processor from the same directory without network access.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from .config import LMConfig
from .model import LlamaLM

_WEIGHTS = "model.safetensors"
_INDEX = "model.safetensors.index.json"


def read_config(path: str) -> dict:
    cfg_file = os.path.join(path, "config.json")
    if not os.path.isdir(path):
        raise ValueError(f"checkpoint directory not found: {path!r}")
    if not os.path.isfile(cfg_file):
        raise ValueError(f"no config.json in checkpoint directory {path!r}")
    with open(cfg_file) as f:
        cfg = json.load(f)
    archs = cfg.get("architectures") or []
    if cfg.get("model_type") != "llava" and "LlavaForConditionalGeneration" not in archs:
        raise ValueError(f"unsupported architecture in {path!r}: model_type={cfg.get('model_type')!r}, "
                         f"architectures={archs}; expected a LlavaForConditionalGeneration checkpoint")
    return cfg


def read_state_dict(path: str) -> dict[str, torch.Tensor]:
    """All tensors of a (possibly sharded) safetensors checkpoint, on the CPU."""
    from safetensors.torch import load_file

    single, index = os.path.join(path, _WEIGHTS), os.path.join(path, _INDEX)
    if os.path.isfile(single):
        return load_file(single)
    if os.path.isfile(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        out: dict[str, torch.Tensor] = {}
        for shard in shards:
            shard_path = os.path.join(path, shard)
            if not os.path.isfile(shard_path):
                raise ValueError(f"missing checkpoint shard {shard!r} listed in {index}")
            out.update(load_file(shard_path))
        return out
    raise ValueError(f"no {_WEIGHTS} or {_INDEX} in {path!r} (only safetensors checkpoints load)")


def split_keys(sd: dict[str, torch.Tensor]):
    """Split checkpoint tensors into (lm, vision, projector) dicts with canonical keys:
    lm keys as in `LlamaLM` (`layers.0.self_attn.q_proj.weight`, `lm_head.weight`, ...),
    vision keys without any `vision_model.` prefix, projector keys `linear_1.weight`, ..."""
    lm, vision, proj = {}, {}, {}
    for key, t in sd.items():
        k = key[len("model."):] if key.startswith("model.") and not key.startswith("model.layers") else key
        if k.startswith("language_model."):
            k = k[len("language_model."):]
            if k.startswith("lm_head."):
                lm[k] = t
            else:
                lm[k[len("model."):] if k.startswith("model.") else k] = t
        elif k.startswith("lm_head."):
            lm[k] = t
        elif k.startswith("vision_tower."):
            k = k[len("vision_tower."):]
            vision[k[len("vision_model."):] if k.startswith("vision_model.") else k] = t
        elif k.startswith("multi_modal_projector."):
            proj[k[len("multi_modal_projector."):]] = t
        else:
            raise ValueError(f"unexpected tensor {key!r} in a LLaVA checkpoint")
    return lm, vision, proj


def _load_strict(module: nn.Module, sd: dict[str, torch.Tensor], what: str, strip: str = ""):
    """load_state_dict with keys compared after removing `strip` from the module's keys."""
    own = module.state_dict()
    rename = {k[len(strip):] if strip and k.startswith(strip) else k: k for k in own}
    missing = [k for k in rename if k not in sd]
    unexpected = [k for k in sd if k not in rename]
    if missing or unexpected:
        raise ValueError(f"{what} weights do not match the config: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}")
    for k, t in sd.items():
        if tuple(own[rename[k]].shape) != tuple(t.shape):
            raise ValueError(f"{what} tensor {k!r} has shape {tuple(t.shape)}, "
                             f"config expects {tuple(own[rename[k]].shape)}")
    module.load_state_dict({rename[k]: t for k, t in sd.items()}, strict=True)


class VisionEncoder(nn.Module):
    """The checkpoint's vision tower + projector (transformers modules; run once per image)."""

    def __init__(self, hf_config, feature_layer, strategy: str):
        super().__init__()
        from transformers import AutoModel
        from transformers.models.llava.modeling_llava import LlavaMultiModalProjector

        if strategy not in ("default", "full"):
            raise ValueError(f"unsupported vision_feature_select_strategy {strategy!r}")
        self.tower = AutoModel.from_config(hf_config.vision_config)
        self.projector = LlavaMultiModalProjector(hf_config)
        self.feature_layer = feature_layer
        self.strategy = strategy

    @torch.no_grad()
    def select(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """Tower features before the projector [n, tokens_per_image, vision_hidden]."""
        out = self.tower(pixel_values.to(self.projector.linear_1.weight.dtype), output_hidden_states=True)
        layers = [self.feature_layer] if isinstance(self.feature_layer, int) else list(self.feature_layer)
        feats = [out.hidden_states[i] for i in layers]
        if self.strategy == "default":
            feats = [f[:, 1:] for f in feats]
        return torch.cat(feats, dim=-1)

    @torch.no_grad()
    def project(self, feats: torch.Tensor) -> torch.Tensor:
        return self.projector(feats)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """pixel_values [n, 3, H, W] -> projected features [n, tokens_per_image, lm_hidden]."""
        return self.project(self.select(pixel_values))


@dataclass
class LoadedLVLM:
    path: str
    lm: LlamaLM
    vision: VisionEncoder
    image_token_id: int
    config: dict
    vision_sd_hash: int  # equal towers can share the image encoding


def load_lvlm(path: str, device, dtype) -> LoadedLVLM:
    """Build our decoder and the HF vision modules from a local LLaVA checkpoint."""
    from transformers import AutoConfig

    raw = read_config(path)
    hf_config = AutoConfig.from_pretrained(path, local_files_only=True)
    return _build(path, raw, hf_config, read_state_dict(path), device, dtype)


def lvlm_from_hf(model, device=None, dtype=None) -> LoadedLVLM:
    """Wrap an in-memory `LlavaForConditionalGeneration` (e.g. random weights built on the GPU
    for a benchmark) through the same key mapping as checkpoints. Shares no storage
    guarantees: weights are copied when device/dtype differ."""
    p = next(model.parameters())
    device = device or p.device
    dtype = dtype or p.dtype
    raw = model.config.to_dict()
    raw.setdefault("architectures", ["LlavaForConditionalGeneration"])
    return _build("<in-memory>", raw, model.config, dict(model.state_dict()), device, dtype)


def fuse_projections(lm_sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Concatenate each layer's q/k/v projections into `qkv_proj` and gate/up into
    `gate_up_proj` (the decoder's fused layout); other keys pass through."""
    out = dict(lm_sd)
    groups = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
              "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}
    layers = sorted({k.split(".")[1] for k in lm_sd if k.startswith("layers.")}, key=int)
    for i in layers:
        for fused, parts in groups.items():
            for kind in ("weight", "bias"):
                keys = [f"layers.{i}.{p}.{kind}" for p in parts]
                present = [k in out for k in keys]
                if all(present):
                    out[f"layers.{i}.{fused}.{kind}"] = torch.cat([out.pop(k) for k in keys], dim=0)
                elif any(present):
                    raise ValueError(f"layer {i}: only some of {keys} are in the checkpoint")
    return out


def _build(path, raw, hf_config, state_dict, device, dtype) -> LoadedLVLM:
    tc = raw.get("text_config") or {}
    lm_cfg = LMConfig.from_text_config({"model_type": "llama", **tc}, raw)
    lm_sd, vis_sd, proj_sd = split_keys(state_dict)
    lm_sd = fuse_projections(lm_sd)
    if "lm_head.weight" not in lm_sd:
        if not lm_cfg.tie_word_embeddings:
            raise ValueError(f"{path!r}: no lm_head weight and tie_word_embeddings is false")
    elif lm_cfg.tie_word_embeddings:
        del lm_sd["lm_head.weight"]  # tied: the head is the embedding, as in transformers
    with torch.device("meta"):
        lm = LlamaLM(lm_cfg)
    lm = lm.to(dtype).to_empty(device=device)   # cast on meta: no float32 copy of a 7B
    if lm_cfg.tie_word_embeddings:
        lm.lm_head.weight = lm.embed_tokens.weight
        own = {k: v for k, v in lm.state_dict().items() if k != "lm_head.weight"}
        missing = [k for k in own if k not in lm_sd]
        if missing or set(lm_sd) - set(own):
            raise ValueError(f"language-model weights do not match the config: missing {missing[:5]}, "
                             f"unexpected {sorted(set(lm_sd) - set(own))[:5]}")
        lm.load_state_dict(lm_sd, strict=False)
    else:
        _load_strict(lm, lm_sd, "language-model")
    with torch.device("meta"):
        vision = VisionEncoder(hf_config, raw.get("vision_feature_layer", -2),
                               raw.get("vision_feature_select_strategy", "default"))
    vision = vision.to(dtype).to_empty(device=device)
    _load_strict(vision.tower, vis_sd, "vision-tower", strip="vision_model.")
    _load_strict(vision.projector, proj_sd, "projector")
    _init_buffers(vision.tower, hf_config)
    lm.eval().requires_grad_(False)
    vision.eval().requires_grad_(False)
    image_token = raw.get("image_token_index", raw.get("image_token_id"))
    if image_token is None:
        raise ValueError(f"{path!r}: config has no image_token_index")
    h = hash(tuple((k, tuple(t.shape), float(t.float().sum())) for k, t in sorted(vis_sd.items())))
    return LoadedLVLM(path, lm, vision, int(image_token), raw, h)


def _init_buffers(tower: nn.Module, hf_config):
    """Non-persistent buffers (CLIP's position_ids) are not in checkpoints: rebuild them."""
    for name, buf in tower.named_buffers():
        if name.endswith("position_ids"):
            buf.copy_(torch.arange(buf.shape[-1], device=buf.device).expand_as(buf))


def load_processor(path: str):
    """The checkpoint's processor (tokenizer + image processor), offline."""
    from transformers import AutoProcessor

    try:
        return AutoProcessor.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as e:
        raise ValueError(f"could not load the tokenizer/processor from {path!r}: {e}") from e
