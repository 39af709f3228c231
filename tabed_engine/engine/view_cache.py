"""Prefix caching for the draft's view rows: what each of a slot's K draft rows still holds, so
a speculative request whose view rows start the same way (a chat's next turn, the same picture
in a new conversation) prefills only the rest of each view row.

A draft row's KV at position i depends on the row's ids up to i and on the features at its image
positions, never on which view it serves: an entry records the row's ids and, per media run of
the row, the picture's hash (`prefix_cache.media_keys`) tagged with how the draft embeds it (M:
the draft's own features; P: pooled, with the pool size; the runs' lengths follow the draft's
own image-token counts). T and C rows hold no media (the escape token, the caption's text: the
ids say everything). Any row of any slot may serve any view of a new request (text-only
prompts make every view the same row): the request's row shares its full pages below the reused
length and copies the partial one (`PagePool.assign`, as the target's rows do).

Each view reuses the longest match but its last token (its logits are the view's first-token
distribution, which sets the first block's weights); a view without a match prefills from 0.
The views' rests run as one ragged forward over committed lengths (`prefill_rows`), padded to a
multiple of SUFFIX_STEP; when that forward would be as long as the longest view row (one view
missed) all views prefill as before (`chain.prefill_draft`), as they do on the GPU when a rest
exceeds SUFFIX_GRAPH_MAX (beyond the decode kernels, a masked attention costs more than a
fresh prefill).

Validity follows the target's index: a slot's draft rows hold each view row plus the request's
generated tokens whose KV the draft wrote (`Request.draft_valid`); a block run over a free or
finished slot writes its draft rows from the length they hold on (`SlotPages.free_lengths`);
a slot's entries are dropped when its rows are prefilled again, when its request failed
(`forget`), when an admission evicts them for their pages and when a warm-up scribbles on them. Autoregressive requests never write draft rows:
a slot's entries outlive one. Host state from the scheduler's deterministic inputs, like the
target's index (tensor-parallel ranks agree)."""
from __future__ import annotations

from typing import Optional

import torch

from tabed_engine.engine.prefix_cache import SUFFIX_GRAPH_MAX, SUFFIX_STEP, Entry, common_prefix, media_keys
from tabed_engine.models.decoder import KVCache, cache_rows
from tabed_engine.speculation.chain import prefill_draft

Key = tuple[list[int], list[tuple[int, int, bytes]]]      # a view row's ids and media runs


def view_keys(eng, prep, rows, skip: frozenset = frozenset()) -> list[Key]:
    """Each view row's (ids, media runs (start, length, picture hash + how the draft embeds it)),
    in `eng.views` order (`build_views`'s rows; views in `skip` are T rows)."""
    digests = [d for _, _, d in media_keys(prep)]
    keys = []
    for v, row in zip(eng.views, rows):
        v = "T" if v in skip else v
        media = []
        if v in ("M", "P") and row.spans:
            tag = b"M" if v == "M" else b"P%d" % (eng.pool_size or eng.draft.vision.default_pool)
            media = [(s, n, d + tag) for (s, n), d in zip(row.spans, digests)]
        keys.append((list(row.ids), media))
    return keys


class ViewIndex:
    """Per draft row (slot * K + view), the entry it holds (see the module docstring).

    `limit`: the most tokens an entry keeps. `max_suffix`: reuse only when every view's rest is
    at most this long (None: any)."""

    def __init__(self, slots: int, K: int, limit: int, max_suffix: Optional[int] = None):
        self.K = K
        self.entries: list[Optional[Entry]] = [None] * (slots * K)
        self.limit, self.max_suffix = limit, max_suffix
        self.clock = 0
        self.lookups = self.hits = 0            # speculative admissions and those that reused a view prefix
        self.cached_tokens = self.view_tokens = 0

    def _tick(self) -> int:
        self.clock += 1
        return self.clock

    def plan(self, keys: list[Key], slot: int) -> list[tuple[int, Optional[int]]]:
        """Per view, (reused length, draft row to take it from; None: prefill from 0): the longest
        match over every row (at most the row's length - 1), its own row on ties; all (0, None)
        when the reuse would not shorten the views' forward (see the module docstring)."""
        K = self.K
        out = []
        for k, (ids, media) in enumerate(keys):
            own = slot * K + k
            m = [0 if e is None else min(common_prefix(e, ids, media), len(ids) - 1) for e in self.entries]
            best = max(range(len(m)), key=lambda i: (m[i], i == own))
            out.append((m[best], best) if m[best] > 0 else (0, None))
        rest = max(len(ids) - c for (ids, _), (c, _) in zip(keys, out))
        longest = max(len(ids) for ids, _ in keys)
        if rest >= longest or (self.max_suffix is not None and rest > self.max_suffix):
            return [(0, None)] * K
        return out

    def hold(self, slot: int, keys: list[Key]):
        """`slot`'s draft rows now hold these view rows."""
        K, t = self.K, self._tick()
        for k, (ids, media) in enumerate(keys):
            self.entries[slot * K + k] = Entry(ids[: self.limit], [r for r in media if r[0] < self.limit], t)

    def release(self, slot: int, tokens: list[int]):
        """The speculative request in `slot` finished: its draft rows hold its view rows and these
        generated tokens (those the draft's KV holds, `Request.draft_valid`)."""
        t = self._tick()
        for e in self.entries[slot * self.K:(slot + 1) * self.K]:
            if e is not None:
                e.ids = (e.ids + list(tokens))[: self.limit]
                e.used = t

    def forget(self, slot: int):
        """`slot`'s draft rows were written over (or may have been)."""
        self.entries[slot * self.K:(slot + 1) * self.K] = [None] * self.K

    def account(self, cached: int, n: int):
        """One speculative admission: `cached` of its views' `n` tokens (summed over the views) reused."""
        self.lookups += 1
        self.hits += cached > 0
        self.cached_tokens += cached
        self.view_tokens += n

    def stats(self) -> dict:
        """Counters since the engine started: speculative admissions, hits, cached and view tokens."""
        return dict(lookups=self.lookups, hits=self.hits, cached_tokens=self.cached_tokens,
                    view_tokens=self.view_tokens)


def new_view_index(runner) -> Optional[ViewIndex]:
    """The runner's view index (None without a draft or with `Engine(prefix_cache=False)`)."""
    if runner.draft is None or not runner.eng.prefix_cache:
        return None
    return ViewIndex(runner.max_batch, runner.K, runner.max_len,
                     max_suffix=SUFFIX_GRAPH_MAX if runner.graphs is not None else None)


def fit_plan(plan, lens: list[int], max_len: int) -> tuple[list[tuple[int, Optional[int]]], int]:
    """The plan with every row's rest padded to P tokens inside the cache: (plan, P). P is the
    longest rest rounded up to SUFFIX_STEP where that fits, else the longest rest T; a row whose
    reuse + T would pass the cache's end reuses less (its rest stays at most T)."""
    T = max(n - c for n, (c, _) in zip(lens, plan))
    P = -(-T // SUFFIX_STEP) * SUFFIX_STEP
    if any(c + P > max_len for c, _ in plan):
        P = T
    plan = [(min(c, max_len - P), s) if c + P > max_len else (c, s) for c, s in plan]
    return [(c, s if c > 0 else None) for c, s in plan], P


def prefill_rows(runner, rows, cache: KVCache, cached: list[int], P: int) -> torch.Tensor:
    """The rest of each view row: row k's tokens [cached[k], n_k) as new tokens of a row whose
    committed length is cached[k] (one ragged forward, each rest padded to P tokens: the padding
    lands past the row's prompt, where the draft writes before it reads). Sets the rows'
    `pos_offset` as a full prefill does. Returns each row's logits of its last position [K, V]."""
    draft, dev = runner.draft, runner.device
    lens = [len(r.ids) for r in rows]
    x = torch.zeros(len(rows), P, draft.lm.cfg.hidden_size, device=dev, dtype=runner.dtype)
    for i, (r, c) in enumerate(zip(rows, cached)):
        if all(s + n <= c for s, n in r.spans):           # no image in the rest: its tokens alone
            x[i, : lens[i] - c] = draft.lm.embed_tokens(runner.to_device(r.ids[c:]))
        else:
            x[i, : lens[i] - c] = runner.embed(draft, r.ids, r.spans, r.features())[c:]
    offsets = [0 if r.positions is None else int(r.positions.max()) + 1 - n for r, n in zip(rows, lens)]
    slots = torch.tensor(cached)[:, None] + torch.arange(P)                 # [K, P]
    if all(r.positions is None for r in rows):
        pos = slots
    else:   # M-RoPE ids [3, K, P]; the forward adds each row's offset back (the padding: slot + offset)
        pos = slots[None].repeat(3, 1, 1)
        for i, (r, c, n) in enumerate(zip(rows, cached, lens)):
            if r.positions is not None:
                pos[:, i, : n - c] = r.positions[:, c:n] - offsets[i]
    pos = pos.pin_memory().to(dev, non_blocking=True) if dev.type == "cuda" else pos
    cache.pos_offset.copy_(runner.to_device(offsets, cache.pos_offset.dtype))
    last = runner.to_device([[n - c - 1] for n, c in zip(lens, cached)])
    return draft.lm(cache, pos, embeds=x, lengths=runner.to_device(cached, torch.int32), logits_index=last,
                    kv_len=runner.kv_bucket(max(cached) + P))[:, 0]


def prefill_views(runner, req, rows, skip: frozenset, slot: int, pad: int, step: int = 0) -> tuple[torch.Tensor, int]:
    """Prefill request `req`'s view rows into `slot`'s K draft rows (their pages taken here),
    reusing cached prefixes where the
    index (`runner.view_prefix`) holds them; without one, or when nothing is reused, the full
    padded prefill (`chain.prefill_draft`: padded to `pad`, rows of different multiples of
    `step` each to its own). Returns (each view's logits of the
    first generated token [K, V], view-row tokens whose prefill a cached prefix saved)."""
    K, idx, prep = runner.K, runner.view_prefix, req.prep
    cache = cache_rows(runner.dcache, slot * K, slot * K + K)
    lens = [len(r.ids) for r in rows]
    need = runner.pages.draft_tokens(req, lens)
    first = slot * K
    if idx is None:
        runner.pages.draft.assign([(first + k, None, 0, n) for k, n in enumerate(need)])
        return prefill_draft(runner, rows, cache, pad, step)[1], 0
    keys = view_keys(runner.eng, prep, rows, skip)
    plan = idx.plan(keys, slot)
    idx.forget(slot)                     # written over from here on (kept forgotten if this fails)
    if any(c for c, _ in plan):
        plan, P = fit_plan(plan, lens, runner.dcache.max_len)
        runner.pages.draft.assign([(first + k, s, c, n) for k, ((c, s), n) in enumerate(zip(plan, need))])
        first_q = prefill_rows(runner, rows, cache, [c for c, _ in plan], P)
    else:
        runner.pages.draft.assign([(first + k, None, 0, n) for k, n in enumerate(need)])
        first_q = prefill_draft(runner, rows, cache, pad, step)[1]
    saved = sum(c for c, _ in plan)
    idx.hold(slot, keys)
    idx.account(saved, sum(lens))
    return first_q, saved
