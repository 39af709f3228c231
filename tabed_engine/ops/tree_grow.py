"""Bookkeeping of a draft tree under construction (`tree.tree_draft`): the tree's nodes, the
frontier each depth feeds, and the draft's input sequence with its packed tree mask.

`tree_start` lays out depth 0 (the root) and `tree_grow` adds one depth: the frontier's children
as new nodes, then (but at the last depth) the next frontier, the `width` new nodes of highest
cumulative log q in node order, appended to every view row's input sequence. The Triton kernels
(CUDA) do each in one launch, one program per request; the references are the PyTorch ops.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class TreeState:
    """One tree per request (B requests, K view rows each), fixed shapes, on the device.

    Nodes (N, in id order: root, its children, then each depth's): tokens, parents (-1 at
    the root), score (cumulative log q, fp32), fedpos (fed index, -1 for a node never fed).
    Fed nodes (F: the root, then each depth's frontier): fed (their node ids). The draft's input
    per view row (Tx slots: prev, the root, `pad` padding slots, fed nodes 1 .. F - 1): ids,
    pos (RoPE positions: the row's length plus 0 for prev, 1 for the root and padding, d + 1
    for a node of depth d) and bits (bit j of slot i: slot i sees slot j), int64 [B*K, Tx];
    the view rows of a request hold the same bits, and the same ids but for their own
    previous token in slot 0."""

    tokens: torch.Tensor     # [B, N] int64
    parents: torch.Tensor    # [B, N] int64
    score: torch.Tensor      # [B, N] fp32
    fedpos: torch.Tensor     # [B, N] int64
    fed: torch.Tensor        # [B, F] int64
    ids: torch.Tensor        # [B*K, Tx] int64
    pos: torch.Tensor        # [B*K, Tx] int64
    bits: torch.Tensor       # [B*K, Tx] int64

    @classmethod
    def empty(cls, B: int, K: int, N: int, F: int, Tx: int, device) -> "TreeState":
        """Unwritten tensors (`tree_start` writes every element)."""
        def e(*shape, dtype=torch.int64):
            return torch.empty(*shape, dtype=dtype, device=device)
        return cls(e(B, N), e(B, N), e(B, N, dtype=torch.float32), e(B, N), e(B, F), e(B * K, Tx), e(B * K, Tx),
                   e(B * K, Tx))

    def feed(self, lo: int, hi: int):
        """Slots [lo, hi) of every row: (input ids, positions, tree bits), views [B*K, hi - lo]."""
        return self.ids[:, lo:hi], self.pos[:, lo:hi], self.bits[:, lo:hi]


def tree_start_reference(st: TreeState, inp2: torch.Tensor, lens: torch.Tensor, *, pad: int, width: int):
    """Depth 0: the root (request b's last token inp2[b*K, 1]) is node 0 and fed node 0; every
    view row of request b feeds its own previous token inp2[b*K + k, 0] and the root (a view's
    prompt may end in another token than view 0's). inp2 [B*K, 2], lens [B*K]."""
    B, Tx = st.tokens.shape[0], st.ids.shape[1]
    K = st.ids.shape[0] // B
    first = inp2.view(B, K, 2)[:, 0]
    st.tokens.zero_()
    st.tokens[:, 0] = first[:, 1]
    st.parents.fill_(-1)
    st.score.zero_()
    st.fedpos.fill_(-1)
    st.fedpos[:, 0] = 0
    st.fed.zero_()
    st.ids.zero_()
    st.ids[:, 0] = inp2[:, 0]
    st.ids[:, 1] = first[:, 1].repeat_interleave(K, 0)
    slot = torch.arange(Tx, device=inp2.device)
    # prev 0, the root and the padding 1, fed node f >= 1 (fed at depth (f - 1) // width + 1) its depth + 1
    rel = torch.where(slot <= 1 + pad, (slot > 0).long(), 2 + (slot - 2 - pad).div(width, rounding_mode="floor"))
    st.pos.copy_(lens[:, None] + rel)
    st.bits.copy_((1 << slot).expand_as(st.bits))     # every slot sees itself,
    st.bits[:, 1] = 3                                  # the root prev too


def tree_grow_reference(st: TreeState, kids: torch.Tensor, logq: torch.Tensor, *, pad: int, n_nodes: int,
                        n_fed: int, width: int, last: bool):
    """One depth: the children kids [B, T, k] (log q logq [B, T, k]) of the T frontier nodes
    (fed nodes n_fed - T .. n_fed - 1) become nodes n_nodes .. n_nodes + T*k - 1; unless `last`,
    the `width` of them with the highest score (ties: torch.topk's order) become fed nodes
    n_fed .. n_fed + width - 1, in node order, at slots 1 + pad + their fed index, each seeing
    its parent's slot's slots and itself."""
    B, T, k = kids.shape
    K = st.ids.shape[0] // B
    dev = kids.device
    ids = torch.arange(n_nodes, n_nodes + T * k, device=dev)
    frontier = st.fed[:, n_fed - T:n_fed]
    st.tokens[:, ids] = kids.reshape(B, T * k)
    st.parents[:, ids] = frontier.repeat_interleave(k, 1)
    st.score[:, ids] = (st.score.gather(1, frontier)[:, :, None] + logq).reshape(B, T * k)
    if last:
        return
    nodes = ids[st.score[:, ids].topk(width, dim=-1).indices.sort(-1).values]    # [B, width]
    f_ids = torch.arange(n_fed, n_fed + width, device=dev)
    st.fed[:, f_ids] = nodes
    st.fedpos.scatter_(1, nodes, f_ids.expand(B, width))
    slots = 1 + pad + f_ids
    st.ids[:, slots] = st.tokens.gather(1, nodes).repeat_interleave(K, 0)
    par_fed = st.fedpos.gather(1, st.parents.gather(1, nodes))
    par_slot = 1 + torch.where(par_fed > 0, par_fed + pad, par_fed)                 # the root: slot 1
    st.bits[:, slots] = (st.bits[::K].gather(1, par_slot) | (1 << slots)).repeat_interleave(K, 0)


def _use_kernel(x: torch.Tensor, kernel: Optional[bool]) -> bool:
    return x.is_cuda if kernel is None else kernel


def tree_start(st: TreeState, inp2: torch.Tensor, lens: torch.Tensor, *, pad: int, width: int,
               kernel: Optional[bool] = None):
    """Write every element of `st` for depth 0 (see `tree_start_reference`). kernel: None picks
    the Triton kernel for CUDA tensors, the reference otherwise; True forces the kernel (tests
    run it under the Triton interpreter)."""
    if _use_kernel(inp2, kernel):
        from tabed_engine.kernels.tree_grow import tree_start as fn
        fn(st.tokens, st.parents, st.score, st.fedpos, st.fed, st.ids, st.pos, st.bits, inp2, lens, pad=pad,
           width=width)
    else:
        tree_start_reference(st, inp2, lens, pad=pad, width=width)


def tree_grow(st: TreeState, kids: torch.Tensor, logq: torch.Tensor, *, pad: int, n_nodes: int, n_fed: int,
              width: int, last: bool, kernel: Optional[bool] = None):
    """Add one depth to `st` (see `tree_grow_reference`); the kernel breaks exact score ties by
    the lowest node id. kernel: as in `tree_start`."""
    if _use_kernel(kids, kernel):
        from tabed_engine.kernels.tree_grow import tree_grow as fn
        fn(st.tokens, st.parents, st.score, st.fedpos, st.fed, st.ids, st.bits, kids, logq, pad=pad,
           n_nodes=n_nodes, n_fed=n_fed, width=width, last=last)
    else:
        tree_grow_reference(st, kids, logq, pad=pad, n_nodes=n_nodes, n_fed=n_fed, width=width, last=last)
