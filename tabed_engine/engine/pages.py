"""KV pages: which pages of the target's and the draft's page pools each cache row holds, so that
KV memory follows the tokens in use instead of every batch slot reserving `max_len` tokens.

Layout (`models.decoder.KVCache`): a pool of pages per cache and a device block table per row;
page 0 is scratch, where every unassigned table entry points. `PagePool` is the host side of
one cache: a free list, a reference count per page and each row's page list, mirrored into the
row's table entries (a small copy from pinned memory at admission, retirement and eviction,
never per token; the table's address never changes, so captured CUDA graphs stay valid).

Reservation: a request takes, when it is admitted, the pages for every slot it may write:
min(max_len, prompt + max_new_tokens + the block lookahead + 2) target slots, and each draft
view row its own length + the same. Reserving up front is the no-deadlock rule: a running
request never waits for memory, so every admitted request finishes and returns its pages, and a
request that fits the pool alone (checked when it is added: `check_pool`) is admitted once
enough of them have. What a request does not use (it stops early) is returned when it retires.

Sharing: a row whose prompt starts with KV another row holds (prefix caching) takes that row's
full pages below the shared length by reference; the page holding the shared length, if it is
partial, is copied into a fresh page. A row writes only at slots >= its length, and its length
never drops below its prompt, so a shared page is never written. Free slots keep their pages
and the length of what they hold: the garbage rows a bucketed block computes for them write
from that length on, into the slot's own partial page or into scratch, never into the cached
prefix (their prefixes survive the running traffic).

Eviction: when an admission finds too few free pages, the prefix-cache entries of free slots
are dropped, least recently used first, until it fits; else the request waits (`make_room`).

Everything here is host state driven by the scheduler's deterministic inputs, so
tensor-parallel ranks (same scheduler, same decisions) hold the same tables.
"""
from __future__ import annotations

from collections import Counter
from typing import Optional

import torch


class PagePool:
    """The pages of one `KVCache`: free list, reference counts and per-row page lists, mirrored
    into the cache's block table. `to_device(list, dtype)` copies a host list to the cache's
    device without a sync (the runner's). Rows start with no pages (all on scratch)."""

    def __init__(self, cache, to_device):
        self.cache, self.page, self._to_device = cache, cache.page_size, to_device
        self.free = list(range(cache.pages - 1, 0, -1))      # a stack: pages 1, 2, ... first
        self.refs = [0] * cache.pages
        self.rows: list[list[int]] = [[] for _ in range(cache.rows)]
        cache.block_table.zero_()

    @property
    def total(self) -> int:
        """Pages the pool lends (all but scratch)."""
        return self.cache.pages - 1

    def pages_for(self, tokens: int) -> int:
        return -(-max(tokens, 0) // self.page)

    def exclusive(self, rows) -> int:
        """Pages that releasing `rows` would free (held by no other row)."""
        held = Counter(p for r in rows for p in self.rows[r])
        return sum(1 for p, n in held.items() if self.refs[p] == n)

    def release(self, rows):
        """Every page of `rows` returned; their tables point at scratch."""
        rows = list(rows)
        for r in rows:
            self._drop(r)
        self._sync(rows)

    def truncate(self, row: int, tokens: int):
        """Keep only the pages holding slots [0, tokens) of `row`."""
        keep = self.pages_for(tokens)
        if len(self.rows[row]) > keep:
            extra, self.rows[row] = self.rows[row][keep:], self.rows[row][:keep]
            self._unref(extra)
            self._sync([row])

    def assign(self, moves):
        """Give rows fresh page lists. moves: (row, src, cached, tokens) each: the row will hold
        slots [0, tokens), the first `cached` of them equal to row `src`'s (None: nothing reused;
        `src` may be the row itself or another row of the move). Full pages below `cached` are
        shared with src, the partial one copied; every other page is fresh. Raises RuntimeError
        when the free pages (after the rows' old pages are returned) do not suffice: callers
        check first (`make_room`)."""
        kept, partial = {}, []
        for row, src, cached, tokens in moves:
            full = cached // self.page if src is not None else 0
            kept[row] = self.rows[src][:full] if full else []
            for p in kept[row]:
                self.refs[p] += 1
            if src is not None and cached % self.page:
                partial.append((row, self.rows[src][full], cached % self.page))
        # the partial pages' contents are read before any of the rows' pages is returned
        k, v = self.cache.k, self.cache.v
        saved = [(row, k[:, p, :, :n].clone(), v[:, p, :, :n].clone()) for row, p, n in partial]
        for row, *_ in moves:
            self._drop(row)
        need = sum(self.pages_for(tokens) - len(kept[row]) for row, _, _, tokens in moves)
        if need > len(self.free):
            for row, *_ in moves:        # (nothing half-done: the rows end empty)
                self._unref(kept[row])
            self._sync([row for row, *_ in moves])
            raise RuntimeError(f"KV pool: {need} pages needed, {len(self.free)} free")
        for row, _, _, tokens in moves:
            fresh = [self.free.pop() for _ in range(self.pages_for(tokens) - len(kept[row]))]
            for p in fresh:
                self.refs[p] = 1
            self.rows[row] = kept[row] + fresh
        for row, ks, vs in saved:
            p = self.rows[row][len(kept[row])]
            k[:, p, :, :ks.shape[2]] = ks
            v[:, p, :, :vs.shape[2]] = vs
        self._sync([row for row, *_ in moves])

    def _drop(self, row: int):
        self._unref(self.rows[row])
        self.rows[row] = []

    def _unref(self, pages):
        for p in pages:
            self.refs[p] -= 1
            if self.refs[p] == 0:
                self.free.append(p)

    def _sync(self, rows: list[int]):
        if not rows:
            return
        W = self.cache.block_table.shape[1]
        vals = [self.rows[r] + [0] * (W - len(self.rows[r])) for r in rows]
        idx = self._to_device(rows, torch.long)
        self.cache.block_table.index_copy_(0, idx, self._to_device(vals, torch.int32))


class SlotPages:
    """The runner's two pools (target: row = slot; draft: rows slot * K + k) and what admission,
    retirement and eviction do with them (see the module docstring)."""

    def __init__(self, runner):
        self.runner = runner
        self.K = runner.K
        self.target = PagePool(runner.tcache, runner.to_device)
        self.draft = PagePool(runner.dcache, runner.to_device) if runner.dcache is not None else None
        # draft pages promised to admitted requests whose views are not prefilled yet (slot ->
        # pages, `Runner.views_deferred`): later admissions count them as taken
        self.draft_reserved: dict[int, int] = {}

    def draft_rows(self, slot: int) -> range:
        return range(slot * self.K, slot * self.K + self.K)

    # ------------------------------------------------------------------ sizes
    def target_tokens(self, req) -> int:
        return reserve_tokens(self.runner.eng, req.n_prompt, req.max_new, req.speculative)

    def draft_tokens(self, req, view_lens) -> list[int]:
        """Slots each of a request's view rows may write (view lengths: None = unknown yet)."""
        eng = self.runner.eng
        return [reserve_tokens(eng, eng.max_len if n is None else n, req.max_new, True) for n in view_lens]

    def _draft_hint(self, req) -> int:
        """Pages a speculative request's view rows will take (exact but for a C view whose
        caption is not known before its prefill: a whole row)."""
        from tabed_engine.speculation.views import view_lengths
        eng = self.runner.eng
        skip = frozenset(v for v, m in zip(eng.views, req.view_mask or ()) if not m)
        with eng._prepare_lock:
            lens = view_lengths(eng, req.prep, req.caption, skip)
        return sum(self.draft.pages_for(t) for t in self.draft_tokens(req, lens))

    # ------------------------------------------------------------------ admission
    def make_room(self, req, slot: int, slots: list) -> bool:
        """Whether `req` can be admitted into free slot `slot` now (`slots`: every slot's request,
        None when free), after evicting the prefix-cache entries of other free slots, least
        recently used first (the one the request would reuse last). False: it waits."""
        need_t = self.target.pages_for(self.target_tokens(req))
        spec = req.speculative and self.draft is not None
        need_d = self._draft_hint(req) if spec else 0

        def short() -> bool:
            if need_t > len(self.target.free) + self.target.exclusive([slot]):
                return True
            promised = sum(n for s, n in self.draft_reserved.items() if s != slot)
            return spec and need_d > len(self.draft.free) - promised + self.draft.exclusive(self.draft_rows(slot))

        if not short():
            return True
        r = self.runner
        src = r.prefix.source(req.prep, slot)[1] if r.prefix is not None else None
        victims = sorted((i for i, s in enumerate(slots) if s is None and i != slot and self.holds(i)),
                         key=lambda i: (i == src, self._used(i), i))
        for i in victims:
            self.evict(i)
            if not short():
                return True
        return False

    def reserve_views(self, req):
        """Promise the draft pages of `req`'s views (prefilled later) to its slot."""
        self.draft_reserved[req.slot] = self._draft_hint(req)

    def holds(self, slot: int) -> bool:
        return bool(self.target.rows[slot]) or (self.draft is not None and
                                                any(self.draft.rows[r] for r in self.draft_rows(slot)))

    def _used(self, slot: int) -> int:
        """The slot's last use by the prefix caches (LRU order; 0: no entry)."""
        used = 0
        for index, i in ((self.runner.prefix, slot), (self.runner.view_prefix, slot * self.K)):
            e = index.entries[i] if index is not None else None
            used = max(used, e.used if e is not None else 0)
        return used

    def evict(self, slot: int):
        """Drop what free slot `slot` holds: its cache entries and pages (target and draft)."""
        self.scribble(slot)
        if self.draft is not None:
            self.scribble_draft(slot)

    def scribble(self, slot: int):
        """The slot's target row is about to be written from slot 0 by something that is not a
        request (a graph capture, a diagnostic): its entry and pages go, writes land in scratch."""
        if self.runner.prefix is not None:
            self.runner.prefix.forget(slot)
        self.target.release([slot])

    def scribble_draft(self, slot: int):
        """`scribble` for the slot's draft rows."""
        if self.runner.view_prefix is not None:
            self.runner.view_prefix.forget(slot)
        self.draft.release(self.draft_rows(slot))

    def claim(self, slot: int):
        """Whole rows of pages for `slot`'s target and draft rows, evicting what other slots hold
        as needed (diagnostics on an idle runner: `Runner.prefill_target`)."""
        eng, pools = self.runner.eng, [(self.target, [slot])]
        if self.draft is not None:
            pools.append((self.draft, list(self.draft_rows(slot))))
        for i in range(len(self.target.rows)):
            if all(len(pool.free) + pool.exclusive(rows) >= len(rows) * pool.pages_for(eng.max_len)
                   for pool, rows in pools):
                break
            if i != slot:
                self.evict(i)
        self.scribble(slot)
        self.target.assign([(slot, None, 0, eng.max_len)])
        if self.draft is not None:
            self.scribble_draft(slot)
            self.draft.assign([(r, None, 0, eng.max_len) for r in self.draft_rows(slot)])

    # ------------------------------------------------------------------ retirement
    def retire(self, req, keep_target: Optional[int], keep_draft: Optional[list[int]]):
        """`req` left its slot: its rows keep the pages of the tokens their cache entries hold
        (keep_*: tokens kept; None = everything goes; draft None and speculative: the view rows
        go too; an autoregressive request leaves the draft rows alone)."""
        slot = req.slot
        if keep_target is None:
            self.target.release([slot])
        else:
            self.target.truncate(slot, keep_target)
        if self.draft is None or not req.speculative:
            return
        if keep_draft is None:
            self.draft.release(self.draft_rows(slot))
        else:
            for row, n in zip(self.draft_rows(slot), keep_draft):
                self.draft.truncate(row, n)

    def free_lengths(self, slots: list, b: int) -> tuple[list[int], list[int]]:
        """Where blocks write the garbage rows of slots [0, b) that hold no live request (target
        [b], draft [b * K]; live rows' entries are the caller's): a request between prefill
        chunks at its prefilled length, a finished request at what its entry will hold, a free
        slot at what its entry holds, else 0 (no pages: scratch)."""
        r, K = self.runner, self.K
        tl, dl = [0] * b, [0] * (b * K)
        for i in range(b):
            req = slots[i]
            if req is not None and req.finished and req.slot == i:
                tl[i] = req.n_prompt + max(len(req.tokens) - 1, 0)
                if req.speculative and req.view_len:
                    for k in range(K):
                        dl[i * K + k] = req.view_len[k] + req.draft_valid
                continue
            if i in r.parked:
                tl[i] = r.parked[i]
            elif r.prefix is not None and r.prefix.entries[i] is not None:
                tl[i] = len(r.prefix.entries[i].ids)
            if r.view_prefix is not None:
                for k in range(K):
                    e = r.view_prefix.entries[i * K + k]
                    dl[i * K + k] = len(e.ids) if e is not None else 0
        return tl, dl


def reserve_tokens(eng, n: int, max_new: int, speculative: bool) -> int:
    """Cache slots a row of `n` prompt tokens reserves: the prompt, its new tokens and what a
    block writes past them (the lookahead + 2; the first block's tree of every view's chain,
    K * γ + 2 target slots, when that may run), at most max_len."""
    extra = eng.lookahead + 2
    if speculative and eng.draft is not None and eng.view_tree:
        extra = max(extra, len(eng.views) * eng.gamma + 2)
    return min(eng.max_len, n + max_new + extra)


def check_pool(eng, n: int, max_new: Optional[int], room: int, speculative: bool) -> int:
    """The new tokens a request of `n` prompt tokens gets within the KV pool: `max_new`, or with
    None ("as many as fit") `room` cut to what the pool holds. ValueError when the request needs
    more target pages than the whole pool has (it could never be admitted)."""
    page = eng.runner.page_size
    total = -(-eng.kv_cache_tokens // page)
    if max_new is None:
        room = min(room, total * page - (reserve_tokens(eng, n, 0, speculative) - n) - n)
        if room >= 1:
            return room
        max_new = 1
    need = -(-reserve_tokens(eng, n, max_new, speculative) // page)
    if need > total:
        raise ValueError(f"the prompt ({n} tokens) + max_new_tokens ({max_new}) + the block lookahead needs "
                         f"{need} KV pages of {page} tokens but the pool holds {total} (kv_cache_tokens="
                         f"{eng.kv_cache_tokens}): lower max_new_tokens, shorten the prompt or build the engine "
                         "with a larger kv_cache_tokens")
    return max_new
