"""Speculative blocks for the running batch: the draft's catch-up after AR steps, a chain
(draft γ steps over every view as rows of one batch, verify, history) or a tree, queued one
block ahead of the host, and the first block's per-view tree."""
from __future__ import annotations

import time
from functools import partial
from typing import Optional

import torch

from tabed_engine.engine.request import Request
from tabed_engine.speculation.chain import (catch_up_forward, draft_block, forced_tree_path, pack_head,
                                            verify_block, view_tree_block)
from tabed_engine.speculation.ensemble import history_step
from tabed_engine.speculation.sampling import RowSampling, draft_filter, sampling_key, target_probs
from tabed_engine.speculation.tree import node_depth_tensor, tree_draft, tree_history, tree_verify


CATCH_UP = 16          # tokens per draft catch-up forward (see Runner.catch_up)


class SpeculativeSteps:
    """`Runner`'s speculative side (a mixin: it reads the runner's caches, graphs and state)."""

    def catch_up(self, reqs, b):
        """Feed the draft rows the tokens generated while the batch decoded autoregressively
        (a draft block needs them to hold all but the last two): ragged forwards of CATCH_UP
        tokens per row, padded (one shape: a new length compiles kernels, hundreds of ms on the
        GPU, and one captured graph per bucket); the padding lands in slots the next draft block
        writes before it reads them."""
        K = self.K
        need = {r.slot: r.tokens[r.draft_valid: len(r.tokens) - 2] for r in reqs[:b]
                if r is not None and not r.finished and r.draft_valid < len(r.tokens) - 2}
        _, dcache, _ = self.views(b)
        live = [r for r in reqs[:b] if r is not None and not r.finished]
        while need:
            n = min(CATCH_UP, max(len(t) for t in need.values()))
            top = max(max(r.view_len) + r.draft_valid for r in live)
            T = CATCH_UP
            if top + T > self.eng.draft_len:      # no room for the padding: the exact length
                T = n
            # rows of slots without a live request write where they hold nothing (`free_lengths`)
            toks, lens = [[0] * T for _ in range(b * K)], self.pages.free_lengths(reqs, b)[1]
            # every live row is written: the rows with nothing to catch up at their committed
            # end, where the next draft block writes before it reads (at slot 0 the padding
            # overwrote their prompt's first draft KV, lowering their acceptance)
            for r in live:
                for k in range(K):
                    lens[r.slot * K + k] = r.view_len[k] + r.draft_valid
            for slot, t in need.items():
                r = reqs[slot]
                chunk = t[:n]
                for k in range(K):
                    toks[slot * K + k] = chunk + [chunk[-1]] * (T - len(chunk))
                    lens[slot * K + k] = r.view_len[k] + r.draft_valid
                r.draft_valid += len(chunk)
            # a captured graph per (bucket, T) on the GPU: eagerly, the draft's ~40 launches are host-bound
            self.run_graph(("catch_up", b, K, T), partial(catch_up_forward, self.draft.lm, dcache),
                           {"toks": self.to_device(toks), "lens": self.to_device(lens)},
                           kv_len=self.kv_bucket(max(lens) + T))
            need = {s_: t[n:] for s_, t in need.items() if len(t) > n}

    def _draft_inputs(self, reqs, b):
        """Host-built draft inputs: each row's last two tokens [b*K, 2] and length [b*K] (rows of
        slots without a live request: `SlotPages.free_lengths`)."""
        K = self.K
        inp2, dl = [[0, 0]] * (b * K), self.pages.free_lengths(reqs, b)[1]
        for r in reqs[:b]:
            if r is None or r.finished:
                continue
            G = len(r.tokens)
            prev = [r.tokens[-2]] * K if G >= 2 else r.prompt_tail
            for k in range(K):
                inp2[r.slot * K + k] = [prev[k], r.tokens[-1]]
                dl[r.slot * K + k] = r.view_len[k] + G - 2
        return self.to_device(inp2), self.to_device(dl)

    def sd_block(self, reqs: list, b: int, gen, gamma: Optional[int] = None,
                 gamma_next: Optional[int] = None) -> list[list[int]]:
        """One speculative block (chain or tree) for slots [0, b): draft, verify, history.
        `gamma`: the chain's length this block (at most the engine's γ, its default; trees
        keep their shape). Before this block's tokens are read, the whole next block (its draft
        and verification) is queued behind it with chains of `gamma_next` (default `gamma`; 0:
        nothing, the batch changes or decodes autoregressively next), so the host's work on
        this block's tokens overlaps the device's on the next. Returns each slot's new tokens."""
        return self._sd_block(reqs, b, gen, gamma, gamma_next)[0]

    def sd_mixed(self, reqs: list, b: int, gen, gamma: int, parts: list[dict]):
        """A speculative block (a chain of `gamma`, or the engine's tree) whose verification
        forward also runs other target forwards (a step's prompt chunks, `parts`: their `forward`
        arguments, run eagerly, or one `GraphChunk`, captured: `Runner.run_mixed`;
        `LlamaLM.forward_mixed`, the verification first). Nothing is queued
        after it; a block queued ahead is dropped (the caller finished it). Not for a block that
        `takes_view_tree`. Returns each slot's new tokens and each part's logits."""
        self.pending = None
        return self._sd_block(reqs, b, gen, gamma, 0, parts)

    def takes_view_tree(self, live: list, b: int, gamma: Optional[int] = None) -> bool:
        """Whether a block for the live requests in bucket b would be the first block's view tree
        (`_view_tree`; with gamma None, for some chain length)."""
        eng = self.eng
        return (b == 1 and any(r.blocks == 0 for r in live) and eng.view_tree and eng.tree is None
                and all(r.sp.greedy for r in live) and self.K > 1 and self.bench_accept_schedule is None
                and eng.ensemble.policy in ("kld", "tvd", "hedge")
                and (gamma is None or live[0].n_prompt + self.K * gamma + 2 <= self.max_len))

    def _sd_block(self, reqs: list, b: int, gen, gamma: Optional[int], gamma_next: Optional[int],
                  parts: Optional[list] = None):
        """`sd_block`, with `parts` packed into the verification (`sd_mixed`): (new tokens, the
        parts' logits or None)."""
        eng, K, tree = self.eng, self.K, self.eng.tree
        gamma = eng.gamma if gamma is None or tree is not None else gamma
        gamma_next = gamma if gamma_next is None else gamma_next
        if eng.timing:          # per-phase times synchronize each phase: nothing is queued ahead
            gamma_next = 0
        if tree is not None and gamma_next:
            gamma_next = eng.gamma
        for g in (gamma, gamma_next or 1):
            if not 1 <= g <= eng.gamma:
                raise ValueError(f"chain length {g} outside 1..{eng.gamma}")
        depth = gamma if tree is None else tree.depth
        _, _, state = self.views(b)
        sp, temp = self.batch_sampling(reqs, b)      # temp: the draft's softmax and the divergences'
        greedy = sp.greedy
        norms = self._normalisers(sp)
        live = [r for r in reqs[:b] if r is not None and not r.finished]
        timer = _Timer(self, live)

        p = self._pending_for(("sd", gamma), b, reqs)   # taken now: whatever runs, it is used or stale
        if self.takes_view_tree(live, b, gamma):
            if parts:
                raise ValueError("sd_mixed: this block is the first block's view tree")
            return self._view_tree(live[0], timer), None

        if p is None:
            self.catch_up(reqs, b)
            inp2, dl = self._draft_inputs(reqs, b)
            tl, last, t_max = self._target_inputs(reqs, b)
            blk = self._queue_block(b, gamma, sp, temp, gen, inp2, dl, tl, last, t_max,
                                    max(len(r.tokens) for r in live), live, timer=timer, parts=parts)
        else:
            blk = p["blk"]
        res, v = blk["res"], blk["v"]
        n_acc = v["n_acc"]
        head, w_host = self._host("head", (b, 2 + depth)), self._host("w", (b, K), torch.float32)
        head.copy_(v["packed"], non_blocking=True)
        w_host.copy_(self.w[:b], non_blocking=True)   # this block's weights, before they are replaced
        ready = self._record()

        if state.adaptive:
            hist_key = ("hist", b, K, gamma, tree, greedy, temp)
            if tree is not None:
                hist_fn = partial(tree_history, state, depth=tree.depth, temperature=temp)
                h_in = dict(tlogits=v["tlogits"], fed_logits=res[3], path=v["path"], n_acc=n_acc,
                            fedpos=res[4], cursor=state.cursor)
            else:
                hist_fn = partial(history_step, state, temperature=temp)
                h_in = dict(tlogits=v["tlogits"], q_logits=res[1], n_acc=n_acc, cursor=state.cursor)
                if norms:
                    h_in.update(t_lse=v["t_lse"], q_lse=res[3])
            w, cursor = self.run_graph(hist_key, hist_fn, h_in)
            if any(r.view_mask is not None for r in live):
                w = self._masked(w, 0, b)
            act = self.active[:b].bool()
            self.w[:b].copy_(torch.where(act[:, None], w, self.w[:b]))
            state.cursor.copy_(torch.where(act, cursor, state.cursor))   # empty slots stay put
        timer.lap("time_ensemble")

        # the next block, unless every request certainly ends with this one: its rows' last two
        # tokens are (d_n, next), n + 1 tokens further on, its target rows n + 1 longer
        if gamma_next and any(len(r.tokens) + 1 < r.max_new for r in live):
            step = (n_acc + 1) * self.active[:b]
            inp2 = torch.cat([v["d_last"], v["nxt"][:, None]], 1).repeat_interleave(K, 0)
            # (a row whose request ends with this block drafts and verifies garbage: kept within
            # the draft's positions and the target's cache)
            dl2 = torch.clamp(blk["dl"] + step.repeat_interleave(K), max=eng.draft_len - eng.lookahead - 2)
            T_next = (gamma_next if tree is None else tree.nodes) + 1
            tl2 = torch.clamp(blk["tl"] + step.int(), max=self.max_len - T_next)
            self.pending = dict(mode=("sd", gamma_next), b=b, slots=self._slots_key(reqs), blk=self._queue_block(
                b, gamma_next, sp, temp, gen, inp2, dl2, tl2, v["nxt"], blk["t_max"] + depth + 1,
                max(len(r.tokens) for r in live) + depth + 1, live, ahead=1))
        self._wait(ready)
        heads, ws = head.tolist(), w_host.tolist()
        out = []
        for i, r in enumerate(reqs[:b]):
            if r is None or r.finished:
                out.append([])
                continue
            n, t_next, *d = heads[i]
            r.stats.accepted_lengths.append(n)
            r.stats.target_forwards += 1
            r.stats.weights.append([round(x, 4) for x in ws[i]])
            r.record_block(n, depth)
            out.append(r.append(d[:n] + [t_next]))
            r.draft_valid = len(r.tokens) - 2
        timer.lap("time_other")
        return out, blk.get("extra")

    def _normalisers(self, sp) -> bool:
        """Whether the verification returns the target's log-normalisers for the history (they
        serve it only at the history's own temperature: chains, one sampling setting)."""
        return self.state.uses_normalisers and self.eng.tree is None and not isinstance(sp, RowSampling)

    def _queue_block(self, b: int, gamma: int, sp, temp: float, gen, inp2, dl, tl, last, t_max: int, g_max: int,
                     live, ahead: int = 0, timer: Optional["_Timer"] = None, parts: Optional[list] = None) -> dict:
        """Queue one block's draft and verification (nothing read back): draft rows at lengths
        `dl` [b*K] fed `inp2` [b*K, 2], target rows at lengths `tl` [b] int32 fed `last` [b];
        `t_max` bounds the target lengths and `g_max` the requests' generated tokens (for the
        eager attention spans). `ahead`: blocks between the host's view of the live requests
        and this one (the benchmark's forced acceptance follows the block index).
        Returns dict(res = the draft's outputs, v = the verification's (tlogits, n_acc, nxt,
        packed, d_last, t_lse or path), dl, tl, t_max, and with `parts` (forwards packed into
        the verification: `Runner.run_mixed`) extra = their logits)."""
        eng, K, dev, tree = self.eng, self.K, self.device, self.eng.tree
        tcache, dcache, _ = self.views(b)
        greedy, V = sp.greedy, self.draft.lm.cfg.vocab_size
        depth = gamma if tree is None else tree.depth
        confidence = eng.ensemble.policy == "confidence" and K > 1
        norms = self._normalisers(sp)
        longest = max(max(r.view_len) for r in live)
        if tree is None:
            draft_fn = partial(draft_block, self.draft.lm, dcache, B=b, K=K, gamma=gamma, greedy=greedy,
                               temperature=temp, confidence=confidence)
            verify_fn = partial(verify_block, self.target.lm, tcache, sp=sp, normalisers=norms)
            noise = gamma * b * V
        else:
            draft_fn = partial(tree_draft, self.draft.lm, dcache, B=b, K=K, cfg=tree, greedy=greedy,
                               temperature=temp, confidence=confidence)
            verify_fn = partial(tree_verify, self.target.lm, tcache, dcache, sp=sp, K=K, depth=tree.depth,
                                node_depth=node_depth_tensor(tree, dev), probs_fn=partial(target_probs, sp=sp))
            noise = tree.depth * b * tree.width * V
        d_in = dict(inp2=inp2, lens=dl, w=self.w[:b], seed=self.seed, offset=self.offset)
        couple = getattr(sp, "any_coupled", False)     # seeded rows draft under the shared noise
        if couple:                                     # ... and propose only what their filters keep
            filt = draft_filter(sp)
            d_in.update(row_seed=sp.seed, coupled=sp.coupled, tlens=tl, **filt)
            couple = tuple(filt) or True
        res = self.run_graph(("draft", b, K, gamma, tree, greedy, temp, confidence, couple), draft_fn, d_in,
                             kv_len=self.kv_bucket(longest + g_max + eng.lookahead))
        self.offset.add_(noise)
        if timer is not None:
            timer.lap("time_draft")
        verify_key = ("verify", b, gamma, tree, sampling_key(sp), norms)
        v = {}
        if tree is not None:
            tokens, parents, node_q, fed_logits, fedpos = res
            inputs = dict(tokens=tokens, parents=parents, tlens=tl, dlens=dl, fedpos=fedpos)
            if not greedy:
                inputs.update(node_q=node_q, uniforms=torch.rand(b, tree.nodes + 1, generator=gen, device=dev))
            kv_len = self.kv_bucket(t_max + 1 + tree.nodes)
            if parts:     # rows without a live request are the parts' slots: their KV is not compacted
                tlogits, path, n_acc, nxt, packed, extra = self.run_mixed(
                    verify_key, verify_fn, {**inputs, "live": self.active[:b]}, kv_len, parts)
            else:
                tlogits, path, n_acc, nxt, packed = self.run_graph(verify_key, verify_fn, inputs, kv_len=kv_len)
            d_last = tokens.gather(1, path.gather(1, n_acc[:, None]))   # [b, 1]: d_n, or the root
        else:
            drafted, q_logits, mixture, q_lse = res
            vin = torch.cat([last[:, None], drafted], dim=1)
            inputs = dict(vin=vin, tlens=tl)
            if not greedy:
                inputs.update(mixture=mixture, uniforms=torch.rand(b, gamma + 1, generator=gen, device=dev))
            kv_len = self.kv_bucket(t_max + 1 + gamma + 1)
            if parts:
                tlogits, n_acc, nxt, packed, v["t_lse"], extra = self.run_mixed(verify_key, verify_fn, inputs,
                                                                                kv_len, parts)
            else:
                tlogits, n_acc, nxt, packed, v["t_lse"] = self.run_graph(verify_key, verify_fn, inputs, kv_len=kv_len)
            d_last = vin.gather(1, n_acc[:, None])
        schedule = self.bench_accept_schedule
        if schedule is not None:   # benchmark only: a fixed acceptance pattern (not lossless)
            n = min(int(schedule(live[0].blocks + ahead, depth)), depth)
            n_acc = torch.full_like(n_acc, n)
            if tree is None:
                nxt = tlogits[torch.arange(b, device=dev), n_acc].argmax(-1)
                packed = pack_head(n_acc, nxt, drafted)
                d_last = vin.gather(1, n_acc[:, None])
            else:
                path, d_last, nxt, packed = forced_tree_path(tokens, parents, tlogits, n, tree)
        if tree is not None:
            v["path"] = path
        v.update(tlogits=tlogits, n_acc=n_acc, nxt=nxt, packed=packed, d_last=d_last)
        if timer is not None:
            timer.lap("time_verify")
        return dict(res=res, v=v, dl=dl, tl=tl, t_max=t_max, extra=extra if parts else None)

    def _view_tree(self, r: Request, timer) -> list[list[int]]:
        """The first block of a lone greedy request with several views: every view's own chain
        verified as one tree (`speculative.view_tree_block`)."""
        K, gamma = self.K, self.eng.gamma
        tcache, dcache, state = self.views(1)
        self.catch_up([r], 1)               # after autoregressive blocks the draft rows lag
        inp2, dl = self._draft_inputs([r], 1)
        new, n, k, p_views, q_views = view_tree_block(self, dcache, tcache, inp2, dl, r.tokens, r.n_prompt, state,
                                                      K=K, gamma=gamma, longest=max(r.view_len))
        r.stats.view_tree_view = self.eng.views[k]
        r.stats.target_forwards += 1
        r.stats.accepted_lengths.append(n)
        r.stats.weights.append([round(x, 4) for x in self.w[0].tolist()])
        w, cursor = state.step_views(p_views, q_views, state.cursor, temperature=1.0)
        state.cursor.copy_(cursor)
        self.w[:1].copy_(self._masked(w, 0, 1) if r.view_mask is not None else w)
        r.record_block(n, gamma)
        timer.lap("time_verify")
        kept = r.append(new)
        r.draft_valid = len(r.tokens) - 2
        return [kept]


class _Timer:
    """Per-phase wall times, only with `Engine(timing=True)` (each lap synchronizes the device,
    which stops the host from queueing ahead: off by default); added to every live request."""

    def __init__(self, runner, live):
        self.runner, self.live, self.t = runner, live, time.perf_counter()

    def lap(self, field: str):
        if not self.runner.eng.timing:
            return
        self.runner.sync()
        now = time.perf_counter()
        for r in self.live:
            setattr(r.stats, field, getattr(r.stats, field) + now - self.t)
        self.t = now
