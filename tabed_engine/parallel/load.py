"""Loading one rank's shard of a target checkpoint straight from its safetensors files.

The checkpoint is matched against the full model first (a bad file fails as it does for one
GPU), then the decoder is sharded on the meta device (`shard.shard_lm`) and only the rank's
slices are allocated and streamed in: a rank reads its rows of a column-parallel or
vocabulary tensor as one byte range of the file, and a row-parallel tensor (whose kept
columns are strided in the file) whole into a temporary buffer, one tensor at a time, before
keeping its columns. So no rank ever holds the whole model, and a checkpoint that fits only
on N GPUs loads on N. The vision tower and projector load whole on every rank.
"""
from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Optional

import torch

from tabed_engine.models.loader import (_FUSED, LoadedLVLM, _allocate, _auto_config, _finish, _match,
                                        _meta_modules, _targets, read_config)
from tabed_engine.models.registry import family_of
from tabed_engine.models.safetensors_io import TensorEntry, stream_file, stream_plan, weight_files
from tabed_engine.parallel.comm import TPGroup
from tabed_engine.parallel.shard import Cut, RowParallelLinear, VocabParallelEmbedding, VocabParallelHead, shard_lm


def source_cut(lm, key: str) -> Optional[Cut]:
    """The slice of checkpoint tensor `key` (canonical decoder key, e.g.
    `layers.0.self_attn.k_proj.weight`) the sharded decoder `lm` keeps; None: all of it."""
    part, kind = key.rsplit(".", 1)
    for fused, names in _FUSED.items():
        for i, name in enumerate(names):
            if part == name or part.endswith("." + name):
                return lm.get_submodule(part[: len(part) - len(name)] + fused).cuts[i]
    try:
        mod = lm.get_submodule(part)
    except AttributeError:
        return None
    cuts = getattr(mod, "cuts", None)
    if cuts is None or (isinstance(mod, RowParallelLinear) and kind == "bias"):
        return None          # replicated (norms), or a row-parallel bias (added once after the sum)
    return cuts[0]


def rows_entry(e: TensorEntry, cut: Cut) -> TensorEntry:
    """Entry `e` narrowed to rows [start, start + size) of its first dim: one byte range."""
    row = math.prod(e.shape[1:]) * e.dtype.itemsize
    begin = e.begin + cut.start * row
    return replace(e, shape=(cut.size,) + tuple(e.shape[1:]), begin=begin, end=begin + cut.size * row)


@torch.no_grad()
def load_shard(path: str, device, dtype, tp: TPGroup) -> LoadedLVLM:
    """Rank `tp.rank`'s shard of the target checkpoint at `path` (see the module docstring),
    as a `LoadedLVLM` whose decoder is sharded (`shard.shard_lm`) and vision side whole."""
    device = torch.device(device)
    raw = read_config(path)
    family = family_of(raw, repr(path))
    files = weight_files(path)
    lm, vision = _meta_modules(path, raw, _auto_config(path), family)
    plan = _match(((e.name, e.shape, e.file) for entries in files for e in entries),
                  _targets(lm, vision), lm.cfg.tie_word_embeddings, path, family.canonical_key)
    shard_lm(lm, tp)
    lm, vision = _allocate(lm, vision, device, dtype)
    for mod in (lm.embed_tokens, lm.lm_head):    # the last shard's padding rows
        if isinstance(mod, (VocabParallelEmbedding, VocabParallelHead)):
            mod.weight.zero_()
            if getattr(mod, "bias", None) is not None:
                mod.bias.zero_()
    targets = _targets(lm, vision)
    how = stream_plan(device)
    with ThreadPoolExecutor(how.depth) as pool:
        for entries in files:
            ranges, strided = [], []
            for e in entries:
                ck = plan[e.file, e.name]
                if ck is None:
                    continue
                dest = targets[ck]
                cut = source_cut(lm, ck[1]) if ck[0] == "lm" else None
                if cut is None:
                    ranges.append((e, dest))
                elif cut.dim == 0:
                    if cut.size:            # (a vocabulary shard past V holds only padding)
                        ranges.append((rows_entry(e, cut), dest[:cut.size]))
                else:
                    strided.append((e, dest, cut))
            stream_file([e for e, _ in ranges], [d for _, d in ranges], device, how, pool)
            for e, dest, cut in strided:
                full = torch.empty(e.shape, dtype=dest.dtype, device=device)
                stream_file([e], [full], device, how, pool)
                dest.copy_(cut.take(full))
                del full
    return _finish(path, raw, lm, vision, family)
