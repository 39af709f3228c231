"""Compact Llama-family decoder over a paged KV cache with per-row lengths.

One forward call serves prefill (ragged rows, right-padded), chain decode, target
verification of γ+1 tokens and tree nodes: every row r writes its T new tokens' K/V at
cache slots `lengths[r] + t` and each new token attends to the row's committed prefix
`[0, lengths[r])` plus the new tokens its `tree_mask` bits allow (causal by default).
Rolling back after a rejection is lowering `lengths` — no copy.
"""
from __future__ import annotations

import copy
from typing import Optional

import torch
from torch import nn

from tabed_engine.models.config import LMConfig
from tabed_engine.models.layers import DecoderLayer, Linear, RMSNorm, rope_tables


PAGE_SIZE = 64   # slots per page: a multiple of the attention kernels' key tile (64; 32 past head_dim 128)


class KVCache:
    """Paged cache: page pools `k, v: [L, pages, kv_heads, page, head_dim]`, a block table
    `block_table [rows, max_len / page]` int32 (row r's slot s lives in page
    `block_table[r, s // page]` at offset `s % page`), per-row lengths and position offsets.

    Page 0 is scratch: every table entry no allocator gave a page points there, so the garbage
    that free rows of a bucketed block write lands where nobody reads. The pages and tables are
    managed on the host by `engine.pages.PagePool`; the table is a fixed-address device tensor
    updated in place, so CUDA graphs captured over it stay valid. Without `pages` every row
    holds pages for its whole length from the start (rows * W + 1 pages, row r's column c at
    page 1 + r * W + c): a standalone cache that needs no allocator.

    `pos_offset` [rows] int64: what a row's RoPE positions add to its cache slots after the
    prompt. Zero but for M-RoPE rows (Qwen2.5-VL) whose prompt holds images: their prompt's
    positions (`mrope.rope_index`) end at max + 1 != the prompt's length, and every later token
    (decode, verification, drafts, tree nodes: three equal ids, 1-D RoPE) sits at its slot +
    that delta. Written by the prefill; read by every forward that is not a fresh prefill.
    """

    def __init__(self, cfg: LMConfig, rows: int, max_len: int, device, dtype, pages: Optional[int] = None,
                 page_size: int = PAGE_SIZE):
        width = -(-max_len // page_size)
        shape = (cfg.num_layers, rows * width + 1 if pages is None else pages, cfg.num_kv_heads, page_size,
                 cfg.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        if pages is None:
            own = torch.arange(1, rows * width + 1, dtype=torch.int32).view(rows, width)
            self.block_table = own.to(device)                                       # [rows, W]
        else:
            self.block_table = torch.zeros(rows, width, device=device, dtype=torch.int32)
        self.lengths = torch.zeros(rows, device=device, dtype=torch.int32)  # [rows]
        self.pos_offset = torch.zeros(rows, device=device, dtype=torch.int64)  # [rows]
        self.max_len = max_len
        self.page_size = page_size

    @property
    def rows(self) -> int:
        return self.block_table.shape[0]

    @property
    def pages(self) -> int:
        return self.k.shape[1]


def cache_rows(cache: KVCache, start: int, stop: int) -> KVCache:
    """Rows [start, stop) of a cache as a cache sharing its pools and its table's rows (same
    addresses on every call, so graphs captured on a view stay valid)."""
    view = copy.copy(cache)
    view.block_table, view.lengths = cache.block_table[start:stop], cache.lengths[start:stop]
    view.pos_offset = cache.pos_offset[start:stop]
    return view


_CHAIN_BITS: dict = {}


def chain_bits(T: int, device) -> torch.Tensor:
    """Packed causal mask [T] int64: node i sees nodes 0..i (bit j = node j). Cached, so a
    CUDA-graph capture never copies it from the host."""
    key = (T, str(device))
    if key not in _CHAIN_BITS:
        bits = [(1 << (i + 1)) - 1 for i in range(T)]
        _CHAIN_BITS[key] = torch.tensor([b - (1 << 64) if b >= 1 << 63 else b for b in bits],
                                        dtype=torch.int64, device=device)
    return _CHAIN_BITS[key]


def mask_to_bits(tree_mask: torch.Tensor) -> torch.Tensor:
    """[R, T, T] bool (node i sees node j) -> [R, T] int64 bit masks (T <= 64)."""
    T = tree_mask.shape[-1]
    w = torch.ones(T, dtype=torch.int64, device=tree_mask.device) << torch.arange(
        T, device=tree_mask.device, dtype=torch.int64)
    return (tree_mask.long() * w).sum(-1)


def bits_to_mask(tree_bits: torch.Tensor, slots: Optional[int] = None) -> torch.Tensor:
    """[R, T] int64 bit masks -> [R, T, slots] bool (node i sees slot j where bit j of row i is
    set; slots default T)."""
    slots = tree_bits.shape[-1] if slots is None else slots
    return ((tree_bits[..., None] >> torch.arange(slots, device=tree_bits.device)) & 1) != 0


class ForwardContext:
    """Per-call metadata shared by all layers (built once per forward, not per layer).

    On CUDA, calls of at most 64 new tokens per row (decode, verification, tree nodes)
    write their K/V through the `rope_kv_write` kernel and attend through `tree_attention`;
    both read each row's own length on the device (no slot index, no mask tensor, no length
    bucket: CUDA-graph friendly); so do longer calls without a tree (a prompt's rest after
    its cached prefix, a prefill chunk: `causal`), the attention in its causal mode. Otherwise SDPA with a
    dense boolean mask, or plain causal SDPA (FlashAttention) for a fresh single-row prefill;
    a fresh prefill on CUDA rotates and writes its K/V through `rope_kv_write` too (rows from
    slot 0: `starts32`). `slot` ([1] int64, device): a fresh single-row prefill written into
    that cache row (`lengths` unused). `tree_bits` ([R, T] int64, any strides): the tree mask
    already packed (bit j of row i: node i sees node j), read as it is by the kernel path and
    unpacked to the dense mask elsewhere; at most one of tree_mask and tree_bits.
    `tree_offset` (with tree_bits): the new tokens sit at slots lengths[r] + tree_offset + t,
    after tree nodes an earlier call wrote there; the bits name slots from lengths[r].
    """

    def __init__(self, lengths, T: int, kv_len: int, tree_mask=None, fresh: bool = False, slot=None,
                 tree_bits=None, tree_offset: int = 0):
        # lengths: [R] committed prefix per row; tree_mask: [R, T, T] bool or None (causal)
        dev = lengths.device
        self.invariant = False  # the model sets it for its kernel-path calls (`LlamaLM.invariant`)
        # a tree (verification, the views' tree; not a draft tree fed depth by depth): with
        # `invariant` its nodes' keys are summed as AR steps hold them (`tree_attention` paths)
        self.tree = (tree_mask is not None or tree_bits is not None) and not tree_offset
        kernels = dev.type == "cuda" and T <= 64 and not fresh
        if tree_offset and (tree_bits is None or fresh or slot is not None or tree_offset + T > 64):
            raise ValueError(f"tree_offset={tree_offset} needs tree_bits, no fresh prefill or slot, and "
                             f"tree_offset + T = {tree_offset + T} <= 64 tree slots")
        self.tree_slots = tree_offset + T
        if tree_bits is not None:
            if tree_mask is not None:
                raise ValueError("pass tree_mask or tree_bits, not both")
            if not kernels:
                tree_mask, tree_bits = bits_to_mask(tree_bits, self.tree_slots), None
        self.kv_len = kv_len
        self.fresh = fresh
        self.slot = slot
        self.tree_bits = self.mask = None
        # more than 64 new tokens a row without a tree (a prompt's rest after a cached prefix, a
        # prefill chunk): the same kernels, the attention in its causal mode (no mask words)
        self.causal = (dev.type == "cuda" and not kernels and not fresh and tree_mask is None
                       and tree_bits is None and slot is None)
        if self.causal:
            self.lengths32 = self.write32 = lengths.int()
            return
        if fresh:  # a prefill writes every row from slot 0: the fused prefill's lengths
            self.starts32 = torch.zeros(len(lengths) if slot is None else len(slot), dtype=torch.int32,
                                        device=lengths.device)
        if slot is not None:
            if not fresh or tree_mask is not None:
                raise ValueError("slot= is for a fresh causal prefill of one row")
            return                                  # causal SDPA over the new keys, no mask
        R = lengths.shape[0]
        if kernels:
            self.lengths32 = lengths.int()  # the attention's prefix; the tree's slots follow it
            # rope_kv_write derives the cache slots from it
            self.write32 = (lengths + tree_offset).int() if tree_offset else self.lengths32
            if tree_bits is not None:
                self.tree_bits = tree_bits
            elif tree_mask is None:
                self.tree_bits = chain_bits(T, dev)[None].expand(R, T)
            else:
                self.tree_bits = mask_to_bits(tree_mask)
            return
        ar = torch.arange(T, device=dev)
        self.slots = lengths.long()[:, None] + tree_offset + ar[None, :]    # [R, T]
        if fresh and tree_mask is None:
            # causal SDPA over the new keys, no mask: every row starts at slot 0, so a row's padding
            # after its prompt is never attended to by its real tokens. (Several rows, the draft's
            # views: a dense [R, 1, T, S] mask kept SDPA off its fused kernels, GQA with a mask falling
            # to the math path, which materialises [R, heads, T, S] scores a layer.)
            return
        s = torch.arange(kv_len, device=dev)                                # [S]
        rel = s[None, None, :] - lengths.long()[:, None, None]              # [R, 1, S]
        prefix = rel < 0
        if tree_mask is None:
            new = (rel >= 0) & (rel <= ar[None, :, None])                   # causal among new
        else:
            n = tree_mask.shape[-1]                                         # tree slots
            idx = rel.clamp(0, n - 1).expand(R, T, kv_len)
            new = (rel >= 0) & (rel < n) & torch.gather(tree_mask, 2, idx)
        self.mask = (prefix | new)[:, None]                                  # [R, 1, T, S]


    @property
    def kernels(self) -> bool:
        """Whether the call's attention runs the kernel path (`rope_kv_write` + `tree_attention`)."""
        return self.tree_bits is not None or self.causal


class Part:
    """One call's share of a forward (`LlamaLM.part`): embeddings x [R, T, hidden], context,
    cos / sin [R, T, 1, head_dim], the cache view it writes and its logits_index [R, n] or None."""

    def __init__(self, x, ctx: ForwardContext, cos, sin, cache: KVCache, logits_index):
        self.x, self.ctx, self.cos, self.sin, self.cache, self.logits_index = x, ctx, cos, sin, cache, logits_index
        self.rows, self.T = x.shape[0], x.shape[1]


class MixedContext:
    """The context of `LlamaLM.forward_mixed`: its parts in packing order (`Attention` runs each
    part's attention on its slice of the packed stream). `invariant`: the linear layers' mode,
    row-count-invariant when any part's own call would be (its rows keep their bits)."""

    def __init__(self, parts: list[Part], invariant: bool):
        self.parts = parts
        self.invariant = invariant and any(p.ctx.invariant for p in parts)
        self.sizes = [p.rows * p.T for p in parts]

    def logit_rows(self, device) -> list[torch.Tensor]:
        """Per part, the packed positions [R * n] of the logits its call returns (row-major)."""
        out, start = [], 0
        for p, size in zip(self.parts, self.sizes):
            base = start + torch.arange(p.rows, device=device)[:, None] * p.T     # [R, 1]
            idx = torch.arange(p.T, device=device)[None] if p.logits_index is None else p.logits_index
            out.append((base + idx).reshape(-1))
            start += size
        return out

    @property
    def n_logits(self) -> list[int]:
        return [p.rows * (p.T if p.logits_index is None else p.logits_index.shape[1]) for p in self.parts]


class LlamaLM(nn.Module):
    """Decoder + embeddings + head. Weights are mapped from a HF checkpoint by the loader."""

    def __init__(self, cfg: LMConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False, parallel="column")
        self._rope = None
        self._ropes_outgrown = []   # CUDA graphs captured with an earlier table read it by address
        self._mrope_index = None
        # row-count-invariant decode (`Engine(..., invariant=True)`): calls on the kernel path
        # (decode, verification, tree nodes on CUDA) run launch configs that do not depend on
        # the number of rows, so a row's logits have the same bits alone or among others
        self.invariant = False

    def rope(self, max_pos: int, device):
        """[P, 2 * head_dim] float32: the cos table, then the sin table, per position (one
        gather per forward fetches both). A table replaced by a longer one is kept alive."""
        if self._rope is None or self._rope.shape[0] < max_pos or self._rope.device != device:
            if self._rope is not None:
                self._ropes_outgrown.append(self._rope)
            self._rope = torch.cat(rope_tables(self.cfg, max(max_pos, 256), device), dim=-1)
        return self._rope

    def rope_rows(self, positions: torch.Tensor, max_pos: int, device) -> torch.Tensor:
        """The rope table's rows [R, T, 2 * head_dim] at positions [R, T], or, with M-RoPE, at
        3-D positions [3, R, T] (temporal, height, width): each frequency takes its section's
        position id (`mrope_section` splits the head_dim / 2 frequencies, in the cos half and
        the sin half alike), as transformers' Qwen2.5-VL rotary embedding does."""
        table = self.rope(max_pos, device)
        if positions.dim() == 2:
            return table[positions]
        section = self.cfg.mrope_section
        if section is None or positions.shape[0] != 3:
            raise ValueError(f"positions of shape {tuple(positions.shape)}: 3-D positions [3, R, T] need an "
                             "M-RoPE model (mrope_section)")
        if self._mrope_index is None or self._mrope_index.device != table.device:
            half = torch.cat([torch.full((n,), i % 3) for i, n in enumerate(section)])
            self._mrope_index = torch.cat([half, half, half, half]).to(table.device)   # cos | sin
        rows = table[positions]                                                   # [3, R, T, 2D]
        idx = self._mrope_index.expand(1, *rows.shape[1:])
        return rows.gather(0, idx)[0]

    def forward(self, cache: KVCache, positions: torch.Tensor, *, input_ids=None, embeds=None,
                tree_mask: Optional[torch.Tensor] = None, logits_index: Optional[torch.Tensor] = None,
                kv_len: Optional[int] = None, lengths: Optional[torch.Tensor] = None,
                fresh: bool = False, slot: Optional[torch.Tensor] = None, float_logits: bool = True,
                tree_bits: Optional[torch.Tensor] = None, tree_offset: int = 0):
        """Run T new tokens per row; returns logits in float32 (in the model's dtype with
        `float_logits=False`: no conversion kernel, for consumers that read any float dtype).

        positions: [R, T] RoPE positions, or [3, R, T] M-RoPE ids (temporal, height, width) for a
        fresh prefill of an M-RoPE model; a call that is not a fresh prefill adds each row's
        `cache.pos_offset` to its [R, T] positions (M-RoPE models only). input_ids: [R, T] or embeds: [R, T, hidden].
        tree_mask: [R, T, T] bool (node i sees node j) or None for causal; or tree_bits: the
        same packed, [R, T] int64 with bit j of row i set (any strides; the CUDA kernels read it
        without a conversion).
        logits_index: [R, n] indices into T of the positions whose logits are wanted
        (None = all). kv_len: attend over cache slots [0, kv_len) (default: whole cache).
        lengths: per-row committed prefix (default `cache.lengths`). Does not update lengths.
        fresh: every row starts at length 0 (a prefill), so a single row can use causal SDPA.
        slot: [1] int64 device tensor: a fresh prefill of one row (R = 1) written into cache row
        `slot` of a many-row `cache` (CUDA-graph friendly: the row is an input, not a shape).
        tree_offset: with tree_bits, the T tokens go to slots lengths + tree_offset + t and their
        bits name tree slots from `lengths`: nodes an earlier call wrote at lengths ..
        lengths + tree_offset stay visible to the tokens whose bits name them (a tree drafted
        depth by depth feeds only its new nodes).
        """
        part = self.part(cache, positions, input_ids=input_ids, embeds=embeds, tree_mask=tree_mask,
                         logits_index=logits_index, kv_len=kv_len, lengths=lengths, fresh=fresh, slot=slot,
                         tree_bits=tree_bits, tree_offset=tree_offset)
        ctx = part.ctx
        x = self.trunk(part.x, cache, part.cos, part.sin, cache.block_table, ctx)
        if logits_index is not None:
            x = torch.gather(x, 1, logits_index[:, :, None].expand(-1, -1, x.shape[-1]))
        logits = self.lm_head(x, invariant=ctx.invariant)
        return logits.float() if float_logits else logits

    def part(self, cache: KVCache, positions: torch.Tensor, *, input_ids=None, embeds=None, tree_mask=None,
             logits_index=None, kv_len=None, lengths=None, fresh: bool = False, slot=None, tree_bits=None,
             tree_offset: int = 0) -> "Part":
        """What one call's layers read (see `forward` for the arguments): its token embeddings
        [R, T, hidden], its `ForwardContext` and its RoPE cos / sin rows [R, T, 1, head_dim]."""
        x = self.embed_tokens(input_ids) if embeds is None else embeds
        R, T = positions.shape[-2:]
        if not fresh and self.cfg.mrope_section is not None:
            positions = positions + cache.pos_offset[:, None]   # slot -> M-RoPE position: one add
        lengths = cache.lengths if lengths is None else lengths
        kv_len = cache.max_len if kv_len is None else kv_len
        ctx = ForwardContext(lengths, T, kv_len, tree_mask, fresh, slot, tree_bits, tree_offset)
        ctx.invariant = self.invariant and ctx.kernels
        ctx.paths = ctx.invariant and ctx.tree
        # the table spans the cache: a draft's cache may be longer than the draft's position
        # limit (it has the target's length); a request's draft rows stay within the limit
        # (`Engine._draft_room`, checked when it is added), and only the slots drafted past a
        # request's end in the block it finishes (tokens that are dropped) may go beyond it
        cs = self.rope_rows(positions, max(self.cfg.max_position_embeddings, cache.max_len), x.device)  # [R, T, 2D]
        D = self.cfg.head_dim
        return Part(x, ctx, cs[:, :, None, :D], cs[:, :, None, D:], cache, logits_index)

    def trunk(self, x, cache: KVCache, cos, sin, table, ctx):
        """The decoder layers and the final norm over x [R, T, hidden] (one call's, or the packed
        stream [1, N, hidden] of a mixed call with its `MixedContext`)."""
        delta = None
        for i, layer in enumerate(self.layers):
            x, delta = layer(x, delta, cos, sin, cache.k[i], cache.v[i], table, ctx)
        _, x = self.norm.add_forward(x, delta)  # the last residual add and the final norm: one kernel on CUDA
        return x

    def forward_mixed(self, parts: list[dict], float_logits: bool = True) -> list[torch.Tensor]:
        """Several forward calls over views of one cache as one pass through the weights.

        Each part is the keyword arguments of one `forward` call (`cache` among them: views of
        the same page pools, e.g. `cache_rows`), say a decode step of R rows and a prompt chunk.
        The parts' tokens are packed into one stream [1, sum R * T, hidden] for the per-token
        layers (embeddings, norms, projections, MLP, head: each weight read once); each part's
        attention (RoPE, KV write, attention) runs on its slice with its own `ForwardContext`, as
        its own `forward` would, in the order of `parts` (a later part's KV writes land after an
        earlier one's). Returns each part's logits as its `forward` would, [R, n, V].
        """
        if not parts:
            raise ValueError("forward_mixed needs at least one part")
        cache = parts[0]["cache"]
        if any(p["cache"].k is not cache.k for p in parts):
            raise ValueError("forward_mixed: every part's cache must be a view of the same page pools")
        prepared = [self.part(**p) for p in parts]
        ctx = MixedContext(prepared, self.invariant)
        x = self.trunk(torch.cat([p.x.reshape(1, -1, p.x.shape[-1]) for p in prepared], 1), cache, None, None,
                       None, ctx)
        rows = torch.cat(ctx.logit_rows(x.device))          # packed positions whose logits are wanted
        logits = self.lm_head(x[:, rows], invariant=ctx.invariant)[0]
        logits = logits.float() if float_logits else logits
        return [lg.view(p.rows, -1, lg.shape[-1]) for p, lg in zip(prepared, logits.split(ctx.n_logits))]
