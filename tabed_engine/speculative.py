"""One speculative block (chain), repeated: batched multi-view drafting with an adaptive
ensemble, one target verification of γ+1 tokens, lossless acceptance, history update.
With greedy decoding, several views and a divergence policy, the first block is a view
tree instead (`view_tree_block`): every view's own chain verified in one target forward.

Row bookkeeping: every row's sequence is its prompt (the view's prompt for draft rows)
followed by the G generated tokens. A row's KV cache holds at least all but its last two
tokens, so the first draft step of a block always feeds the last two tokens (re-writing
identical KV for the first is harmless) and later steps feed one; the target verifies
[last generated token, d_1 .. d_γ]. Rollback after a rejection is just the new lengths.
"""
from __future__ import annotations

import time
from functools import partial

import torch

from .ensemble import confidence_weights, history_step
from .outputs import GenerationStats
from .ops.chain_verify import chain_verify
from .ops.ensemble_mix import ensemble_mix
from .sampling import pick_tokens, target_probs
from .tree import node_depth_tensor, tree_draft, tree_history, tree_verify
from .views import build_views


class _Timer:
    """Per-phase wall times, only with `Engine(timing=True)` (each lap synchronizes the device,
    which stops the host from queueing ahead: off by default)."""

    def __init__(self, eng, stats):
        self.eng, self.stats, self.t = eng, stats, time.perf_counter()

    def lap(self, field: str):
        if not self.eng.timing:
            return
        self.eng.sync()
        now = time.perf_counter()
        setattr(self.stats, field, getattr(self.stats, field) + now - self.t)
        self.t = now


def prefill_draft(eng, rows):
    """Prefill all view rows in one ragged batch. Returns the cache, per-row prompt lengths
    [R] and each row's logits for the first generated token [R, V] (its last position)."""
    draft, dev = eng.draft, eng.device
    lens = [len(r.ids) for r in rows]
    Tm = max(lens)
    x = torch.zeros(len(rows), Tm, draft.lm.cfg.hidden_size, device=dev, dtype=eng.dtype)
    for i, r in enumerate(rows):
        x[i, : lens[i]] = eng.embed(draft, r.ids, r.spans, r.feats)
    cache = eng.draft_cache(len(rows))
    pos = torch.arange(Tm, device=dev)[None].expand(len(rows), Tm)
    lens = torch.tensor(lens, device=dev)
    logits = draft.lm(cache, pos, embeds=x, logits_index=(lens - 1)[:, None], kv_len=eng.kv_bucket(Tm),
                      fresh=True)[:, 0]
    return cache, lens, logits


def draft_block(draft_lm, cache, inp2, lens, w, seed, offset, *, B: int, K: int, gamma: int,
                greedy: bool, temperature: float, confidence: bool, kv_len=None,
                per_view: bool = False):
    """γ draft steps for B requests × K views (rows of one batch), fixed shapes, no host sync
    (captured as one CUDA graph on the GPU).

    inp2: [B*K, 2] the rows' last two tokens, written at slots lens, lens+1; lens: [B*K];
    w: [B, K] ensemble weights; seed/offset: [1] int64 RNG state for the mixture samples.
    Returns drafted [B, γ], per-view logits [γ, B*K, V] in the draft's dtype (the mixing
    and divergence kernels read any float dtype; no conversion kernel per step), mixtures
    [γ, B, V] fp32 (sampling) and the per-view log-normalisers [γ, B*K] fp32 at
    `temperature` (from the mixing kernel, for the history's divergences).
    per_view (greedy): every row follows its own argmax instead of the mixture's token, and
    drafted is [B*K, γ] (the first block's view tree).
    """
    R, dev = B * K, inp2.device
    if per_view:
        B, K, w = R, 1, torch.ones(R, 1, device=dev)
    logits = draft_lm(cache, lens[:, None] + torch.arange(2, device=dev), input_ids=inp2, lengths=lens,
                      logits_index=torch.ones(R, 1, dtype=torch.long, device=dev), kv_len=kv_len,
                      float_logits=False)[:, -1]
    lens = lens + 2
    q_logits, mixtures, tokens, q_lse = [], [], [], []
    for i in range(gamma):
        step_w = confidence_weights(logits, B, K, temperature) if confidence else w
        # greedy draws no random numbers: no per-step offset kernel
        step_offset = offset if greedy else offset + i * B * logits.shape[-1]
        # K > 1: the mixing kernel also writes the token into every view's row, the next
        # step's input ids (none after the last step); a fresh buffer each step, since the
        # returned token is a view of it and is kept in `tokens`
        ids = torch.empty(R, dtype=torch.long, device=dev) if K > 1 and i < gamma - 1 else None
        tok, _, mix, lse = ensemble_mix(logits, step_w, greedy=greedy, seed=seed, offset=step_offset,
                                        temperature=temperature, return_mixture=not greedy, view_tokens_out=ids)
        q_logits.append(logits)
        q_lse.append(lse)
        mixtures.append(mix)
        tokens.append(tok)
        if i < gamma - 1:
            logits = draft_lm(cache, lens[:, None], input_ids=tok[:, None] if K == 1 else ids[:, None],
                              lengths=lens, kv_len=kv_len, float_logits=False)[:, -1]
            lens = lens + 1
    return (torch.stack(tokens, 1), torch.stack(q_logits),
            torch.stack(mixtures) if not greedy else torch.empty(0, device=dev), torch.stack(q_lse))


def verify_forward(target_lm, cache, vin, tlens, kv_len=None):
    """Target logits [B, γ+1, V] for vin [B, γ+1] written at slots tlens.."""
    pos = tlens[:, None] + torch.arange(vin.shape[1], device=vin.device)   # int64 by promotion: one kernel
    return target_lm(cache, pos, input_ids=vin, lengths=tlens, kv_len=kv_len)


def verify_block(target_lm, cache, vin, tlens, mixture=None, uniforms=None, *, sp, normalisers=False,
                 kv_len=None):
    """Target forward on vin = [last token, d_1..d_γ] and the lossless acceptance, one graph:
    returns (target logits [B, γ+1, V], accepted drafts n_acc [B], next token [B],
    [n_acc, next token, d_1..d_γ] packed as [B, 2+γ] for the block's one host read, and with
    `normalisers` the target rows' logsumexp(logits / T) [B, γ+1] fp32 for the history's TV,
    T = 1 greedy (written by the greedy verification's own pass), else an empty tensor).
    Greedy: the target's argmax chain. Sampling (sp.temperature > 0): mixture [γ, B, V] is the
    draft distribution each d_i was drawn from, uniforms [B, γ+1] the acceptance draws."""
    tlogits = verify_forward(target_lm, cache, vin, tlens, kv_len=kv_len)
    drafted = vin[:, 1:]
    t_lse = torch.empty(tlogits.shape[:2] if normalisers else 0, device=tlogits.device)
    lse_out = t_lse if normalisers else None
    if sp.greedy:
        n_acc, nxt = chain_verify(drafted, None, tlogits, greedy=True, lse_out=lse_out)
    else:
        n_acc, nxt = chain_verify(drafted, mixture.transpose(0, 1), target_probs(tlogits, sp, lse_out),
                                  greedy=False, uniforms=uniforms)
    return tlogits, n_acc, nxt, pack_head(n_acc, nxt, drafted), t_lse


def pack_head(n_acc, nxt, drafted):
    """[B, 2+γ] int64: accepted count, next token, drafted tokens per request."""
    return torch.cat([n_acc[:, None], nxt[:, None], drafted], dim=1)


def view_trie(drafted):
    """The K views' chains as one tree with shared prefixes merged.

    drafted: [K, γ] host tensor, view k's tokens. Returns (tokens [N] with tokens[0] a
    placeholder for the root, the last committed token; parents [N], parents[0] = 0 for the
    root; node_of [K, γ], the node of view k's i-th token). Children of a node carry distinct
    tokens, so `verify_tree`'s greedy walk (first child equal to the target's argmax) finds
    the longest branch the target accepts, and views that agree are verified once."""
    K, gamma = drafted.shape
    tokens, parents, index = [0], [0], {}
    node_of = torch.empty(K, gamma, dtype=torch.long)
    for k in range(K):
        node = 0
        for i, t in enumerate(drafted[k].tolist()):
            if (node, t) not in index:
                index[node, t] = len(tokens)
                tokens.append(t)
                parents.append(node)
            node = node_of[k, i] = index[node, t]
    return tokens, parents, node_of


def tree_verify_block(target_lm, cache, tok, pos, parents, mask, tlens, kv_len=None):
    """The view tree's verification, fixed shapes (one CUDA graph on the GPU): the target
    forward on the tree's nodes tok [1, N] at positions pos under the ancestor mask [1, N, N]
    (written at slots tlens..), the greedy `verify_tree` walk, and `compact_kv` moving the
    accepted path's KV next to the root. Padding nodes carry parent -1 (never visited) and
    see only themselves. Returns (target logits [1, N, V], path [1, N], accepted [1], next
    token [1])."""
    from .ops.compact_kv import compact_kv
    from .ops.verify_tree import verify_tree

    tlogits = target_lm(cache, pos, input_ids=tok, lengths=tlens, tree_mask=mask, kv_len=kv_len)
    path, n_acc, nxt = verify_tree(tok, parents, tlogits, greedy=True)
    compact_kv(cache.k, cache.v, tlens, path, n_acc)
    return tlogits, path, n_acc, nxt


def catch_up_forward(draft_lm, cache, toks, lens, kv_len=None):
    """Draft rows take tokens toks [R, T] at slots lens.. (KV only; fixed shapes)."""
    pos = lens[:, None] + torch.arange(toks.shape[1], device=toks.device)
    zero = torch.zeros(toks.shape[0], 1, dtype=torch.long, device=toks.device)
    return draft_lm(cache, pos, input_ids=toks, lengths=lens, logits_index=zero, kv_len=kv_len)


def view_tree_block(eng, dcache, tcache, inp2, lens, out, n_prompt, state, *, K: int, gamma: int,
                    longest: int):
    """The first block with several views (greedy): each view drafts its own greedy chain (rows
    of one batch, as always), the target verifies the chains merged into one tree
    (`view_trie`) in one forward, and `verify_tree` walks it, so the first block, which has no
    evidence for the weights yet, accepts as much as the best view would have. Once per
    generation, two host reads (the drafted chains, the accepted path); on the GPU the draft
    loop, the tree verification (padded to 1 + K·γ nodes, so one shape) and the draft rows'
    catch-up (padded to γ - 1 tokens) are CUDA graphs. Returns (new tokens, accepted count,
    the index of a view whose chain was accepted, per-view target logits [1, K, γ, V] at the
    positions where each view drafted, per-view logits [1, K, γ, V])."""
    dev, V = eng.device, eng.draft.lm.cfg.vocab_size
    zero = torch.zeros(1, dtype=torch.long, device=dev)           # no RNG: greedy
    d_kv = eng.kv_bucket(longest + len(out) + gamma)
    draft_fn = partial(draft_block, eng.draft.lm, dcache, B=1, K=K, gamma=gamma, greedy=True, temperature=1.0,
                       confidence=False, per_view=True)
    drafted, q_logits, _, _ = eng.run_graph(("draft_views", K, gamma), draft_fn,
                                         dict(inp2=inp2, lens=lens, w=state.uniform, seed=zero, offset=zero),
                                         kv_len=d_kv)
    tokens, parents, node_of = view_trie(drafted.cpu())
    tokens[0] = out[-1]
    N, n_max = len(tokens), 1 + K * gamma
    depth, mask = [0] * n_max, torch.eye(n_max, dtype=torch.bool)
    for i in range(1, N):                      # parents come before children
        depth[i] = depth[parents[i]] + 1
        mask[i] |= mask[parents[i]]            # a node sees its ancestors and itself
    # padding nodes: any token, parent -1 (never visited), seeing only themselves; their KV
    # lands in slots past the tree that later blocks overwrite before reading
    tokens += [tokens[0]] * (n_max - N)
    parents += [-1] * (n_max - N)
    root = n_prompt + len(out) - 1
    tlens = torch.full((1,), root, dtype=torch.int32, device=dev)
    inputs = dict(tok=torch.tensor([tokens], device=dev), pos=root + torch.tensor([depth], device=dev),
                  parents=torch.tensor([parents], device=dev), mask=mask[None].to(dev), tlens=tlens)
    tlogits, path, n_acc, nxt = eng.run_graph(("view_tree", K, gamma), partial(tree_verify_block, eng.target.lm,
                                                                               tcache),
                                              inputs, kv_len=eng.kv_bucket(root + n_max))
    path, n, t_next = path[0].tolist(), int(n_acc), int(nxt)
    k = next(j for j in range(K) if n == 0 or int(node_of[j, n - 1]) == path[n])
    # every view's drafting positions: the root, then its own chain's nodes
    at = torch.cat([torch.zeros(K, 1, dtype=torch.long), node_of[:, :-1]], 1).to(dev)
    p_views = tlogits[0][at][None]                                         # [1, K, γ, V]
    q_views = q_logits.view(gamma, K, V).permute(1, 0, 2)[None]           # [1, K, γ, V]
    new = [tokens[j] for j in path[1:n + 1]] + [t_next]
    # the draft rows' KV must hold the new tokens but the last two (the next block feeds
    # those): row k drafted them, the others take them in one forward (re-writing identical KV
    # is harmless; the padding lands in slots the next block writes before it reads them)
    if gamma >= 2:
        catch = (new[: n - 1] + [new[-1]] * gamma)[: gamma - 1]
        eng.run_graph(("catch_up", K, gamma), partial(catch_up_forward, eng.draft.lm, dcache),
                      dict(toks=torch.tensor(catch, device=dev)[None].expand(K, -1), lens=lens + 2), kv_len=d_kv)
    return new, n, k, p_views, q_views


def run_speculative(eng, prep, sp, gen, caption):
    """Generator yielding lists of accepted tokens; returns GenerationStats."""
    stats = GenerationStats(speculative=True, prompt_tokens=len(prep.ids), views=eng.views)
    timer = _Timer(eng, stats)
    t_start = timer.t
    dev, gamma, K, B = eng.device, eng.gamma, len(eng.views), 1
    V = eng.draft.lm.cfg.vocab_size
    tree = eng.tree
    # tokens a block may write past the committed ones (target nodes; draft rows: fed nodes)
    lookahead = eng.lookahead
    depth = gamma if tree is None else tree.depth

    tcache, logits, target_sel = eng.prefill_target(prep)
    first = pick_tokens(logits, sp, gen)                                   # [B]
    rows = build_views(eng, prep, target_sel, caption)
    longest = max(len(r.ids) for r in rows)
    if longest + sp.max_new_tokens + lookahead + 2 > eng.max_len:
        raise ValueError(f"a draft view of {longest} tokens + max_new_tokens exceeds the cache length "
                         f"{eng.max_len}")
    dcache, view_len, first_q = prefill_draft(eng, rows)
    timer.lap("time_prefill")

    greedy = sp.greedy
    temp = 1.0 if greedy else sp.temperature   # draft softmax and divergence temperature
    state = eng.ensemble_state(B, depth * (sp.max_new_tokens + 1))
    if tree is None:
        hist_fn = partial(history_step, state, temperature=temp)
    else:
        hist_fn = partial(tree_history, state, depth=tree.depth, temperature=temp)
    hist_key = ("hist", B, K, gamma, tree, state.capacity, greedy, temp, id(state))
    w = state.uniform
    if state.adaptive:
        # the prefill already verified one position: the target's distribution of the first
        # token. Recording each view's divergence there gives the first block adapted weights
        # (one position of history instead of none; uniform when the policy is not adaptive).
        w, new_cursor = state.step(logits[:, None], first_q.view(B, K, 1, V), torch.zeros_like(first[:B]),
                                   state.cursor, temperature=temp)
        state.cursor.copy_(new_cursor)
    confidence = eng.ensemble.policy == "confidence" and K > 1
    # the history's TV takes the target's and the views' normalisers from the verification
    # and the draft loop (one pass over the logits instead of two)
    norms = state.uses_normalisers and tree is None
    if tree is None:
        draft_fn = partial(draft_block, eng.draft.lm, dcache, B=B, K=K, gamma=gamma, greedy=greedy,
                           temperature=temp, confidence=confidence)
        verify_fn = partial(verify_block, eng.target.lm, tcache, sp=sp, normalisers=norms)
        noise_per_block = gamma * B * V
    else:
        draft_fn = partial(tree_draft, eng.draft.lm, dcache, B=B, K=K, cfg=tree, greedy=greedy,
                           temperature=temp, confidence=confidence)
        verify_fn = partial(tree_verify, eng.target.lm, tcache, dcache, sp=sp, K=K, depth=tree.depth,
                            node_depth=node_depth_tensor(tree, dev),
                            probs_fn=partial(target_probs, sp=sp))
        noise_per_block = tree.depth * B * tree.width * V
    verify_key = ("verify", B, gamma, tree, greedy, sp.temperature, sp.top_k, sp.top_p, norms)
    # the block's one host read (accepted count, next token, drafted tokens), into pinned
    # memory on the GPU so the history update can be queued before the host waits
    head = torch.empty(2 + depth, dtype=torch.long, pin_memory=dev.type == "cuda")
    head_ready = torch.cuda.Event() if dev.type == "cuda" else None
    draft_key = ("draft", B, K, gamma, tree, greedy, temp, confidence)
    dlens = None            # the draft rows' lengths at the start of the queued block
    seed = torch.randint(0, 2 ** 62, (1,), generator=gen, device=dev)
    offset = torch.zeros(1, dtype=torch.long, device=dev)
    schedule = eng.bench_accept_schedule

    # each block's weights for request 0, recorded on the device (a host read per block would
    # be a second synchronisation) and read back once at the end; with a non-adaptive policy
    # the weights never change and nothing is recorded
    w_rec = torch.empty(sp.max_new_tokens, K, device=dev) if state.adaptive else None

    out = [int(first[0])]
    stats.time_first_token = time.perf_counter() - t_start
    yield list(out)
    prompt_tail = [r.ids[-1] for r in rows]   # per row: the token before the first generated one
    n_prompt = len(prep.ids)
    block = 0
    # the first block's view tree (see view_tree_block): greedy, several views, a divergence
    # policy (w-grid scores mixtures, which a tree of single-view chains does not give), and
    # room in the target cache for up to K·γ tree nodes
    use_tree = (eng.view_tree and tree is None and greedy and K > 1 and schedule is None
                and eng.ensemble.policy in ("kld", "tvd", "hedge")
                and n_prompt + K * gamma + 2 <= eng.max_len)
    def queue_draft(inp2, lens, g_next):
        """The next block's draft (one graph): γ chain steps or one tree; g_next bounds the
        tokens it follows."""
        nonlocal dlens
        dlens = lens
        res = eng.run_graph(draft_key, draft_fn, dict(inp2=inp2, lens=lens, w=w, seed=seed, offset=offset),
                            kv_len=eng.kv_bucket(longest + g_next + lookahead))
        offset.add_(noise_per_block)
        timer.lap("time_draft")
        return res

    # the draft of block b+1 is queued before the host waits for block b's result (its inputs
    # are computed on the device from the accepted count), so the GPU does not idle while the
    # host reads the block, yields its tokens and launches the next graphs
    pending = None
    while not _finished(eng, sp, out):
        G = len(out)
        if pending is None:   # no earlier block queued this one's draft: its inputs from the host
            prev = [out[-2]] * K if G >= 2 else prompt_tail
            inp2 = torch.tensor([[p, out[-1]] for p in prev], device=dev)     # [B*K, 2]
            lens = view_len + (G - 2)                                          # [B*K]
        if use_tree and block == 0:   # ---- first block: every view's chain, one tree verification
            new, n, k, p_views, q_views = view_tree_block(eng, dcache, tcache, inp2, lens, out, n_prompt, state,
                                                          K=K, gamma=gamma, longest=longest)
            stats.view_tree_view = eng.views[k]
            stats.target_forwards += 1
            w_rec[block].copy_(w[0])                                         # before w is replaced
            w, new_cursor = state.step_views(p_views, q_views, state.cursor, temperature=temp)
            state.cursor.copy_(new_cursor)
            timer.lap("time_verify")
        else:
            # ---- draft: γ steps, all views as rows of one batch per step
            if pending is None:
                pending = queue_draft(inp2, lens, G)
            if tree is not None:
                tokens, parents, node_q, fed_logits, fedpos = pending
            else:
                drafted, q_logits, mixture, q_lse = pending
            pending = None

            # ---- verify: target forward on [last, d_1..d_γ] (or the tree's nodes) and acceptance
            # (one graph)
            tlens = torch.full((B,), n_prompt + G - 1, dtype=torch.int32, device=dev)
            if tree is not None:
                inputs = dict(tokens=tokens, parents=parents, tlens=tlens, dlens=dlens, fedpos=fedpos)
                if not greedy:
                    inputs.update(node_q=node_q, uniforms=torch.rand(B, tree.nodes + 1, generator=gen, device=dev))
                tlogits, path, n_acc, nxt, packed = eng.run_graph(verify_key, verify_fn, inputs,
                                                                  kv_len=eng.kv_bucket(n_prompt + G + tree.nodes))
                d_last = tokens.gather(1, path.gather(1, n_acc[:, None]))   # [B, 1]: d_n, or the root
            else:
                vin = torch.cat([torch.full((B, 1), out[-1], device=dev, dtype=torch.long), drafted], dim=1)
                inputs = dict(vin=vin, tlens=tlens)
                if not greedy:
                    inputs.update(mixture=mixture, uniforms=torch.rand(B, gamma + 1, generator=gen, device=dev))
                tlogits, n_acc, nxt, packed, t_lse = eng.run_graph(verify_key, verify_fn, inputs,
                                                                   kv_len=eng.kv_bucket(n_prompt + G + gamma + 1))
                d_last = vin.gather(1, n_acc[:, None])
            if schedule is not None:   # benchmark only: a fixed acceptance pattern (not lossless)
                n_acc = torch.full_like(n_acc, min(int(schedule(block)), depth))
                if tree is None:
                    nxt = tlogits[torch.arange(B, device=dev), n_acc].argmax(-1)
                    packed = pack_head(n_acc, nxt, drafted)
                else:
                    path, d_last, nxt, packed = forced_tree_path(tokens, parents, tlogits, int(n_acc[0]), tree)
            head.copy_(packed[0], non_blocking=True)
            if head_ready is not None:
                head_ready.record()
            stats.target_forwards += 1
            timer.lap("time_verify")

            # ---- history: divergences at the block's positions (the accepted ones + the first
            # rejected; all drafted ones with hedge) and the next block's weights (one graph on the
            # GPU, queued before the host waits)
            if state.adaptive:
                # after the verification is queued: on the GPU, nothing between the host's wait
                # and the verification launch but what that launch needs
                w_rec[block].copy_(w[0])                                     # before w is replaced
                if tree is not None:
                    h_in = dict(tlogits=tlogits, fed_logits=fed_logits, path=path, n_acc=n_acc, fedpos=fedpos,
                                cursor=state.cursor)
                else:
                    h_in = dict(tlogits=tlogits, q_logits=q_logits, n_acc=n_acc, cursor=state.cursor)
                    if norms:
                        h_in.update(t_lse=t_lse, q_lse=q_lse)
                w, new_cursor = eng.run_graph(hist_key, hist_fn, h_in)
                state.cursor.copy_(new_cursor)
            timer.lap("time_ensemble")

            # ---- the next block's draft, unless this block certainly ends the generation: its
            # last two tokens are (d_n, next) (or (last, next) when nothing was accepted) and its
            # rows are n + 1 tokens further
            # eager (no graphs) reads the accepted count now: it costs nothing on the CPU (one
            # sync per block on CUDA without graphs), bounds the next draft's attention span by
            # the exact length and skips a draft the generation will not use; graphs ignore the
            # span and queue the draft unless the block certainly ends the generation
            n_now = int(n_acc[0]) if eng.graphs is None else None
            if G + 1 + (n_now or 0) < sp.max_new_tokens:
                step = (n_acc + 1).repeat_interleave(K)
                inp2 = torch.cat([d_last, nxt[:, None]], 1).repeat_interleave(K, 0)
                g_next = G + 1 + (lookahead if n_now is None else n_now)
                pending = queue_draft(inp2, view_len + (G - 2) + step, g_next)

            if head_ready is not None:
                head_ready.synchronize()                                     # the block's one host sync
            n, t_next, *d = head.tolist()
            new = d[:n] + [t_next]
        stats.accepted_lengths.append(n)
        new = _truncate(eng, sp, out, new)
        out += new
        block += 1
        yield new
        timer.lap("time_other")
    stats.new_tokens = len(out)
    w_blocks = w_rec[:block].tolist() if w_rec is not None else [state.uniform[0].tolist()] * block
    stats.weights = [[round(x, 4) for x in row] for row in w_blocks]
    eng.sync()
    stats.time_total = time.perf_counter() - t_start
    return stats


def forced_tree_path(tokens, parents, tlogits, n: int, tree):
    """Benchmark only: the path to the first node at depth n (its ancestors are all expanded
    nodes), as if the target had accepted it. Returns (path [B, N], its last token [B, 1],
    the next token [B], packed [B, 2 + depth])."""
    B, N = tokens.shape
    cols = [torch.full((B,), tree.node_depths().index(n), dtype=torch.long, device=tokens.device)]
    for _ in range(n):
        cols.insert(0, parents.gather(1, cols[0][:, None])[:, 0])
    path = torch.full((B, N), -1, dtype=torch.long, device=tokens.device)
    path[:, : n + 1] = torch.stack(cols, 1)
    last = path[:, n:n + 1]
    nxt = tlogits.gather(1, last[:, :, None].expand(-1, -1, tlogits.shape[-1]))[:, 0].argmax(-1)
    n_acc = torch.full((B,), n, dtype=torch.long, device=tokens.device)
    path_tok = tokens.gather(1, path[:, 1:tree.depth + 1].clamp_min(0))
    return path, tokens.gather(1, last), nxt, torch.cat([n_acc[:, None], nxt[:, None], path_tok], 1)


def _truncate(eng, sp, out, new):
    """Cut a block's tokens at EOS (inclusive) and at max_new_tokens, exactly as AR would."""
    room = sp.max_new_tokens - len(out)
    new = new[:room]
    if sp.stop_at_eos:
        for i, t in enumerate(new):
            if t in eng.eos_ids:
                return new[: i + 1]
    return new


def _finished(eng, sp, out) -> bool:
    return len(out) >= sp.max_new_tokens or (sp.stop_at_eos and out[-1] in eng.eos_ids)
