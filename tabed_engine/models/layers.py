"""The shared pieces of every decoder family: RMSNorm, rotary embeddings, attention over the
paged KV cache (optional q/k/v bias, GQA), the gated MLP, and `Linear`, the one linear layer
every projection uses.

`Linear.parallel` marks how tensor parallelism shards a projection ("column": its output rows,
each fused part (q, k, v; gate, up) split on its own; "row": its input columns, the partial
outputs summed across ranks; None: replicated). A model file only says which kind each layer
is; `tabed_engine.parallel` does the sharding, so one-rank execution stays the plain path.
"""
from __future__ import annotations

import functools
import os
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from tabed_engine.models.config import LMConfig
from tabed_engine.ops.add_rms_norm import add_rms_norm, rms_norm_reference
from tabed_engine.ops.gemv import gemv_kind, linear, silu_mul as silu_mul_op
from tabed_engine.ops.paged import gather_rows, write_slots
from tabed_engine.ops.rope_kv_write import rope_kv_write, rope_reference, use_kernel
from tabed_engine.ops.tree_attention import tree_attention


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
    """nn.Linear whose 1-64-row calls on CUDA run the Triton GEMVs (`ops.gemv.linear`); with
    `invariant=True` every CUDA call runs the row-count-invariant kernel.

    parallel: "column", "row" or None (see the module docstring); parts: the output sizes of
    the projections fused in it (q, k, v rows of `qkv_proj`), each sharded on its own."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 parallel: Optional[str] = None, parts: Optional[tuple[int, ...]] = None):
        super().__init__(in_features, out_features, bias=bias)
        if parallel not in (None, "column", "row"):
            raise ValueError(f"parallel must be 'column', 'row' or None, got {parallel!r}")
        if parts is not None and sum(parts) != out_features:
            raise ValueError(f"parts {parts} do not add up to out_features {out_features}")
        self.parallel = parallel
        self.parts = (out_features,) if parts is None else tuple(parts)

    def forward(self, x, *, gated: bool = False, glu: bool = False, invariant: bool = False):
        # every call of the projection goes through here (the MLP's fused SiLU gate too), so a
        # tensor-parallel subclass adds its collective in one place
        return linear(x, self.weight, self.bias, gated=gated, glu=glu, invariant=invariant)


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
        self.qkv_proj = Linear(cfg.hidden_size, (h + 2 * kv) * hd, bias=cfg.qkv_bias, parallel="column",
                               parts=(h * hd, kv * hd, kv * hd))
        self.o_proj = Linear(h * hd, cfg.hidden_size, bias=False, parallel="row")

    def forward(self, x, cos, sin, k_cache, v_cache, table, ctx):
        # x: [R, T, hidden]; k_cache/v_cache: [pages, kv, page, hd] (this layer's pools);
        # table: [R, S / page] int32, the rows' pages. A mixed call (`decoder.MixedContext`): x is
        # the packed stream [1, N, hidden] and each part attends on its slice with its own
        # context, cos / sin and table (the projections stay one product over all tokens)
        qkv = self.qkv_proj(x, invariant=ctx.invariant)                   # [R, T, (h + 2 kv) * hd]
        parts = getattr(ctx, "parts", None)
        if parts is None:
            out = self.attend(qkv, cos, sin, k_cache, v_cache, table, ctx)
        else:
            out = torch.cat([self.attend(q.view(p.rows, p.T, -1), p.cos, p.sin, k_cache, v_cache, p.cache.block_table,
                                         p.ctx).reshape(1, p.rows * p.T, -1)
                             for q, p in zip(qkv.split(ctx.sizes, dim=1), parts)], 1)
        return self.o_proj(out, invariant=ctx.invariant)

    def attend(self, qkv, cos, sin, k_cache, v_cache, table, ctx):
        """One call's attention: rotate q and k, write k and v at the rows' cache slots, attend.
        qkv: [R, T, (h + 2 kv) * hd]; returns the heads' outputs [R, T, h * hd] (o_proj's input)."""
        R, T, _ = qkv.shape
        cfg = self.cfg
        if ctx.kernels:      # decode / verify / tree nodes / prompt chunks on CUDA: Triton kernels
            # one launch rotates q and k and writes k, v at cache slots lengths[r] + t
            q = rope_kv_write(qkv, cos, sin, k_cache, v_cache, table, ctx.write32,
                              cfg.num_heads, cfg.num_kv_heads)  # [R, T, h, hd]
            out = tree_attention(q, k_cache, v_cache, table, ctx.lengths32, ctx.tree_bits,
                                 tree_slots=None if ctx.causal else ctx.tree_slots, invariant=ctx.invariant,
                                 causal=ctx.causal, paths=ctx.paths)
            return out.reshape(R, T, -1)
        if ctx.fresh and use_kernel(qkv, cfg.head_dim):  # CUDA prefill: one launch
            q, new_k, new_v = fused_prefill_sdpa_qkv(qkv, cos, sin, k_cache, v_cache, table, ctx, cfg)
        else:
            q, new_k, new_v = sdpa_qkv(qkv, cos, sin, k_cache, v_cache, table, ctx, cfg)
        if ctx.mask is None:
            # fresh single-row prefill: attend over the new keys themselves (contiguous, so
            # SDPA takes its FlashAttention kernel with fp32 softmax; strided cache slices
            # sent it to a path that lost ~3x more accuracy in bf16)
            keys, values = new_k, new_v
        else:
            keys, values = gather_rows(k_cache, table, ctx.kv_len), gather_rows(v_cache, table, ctx.kv_len)
        out = F.scaled_dot_product_attention(
            q, keys, values, attn_mask=ctx.mask,
            is_causal=ctx.mask is None, enable_gqa=cfg.num_heads != cfg.num_kv_heads)
        return out.transpose(1, 2).reshape(R, T, -1)


def sdpa_qkv(qkv, cos, sin, k_cache, v_cache, table, ctx, cfg: LMConfig):
    """The PyTorch chain (CPU: the float32 reference; CUDA calls the kernels do not take):
    rotate q and k, write k and v into the cache; returns q [R, h, T, hd] and, for a fresh
    prefill, the new k, v [R, kv, T, hd] (else None), contiguous for SDPA."""
    R, T, _ = qkv.shape
    q, k, v = qkv.view(R, T, -1, cfg.head_dim).split(
        [cfg.num_heads, cfg.num_kv_heads, cfg.num_kv_heads], dim=2)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    new_k = new_v = None
    if ctx.fresh:
        # every row from slot 0 (the CUDA prefill takes `fused_prefill_sdpa_qkv` for even head dims)
        new_k, new_v = k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()
        slots = torch.arange(T, device=qkv.device).expand(R, T)
        rows = table if ctx.slot is None else table.index_select(0, ctx.slot)  # (a device index: graph-safe)
    else:   # the new tokens at each row's own slots
        slots, rows = ctx.slots, table
    write_slots(k_cache, rows, slots, k)
    write_slots(v_cache, rows, slots, v)
    return q.transpose(1, 2).contiguous(), new_k, new_v


def fused_prefill_sdpa_qkv(qkv, cos, sin, k_cache, v_cache, table, ctx, cfg: LMConfig):
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
    rope_kv_write(qkv, cos, sin, k_cache, v_cache, table, ctx.starts32, h, kv, out=q, rows=ctx.slot,
                  k_out=new_k, v_out=new_v)
    return q.transpose(1, 2), new_k, new_v


class MLP(nn.Module):
    def __init__(self, cfg: LMConfig):
        super().__init__()
        inter = cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * inter, bias=False, parallel="column", parts=(inter, inter))
        self.down_proj = Linear(inter, cfg.hidden_size, bias=False, parallel="row")

    def forward(self, x, invariant: bool = False):
        kind = gemv_kind(x, self.gate_up_proj.weight, invariant=invariant)
        if kind == "invariant":  # any rows: the gate in the invariant product's epilogue
            return self.down_proj(self.gate_up_proj(x, glu=True, invariant=True), invariant=True)
        if kind == "rows":  # 2-64 rows: the SiLU gate in the gate/up GEMV's epilogue
            return self.down_proj(self.gate_up_proj(x, glu=True))
        gate_up = self.gate_up_proj(x)
        if kind == "row":  # one row: the SiLU gate as the down projection's GEMV loads its input
            return self.down_proj(gate_up, gated=True)
        return self.down_proj(silu_mul(gate_up))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: LMConfig):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, delta, cos, sin, k_cache, v_cache, table, ctx):
        # x + attn(norm(x)), then + mlp(norm(.)), with each residual add deferred into the
        # RMSNorm that follows it (one kernel on CUDA instead of an add and a norm): x is the
        # residual stream [R, T, hidden] still missing `delta`, the previous layer's MLP output
        # (None before the first layer), and the layer returns (x, its MLP output) the same way.
        x, h = self.input_layernorm.add_forward(x, delta)
        x, h = self.post_attention_layernorm.add_forward(x, self.self_attn(h, cos, sin, k_cache, v_cache, table, ctx))
        return x, self.mlp(h, ctx.invariant)


