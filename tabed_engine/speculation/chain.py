"""The fixed-shape pieces of a speculative block (chain): batched multi-view drafting with an
adaptive ensemble, one target verification of γ+1 tokens with lossless acceptance; the
runner (`tabed_engine.engine.runner`) strings them together for a batch. With greedy decoding,
several views and a divergence policy, a lone request's first block is a view tree instead
(`view_tree_block`): every view's own chain verified in one target forward.

Row bookkeeping: every row's sequence is its prompt (the view's prompt for draft rows)
followed by the G generated tokens. A row's KV cache holds at least all but its last two
tokens, so the first draft step of a block always feeds the last two tokens (re-writing
identical KV for the first is harmless) and later steps feed one; the target verifies
[last generated token, d_1 .. d_γ]. Rollback after a rejection is just the new lengths.
"""
from __future__ import annotations

from functools import partial

import torch

from tabed_engine.models.decoder import cache_rows
from tabed_engine.ops.chain_verify import chain_verify
from tabed_engine.ops.ensemble_mix import ensemble_mix
from tabed_engine.speculation.coupling import coupled_proposals, coupled_scores
from tabed_engine.speculation.ensemble import confidence_weights
from tabed_engine.speculation.sampling import row_filtered_probs, target_probs


def prefill_draft(eng, rows, cache, pad_to: int = 0, step: int = 0):
    """Prefill all view rows into `cache` (one row per view) in one pass through the draft's
    weights. Rows padded to one length, `pad_to` positions when that is longer than every row
    (the padding is written past each row's prompt, where the draft's next writes land before
    anything reads it), form one batch. With `step`, rows whose lengths round up to different
    multiples of `step` (an image view beside the text-only one) are instead packed as one
    token stream, each padded to its own multiple (`LlamaLM.forward_mixed`), so a short row
    costs its own tokens, not the longest row's. Returns the per-row prompt lengths [R] and
    each row's logits for the first generated token [R, V] (its last position)."""
    draft, dev = eng.draft, eng.device
    lens = [len(r.ids) for r in rows]
    Tm = max(max(lens), pad_to)
    pads = [min(-(-n // step) * step, Tm) for n in lens] if step else [Tm] * len(rows)
    packed = len(set(pads)) > 1
    x = torch.zeros(len(rows), Tm, draft.lm.cfg.hidden_size, device=dev, dtype=eng.dtype)
    for i, r in enumerate(rows):
        x[i, : lens[i]] = eng.embed(draft, r.ids, r.spans, r.features())
    pos, offsets = prompt_positions([r.positions for r in rows], lens, Tm)
    # host lists and tensors uploaded without a device sync (`Runner.to_device`): a blocking
    # upload waits for the stream's queued work, and this runs on the side stream while the host
    # has yet to read the request's first token (Runner.prefill); contiguous first: the slots
    # are an expanded view (stride 0), which pin_memory refuses
    pos = pos.contiguous().pin_memory().to(dev, non_blocking=True) if dev.type == "cuda" else pos
    cache.pos_offset.copy_(eng.to_device(offsets, cache.pos_offset.dtype))
    lens = eng.to_device(lens)
    last = (lens - 1)[:, None]
    if not packed:
        logits = draft.lm(cache, pos, embeds=x, logits_index=last, kv_len=eng.kv_bucket(Tm), fresh=True)
        return lens, logits[:, 0]
    parts = [dict(cache=cache_rows(cache, i, i + 1), positions=pos[..., i:i + 1, :P], embeds=x[i:i + 1, :P],
                  logits_index=last[i:i + 1], kv_len=eng.kv_bucket(P), fresh=True) for i, P in enumerate(pads)]
    return lens, torch.cat([lg[:, 0] for lg in draft.lm.forward_mixed(parts)])


def prompt_positions(positions, lens, T: int):
    """RoPE positions of prompts prefilled as rows of one batch, padded to T: [R, T] slots when
    no row has M-RoPE ids, else [3, R, T] (rows without them: three equal ids = slots; the
    padding continues from each row's end), and each row's `KVCache.pos_offset`: its largest
    id + 1 - its length (0 for a row without M-RoPE ids)."""
    R = len(lens)
    slots = torch.arange(T)[None].expand(R, T)
    if all(p is None for p in positions):
        return slots, [0] * R
    pos = slots[None].repeat(3, 1, 1)
    offsets = []
    for i, (p, n) in enumerate(zip(positions, lens)):
        delta = 0 if p is None else int(p.max()) + 1 - n
        if p is not None:
            pos[:, i, :n] = p
            pos[:, i, n:] += delta
        offsets.append(delta)
    return pos, offsets


def draft_block(draft_lm, cache, inp2, lens, w, seed, offset, row_seed=None, coupled=None, tlens=None, top_k=None,
                top_p=None, *, B: int, K: int, gamma: int, greedy: bool, temperature: float, confidence: bool,
                kv_len=None, per_view: bool = False):
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
    row_seed [B] int64, coupled [B] bool, tlens [B] (sampling, optional): requests whose
    `coupled` is set propose argmax(log q + G(row_seed, position)) instead of a sample (the
    Gumbel coupling, `speculation.coupling`), d_i at position tlens + i (tlens: each request's
    committed target length, where its last token sits). top_k [B] int64 / top_p [B] float32
    (optional, with row_seed; `sampling.draft_filter`): the requests' filters, applied to the
    mixture a coupled proposal is drawn from (renormalised, at the draft's temperature), so it
    is a token the target's filter keeps wherever q ranks tokens as the target does.
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
        if row_seed is not None:          # seeded requests: the coupling's proposal, in every view's row
            q = mix if top_k is None and top_p is None else row_filtered_probs(torch.log(mix), top_k, top_p)
            prop, _ = coupled_proposals(q, row_seed, tlens.long() + 1 + i)
            tok = torch.where(coupled, prop[:, 0], tok)
            if ids is not None:
                ids = tok.repeat_interleave(K)
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


def verify_args(cache, vin, tlens, kv_len=None) -> dict:
    """The target `forward` arguments of a verification: vin [B, γ+1] written at slots tlens.."""
    pos = tlens[:, None] + torch.arange(vin.shape[1], device=vin.device)   # int64 by promotion: one kernel
    return dict(cache=cache, positions=pos, input_ids=vin, lengths=tlens, kv_len=kv_len)


def verify_forward(target_lm, cache, vin, tlens, kv_len=None):
    """Target logits [B, γ+1, V] for vin [B, γ+1] written at slots tlens.."""
    args = verify_args(cache, vin, tlens, kv_len)
    return target_lm(args.pop("cache"), args.pop("positions"), **args)


def verify_block(target_lm, cache, vin, tlens, mixture=None, uniforms=None, *, sp, normalisers=False,
                 kv_len=None, parts=None):
    """Target forward on vin = [last token, d_1..d_γ] and the lossless acceptance, one graph:
    returns (target logits [B, γ+1, V], accepted drafts n_acc [B], next token [B],
    [n_acc, next token, d_1..d_γ] packed as [B, 2+γ] for the block's one host read, and with
    `normalisers` the target rows' logsumexp(logits / T) [B, γ+1] fp32 for the history's TV,
    T = 1 greedy (written by the greedy verification's own pass), else an empty tensor).
    Greedy: the target's argmax chain. Sampling (sp.temperature > 0): mixture [γ, B, V] is the
    draft distribution each d_i was drawn from, uniforms [B, γ+1] the acceptance draws; rows
    coupled by `sp` (a RowSampling with seeded rows) accept d_i iff it equals the target's
    Gumbel-argmax at its position and continue with the target's own token (the argmax chain
    of the perturbed scores). `parts` (eager only): other target forwards' arguments packed into
    the verification's forward (`LlamaLM.forward_mixed`, the verification first); their logits
    are then returned as a sixth item, a list."""
    if parts:
        tlogits, *extra = target_lm.forward_mixed([verify_args(cache, vin, tlens, kv_len), *parts])
    else:
        tlogits = verify_forward(target_lm, cache, vin, tlens, kv_len=kv_len)
    drafted = vin[:, 1:]
    t_lse = torch.empty(tlogits.shape[:2] if normalisers else 0, device=tlogits.device)
    lse_out = t_lse if normalisers else None
    if sp.greedy:
        n_acc, nxt = chain_verify(drafted, None, tlogits, greedy=True, lse_out=lse_out)
    else:
        probs = target_probs(tlogits, sp, lse_out)
        n_acc, nxt = chain_verify(drafted, mixture.transpose(0, 1), probs, greedy=False, uniforms=uniforms)
        if getattr(sp, "any_coupled", False):
            pos = tlens.long()[:, None] + 1 + torch.arange(vin.shape[1], device=vin.device)
            scores = coupled_scores(tlogits, probs, sp.temperature, sp.seed, pos)
            c_acc, c_nxt = chain_verify(drafted, None, scores, greedy=True)
            n_acc, nxt = torch.where(sp.coupled, c_acc, n_acc), torch.where(sp.coupled, c_nxt, nxt)
    out = (tlogits, n_acc, nxt, pack_head(n_acc, nxt, drafted), t_lse)
    return (*out, extra) if parts else out


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
    from tabed_engine.ops.compact_kv import compact_kv
    from tabed_engine.ops.verify_tree import verify_tree

    tlogits = target_lm(cache, pos, input_ids=tok, lengths=tlens, tree_mask=mask, kv_len=kv_len)
    path, n_acc, nxt = verify_tree(tok, parents, tlogits, greedy=True)
    compact_kv(cache.k, cache.v, cache.block_table, tlens, path, n_acc)
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
