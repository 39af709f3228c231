"""Load a local HF LLaVA checkpoint (`LlavaForConditionalGeneration`, or LLaVA-NeXT's
`LlavaNextForConditionalGeneration`) into our modules.

Accepts single-file and sharded safetensors, both key layouts (the transformers-4.x
published one: `language_model.model.*`, `language_model.lm_head.*`,
`vision_tower.vision_model.*`, `multi_modal_projector.*`, LLaVA-NeXT's `image_newline`; and
today's `model.language_model.*`, `lm_head.*`, `model.vision_tower.*`, `model.image_newline`,
...), and reads the tokenizer/processor from the same directory without network access.

Loading streams: the modules are built on the meta device and allocated empty on the target
device, every file's header is read and matched against them first (a bad file fails before
any weight moves), then each shard is read in fixed-size chunks and every checkpoint tensor's
bytes go straight into its slice of our parameter (`qkv_proj.weight[q rows]`, ...), converted
on the device when the dtypes differ. Host memory holds a few chunks, never the state dict.
"""
from __future__ import annotations

import json
import math
import os
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Iterable, Optional

import torch
from torch import nn

from .config import LMConfig
from .model import LlamaLM
from .vision import VisionEncoder

_WEIGHTS = "model.safetensors"
_INDEX = "model.safetensors.index.json"
_FIX = "re-download the checkpoint or write it again with save_pretrained"
ARCHITECTURES = {"llava": "LlavaForConditionalGeneration", "llava_next": "LlavaNextForConditionalGeneration"}


def read_config(path: str) -> dict:
    cfg_file = os.path.join(path, "config.json")
    if not os.path.isdir(path):
        raise ValueError(f"checkpoint directory not found: {path!r}")
    try:
        os.listdir(path)
    except OSError as e:
        raise ValueError(f"cannot read checkpoint directory {path!r}: {e}; check its permissions") from e
    if not os.path.exists(cfg_file):
        raise ValueError(f"no config.json in checkpoint directory {path!r}")
    cfg = _read_json(cfg_file)
    archs = cfg.get("architectures") or []
    if cfg.get("model_type") not in ARCHITECTURES and not set(archs) & set(ARCHITECTURES.values()):
        raise ValueError(f"unsupported architecture in {path!r}: model_type={cfg.get('model_type')!r}, "
                         f"architectures={archs}; expected a LlavaForConditionalGeneration or "
                         "LlavaNextForConditionalGeneration checkpoint")
    return cfg


def image_layout(raw: dict) -> tuple:
    """What a checkpoint's image preprocessing depends on (its config as a dict): the tower's
    input size and patch, and LLaVA-NeXT's grid pinpoints. A draft with another layout than the
    target's needs its own processor (the draft then sees its own image tokens)."""
    vc = raw.get("vision_config") or {}
    pins = raw.get("image_grid_pinpoints") if raw.get("model_type") == "llava_next" or \
        "LlavaNextForConditionalGeneration" in (raw.get("architectures") or []) else None
    return (vc.get("image_size", 336), vc.get("patch_size", 14),
            None if pins is None else tuple(tuple(p) for p in pins))


def _read_json(file: str) -> dict:
    try:
        with open(file, encoding="utf-8") as f:
            out = json.load(f)
    except OSError as e:
        raise ValueError(f"cannot read {file}: {e}; check that it exists and is readable") from e
    except ValueError as e:   # JSONDecodeError, UnicodeDecodeError
        raise ValueError(f"{file} is not valid JSON ({e}); {_FIX}") from e
    if not isinstance(out, dict):
        raise ValueError(f"{file} holds a JSON {type(out).__name__}, expected an object; {_FIX}")
    return out


def _auto_config(path: str):
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(path, local_files_only=True)
    except Exception as e:   # transformers raises many types for a config it cannot parse
        raise ValueError(f"transformers could not read the config of {path!r}: {e}") from e


# ---------------------------------------------------------------- safetensors files

_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
           "U8": torch.uint8, "BOOL": torch.bool}
_DTYPES.update({k: getattr(torch, v) for k, v in (("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2"))
                if hasattr(torch, v)})


@dataclass(frozen=True)
class TensorEntry:
    """One tensor a safetensors file declares; begin/end are absolute byte offsets in the file."""

    file: str
    name: str
    dtype: torch.dtype
    shape: tuple
    begin: int
    end: int


def read_header(file: str) -> list[TensorEntry]:
    """The tensors of one safetensors file, in file order, checked against the file's size
    (a truncated or empty file fails here, before any data is read)."""
    try:
        size = os.path.getsize(file)
        with open(file, "rb") as f:
            head = f.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else -1
            if n < 2 or n > min(size - 8, 1 << 28):
                raise ValueError(f"{file} is {'empty' if size == 0 else 'truncated or not a safetensors file'} "
                                 f"({size} bytes); {_FIX}")
            raw = f.read(n)
    except OSError as e:
        raise ValueError(f"cannot read checkpoint file {file}: {e}; check that it exists and is readable") from e
    try:
        header = json.loads(raw)
        entries = []
        for name, info in header.items():
            if name == "__metadata__":
                continue
            dtype = _DTYPES.get(info["dtype"])
            if dtype is None:
                raise ValueError(f"tensor {name!r} has unsupported dtype {info['dtype']!r}")
            shape = tuple(int(s) for s in info["shape"])
            b, e = (int(x) for x in info["data_offsets"])
            if b < 0 or e - b != math.prod(shape) * dtype.itemsize:
                raise ValueError(f"tensor {name!r}: data_offsets {[b, e]} do not fit shape {shape} {info['dtype']}")
            if 8 + n + e > size:
                raise ValueError(f"truncated: tensor {name!r} ends at byte {8 + n + e}, the file has {size}")
            entries.append(TensorEntry(file, name, dtype, shape, 8 + n + b, 8 + n + e))
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{file} is damaged ({e}); {_FIX}") from e
    return sorted(entries, key=lambda t: t.begin)


def weight_files(path: str) -> list[list[TensorEntry]]:
    """The headers of the checkpoint's safetensors files (one list per file), validated:
    every shard an index lists exists and holds the tensors the index places in it."""
    single, index = os.path.join(path, _WEIGHTS), os.path.join(path, _INDEX)
    if os.path.isfile(single):
        return [read_header(single)]
    if not os.path.isfile(index):
        raise ValueError(f"no {_WEIGHTS} or {_INDEX} in {path!r} (only safetensors checkpoints load)")
    weight_map = _read_json(index).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map or \
            not all(isinstance(v, str) for v in weight_map.values()):
        raise ValueError(f"{index} has no weight_map of tensor names to file names; {_FIX}")
    out = []
    for shard in sorted(set(weight_map.values())):
        file = os.path.join(path, shard)
        if not os.path.isfile(file):
            raise ValueError(f"checkpoint shard {file} listed in {index} is missing; {_FIX}")
        entries = read_header(file)
        held = {e.name for e in entries}
        absent = [k for k, v in weight_map.items() if v == shard and k not in held]
        if absent:
            raise ValueError(f"{index} places tensor {absent[0]!r} in {file}, which does not hold it "
                             f"({len(absent)} such tensors); {_FIX}")
        out.append(entries)
    return out


def read_state_dict(path: str) -> dict[str, torch.Tensor]:
    """All tensors of a (possibly sharded) safetensors checkpoint, on the CPU, through
    safetensors' own reader. Not on the engine's path (that streams); kept for tools/tests."""
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for entries in weight_files(path):   # validates every file first
        out.update(load_file(entries[0].file) if entries else {})
    return out


# ---------------------------------------------------------------- key mapping

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


def split_keys(sd: dict[str, torch.Tensor]):
    """Split checkpoint tensors into (lm, vision, projector) dicts with `canonical_key`'s keys."""
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


def _match(sources: Iterable[tuple[str, tuple, str]], targets: dict, tied: bool, path: str) -> dict:
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
                             f"belong to the same LLaVA checkpoint")
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


# ---------------------------------------------------------------- streaming copies

@dataclass(frozen=True)
class StreamPlan:
    """How a file is streamed: `depth` host buffers of `chunk_bytes` each, filled by `depth`
    reader threads ahead of the copies. Pinned on CUDA so host-to-device copies run async.
    direct: host destinations of the file's own dtype are read into straight, no buffer."""

    chunk_bytes: int
    depth: int
    pinned: bool
    direct: bool = False


def stream_plan(device: torch.device, cpus: Optional[int] = None) -> StreamPlan:
    """CUDA: up to 8 readers x 32 MiB pinned (256 MiB, kept by torch's pinned-memory cache):
    one thread copies from the page cache at a few GB/s, a PCIe 5 DMA takes ~50, so the reads
    run in parallel. CPU: 2 x 8 MiB."""
    if device.type == "cuda":
        return StreamPlan(32 << 20, max(2, min(8, (cpus or os.cpu_count() or 2) // 2)), True)
    return StreamPlan(8 << 20, 2, False, direct=True)


def _pread_into(fd: int, buf: memoryview, offset: int, file: str):
    got = 0
    while got < len(buf):
        if hasattr(os, "preadv"):
            n = os.preadv(fd, [buf[got:]], offset + got)
        else:   # no preadv (Windows): a private handle per read, seek + readinto
            with open(file, "rb", buffering=0) as f:
                f.seek(offset + got)
                n = f.readinto(buf[got:]) or 0
        if n <= 0:
            raise ValueError(f"{file} ended at byte {offset + got} while reading its tensors "
                             f"(truncated while loading?); {_FIX}")
        got += n


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """The tensor's own bytes as a flat uint8 view (writes land in `t`)."""
    if not t.is_contiguous():
        raise RuntimeError("loader destinations are contiguous rows of a parameter")
    return t.detach().reshape(-1).view(torch.uint8)


@torch.no_grad()
def stream_file(entries: list[TensorEntry], dests: list[Optional[torch.Tensor]], device: torch.device,
                plan: StreamPlan, pool: Optional[ThreadPoolExecutor] = None):
    """Copy each entry's bytes from its file into `dests[i]` (None: skip), converting dtype on
    the device; the file is read once, in `plan.chunk_bytes` pieces, up to `plan.depth` ahead
    (by `pool`'s threads, one made for the call when None)."""
    if pool is None:
        with ThreadPoolExecutor(plan.depth) as own:
            return stream_file(entries, dests, device, plan, own)
    work = [(e, d) for e, d in zip(entries, dests) if d is not None and e.end > e.begin]
    if plan.direct:
        straight = [(e, d) for e, d in work if d.device.type == "cpu" and d.dtype == e.dtype]
        if straight:
            fd = os.open(straight[0][0].file, os.O_RDONLY)
            try:
                for e, d in straight:
                    _pread_into(fd, memoryview(_bytes(d).numpy()), e.begin, e.file)
            finally:
                os.close(fd)
            work = [(e, d) for e, d in work if not (d.device.type == "cpu" and d.dtype == e.dtype)]
    if not work:
        return
    file = work[0][0].file
    lo, hi = work[0][0].begin, max(e.end for e, _ in work)   # entries in file order (read_header)
    nchunks = -(-(hi - lo) // plan.chunk_bytes)
    slots = [torch.empty(min(plan.chunk_bytes, hi - lo), dtype=torch.uint8, pin_memory=plan.pinned)
             for _ in range(min(plan.depth, nchunks))]
    done: list = [None] * len(slots)   # CUDA event after the copies out of each slot
    stream = torch.cuda.current_stream(device) if device.type == "cuda" else None

    def read(i: int):
        s = i % len(slots)
        if done[s] is not None:
            done[s].synchronize()
        off = lo + i * plan.chunk_bytes
        n = min(plan.chunk_bytes, hi - off)
        _pread_into(fd, memoryview(slots[s].numpy())[:n], off, file)
        return s, off, n

    fd = os.open(file, os.O_RDONLY)
    ahead = deque()
    try:
        ahead.extend(pool.submit(read, i) for i in range(len(slots)))
        first, staged = 0, {}   # first entry not fully copied; entry -> its device bytes
        for i in range(nchunks):
            s, off, n = ahead.popleft().result()
            end = off + n
            k = first
            while k < len(work) and work[k][0].begin < end:
                e, dest = work[k]
                a, b = max(e.begin, off), min(e.end, end)
                if a < b:
                    if k not in staged:   # same dtype: straight into the parameter's bytes
                        staged[k] = _bytes(dest) if e.dtype == dest.dtype else \
                            torch.empty(e.end - e.begin, dtype=torch.uint8, device=device)
                    staged[k][a - e.begin:b - e.begin].copy_(slots[s][a - off:b - off], non_blocking=True)
                    if b == e.end:
                        buf = staged.pop(k)
                        if e.dtype != dest.dtype:
                            dest.copy_(buf.view(e.dtype).view(e.shape))
                k += 1
            while first < len(work) and work[first][0].end <= end:
                first += 1
            if stream is not None:
                done[s] = torch.cuda.Event()
                done[s].record(stream)
            if i + len(slots) < nchunks:
                ahead.append(pool.submit(read, i + len(slots)))
    finally:
        for f in ahead:   # no reader may touch the fd or a slot after this returns
            f.cancel() or f.exception()
        os.close(fd)


# ---------------------------------------------------------------- modules

@dataclass
class LoadedLVLM:
    path: str
    lm: LlamaLM
    vision: VisionEncoder
    image_token_id: int
    config: dict
    vision_sd_hash: int  # equal towers can share the image encoding


def _meta_modules(path: str, raw: dict, hf_config):
    if raw.get("image_token_index", raw.get("image_token_id")) is None:
        raise ValueError(f"{path!r}: config has no image_token_index")
    tc = raw.get("text_config") or {}
    lm_cfg = LMConfig.from_text_config({"model_type": "llama", **tc}, raw)
    with torch.device("meta"):
        lm = LlamaLM(lm_cfg)
        vision = VisionEncoder(hf_config, raw.get("vision_feature_layer", -2),
                               raw.get("vision_feature_select_strategy", "default"))
    return lm, vision


def _allocate(lm: LlamaLM, vision: VisionEncoder, device, dtype):
    lm = lm.to(dtype).to_empty(device=device)   # cast on meta: no float32 copy of a 7B
    if lm.cfg.tie_word_embeddings:
        lm.lm_head.weight = lm.embed_tokens.weight
    return lm, vision.to(dtype).to_empty(device=device)


def _finish(path: str, raw: dict, lm: LlamaLM, vision: VisionEncoder) -> LoadedLVLM:
    _init_buffers(vision.tower)
    lm.eval().requires_grad_(False)
    vision.eval().requires_grad_(False)
    image_token = raw.get("image_token_index", raw.get("image_token_id"))
    return LoadedLVLM(path, lm, vision, int(image_token), raw, tower_fingerprint(vision.tower))


def load_lvlm(path: str, device, dtype) -> LoadedLVLM:
    """Build our decoder and the HF vision modules from a local LLaVA checkpoint, streaming
    its safetensors files into the allocated parameters (see the module docstring)."""
    device = torch.device(device)
    raw = read_config(path)
    hf_config = _auto_config(path)
    files = weight_files(path)
    lm, vision = _meta_modules(path, raw, hf_config)
    plan = _match(((e.name, e.shape, e.file) for entries in files for e in entries),
                  _targets(lm, vision), lm.cfg.tie_word_embeddings, path)
    lm, vision = _allocate(lm, vision, device, dtype)
    targets = _targets(lm, vision)
    how = stream_plan(device)
    with ThreadPoolExecutor(how.depth) as pool:
        for entries in files:
            dests = [None if plan[e.file, e.name] is None else targets[plan[e.file, e.name]] for e in entries]
            stream_file(entries, dests, device, how, pool)
    return _finish(path, raw, lm, vision)


def lvlm_from_hf(model, device=None, dtype=None) -> LoadedLVLM:
    """Wrap an in-memory `LlavaForConditionalGeneration` or `LlavaNextForConditionalGeneration`
    (e.g. random weights built on the GPU
    for a benchmark) through the same key mapping as checkpoints. Shares no storage: weights
    are copied (and converted when device/dtype differ)."""
    p = next(model.parameters())
    device = torch.device(device or p.device)
    dtype = dtype or p.dtype
    raw = model.config.to_dict()
    raw["architectures"] = raw.get("architectures") or [ARCHITECTURES.get(raw.get("model_type"), "LlavaForConditionalGeneration")]
    sd = model.state_dict()
    lm, vision = _meta_modules("<in-memory>", raw, model.config)
    plan = _match(((k, t.shape, "<in-memory>") for k, t in sd.items()), _targets(lm, vision),
                  lm.cfg.tie_word_embeddings, "<in-memory>")
    lm, vision = _allocate(lm, vision, device, dtype)
    targets = _targets(lm, vision)
    with torch.no_grad():
        for k, t in sd.items():
            if plan["<in-memory>", k] is not None:
                targets[plan["<in-memory>", k]].copy_(t)
    return _finish("<in-memory>", raw, lm, vision)


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

    try:
        return AutoProcessor.from_pretrained(path, local_files_only=True)
    except Exception as e:   # tokenizers/transformers raise many types for unreadable files
        raise ValueError(f"could not load the tokenizer/processor from {path!r}: {e}; check that "
                         f"the checkpoint directory holds its tokenizer and processor files") from e
