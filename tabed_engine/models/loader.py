"""Load a local HF checkpoint of a registered family (registry.py) into our modules.

The family named by config.json maps the config onto our decoder and vision modules and
the checkpoint's tensor names onto theirs (`Family.canonical_key`); this module does the rest,
the same for every family: the modules are built on the meta device and allocated empty on the
target device, every file's header is matched against them first (a bad file fails before any
weight moves: the tensor, the file and what was expected are named), then the files stream into
the parameters (safetensors_io.py), each tensor into its slice of ours (`qkv_proj.weight[q
rows]`, ...). The tokenizer and processor are read from the same directory, offline.
"""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Iterable, Optional

import torch
from torch import nn

from tabed_engine.models.decoder import LlamaLM
from tabed_engine.models.registry import Family, family_of
from tabed_engine.models.safetensors_io import FIX as _FIX
from tabed_engine.models.safetensors_io import read_json, stream_file, stream_plan, weight_files
from tabed_engine.models.vision import VisionEncoder


def read_config(path: str) -> dict:
    """config.json of a checkpoint directory as a dict, checked to name a supported family
    (ValueError naming the directory and the problem otherwise)."""
    cfg_file = os.path.join(path, "config.json")
    if not os.path.isdir(path):
        raise ValueError(f"checkpoint directory not found: {path!r}")
    try:
        os.listdir(path)
    except OSError as e:
        raise ValueError(f"cannot read checkpoint directory {path!r}: {e}; check its permissions") from e
    if not os.path.exists(cfg_file):
        raise ValueError(f"no config.json in checkpoint directory {path!r}")
    cfg = read_json(cfg_file)
    family_of(cfg, repr(path))
    return cfg


def image_layout(raw: dict) -> tuple:
    """What a checkpoint's image preprocessing depends on (its config as a dict), as its family
    says: the tower's input size and patch, LLaVA-NeXT's grid pinpoints, ... A draft with
    another layout than the target's needs its own processor (it then sees its own image
    tokens)."""
    return family_of(raw).image_layout(raw)


def vocab_size(raw: dict) -> int:
    """The language model's vocabulary (embedding rows) of a checkpoint's config dict."""
    return family_of(raw).lm_config(raw).vocab_size


def _auto_config(path: str):
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(path, local_files_only=True)
    except Exception as e:   # transformers raises many types for a config it cannot parse
        raise ValueError(f"transformers could not read the config of {path!r}: {e}") from e


# ---------------------------------------------------------------- key mapping

def split_keys(sd: dict[str, torch.Tensor], family: Optional[Family] = None):
    """Split checkpoint tensors into (lm, vision, projector) dicts with the family's canonical
    keys (default LLaVA's)."""
    canonical_key = (family or family_of({"model_type": "llava"})).canonical_key
    parts = {"lm": {}, "vision": {}, "proj": {}}
    for key, t in sd.items():
        ck = canonical_key(key)
        if ck is None:
            raise ValueError(f"unexpected tensor {key!r} in a LLaVA checkpoint")
        parts[ck[0]][ck[1]] = t
    return parts["lm"], parts["vision"], parts["proj"]


_FUSED = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
          "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}


def fuse_projections(lm_sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Concatenate each layer's q/k/v projections into `qkv_proj` and gate/up into
    `gate_up_proj` (the decoder's fused layout); other keys pass through. The loader writes
    the same layout slice by slice (`_targets`); this is its full-dict reference."""
    out = dict(lm_sd)
    layers = sorted({k.split(".")[1] for k in lm_sd if k.startswith("layers.")}, key=int)
    for i in layers:
        for fused, parts in _FUSED.items():
            for kind in ("weight", "bias"):
                keys = [f"layers.{i}.{p}.{kind}" for p in parts]
                present = [k in out for k in keys]
                if all(present):
                    out[f"layers.{i}.{fused}.{kind}"] = torch.cat([out.pop(k) for k in keys], dim=0)
                elif any(present):
                    raise ValueError(f"layer {i}: only some of {keys} are in the checkpoint")
    return out


def _targets(lm: "LlamaLM", vision: "VisionEncoder") -> dict[tuple[str, str], torch.Tensor]:
    """Canonical checkpoint key -> the tensor of our modules it fills: a whole parameter, or
    its rows in a fused one (q, k, v of `qkv_proj`; gate, up of `gate_up_proj`). Works on meta
    modules (shapes, for validation) and on allocated ones (the copy destinations)."""
    cfg = lm.cfg
    rows = {"self_attn.qkv_proj": (cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim,
                                   cfg.num_kv_heads * cfg.head_dim),
            "mlp.gate_up_proj": (cfg.intermediate_size, cfg.intermediate_size)}
    out = {}
    for name, t in lm.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue   # tied: the head is the embedding, as in transformers
        fused = next((f for f in _FUSED if f".{f}." in name), None)
        if fused is None:
            out["lm", name] = t
            continue
        pre, kind = name.split(f".{fused}.")
        start = 0
        for part, n in zip(_FUSED[fused], rows[fused]):
            out["lm", f"{pre}.{part}.{kind}"] = t[start:start + n]
            start += n
    for name, t in vision.checkpoint_targets().items():
        out["vision", name] = t
    for name, t in vision.projector.state_dict().items():
        out["proj", name] = t
    if vision.image_newline is not None:
        out["proj", "image_newline"] = vision.image_newline.data
    return out


def _match(sources: Iterable[tuple[str, tuple, str]], targets: dict, tied: bool, path: str,
           canonical_key) -> dict:
    """Map each source tensor (key, shape, file it is in) to its target key; raises ValueError
    naming the tensor and the file for unexpected, duplicated, wrong-shape and missing ones."""
    plan, seen = {}, {}
    for key, shape, file in sources:
        ck = canonical_key(key)
        if ck == ("lm", "lm_head.weight") and tied:
            plan[file, key] = None    # tie_word_embeddings: the head is the embedding; skip it
            continue
        if ck is None or ck not in targets:
            raise ValueError(f"unexpected tensor {key!r} in {file}: the model that {path}/config.json "
                             f"describes has no such weight; check that the weights and config.json "
                             f"belong to the same checkpoint")
        if ck in seen:
            raise ValueError(f"tensor {key!r} is in both {seen[ck]} and {file}; {_FIX}")
        seen[ck] = file
        want = tuple(targets[ck].shape)
        if tuple(shape) != want:
            raise ValueError(f"tensor {key!r} in {file} has shape {tuple(shape)}, {path}/config.json "
                             f"expects {want}; check that the weights and config.json belong together")
        plan[file, key] = ck
    missing = [k for k in targets if k not in seen]
    if ("lm", "lm_head.weight") in missing:
        raise ValueError(f"{path!r}: no lm_head weight and tie_word_embeddings is false")
    if missing:
        raise ValueError(f"the weights in {path!r} lack {len(missing)} tensors that config.json needs, "
                         f"e.g. {[f'{p}:{k}' for p, k in missing[:5]]}; {_FIX}")
    return plan


# ---------------------------------------------------------------- modules

@dataclass
class LoadedLVLM:
    """A loaded checkpoint: our decoder `lm`, its vision side, the image token, the config dict
    and the family that loaded it."""

    path: str
    lm: LlamaLM
    vision: VisionEncoder
    image_token_id: int
    config: dict
    vision_sd_hash: int  # equal towers can share the image encoding
    family: Optional[Family] = None

    @property
    def video_token_id(self) -> Optional[int]:
        """The video placeholder's token id (None: the family takes no videos)."""
        fn = None if self.family is None else self.family.video_token_id
        return None if fn is None else fn(self.config)


def _meta_modules(path: str, raw: dict, hf_config, family: Family):
    if family.image_token_id(raw) is None:
        raise ValueError(f"{path!r}: config has no image_token_index")
    lm_cfg = family.lm_config(raw)
    with torch.device("meta"):
        lm = family.build_lm(lm_cfg)
        vision = family.build_vision(hf_config, raw)
    return lm, vision


def _allocate(lm: LlamaLM, vision: VisionEncoder, device, dtype):
    lm = lm.to(dtype).to_empty(device=device)   # cast on meta: no float32 copy of a 7B
    if lm.cfg.tie_word_embeddings:
        lm.lm_head.weight = lm.embed_tokens.weight
    return lm, vision.to(dtype).to_empty(device=device)


def _finish(path: str, raw: dict, lm: LlamaLM, vision: VisionEncoder, family: Family) -> LoadedLVLM:
    vision.reset_buffers()
    lm.eval().requires_grad_(False)
    vision.eval().requires_grad_(False)
    return LoadedLVLM(path, lm, vision, family.image_token_id(raw), raw, tower_fingerprint(vision.tower), family)


def load_lvlm(path: str, device, dtype) -> LoadedLVLM:
    """Build our decoder and the vision modules of a local checkpoint's family, streaming its
    safetensors files into the allocated parameters (see the module docstring)."""
    device = torch.device(device)
    raw = read_config(path)
    family = family_of(raw, repr(path))
    hf_config = _auto_config(path)
    files = weight_files(path)
    lm, vision = _meta_modules(path, raw, hf_config, family)
    plan = _match(((e.name, e.shape, e.file) for entries in files for e in entries),
                  _targets(lm, vision), lm.cfg.tie_word_embeddings, path, family.canonical_key)
    lm, vision = _allocate(lm, vision, device, dtype)
    targets = _targets(lm, vision)
    how = stream_plan(device)
    with ThreadPoolExecutor(how.depth) as pool:
        for entries in files:
            dests = [None if plan[e.file, e.name] is None else targets[plan[e.file, e.name]] for e in entries]
            stream_file(entries, dests, device, how, pool)
    return _finish(path, raw, lm, vision, family)


RANDOM_STD = 0.02     # the spread of `random_lvlm`'s weights (a typical initializer range)


def random_lvlm(path: str, device, dtype, tp=None, seed: int = 0) -> LoadedLVLM:
    """Our modules for the checkpoint config at `path` with random weights, reading no weight
    file: a benchmark of a published shape without its checkpoint (`Engine.from_pretrained(...,
    random_weights=True)`), also a tensor-parallel rank's shard (`tp`: `shard.shard_lm`'s split;
    a 72B needs no 145 GB checkpoint on disk). Norm weights 1, every other parameter ~ N(0,
    RANDOM_STD) from a generator seeded by (seed, its name), and by the rank for a parameter the
    split shards, so every rank draws the same replicated weights; a vocabulary shard's rows
    past the vocabulary are zero, as `parallel.load.load_shard` leaves them."""
    import hashlib

    device = torch.device(device)
    raw = read_config(path)
    family = family_of(raw, repr(path))
    lm, vision = _meta_modules(path, raw, _auto_config(path), family)
    whole = {name: tuple(p.shape) for name, p in lm.named_parameters()}
    if tp is not None:
        from tabed_engine.parallel.shard import shard_lm

        shard_lm(lm, tp)
    lm, vision = _allocate(lm, vision, device, dtype)
    with torch.no_grad():
        for part, module in (("lm", lm), ("vision", vision)):
            norms = {id(m.weight) for m in module.modules()
                     if "norm" in type(m).__name__.lower() and isinstance(getattr(m, "weight", None), torch.Tensor)}
            for name, p in module.named_parameters():
                if id(p) in norms:
                    p.fill_(1.0)
                    continue
                shard = f"/rank{tp.rank}" if part == "lm" and tuple(p.shape) != whole[name] else ""
                key = hashlib.sha256(f"{seed}/{part}.{name}{shard}".encode()).digest()
                g = torch.Generator(device=device).manual_seed(int.from_bytes(key[:7], "little"))
                p.normal_(0.0, RANDOM_STD, generator=g)
        for mod in (lm.embed_tokens, lm.lm_head):
            cuts = getattr(mod, "cuts", None)
            if tp is not None and cuts is not None and cuts[0].dim == 0:     # the last shard's padding rows
                for t in (mod.weight, getattr(mod, "bias", None)):
                    if t is not None:
                        t[cuts[0].size:].zero_()
    return _finish(path, raw, lm, vision, family)


def lvlm_from_hf(model, device=None, dtype=None) -> LoadedLVLM:
    """Wrap an in-memory transformers model of a registered family (e.g. random weights built
    on the GPU for a benchmark) through the same key mapping as checkpoints. Shares no storage:
    weights are copied (and converted when device/dtype differ)."""
    p = next(model.parameters())
    device = torch.device(device or p.device)
    dtype = dtype or p.dtype
    raw = model.config.to_dict()
    raw["architectures"] = raw.get("architectures") or [type(model).__name__]
    family = family_of(raw, "the in-memory model")
    sd = model.state_dict()
    lm, vision = _meta_modules("<in-memory>", raw, model.config, family)
    plan = _match(((k, t.shape, "<in-memory>") for k, t in sd.items()), _targets(lm, vision),
                  lm.cfg.tie_word_embeddings, "<in-memory>", family.canonical_key)
    lm, vision = _allocate(lm, vision, device, dtype)
    targets = _targets(lm, vision)
    with torch.no_grad():
        for k, t in sd.items():
            if plan["<in-memory>", k] is not None:
                targets[plan["<in-memory>", k]].copy_(t)
    return _finish("<in-memory>", raw, lm, vision, family)


def lvlm_from_config(config, device, dtype, fill) -> LoadedLVLM:
    """Our modules for a transformers config object of a registered family (its `architectures`
    set), allocated on `device` in `dtype` and filled by `fill(module)` (called once for the
    decoder, once for the vision side), with no transformers model and no checkpoint: what a
    benchmark of random weights at a shape too large for two copies on one GPU needs. The tower
    fingerprint is taken after `fill`."""
    raw = config.to_dict()
    family = family_of(raw, "the in-memory config")
    lm, vision = _meta_modules("<in-memory>", raw, config, family)
    lm, vision = _allocate(lm, vision, torch.device(device), dtype)
    with torch.no_grad():
        fill(lm)
        fill(vision)
    return _finish("<in-memory>", raw, lm, vision, family)


_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@torch.no_grad()
def tower_fingerprint(tower: nn.Module) -> int:
    """Exact fingerprint of a vision tower's loaded weights, computed where they live: per
    tensor the wrapping int64 sums of its bit patterns, plain and position-weighted (so a
    permutation changes it); one host sync. Equal towers (same weights, same dtype) get
    equal fingerprints, so draft and target can share one image encoding."""
    sums, names = [], []
    for name, t in sorted(tower.state_dict().items()):
        x = t.detach().reshape(-1).view(_INT_OF_SIZE[t.element_size()]).long()
        w = torch.arange(1, x.numel() + 1, device=x.device)
        sums.append(torch.stack([x.sum(), (x * w).sum()]))
        names.append((name, tuple(t.shape), str(t.dtype)))
    vals = torch.stack(sums).tolist() if sums else []
    return hash(tuple(zip(names, map(tuple, vals))))


def _init_buffers(tower: nn.Module):
    """Non-persistent buffers (CLIP's position_ids) are not in checkpoints: rebuild them."""
    for name, buf in tower.named_buffers():
        if name.endswith("position_ids"):
            buf.copy_(torch.arange(buf.shape[-1], device=buf.device).expand_as(buf))


def load_processor(path: str):
    """The checkpoint's processor (tokenizer + image processor), offline."""
    from transformers import AutoProcessor

    family = family_of(read_config(path), repr(path))
    try:
        if family.load_processor is not None:
            return family.load_processor(path)
        return AutoProcessor.from_pretrained(path, local_files_only=True)
    except Exception as e:   # tokenizers/transformers raise many types for unreadable files
        raise ValueError(f"could not load the tokenizer/processor from {path!r}: {e}; check that "
                         f"the checkpoint directory holds its tokenizer and processor files") from e


def chat_template(path: str, tokenizer) -> Optional[str]:
    """The checkpoint's chat template: chat_template.jinja or chat_template.json where it ships
    one (processors published for newer transformers keep it there), else the tokenizer's."""
    for name in ("chat_template.jinja", "chat_template.json"):
        file = os.path.join(path, name)
        if os.path.isfile(file):
            if name.endswith(".jinja"):
                with open(file, encoding="utf-8") as f:
                    return f.read()
            return read_json(file).get("chat_template")
    return getattr(tokenizer, "chat_template", None)
