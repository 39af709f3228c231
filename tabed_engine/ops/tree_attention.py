"""Tree attention over the paged KV cache (decode, chain verification, tree verification).

The cache of a layer is a pool of pages [P, Hkv, PAGE, D]; row r's slot s is in page
`block_table[r, s // PAGE]` at offset s % PAGE (`tabed_engine.ops.paged`).

Row r has a committed prefix of `lengths[r]` cache slots; its N query nodes' own K/V sit at
slots lengths[r] + j. Node i sees the whole prefix plus the nodes j whose bit is set in
`tree_mask[r, i]` (itself and its ancestors). A chain is the lower-triangular mask, plain
decode is N = 1 with mask 1. A causal call (`causal=True`, no mask) is a prompt chunk: node i
sees the prefix and the nodes j <= i, for any N up to the cache span.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tabed_engine.ops.paged import gather_rows


def tree_attention_mask(lengths: torch.Tensor, tree_mask: torch.Tensor, span: int,
                        tree_slots: int | None = None) -> torch.Tensor:
    """Dense visibility mask of the first `span` cache slots.

    Parameters
    ----------
    lengths : torch.Tensor
        [R] int32/int64, committed prefix length per row.
    tree_mask : torch.Tensor
        [R, N] int64, bit j of tree_mask[r, i] set iff node i attends to node j.
    span : int
        Number of cache slots covered.
    tree_slots : int, optional
        Tree slots lengths[r] + j the bits may name (default N).

    Returns
    -------
    torch.Tensor
        [R, N, span] bool, True where node i of row r may attend to slot s.
    """
    R, N = tree_mask.shape
    tree_slots = N if tree_slots is None else tree_slots
    slot = torch.arange(span, device=tree_mask.device)  # [span]
    j = slot[None, :] - lengths.to(torch.int64)[:, None]  # [R, span] tree slot of each cache slot
    in_tree = (j >= 0) & (j < tree_slots)
    bit = (tree_mask[:, :, None] >> j.clamp(0, 63)[:, None, :]) & 1  # [R, N, span]
    return (j < 0)[:, None, :] | (in_tree[:, None, :] & (bit != 0))


def causal_attention_mask(lengths: torch.Tensor, n: int, span: int) -> torch.Tensor:
    """[R, n, span] bool: node i of row r sees slots s < lengths[r] + i + 1."""
    slot = torch.arange(span, device=lengths.device)
    node = torch.arange(n, device=lengths.device)
    return slot[None, None, :] <= lengths.to(torch.int64)[:, None, None] + node[None, :, None]


def tree_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    lengths: torch.Tensor,
    tree_mask: torch.Tensor | None = None,
    *,
    scale: float | None = None,
    span: int | None = None,
    upcast: bool = True,
    tree_slots: int | None = None,
    causal: bool = False,
) -> torch.Tensor:
    """Plain-PyTorch tree attention: a dense boolean mask and SDPA.

    Parameters
    ----------
    q : torch.Tensor
        [R, N, H, D] queries of the N nodes of each row (float16/bfloat16/float32).
    k_cache, v_cache : torch.Tensor
        [P, Hkv, PAGE, D] one layer's page pool, H a multiple of Hkv (query head h reads kv
        head h // (H // Hkv)). The nodes' own K/V are already at slots lengths[r] + j.
    block_table : torch.Tensor
        [R, W] int32: row r's slot s lives in page block_table[r, s // PAGE] (S = W * PAGE).
    lengths : torch.Tensor
        [R] int32, committed prefix length per row.
    tree_mask : torch.Tensor or None
        [R, N] int64, bit j of tree_mask[r, i] set iff node i attends to node j; None when
        `causal`.
    scale : float, optional
        Softmax scale, default 1 / sqrt(D).
    span : int, optional
        Cache slots to look at, at least max(lengths) + N. Default computes that bound,
        which syncs with the host; pass it to stay sync-free (e.g. under torch.compile).
    upcast : bool
        Compute in float32 and cast the result back (default); else in q's dtype.
    tree_slots : int, optional
        Tree slots lengths[r] + j the bits may name (default N): the N queries are the last
        of them, the slots before hold nodes fed earlier.
    causal : bool
        Node i sees slots [0, lengths[r] + i] (a prompt chunk); no tree_mask / tree_slots.

    Returns
    -------
    torch.Tensor
        [R, N, H, D] in q's dtype.
    """
    R, N, H, D = q.shape
    Hkv, S = k_cache.shape[1], block_table.shape[1] * k_cache.shape[2]
    if causal and (tree_mask is not None or tree_slots is not None):
        raise ValueError("tree_attention_reference: causal calls take no tree_mask / tree_slots")
    if not causal and tree_mask is None:
        raise ValueError("tree_attention_reference: tree_mask is required unless causal=True")
    tree_slots = N if tree_slots is None else tree_slots
    if span is None:
        span = min(S, int(lengths.max()) + tree_slots) if R else 0
    if causal:
        mask = causal_attention_mask(lengths, N, span)  # [R, N, span]
    else:
        mask = tree_attention_mask(lengths, tree_mask, span, tree_slots)
    # Slots past a row's tree may hold garbage (even NaN); a zero softmax weight times NaN is
    # still NaN, so those K/V are zeroed rather than only masked.
    live = (torch.arange(span, device=q.device)[None, :] < (lengths.to(torch.int64) + tree_slots)[:, None])
    live = live[:, None, :, None]  # [R, 1, span, 1]
    k = torch.where(live, gather_rows(k_cache, block_table, span), 0)
    v = torch.where(live, gather_rows(v_cache, block_table, span), 0)
    if H != Hkv:
        k = k.repeat_interleave(H // Hkv, dim=1)
        v = v.repeat_interleave(H // Hkv, dim=1)
    qt = q.transpose(1, 2)  # [R, H, N, D]
    if upcast:
        qt, k, v = qt.float(), k.float(), v.float()
    out = F.scaled_dot_product_attention(qt, k, v, attn_mask=mask[:, None], scale=scale)
    return out.transpose(1, 2).to(q.dtype).contiguous()


def tree_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    lengths: torch.Tensor,
    tree_mask: torch.Tensor | None = None,
    *,
    scale: float | None = None,
    out: torch.Tensor | None = None,
    tree_slots: int | None = None,
    invariant: bool = False,
    causal: bool = False,
    paths: bool = False,
) -> torch.Tensor:
    """Tree attention: the Triton kernel for CUDA tensors, else the reference.

    Parameters
    ----------
    q : torch.Tensor
        [R, N, H, D], N <= 64 (causal: up to the cache span), any strides with a contiguous
        last dimension.
    k_cache, v_cache : torch.Tensor
        [P, Hkv, PAGE, D] page pools, e.g. `cache.k[layer]` of a [L, P, Hkv, PAGE, D] tensor
        (strides honoured; PAGE a multiple of 64 on CUDA).
    block_table : torch.Tensor
        [R, W] int32 on q's device (unit last stride): row r's slot s is in page
        block_table[r, s // PAGE]. Read on the device only (CUDA-graph safe).
    lengths : torch.Tensor
        [R] int32 on q's device, committed prefix length per row.
    tree_mask : torch.Tensor or None
        [R, N] int64, bit j of tree_mask[r, i] set iff node i attends to node j (own bit
        included). Slots >= lengths[r] + tree_slots are never read. None when `causal`.
    scale : float, optional
        Softmax scale, default 1 / sqrt(D).
    out : torch.Tensor, optional
        [R, N, H, D] buffer in q's dtype to write into (e.g. a CUDA-graph static buffer).
    tree_slots : int, optional
        Tree slots lengths[r] + j the bits may name, N to 64 (default N): the N queries sit at
        the last N of them, nodes fed by an earlier call before (a tree drafted depth by depth).
    invariant : bool
        On CUDA, one launch config whatever R and N (`kernels.tree_attention.invariant_launch`):
        a chain node's output has the bits of an AR step at its length, alone or in a batch
        (a causal node too: a prompt token's bits do not depend on how the prompt was chunked).
    causal : bool
        A prompt chunk over a cached prefix: node i sees slots [0, lengths[r] + i] (its own
        K/V and the earlier nodes' already written), N up to the cache span. Takes no
        tree_mask / tree_slots; slots >= lengths[r] + N are never read.
    paths : bool
        A tree whose bits are each node's path (ancestors at lower slots): on CUDA a node's
        keys past the prefix are summed in the order an AR step at lengths[r] + depth holds
        them, so with `invariant` a tree node gets that step's bits. The same keys either way:
        the reference ignores it.

    Returns
    -------
    torch.Tensor
        [R, N, H, D] in q's dtype.
    """
    if q.is_cuda:
        from tabed_engine.kernels import tree_attention as _k

        return _k.tree_attention(q, k_cache, v_cache, block_table, lengths, tree_mask, scale=scale, out=out,
                                 tree_slots=tree_slots, invariant=invariant, causal=causal, paths=paths)
    result = tree_attention_reference(q, k_cache, v_cache, block_table, lengths, tree_mask, scale=scale,
                                      tree_slots=tree_slots, causal=causal)
    if out is None:
        return result
    return out.copy_(result)
