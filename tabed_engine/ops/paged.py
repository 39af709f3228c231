"""Addressing a paged KV cache in PyTorch (the references and the SDPA prefill path).

A layer's cache is a pool of pages `[P, Hkv, PAGE, D]`; `block_table [R, W]` int32 maps row r's
slot s to page `block_table[r, s // PAGE]`, offset `s % PAGE`. These helpers turn slots into
(page, offset) pairs for indexed writes and gather a row's slots back into the contiguous
`[R, Hkv, S, D]` layout SDPA reads.
"""
from __future__ import annotations

import torch


def slot_pages(block_table: torch.Tensor, slots: torch.Tensor, page: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(pages, offsets) of slots [R, T] (int64, >= 0) of the table's rows [R, W]: both [R, T]
    int64. A slot past the row's W * page lands in scratch page 0, as the kernels drop it."""
    W = block_table.shape[1]
    col = torch.div(slots, page, rounding_mode="floor")
    pages = block_table.long().gather(1, col.clamp(max=W - 1))
    return torch.where(col < W, pages, 0), slots % page


def write_slots(pool: torch.Tensor, block_table: torch.Tensor, slots: torch.Tensor, values: torch.Tensor):
    """pool [P, Hkv, PAGE, D] at rows' slots [R, T] <- values [R, T, Hkv, D], in place."""
    pages, offs = slot_pages(block_table, slots, pool.shape[2])
    pool[pages, :, offs] = values.to(pool.dtype)


def gather_rows(pool: torch.Tensor, block_table: torch.Tensor, span: int) -> torch.Tensor:
    """Slots [0, span) of every table row as a contiguous [R, Hkv, span, D] tensor (a copy)."""
    page = pool.shape[2]
    n = -(-span // page)
    x = pool[block_table[:, :n].long()]                   # [R, n, Hkv, PAGE, D]
    R, _, H, _, D = x.shape
    return x.transpose(1, 2).reshape(R, H, n * page, D)[:, :, :span]
