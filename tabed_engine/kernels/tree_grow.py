"""Draft-tree bookkeeping, one program per request: depth 0 (`tree_start`) and one more depth
(`tree_grow`). The state layout and the references are in `tabed_engine.ops.tree_grow`.

Every tile is at most 64 elements (TreeConfig: at most 64 nodes and 64 draft slots), so each
launch is one short program per request. The next frontier is a rank selection: node i is kept
when fewer than `width` new nodes beat it (a higher score, or an equal one and a lower id), and
its place among the kept is the number kept before it; exact ties go to the lowest node id. A
step reads only the slots and nodes earlier depths wrote and writes only new ones, so its
programs need no barrier.
"""
import torch
import triton
import triton.language as tl

from ._common import pdl, pdl_wait


@triton.jit
def _tree_start_kernel(tokens_ptr, parents_ptr, score_ptr, fedpos_ptr, fed_ptr, ids_ptr, pos_ptr, bits_ptr,
                       inp2_ptr, lens_ptr, N, F, TX, K, PAD, WIDTH, stride_inp2,
                       NP: tl.constexpr, PDL: tl.constexpr):
    """Request program_id(0): the root node and fed node 0, every slot of its K view rows."""
    pdl_wait(PDL)
    b = tl.program_id(0).to(tl.int64)
    n = tl.arange(0, NP)
    root = tl.load(inp2_ptr + b * K * stride_inp2 + 1)
    tl.store(tokens_ptr + b * N + n, tl.where(n == 0, root, 0), mask=n < N)
    tl.store(parents_ptr + b * N + n, tl.full([NP], -1, tl.int64), mask=n < N)
    tl.store(score_ptr + b * N + n, tl.zeros([NP], tl.float32), mask=n < N)
    tl.store(fedpos_ptr + b * N + n, tl.where(n == 0, 0, -1).to(tl.int64), mask=n < N)
    tl.store(fed_ptr + b * F + n, tl.zeros([NP], tl.int64), mask=n < F)
    rel = tl.where(n <= 1 + PAD, (n > 0).to(tl.int64), 2 + (tl.maximum(n - 2 - PAD, 0) // WIDTH).to(tl.int64))
    bits = tl.where(n == 1, 3, tl.full([NP], 1, tl.int64) << n.to(tl.int64))
    for k in range(K):
        r = b * K + k
        prev = tl.load(inp2_ptr + r * stride_inp2)      # each view row's own previous token
        ids = tl.where(n == 0, prev, tl.where(n == 1, root, 0))
        tl.store(ids_ptr + r * TX + n, ids, mask=n < TX)
        tl.store(pos_ptr + r * TX + n, tl.load(lens_ptr + r).to(tl.int64) + rel, mask=n < TX)
        tl.store(bits_ptr + r * TX + n, bits, mask=n < TX)


@triton.jit
def _tree_grow_kernel(tokens_ptr, parents_ptr, score_ptr, fedpos_ptr, fed_ptr, ids_ptr, bits_ptr,
                      kids_ptr, logq_ptr, N, F, TX, K, PAD, T, KC, N_NODES, N_FED, WIDTH,
                      LAST: tl.constexpr, TKP: tl.constexpr, PDL: tl.constexpr):
    """Request program_id(0): child i = t * KC + j of frontier node t (fed node N_FED - T + t)
    becomes node N_NODES + i; unless LAST, the next frontier (the module docstring's rule) is
    appended as fed nodes N_FED .. N_FED + WIDTH - 1 to the K view rows."""
    pdl_wait(PDL)
    b = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, TKP)
    valid = i < T * KC
    parent = tl.load(fed_ptr + b * F + N_FED - T + i // KC, mask=valid, other=0)
    kid = tl.load(kids_ptr + b * T * KC + i, mask=valid, other=0)
    score = tl.load(score_ptr + b * N + parent, mask=valid, other=0.0) \
        + tl.load(logq_ptr + b * T * KC + i, mask=valid, other=0.0)
    node = N_NODES + i
    tl.store(tokens_ptr + b * N + node, kid, mask=valid)
    tl.store(parents_ptr + b * N + node, parent, mask=valid)
    tl.store(score_ptr + b * N + node, score, mask=valid)
    if not LAST:
        s_i, s_j = score[:, None], score[None, :]
        before = i[None, :] < i[:, None]                                   # [i, j]: j is an earlier node
        beats = valid[None, :] & ((s_j > s_i) | ((s_j == s_i) & before))
        keep = valid & (tl.sum(beats.to(tl.int32), axis=1) < WIDTH)
        f = N_FED + tl.sum((keep[None, :] & before).to(tl.int32), axis=1)  # its fed index
        tl.store(fed_ptr + b * F + f, node.to(tl.int64), mask=keep)
        tl.store(fedpos_ptr + b * N + node, f.to(tl.int64), mask=keep)
        par_fed = tl.load(fedpos_ptr + b * N + parent, mask=keep, other=0)
        par_slot = tl.where(par_fed > 0, 1 + PAD + par_fed, 1)             # the root: slot 1
        slot = 1 + PAD + f
        bits = tl.load(bits_ptr + b * K * TX + par_slot, mask=keep, other=0) \
            | (tl.full([TKP], 1, tl.int64) << slot.to(tl.int64))
        for k in range(K):
            r = b * K + k
            tl.store(ids_ptr + r * TX + slot, kid, mask=keep)
            tl.store(bits_ptr + r * TX + slot, bits, mask=keep)


def _check_state(tokens, parents, score, fedpos, fed, ids, bits, pos=None):
    B, N = tokens.shape
    R, TX = ids.shape
    i64 = [tokens, parents, fedpos, fed, ids, bits] + ([pos] if pos is not None else [])
    if any(t.dtype != torch.int64 for t in i64) or score.dtype != torch.float32:
        raise TypeError("tree state: int64 tensors and a float32 score")
    if (parents.shape != (B, N) or score.shape != (B, N) or fedpos.shape != (B, N) or fed.shape[0] != B
            or bits.shape != (R, TX) or (pos is not None and pos.shape != (R, TX)) or B == 0 or R % B):
        raise ValueError("tree state shapes do not match")
    if max(N, TX, fed.shape[1]) > 64:
        raise ValueError("a tree holds at most 64 nodes and 64 draft slots")
    if not all(t.is_contiguous() for t in i64 + [score]):
        raise ValueError("tree state tensors must be contiguous")
    return B, N, fed.shape[1], R // B, TX


def tree_start(tokens, parents, score, fedpos, fed, ids, pos, bits, inp2, lens, *, pad, width):
    """Triton launcher; see `tabed_engine.ops.tree_grow.tree_start_reference` for the contract
    (the state's tensors one by one, contiguous)."""
    B, N, F, K, TX = _check_state(tokens, parents, score, fedpos, fed, ids, bits, pos)
    if inp2.shape != (B * K, 2) or inp2.stride(1) != 1 or lens.shape != (B * K,):
        raise ValueError(f"inp2 must be [{B * K}, 2] with unit last stride and lens [{B * K}]")
    use_pdl = pdl(tokens.device)
    _tree_start_kernel[(B,)](
        tokens, parents, score, fedpos, fed, ids, pos, bits, inp2, lens, N, F, TX, K, pad, width, inp2.stride(0),
        NP=triton.next_power_of_2(max(N, F, TX)), PDL=use_pdl, launch_pdl=use_pdl, num_warps=1,
    )


def tree_grow(tokens, parents, score, fedpos, fed, ids, bits, kids, logq, *, pad, n_nodes, n_fed, width, last):
    """Triton launcher; see `tabed_engine.ops.tree_grow.tree_grow_reference` for the contract
    (kids [B, T, k] int64 and logq [B, T, k] fp32 contiguous)."""
    B, N, F, K, TX = _check_state(tokens, parents, score, fedpos, fed, ids, bits)
    _, T, KC = kids.shape
    if kids.shape[0] != B or logq.shape != kids.shape or not (kids.is_contiguous() and logq.is_contiguous()):
        raise ValueError(f"kids and logq must be contiguous [{B}, T, k], got {tuple(kids.shape)}, {tuple(logq.shape)}")
    if kids.dtype != torch.int64 or logq.dtype != torch.float32:
        raise TypeError("kids must be int64 and logq float32")
    if n_nodes + T * KC > N or n_fed < T or (not last and (n_fed + width > F or width > T * KC)):
        raise ValueError(f"depth out of the tree: {T}x{KC} children at node {n_nodes} of {N}, fed {n_fed} of {F}")
    use_pdl = pdl(tokens.device)
    _tree_grow_kernel[(B,)](
        tokens, parents, score, fedpos, fed, ids, bits, kids, logq, N, F, TX, K, pad, T, KC, n_nodes, n_fed, width,
        LAST=bool(last), TKP=triton.next_power_of_2(T * KC), PDL=use_pdl, launch_pdl=use_pdl, num_warps=4,
    )
