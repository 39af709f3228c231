"""Dynamic draft trees over the TABED ensemble (Spec-LLaVA / EAGLE-2 style expansion).

One tree block, fixed shapes for (B, K, depth, width, branch), no host sync:

* Draft (`tree_draft`, one CUDA graph). Depth 0 feeds each view row its last two tokens;
  the views' next-token distributions at the root are mixed, q = Σ_k w_k softmax(z_k / T),
  and the root gets `width` children. At every later depth the `width` frontier nodes are
  fed, alone (the nodes fed before them are in the draft's cache already; the tree bits show
  each node only its ancestors), each gets `branch` children from its own mixture, and the
  `width` children with the highest cumulative log q become the next frontier. Children are
  the top tokens of q (greedy) or a draw without replacement from q (sampling: Gumbel-top-k,
  noise from a counter-based hash of a device seed and offset).
  The tree holds every child drawn: N = 1 + width + (depth - 1) * width * branch nodes.
* Verify (`tree_verify`, one CUDA graph): the target's forward over the N nodes under the
  tree mask, `verify_tree` (greedy walk, or recursive rejection sampling over siblings
  against the same mixture q the children were drawn from), `compact_kv` moving the
  accepted path's KV next to the root in the target cache and in the draft rows.
* History (`tree_history`): the divergences at the accepted path's nodes (and the node
  after it where the draft fed it), the chain's "accepted positions plus the first rejected".

Why no re-ranking of the candidates to a smaller budget (EAGLE-2's last step): with a fixed
node count the target's cost is the same whichever nodes are kept, and in sampling mode
whether a child is kept must not depend on the value drawn for it (recursive rejection
sampling is exact only for children drawn without replacement whose number is fixed before
they are drawn); the frontier choice depends only on nodes whose children come later.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from tabed_engine.ops.compact_kv import compact_kv
from tabed_engine.ops.mix_topk import mix_topk
from tabed_engine.ops.tree_grow import TreeState, tree_grow, tree_start
from tabed_engine.ops.verify_tree import verify_tree
from tabed_engine.speculation.coupling import coupled_proposals, coupled_scores, tree_child_scores
from tabed_engine.speculation.ensemble import confidence_weights
from tabed_engine.speculation.sampling import row_filtered_probs


@dataclass(frozen=True)
class TreeConfig:
    """Shape of the draft tree: `depth` levels below the root (the most tokens one block can
    accept before the bonus token), `width` frontier nodes expanded per level (the root has
    `width` children), `branch` children per expanded node. N = 1 + width +
    (depth - 1) * width * branch target nodes per block (at most 64).

    The default, 10x3x2 (58 nodes), drafted the most tokens per unit of block time among the
    shapes measured: block efficiency on the procedural world
    (benchmarks/results/tree_scenarios_cpu_deeper.md, tree_scenarios_cpu_fp32_{deep,shapes}.md)
    over the block's cost on the H200 at the LLaVA-1.5-7B shape
    (benchmarks/results/e2e_llava-1.5-7b_trees.md)."""

    depth: int = 10
    width: int = 3
    branch: int = 2

    def __post_init__(self):
        for name in ("depth", "width", "branch"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"TreeConfig.{name} must be a positive int, got {v!r}")
        if self.nodes > 64 or self.draft_rows > 64:
            raise ValueError(f"a tree of depth {self.depth}, width {self.width}, branch {self.branch} has "
                             f"{self.nodes} nodes ({self.draft_rows} draft tree slots); at most 64 "
                             "fit one pass (lower one of them)")

    @property
    def nodes(self) -> int:
        """Target nodes per block, the root included."""
        return 1 + self.width + (self.depth - 1) * self.width * self.branch

    @property
    def fed(self) -> int:
        """Draft nodes fed per block: the root and every frontier node."""
        return 1 + self.width * max(self.depth - 1, 0)

    @property
    def draft_rows(self) -> int:
        """Tree slots per draft row (the draft's attention mask spans them): prev, root,
        depth - 1 padding slots and the frontier nodes."""
        return 1 + (self.depth - 1) + self.fed

    def node_depths(self) -> list[int]:
        """Depth of every target node (root 0), in node order."""
        wb = self.width * self.branch
        return [0] + [1] * self.width + [d for d in range(2, self.depth + 1) for _ in range(wb)]


_NODE_DEPTH: dict = {}


def node_depth_tensor(cfg: TreeConfig, device) -> torch.Tensor:
    """`cfg.node_depths()` as an int64 device tensor, cached: a captured verification graph
    reads it by address on every replay, so it must outlive the generation that captured it."""
    key = (cfg, str(device))
    if key not in _NODE_DEPTH:
        _NODE_DEPTH[key] = torch.tensor(cfg.node_depths(), device=device)
    return _NODE_DEPTH[key]


def parse_tree(value) -> "TreeConfig | None":
    """`tree=` argument: None/False (chains), True or "default" (TreeConfig()), a TreeConfig,
    a dict of its fields, or "DEPTHxWIDTHxBRANCH" (e.g. "5x4x2")."""
    if value is None or value is False:
        return None
    if value is True or value == "default":
        return TreeConfig()
    if isinstance(value, TreeConfig):
        return value
    if isinstance(value, dict):
        return TreeConfig(**value)
    if isinstance(value, str):
        parts = value.lower().split("x")
        if len(parts) == 3 and all(p.strip().isdigit() for p in parts):
            return TreeConfig(*(int(p) for p in parts))
        raise ValueError(f"tree must look like 'DEPTHxWIDTHxBRANCH' (e.g. '5x4x2'), got {value!r}")
    raise TypeError(f"tree must be None, True, a TreeConfig, a dict or a 'DxWxB' string, got {type(value).__name__}")


# ---------------------------------------------------------------------------- draft
def _confidence(logits: torch.Tensor, B: int, temperature: float) -> torch.Tensor:
    """One-hot weights [B, T, K] on each node's most confident view (`confidence` policy):
    `ensemble.confidence_weights` with every (node, request) as a request."""
    BK, T, V = logits.shape
    K = BK // B
    w = confidence_weights(logits.transpose(0, 1).reshape(T * BK, V), T * B, K, temperature)
    return w.view(T, B, K).transpose(0, 1)


def tree_draft(draft_lm, cache, inp2, lens, w, seed, offset, row_seed=None, coupled=None, tlens=None, top_k=None,
               top_p=None, *, B: int, K: int, cfg: TreeConfig, greedy: bool, temperature: float, confidence: bool,
               kv_len=None, _kernels=None):
    """Draft one tree for B requests × K views (rows of one batch), fixed shapes, no host sync.

    inp2 [B*K, 2]: each row's last two tokens, written at slots lens, lens + 1 (lens [B*K]);
    the root is the last token at slot lens + 1, and fed node f >= 1 at slot lens + depth + f.
    w [B, K] ensemble weights; seed, offset [1] int64 (sampling noise).
    row_seed [B] int64, coupled [B] bool, tlens [B] (sampling, optional): a coupled request's
    children at depth d are the top k of log q + G(row_seed, tlens + d) (`coupling`: the first
    is the coupled proposal, the others the next guesses under the same noise), and the frontier
    ranks them by `coupling.tree_child_scores` (the coupled chain always expanded). top_k [B]
    int64 / top_p [B] float32 (optional, with row_seed; `sampling.draft_filter`): the requests'
    filters, applied to each node's mixture (at the draft's temperature): its coupled children
    are the kept tokens first (the first child, the coupled proposal, always one), then the
    best of the others (`coupling.FILTERED_PENALTY`).
    Returns (tokens [B, N] (tokens[:, 0] is the root's token), parents [B, N] (-1 for the
    root), node_q [B, N, V] fp32 mixture each node's children were drawn from (zeros at
    leaves; greedy: an empty tensor, as `draft_block`'s mixtures: the greedy walk reads only
    the tokens), fed_logits
    [B*K, F, V] the views' logits at each fed node, fedpos [B, N] the fed index of every node
    or -1).

    Per depth, on CUDA: the children come from the `mix_topk` kernels (which store the mixture
    only when sampling) and the bookkeeping is one `tree_grow` kernel. `_kernels` (internal):
    None picks by device, True as on CUDA whatever the device (tests: the kernels under the
    Triton interpreter), False the PyTorch references.
    """
    dev = inp2.device
    W, Bc, D = cfg.width, cfg.branch, cfg.depth
    V = draft_lm.cfg.vocab_size
    # the draft rows' tree slots: [prev, root, P padding slots (never fed), frontier_1 .. frontier_{D-1}]
    # P = depth - 1 padding slots after the root keep the frontier's KV clear of the slots the
    # accepted path is compacted into (root + 1 .. root + depth - 1), so the verification's
    # compaction reads sources it never writes (idempotent, as a graph's warm-up needs)
    P = D - 1
    st = TreeState.empty(B, K, cfg.nodes, cfg.fed, cfg.draft_rows, dev)
    tree_start(st, inp2, lens, pad=P, width=W, kernel=_kernels)
    node_q = torch.empty(0, device=dev) if greedy else torch.zeros(B, cfg.nodes, V, device=dev)
    fed_logits = []

    def forward(lo, hi):
        # slots [lo, hi) of the sequence; those before are in the cache (views: a request's K rows
        # alike but for their first slot)
        ids, pos, bits = st.feed(lo, hi)
        return draft_lm(cache, pos, input_ids=ids, lengths=lens, tree_bits=bits, tree_offset=lo, kv_len=kv_len,
                        float_logits=False)

    new_logits = forward(0, 2)[:, 1:2]                                  # [R, 1, V]: the root's
    n_nodes, n_fed = 1, 1
    for depth in range(1, D + 1):
        fed_logits.append(new_logits)
        T = new_logits.shape[1]
        k = W if depth == 1 else Bc
        wk = _confidence(new_logits, B, temperature) if confidence else w
        # sampling: the draws' noise at counters offset + (depth - 1) * B * W * V + ..., and each
        # frontier node's mixture kept for the verification
        draw = {} if greedy else dict(seed=seed, offset=offset + (depth - 1) * B * W * V, mixture_out=node_q,
                                      out_rows=st.fed[:, n_fed - T:n_fed])
        kids, logq = mix_topk(new_logits, wk, k, temperature, kernel=_kernels, **draw)   # [B, T, k]
        if row_seed is not None:       # seeded requests: children under the shared noise
            q = node_q.gather(1, draw["out_rows"][..., None].expand(B, T, V))
            keep = None if top_k is None and top_p is None else row_filtered_probs(torch.log(q), top_k, top_p) > 0
            c_kids, perturbed = coupled_proposals(q, row_seed, tlens.long() + depth, k, keep)
            kids = torch.where(coupled[:, None, None], c_kids, kids)
            logq = torch.where(coupled[:, None, None], tree_child_scores(perturbed), logq)
        tree_grow(st, kids, logq, pad=P, n_nodes=n_nodes, n_fed=n_fed, width=W, last=depth == D, kernel=_kernels)
        n_nodes += T * k
        if depth == D:
            break
        n_fed += W
        new_logits = forward(1 + P + n_fed - W, 1 + P + n_fed)            # [R, W, V]: the new frontier's
    return st.tokens, st.parents, node_q, torch.cat(fed_logits, 1), st.fedpos


# ---------------------------------------------------------------------------- verify
def tree_bits_of(parents: torch.Tensor, depth: int) -> torch.Tensor:
    """Packed ancestor-or-self mask [B, N] int64 of a tree in topological order (parents
    [B, N], -1 at the root; N <= 64): bit j of node i set iff j is i or an ancestor. Pointer
    doubling: after r rounds each node holds its ancestors up to 2^r - 1 levels up, so
    ceil(log2(depth + 1)) rounds of two gathers cover a path of `depth` edges."""
    B, N = parents.shape
    node = torch.arange(N, device=parents.device)
    jump = torch.where(parents >= 0, parents, node)        # the root points at itself
    bits = (torch.ones_like(parents) << node).contiguous()  # bit 63 wraps to the sign bit, as the kernels read it
    for _ in range(max(1, depth).bit_length()):
        bits = bits | bits.gather(1, jump)
        jump = jump.gather(1, jump)
    return bits


def tree_verify(target_lm, tcache, dcache, tokens, parents, tlens, dlens, fedpos, node_q=None, uniforms=None, *,
                sp, K: int, node_depth, depth: int, kv_len=None, probs_fn=None, parts=None, live=None):
    """Verify one tree (fixed shapes, one CUDA graph on the GPU): the target forward over the N
    nodes tokens [B, N] (parents [B, N]; node_depth [N] their depths) at positions tlens +
    depth under the ancestor mask, written at slots tlens..; the
    `verify_tree` walk; the accepted path's KV compacted in the target rows and in the draft's
    B*K view rows (fed nodes at slots dlens + 1 + fed index). Returns (target logits
    [B, N, V], path [B, N], accepted [B], next token [B], packed [B, 2 + depth] for the
    block's one host read: accepted count, next token, the path's tokens).
    Rows coupled by `sp` (a RowSampling with seeded rows) walk greedily over the target's
    Gumbel-perturbed scores: the child equal to the target's coupled token, else that token.
    `parts` (eager only): other target forwards' arguments packed into the verification's forward
    (`LlamaLM.forward_mixed`, the tree first), their logits returned as a sixth item, a list;
    `live` [B] (0 / 1) then marks the rows whose accepted path is compacted: a row without a
    live request (a slot a packed prompt chunk fills) keeps the KV that part wrote."""
    pos = tlens.long()[:, None] + node_depth[None]
    fwd = dict(input_ids=tokens, lengths=tlens, tree_bits=tree_bits_of(parents, depth), kv_len=kv_len)
    if parts:
        tlogits, *extra = target_lm.forward_mixed([dict(cache=tcache, positions=pos, **fwd), *parts])
    else:
        tlogits = target_lm(tcache, pos, **fwd)
    if sp.greedy:
        path, n_acc, nxt = verify_tree(tokens, parents, tlogits, greedy=True)
    else:
        probs = probs_fn(tlogits)
        path, n_acc, nxt = verify_tree(tokens, parents, probs, node_q, uniforms, greedy=False)
        if getattr(sp, "any_coupled", False):
            scores = coupled_scores(tlogits, probs, sp.temperature, sp.seed, pos + 1)   # a node's child's position
            c_path, c_acc, c_nxt = verify_tree(tokens, parents, scores, greedy=True)
            c = sp.coupled
            path, n_acc, nxt = torch.where(c[:, None], c_path, path), torch.where(c, c_acc, n_acc), \
                torch.where(c, c_nxt, nxt)
    moved = n_acc if live is None else n_acc * live     # accepted nodes whose KV moves, per row
    compact_kv(tcache.k, tcache.v, tcache.block_table, tlens, path, moved)
    # the draft rows keep the path's fed nodes (all of it but possibly its last node, a leaf
    # the next block re-feeds); their root sits at slot dlens + 1, fed node f >= 1 at
    # dlens + depth + f (see tree_draft)
    f = fedpos.gather(1, path.clamp_min(0))
    dpath = torch.where((path >= 0) & (f >= 0), torch.where(f > 0, f + depth - 1, f), -1).repeat_interleave(K, 0)
    compact_kv(dcache.k, dcache.v, dcache.block_table, (dlens + 1).int(), dpath,
               (moved - 1).clamp_min(0).repeat_interleave(K, 0))
    path_tok = tokens.gather(1, path[:, 1:depth + 1].clamp_min(0))
    packed = torch.cat([n_acc[:, None], nxt[:, None], path_tok], dim=1)
    out = (tlogits, path, n_acc, nxt, packed)
    return (*out, extra) if parts else out


def tree_history(state, tlogits, fed_logits, path, n_acc, fedpos, cursor, *, depth: int, temperature: float,
                 kv_len=None):
    """The history's positions of one tree block: the path's nodes root, d_1 .. d_n (the
    accepted ones and the node where the first rejected token was drafted), as far as the
    draft fed them (the last may be a leaf). tlogits [B, N, V], fed_logits [B*K, F, V],
    path [B, N], n_acc [B], fedpos [B, N]. Returns (next weights [B, K], new cursor)."""
    B, N, V = tlogits.shape
    K = fed_logits.shape[0] // B
    nodes = path[:, :depth].clamp_min(0)                                   # [B, depth]
    fed = fedpos.gather(1, nodes)                                          # [B, depth]
    last_fed = fed.gather(1, n_acc.clamp(max=depth - 1)[:, None])[:, 0] >= 0
    n_rec = torch.where(last_fed, n_acc, n_acc - 1)                        # recorded positions - 1
    p = tlogits.gather(1, nodes[:, :, None].expand(B, depth, V))           # [B, depth, V]
    fidx = fed.clamp_min(0).repeat_interleave(K, 0)                        # [B*K, depth]
    q = fed_logits.gather(1, fidx[:, :, None].expand(B * K, depth, V)).view(B, K, depth, V)
    return state.step(p, q, n_rec.clamp(max=depth - 1), cursor, temperature, all_positions=False)
