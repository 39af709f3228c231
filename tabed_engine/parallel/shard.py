"""Sharding a target decoder over the tensor-parallel group, by the `Linear.parallel` marks.

* column-parallel (`qkv_proj`, `gate_up_proj`): each rank keeps a slice of the output rows of
  every fused part (q, k, v; gate, up), each part split on its own. q heads split evenly; KV
  heads split when the degree divides them, else (the degree a multiple of them) each rank
  keeps the one KV head its q heads read (replicated). MLP parts split as evenly as they go
  (an odd intermediate size gives ranks one row more or less).
* row-parallel (`o_proj`, `down_proj`): each rank keeps the matching input columns; the
  partial outputs are summed (`comm.all_reduce`), the bias added once after the sum.
* the vocabulary (`embed_tokens`, `lm_head`): ceil(V / N) rows a rank, the last shard padded
  with zero rows; an embedding looks up only its rows (zeros elsewhere) and the sums give
  every rank the full vectors; the head's logits are gathered in rank order and the padding
  cut, so every rank holds the same [.., V] logits and picks the same token.

`shard_lm` works on a loaded decoder (it slices the weights) and on one still on the meta
device (the loader then streams each rank's slices in: parallel/load.py). Every sharded
module records the source ranges it keeps (`cuts`) for that. The model files know nothing of
this; the local `LMConfig` (heads, KV heads, MLP rows per rank; the full vocabulary) replaces
the decoder's, so attention and the KV cache are sized per rank.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from tabed_engine.models.config import LMConfig
from tabed_engine.models.layers import Linear
from tabed_engine.ops.gemv import linear
from tabed_engine.parallel.comm import TPGroup, all_reduce, gather_last


def check_degree(n, num_heads: int, num_kv_heads: int, device: Optional[torch.device] = None) -> int:
    """`n` as a tensor-parallel degree for a decoder of `num_heads` q heads and `num_kv_heads`
    KV heads: a positive int dividing the q heads, dividing the KV heads or a multiple of them,
    and on CUDA at most the visible GPUs from `device`'s index on. Raises ValueError naming
    the problem."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"tensor_parallel must be a positive int, got {n!r}")
    if num_heads % n:
        raise ValueError(f"tensor_parallel={n} does not divide the target's {num_heads} attention heads")
    if num_kv_heads % n and n % num_kv_heads:
        raise ValueError(f"tensor_parallel={n} neither divides the target's {num_kv_heads} KV heads nor is a "
                         "multiple of them (each rank must hold whole KV heads)")
    if device is not None and device.type == "cuda":
        base = device.index or 0
        have = torch.cuda.device_count()
        if base + n > have:
            raise ValueError(f"tensor_parallel={n} needs GPUs {base}..{base + n - 1}, but {have} are visible")
    return n


def split(n: int, world: int, rank: int) -> tuple[int, int]:
    """(start, size) of rank's share of n items split as evenly as they go."""
    base, extra = divmod(n, world)
    return rank * base + min(rank, extra), base + (rank < extra)


def vocab_shard(vocab: int, world: int, rank: int) -> tuple[int, int, int]:
    """(first id, real rows, padded rows) of rank's vocabulary shard: ceil(V / N) rows a rank
    (equal shards gather in one collective), the ids past V padding."""
    padded = -(-vocab // world)
    start = rank * padded
    return start, max(0, min(vocab - start, padded)), padded


def local_config(cfg: LMConfig, rank: int, world: int) -> LMConfig:
    """Rank's `LMConfig`: its q heads, KV heads and MLP rows; the vocabulary stays whole (the
    logits are gathered)."""
    kv = cfg.num_kv_heads // world if cfg.num_kv_heads >= world else 1
    return dataclasses.replace(cfg, num_heads=cfg.num_heads // world, num_kv_heads=kv,
                               intermediate_size=split(cfg.intermediate_size, world, rank)[1])


@dataclass(frozen=True)
class Cut:
    """The slice of a source tensor a rank keeps: `size` entries from `start` along `dim`."""

    dim: int
    start: int
    size: int

    def take(self, t: torch.Tensor) -> torch.Tensor:
        return t.narrow(self.dim, self.start, self.size)


class ColumnParallelLinear(Linear):
    """A rank's output rows of a column-parallel projection; no collective (the next
    row-parallel layer sums). `cuts`: per fused part, the source rows kept."""

    def __init__(self, in_features: int, full_parts: tuple[int, ...], bias: bool, cuts: list[Cut]):
        parts = tuple(c.size for c in cuts)
        super().__init__(in_features, sum(parts), bias=bias, parallel="column", parts=parts)
        self.cuts, self.full_parts = cuts, tuple(full_parts)


class RowParallelLinear(Linear):
    """A rank's input columns of a row-parallel projection: the partial product summed over
    the group, the bias added once after the sum."""

    def __init__(self, in_features: int, out_features: int, bias: bool, cut: Cut, tp: TPGroup):
        super().__init__(in_features, out_features, bias=bias, parallel="row")
        self.cuts, self.tp = [cut], tp

    def forward(self, x, *, gated: bool = False, glu: bool = False, invariant: bool = False):
        y = all_reduce(linear(x, self.weight, None, gated=gated, glu=glu, invariant=invariant).contiguous(), self.tp)
        return y if self.bias is None else y + self.bias


class VocabParallelHead(Linear):
    """A rank's rows of the vocabulary head (padded to equal shards); its logits gathered in
    rank order to the full [.., V] on every rank."""

    def __init__(self, in_features: int, padded: int, vocab: int, bias: bool, cut: Cut, tp: TPGroup):
        super().__init__(in_features, padded, bias=bias, parallel="column")
        self.vocab, self.cuts, self.tp = vocab, [cut], tp

    def forward(self, x, *, gated: bool = False, glu: bool = False, invariant: bool = False):
        return gather_last(linear(x, self.weight, self.bias, gated=gated, glu=glu, invariant=invariant), self.tp,
                           self.vocab)


class VocabParallelEmbedding(nn.Module):
    """A rank's rows of the token embedding: ids of other shards look up zeros, and the sum
    over the group (one nonzero term per id: exact) gives every rank the full embeddings."""

    def __init__(self, padded: int, hidden: int, cut: Cut, tp: TPGroup):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(padded, hidden))
        self.start, self.padded, self.cuts, self.tp = cut.start, padded, [cut], tp

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        mine = (local >= 0) & (local < self.padded)
        x = F.embedding(torch.where(mine, local, 0), self.weight)
        return all_reduce(x.masked_fill_(~mine[..., None], 0), self.tp)


def _qkv_cuts(cfg: LMConfig, tp: TPGroup) -> list[Cut]:
    """Source rows of q, k and v (each in its own part's coordinates) rank keeps."""
    hd, world, rank = cfg.head_dim, tp.world, tp.rank
    hl = cfg.num_heads // world
    if cfg.num_kv_heads >= world:
        kvl = cfg.num_kv_heads // world
        kv = Cut(0, rank * kvl * hd, kvl * hd)
    else:   # fewer KV heads than ranks: the one KV head this rank's q heads read, replicated
        kv = Cut(0, (rank * cfg.num_kv_heads // world) * hd, hd)
    return [Cut(0, rank * hl * hd, hl * hd), kv, kv]


def _sharded(mod: Linear, lm, cfg: LMConfig, tp: TPGroup) -> nn.Module:
    """The rank's replacement (on the meta device) for one marked projection."""
    has_bias = mod.bias is not None
    if mod is lm.lm_head:
        start, real, padded = vocab_shard(cfg.vocab_size, tp.world, tp.rank)
        return VocabParallelHead(mod.in_features, padded, cfg.vocab_size, has_bias, Cut(0, start, real), tp)
    if mod.parallel == "column":
        hd = cfg.head_dim
        if mod.parts == (cfg.num_heads * hd, cfg.num_kv_heads * hd, cfg.num_kv_heads * hd):   # q, k, v
            cuts = _qkv_cuts(cfg, tp)
        else:
            cuts = [Cut(0, *split(n, tp.world, tp.rank)) for n in mod.parts]
        return ColumnParallelLinear(mod.in_features, mod.parts, has_bias, cuts)
    cut = Cut(1, *split(mod.in_features, tp.world, tp.rank))
    return RowParallelLinear(cut.size, mod.out_features, has_bias, cut, tp)


def _part_slices(mod: nn.Module, full: torch.Tensor, kind: str) -> torch.Tensor:
    """The rank's slice of a full parameter (`kind` "weight" or "bias") of the module `mod`
    replaces, laid out as `mod` holds it."""
    if isinstance(mod, RowParallelLinear):
        return full if kind == "bias" else mod.cuts[0].take(full)
    if isinstance(mod, ColumnParallelLinear):
        offsets = [0]
        for n in mod.full_parts:
            offsets.append(offsets[-1] + n)
        return torch.cat([c.take(full.narrow(0, o, n)) for c, o, n in zip(mod.cuts, offsets, mod.full_parts)])
    cut = mod.cuts[0]          # vocabulary rows, padded with zeros
    out = full.new_zeros((mod.padded if isinstance(mod, VocabParallelEmbedding) else mod.out_features,)
                         + tuple(full.shape[1:]))
    out[:cut.size] = cut.take(full)
    return out


@torch.no_grad()
def shard_lm(lm, tp: TPGroup):
    """Shard decoder `lm` (a `LlamaLM`, loaded or on the meta device) in place for rank
    `tp.rank` of `tp.world` (see the module docstring); returns it. Loaded weights are sliced
    (copies: the full ones can be freed); meta ones stay meta for the loader."""
    cfg = lm.cfg
    check_degree(tp.world, cfg.num_heads, cfg.num_kv_heads)
    if tp.world == 1:
        return lm
    tied = cfg.tie_word_embeddings and lm.lm_head.weight is lm.embed_tokens.weight
    swaps = []
    with torch.device("meta"):           # the new modules' shapes only; weights come below
        for parent in lm.modules():
            for child_name, child in parent.named_children():
                if isinstance(child, Linear) and child.parallel is not None:
                    swaps.append((parent, child_name, child, _sharded(child, lm, cfg, tp)))
        emb = lm.embed_tokens
        start, real, padded = vocab_shard(cfg.vocab_size, tp.world, tp.rank)
        swaps.append((lm, "embed_tokens", emb,
                      VocabParallelEmbedding(padded, emb.embedding_dim, Cut(0, start, real), tp)))
    for parent, child_name, old, new in swaps:
        meta = old.weight.is_meta
        new = new.to(dtype=old.weight.dtype)
        if not meta:
            new = new.to_empty(device=old.weight.device)
            new.weight.copy_(_part_slices(new, old.weight, "weight"))
            if getattr(old, "bias", None) is not None:
                new.bias.copy_(_part_slices(new, old.bias, "bias"))
        new.requires_grad_(False)
        setattr(parent, child_name, new)
    if tied:
        lm.lm_head.weight = lm.embed_tokens.weight
    local = local_config(cfg, tp.rank, tp.world)
    for m in lm.modules():
        if getattr(m, "cfg", None) is cfg:
            m.cfg = local
    return lm
