"""Accepted-path KV compaction after tree verification.

`compact_kv` runs the compiled kernel of `tabed_engine._C` (csrc/compact_kv.*) for the
caches' device when the extension is loaded, else `compact_kv_reference`.
"""
from __future__ import annotations

import torch

from tabed_engine.ops import _ext
from tabed_engine.ops.paged import slot_pages

__all__ = ["compact_kv", "compact_kv_reference"]


def compact_kv(k_cache, v_cache, block_table, lengths, path, num_accepted):
    """Move each row's accepted tree nodes' KV to contiguous slots, in place.

    Parameters
    ----------
    k_cache, v_cache : [L, P, Hkv, PAGE, D] page pools, one float dtype, head_dim contiguous
        Tree node j of row r sits at slot ``lengths[r] + j``.
    block_table : int32 [R, W], unit last stride
        Row r's slot s lives in page ``block_table[r, s // PAGE]`` at offset ``s % PAGE``;
        a row spans S = W * PAGE slots.
    lengths : int32 [R]
        Committed prefix length of each row (not modified).
    path : int64 [R, N]
        Accepted node indices starting with the root 0, padded with -1
        (`verify_tree`'s output).
    num_accepted : int64 [R]
        Accepted non-root nodes; entries ``0..num_accepted[r]`` of ``path`` move.

    For every layer and head, slot ``lengths[r] + path[r, i]`` moves to slot
    ``lengths[r] + i``. All sources are read before any destination is written.
    Entries with ``path[r, i] < 0``, ``lengths[r] < 0`` or a slot outside ``[0, S)``
    are skipped; ``num_accepted`` is clamped to ``[0, N - 1]``.
    """
    if _ext.use_ext(k_cache.device):
        torch.ops.tabed_engine.compact_kv(k_cache, v_cache, block_table, lengths, path, num_accepted)
    else:
        compact_kv_reference(k_cache, v_cache, block_table, lengths, path, num_accepted)


def _check(k_cache, v_cache, block_table, lengths, path, num_accepted):
    if k_cache.dim() != 5 or v_cache.shape != k_cache.shape:
        raise ValueError(f"k_cache and v_cache must both be page pools [L, P, Hkv, PAGE, D], got "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if block_table.dim() != 2 or block_table.dtype != torch.int32:
        raise ValueError(f"block_table must be int32 [R, W], got {block_table.dtype} {tuple(block_table.shape)}")
    R = block_table.shape[0]
    if lengths.shape != (R,) or num_accepted.shape != (R,) or path.dim() != 2 or path.shape[0] != R:
        raise ValueError(f"lengths [R], num_accepted [R], path [R, N] with R = {R}, got "
                         f"{tuple(lengths.shape)}, {tuple(num_accepted.shape)}, {tuple(path.shape)}")
    if lengths.dtype != torch.int32 or path.dtype != torch.int64 or num_accepted.dtype != torch.int64:
        raise TypeError(f"lengths must be int32, path and num_accepted int64; got {lengths.dtype}, "
                        f"{path.dtype}, {num_accepted.dtype}")


def compact_kv_reference(k_cache, v_cache, block_table, lengths, path, num_accepted):
    """Plain-PyTorch `compact_kv` (same arguments, same in-place result).

    Vectorised without host syncs: every row rewrites its N-slot window at
    ``lengths[r] + j`` (clamped into the row's S slots), skipped entries writing back their
    own old value. Window slots past the end of the row all land on slot S - 1 and carry
    that slot's value, so duplicate writes agree.
    """
    _check(k_cache, v_cache, block_table, lengths, path, num_accepted)
    page = k_cache.shape[3]
    S = block_table.shape[1] * page
    R, N = path.shape
    dev = k_cache.device
    j = torch.arange(N, device=dev)[None, :]                  # [1, N]
    length = lengths.to(torch.int64)[:, None]                 # [R, 1]
    n = num_accepted.clamp(0, N - 1)[:, None] + 1             # entries per row
    src, dst = length + path, length + j
    move = (j < n) & (length >= 0) & (path >= 0) & (path != j) & (src < S) & (dst < S)
    rel = torch.where(move, path, j)                          # source, relative to length
    last_in = (S - 1 - length).clamp(0, N - 1)                # last j whose dst is in the row
    rel = rel.gather(1, torch.minimum(j.expand(R, N), last_in))
    dst_page, dst_off = slot_pages(block_table, (length + j).clamp(0, S - 1), page)
    src_page, src_off = slot_pages(block_table, (length + rel).clamp(0, S - 1), page)
    for cache in (k_cache, v_cache):
        moved = cache[:, src_page, :, src_off]                # [R, N, L, Hkv, D], a copy
        cache[:, dst_page, :, dst_off] = moved
