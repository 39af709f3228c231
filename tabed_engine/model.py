"""Compact Llama-family decoder over a static KV cache with per-row lengths.

One forward call serves prefill (ragged rows, right-padded), chain decode, target
verification of γ+1 tokens and tree nodes: every row r writes its T new tokens' K/V at
cache slots `lengths[r] + t` and each new token attends to the row's committed prefix
`[0, lengths[r])` plus the new tokens its `tree_mask` bits allow (causal by default).
Rolling back after a rejection is lowering `lengths` — no copy.
"""
from __future__ import annotations

import functools
import os
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from .config import LMConfig
from .ops.add_rms_norm import add_rms_norm, rms_norm_reference
from .ops.gemv import gemv_kind, linear, silu_mul as silu_mul_op
from .ops.rope_kv_write import rope_kv_write, rope_reference, use_kernel
from .ops.tree_attention import tree_attention


class KVCache:
    """Static cache `k, v: [L, rows, kv_heads, S_max, head_dim]` plus per-row lengths."""

    def __init__(self, cfg: LMConfig, rows: int, max_len: int, device, dtype):
        shape = (cfg.num_layers, rows, cfg.num_kv_heads, max_len, cfg.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.lengths = torch.zeros(rows, device=device, dtype=torch.int32)  # [rows]
        self.max_len = max_len

    @property
    def rows(self) -> int:
        return self.k.shape[1]


def fused_on_cuda(fn):
    """Run `fn` through torch.compile (one generated kernel instead of a chain of pointwise
    launches) for CUDA tensors, eagerly elsewhere. Decode steps are launch-bound: RMSNorm
    alone is six launches eager. `TABED_NO_COMPILE=1` turns it off."""
    compiled = None

    @functools.wraps(fn)
    def wrapper(x, *args):
        nonlocal compiled
        if not x.is_cuda or os.environ.get("TABED_NO_COMPILE") == "1":
            return fn(x, *args)
        if compiled is None:
            compiled = torch.compile(fn, dynamic=True, fullgraph=True)
        return compiled(x, *args)

    return wrapper


rms_norm = fused_on_cuda(rms_norm_reference)


# silu(gate) * up for gate_up = [gate | up]: the Triton kernel on CUDA for prefill (decode and
# verification rows have it fused: into the one-row down-projection GEMV's loads, into the
# 2-64-row gate/up GEMV's epilogue, see `MLP.forward`); faster on prefill rows than the
# generated pointwise kernel it replaces (results/profile_prefill.json vs _20f001a.json)
silu_mul = silu_mul_op


class Linear(nn.Linear):
    """nn.Linear whose 1-64-row calls on CUDA run the Triton GEMVs (`ops.gemv.linear`)."""

    def forward(self, x):
        return linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return rms_norm(x, self.weight, self.eps)

    def add_forward(self, x, delta):
        """(x + delta, norm(x + delta)); delta None: (x, norm(x)). One kernel on CUDA."""
        return add_rms_norm(x, delta, self.weight, self.eps)


def rope_tables(cfg: LMConfig, max_pos: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [max_pos, head_dim] in float32 (HF's rotate-half convention)."""
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.int64,
                                                  device=device).float() / cfg.head_dim))
    t = torch.arange(max_pos, device=device, dtype=torch.float32) / cfg.rope_scaling_factor
    freqs = torch.outer(t, inv)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


# x: [R, T, H, D]; cos/sin: [R, T, 1, D]. x * cos + rotate_half(x) * sin in float32; the
# math lives with the fused kernel's reference so the two cannot drift apart.
apply_rope = fused_on_cuda(rope_reference)


class Attention(nn.Module):
    def __init__(self, cfg: LMConfig):
        super().__init__()
        self.cfg = cfg
        hd, h, kv = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
        # q, k, v in one matrix: one GEMV per decode step instead of three (the loader
        # concatenates the checkpoint's q_proj/k_proj/v_proj)
        self.qkv_proj = Linear(cfg.hidden_size, (h + 2 * kv) * hd, bias=cfg.qkv_bias)
        self.o_proj = Linear(h * hd, cfg.hidden_size, bias=False)

    def forward(self, x, cos, sin, k_cache, v_cache, ctx: "ForwardContext"):
        # x: [R, T, hidden]; k_cache/v_cache: [R, kv, S, hd] (this layer)
        R, T, _ = x.shape
        cfg = self.cfg
        qkv = self.qkv_proj(x)                                  # [R, T, (h + 2 kv) * hd]
        if ctx.tree_bits is not None:      # decode / verify / tree nodes: Triton kernels
            # one launch rotates q and k and writes k, v at cache slots lengths[r] + t
            q = rope_kv_write(qkv, cos, sin, k_cache, v_cache, ctx.write32,
                              cfg.num_heads, cfg.num_kv_heads)  # [R, T, h, hd]
            out = tree_attention(q, k_cache, v_cache, ctx.lengths32, ctx.tree_bits, tree_slots=ctx.tree_slots)
            return self.o_proj(out.reshape(R, T, -1))
        if ctx.fresh and use_kernel(qkv, cfg.head_dim):  # CUDA prefill: one launch
            q, new_k, new_v = fused_prefill_sdpa_qkv(qkv, cos, sin, k_cache, v_cache, ctx, cfg)
        else:
            q, new_k, new_v = sdpa_qkv(qkv, cos, sin, k_cache, v_cache, ctx, cfg)
        if ctx.mask is None:
            # fresh single-row prefill: attend over the new keys themselves (contiguous, so
            # SDPA takes its FlashAttention kernel with fp32 softmax; strided cache slices
            # sent it to a path that lost ~3x more accuracy in bf16)
            keys, values = new_k, new_v
        else:
            keys, values = k_cache[:, :, :ctx.kv_len], v_cache[:, :, :ctx.kv_len]
        out = F.scaled_dot_product_attention(
            q, keys, values, attn_mask=ctx.mask,
            is_causal=ctx.mask is None, enable_gqa=cfg.num_heads != cfg.num_kv_heads)
        return self.o_proj(out.transpose(1, 2).reshape(R, T, -1))


def sdpa_qkv(qkv, cos, sin, k_cache, v_cache, ctx, cfg: LMConfig):
    """The PyTorch chain (CPU: the float32 reference; CUDA calls the kernels do not take):
    rotate q and k, write k and v into the cache; returns q [R, h, T, hd] and, for a fresh
    prefill, the new k, v [R, kv, T, hd] (else None), contiguous for SDPA."""
    R, T, _ = qkv.shape
    q, k, v = qkv.view(R, T, -1, cfg.head_dim).split(
        [cfg.num_heads, cfg.num_kv_heads, cfg.num_kv_heads], dim=2)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    new_k = new_v = None
    if ctx.fresh:
        # every row starts at slot 0: a slice copy per cache instead of an indexed write
        # (the indexed write took 3.0 of a 1,800-token prefill's 45.9 ms on the H200,
        # benchmarks/results/profile_prefill.json)
        new_k, new_v = k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()
        if ctx.slot is None:
            k_cache[:, :, :T] = new_k
            v_cache[:, :, :T] = new_v
        else:   # into cache row `slot`, a device index: one captured graph serves every row
            k_cache.narrow(2, 0, T).index_copy_(0, ctx.slot, new_k)
            v_cache.narrow(2, 0, T).index_copy_(0, ctx.slot, new_v)
    else:
        # the new tokens at each row's own slots: cache[r, :, slots[r, t]] = k[r, t]
        k_cache[ctx.row_index, :, ctx.slots] = k
        v_cache[ctx.row_index, :, ctx.slots] = v
    return q.transpose(1, 2).contiguous(), new_k, new_v


def fused_prefill_sdpa_qkv(qkv, cos, sin, k_cache, v_cache, ctx, cfg: LMConfig):
    """A fresh prefill's q, k, v in one `rope_kv_write` launch (the CUDA path): rotates q and
    k, writes k and v at slots [0, T) of cache row `ctx.slot` (of each row r without a slot)
    and returns q [R, h, T, hd] (a view of [R, T, h, hd] storage) and, for single-row causal
    attention (no mask), the new k, v [R, kv, T, hd], contiguous for SDPA (else None).
    Replaces a compiled RoPE kernel, three transposed copies and two index_copy_
    (benchmarks/results/rope_kv_write.json)."""
    R, T, _ = qkv.shape
    h, kv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    # q stored [R, T, h, hd] and handed to SDPA as its [R, h, T, hd] view: the attention
    # output comes back in q's layout, so the o_proj input needs no transposing copy
    q = qkv.new_empty(R, T, h, hd)
    new_k = new_v = None
    if ctx.mask is None:
        new_k, new_v = qkv.new_empty(R, kv, T, hd), qkv.new_empty(R, kv, T, hd)
    rope_kv_write(qkv, cos, sin, k_cache, v_cache, ctx.starts32, h, kv, out=q, rows=ctx.slot,
                  k_out=new_k, v_out=new_v)
    return q.transpose(1, 2), new_k, new_v


class MLP(nn.Module):
    def __init__(self, cfg: LMConfig):
        super().__init__()
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        kind = gemv_kind(x, self.gate_up_proj.weight)
        if kind == "rows":  # 2-64 rows: the SiLU gate in the gate/up GEMV's epilogue
            return self.down_proj(linear(x, self.gate_up_proj.weight, glu=True))
        gate_up = self.gate_up_proj(x)
        if kind == "row":  # one row: the SiLU gate as the down projection's GEMV loads its input
            return linear(gate_up, self.down_proj.weight, gated=True)
        return self.down_proj(silu_mul(gate_up))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: LMConfig):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, delta, cos, sin, k_cache, v_cache, ctx):
        # x + attn(norm(x)), then + mlp(norm(.)), with each residual add deferred into the
        # RMSNorm that follows it (one kernel on CUDA instead of an add and a norm): x is the
        # residual stream [R, T, hidden] still missing `delta`, the previous layer's MLP output
        # (None before the first layer), and the layer returns (x, its MLP output) the same way.
        x, h = self.input_layernorm.add_forward(x, delta)
        x, h = self.post_attention_layernorm.add_forward(x, self.self_attn(h, cos, sin, k_cache, v_cache, ctx))
        return x, self.mlp(h)


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
    bucket: CUDA-graph friendly). Otherwise SDPA with a
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
        self.row_index = torch.arange(R, device=dev)[:, None]              # [R, 1]
        self.slots = lengths.long()[:, None] + tree_offset + ar[None, :]    # [R, T]
        if fresh and R == 1 and tree_mask is None:
            return                                  # causal SDPA over the new keys, no mask
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


class LlamaLM(nn.Module):
    """Decoder + embeddings + head. Weights are mapped from a HF checkpoint by the loader."""

    def __init__(self, cfg: LMConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self._rope = None
        self._ropes_outgrown = []   # CUDA graphs captured with an earlier table read it by address

    def rope(self, max_pos: int, device):
        """[P, 2 * head_dim] float32: the cos table, then the sin table, per position (one
        gather per forward fetches both). A table replaced by a longer one is kept alive."""
        if self._rope is None or self._rope.shape[0] < max_pos or self._rope.device != device:
            if self._rope is not None:
                self._ropes_outgrown.append(self._rope)
            self._rope = torch.cat(rope_tables(self.cfg, max(max_pos, 256), device), dim=-1)
        return self._rope

    def forward(self, cache: KVCache, positions: torch.Tensor, *, input_ids=None, embeds=None,
                tree_mask: Optional[torch.Tensor] = None, logits_index: Optional[torch.Tensor] = None,
                kv_len: Optional[int] = None, lengths: Optional[torch.Tensor] = None,
                fresh: bool = False, slot: Optional[torch.Tensor] = None, float_logits: bool = True,
                tree_bits: Optional[torch.Tensor] = None, tree_offset: int = 0):
        """Run T new tokens per row; returns logits in float32 (in the model's dtype with
        `float_logits=False`: no conversion kernel, for consumers that read any float dtype).

        positions: [R, T] RoPE positions. input_ids: [R, T] or embeds: [R, T, hidden].
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
        x = self.embed_tokens(input_ids) if embeds is None else embeds
        R, T = positions.shape
        lengths = cache.lengths if lengths is None else lengths
        kv_len = cache.max_len if kv_len is None else kv_len
        ctx = ForwardContext(lengths, T, kv_len, tree_mask, fresh, slot, tree_bits, tree_offset)
        # the table spans the cache: a draft's cache may be longer than the draft's position
        # limit (it has the target's length); a request's draft rows stay within the limit
        # (`Engine._draft_room`, checked when it is added), and only the slots drafted past a
        # request's end in the block it finishes (tokens that are dropped) may go beyond it
        cs = self.rope(max(self.cfg.max_position_embeddings, cache.max_len), x.device)[positions]  # [R, T, 2D]
        D = self.cfg.head_dim
        cos, sin = cs[:, :, None, :D], cs[:, :, None, D:]
        delta = None
        for i, layer in enumerate(self.layers):
            x, delta = layer(x, delta, cos, sin, cache.k[i], cache.v[i], ctx)
        _, x = self.norm.add_forward(x, delta)  # the last residual add and the final norm: one kernel on CUDA
        if logits_index is not None:
            x = torch.gather(x, 1, logits_index[:, :, None].expand(-1, -1, x.shape[-1]))
        logits = self.lm_head(x)
        return logits.float() if float_logits else logits
