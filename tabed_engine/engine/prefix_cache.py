"""Prefix caching over the batch slots: which tokens (and which pictures) each slot's target
row still holds, so a request whose prompt starts the same way skips their prefill.

Design. The KV stays where it already is: in the pages of the slot rows (`engine/pages.py`;
no second pool). A finished request's slot keeps its row's pages (those of its valid tokens)
until a new request needs the slot or an admission needs the pages (eviction, least recently
used first); an entry records the row's valid tokens (prompt + generated tokens but the last, whose KV is
written by the next step) and, per image or video run, a hash of its pixels, because every
image's tokens carry the same id and must never match on ids alone. A new request's reuse is
the longest common prefix over every entry, rounded down so the last prompt token is always
recomputed (its logits give the first token). The slot it takes (`pick`) is, among the free
slots that keep the batch's bucket as small as taking the lowest free slot would, the one
holding the longest match (no copy), else the least recently used; any other slot's match,
free or running, is shared with it: its full pages by reference, the partial last one copied
(`PagePool.assign`). A free slot inside the batch's bucket is computed by every block as a
garbage row that writes from the length its entry holds on (`SlotPages.free_lengths`), so its
prefix survives running traffic.

The draft's view rows have an index of their own (`engine/view_cache.py`): they differ per
view (T has no image, P pools, C has the caption text) and are looked up when the views are
prefilled, after the target's prompt; `retire` keeps both (and the slot's pages) up to date.

Everything here is host state updated from the scheduler's deterministic inputs (the
requests' tokens and pixels, the order of admissions and blocks), so tensor-parallel ranks,
which run the same scheduler, make the same choices.
"""
from __future__ import annotations

import hashlib
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Optional

import torch

from tabed_engine.engine.prompt import Prepared
from tabed_engine.models.decoder import cache_rows

HASH_PIECE = 1 << 20     # bytes one thread hashes: a larger picture's pieces are hashed side by side
_hash_pool: Optional[ThreadPoolExecutor] = None


def content_hash(header: bytes, data) -> bytes:
    """16 bytes of SHA-256 over `header` and the bytes of `data` (a buffer). Data of more than two
    pieces of HASH_PIECE bytes is hashed piecewise on a thread pool (hashlib releases the GIL) and
    the pieces' digests are hashed after the header: a photo of several megabytes is hashed in a
    fraction of one thread's time, on the scheduler's path to every image request's prefill. The
    same bytes give the same key in every process (tensor-parallel ranks agree)."""
    global _hash_pool
    view = memoryview(data).cast("B")
    n = len(view)
    if n <= 2 * HASH_PIECE:
        h = hashlib.sha256(header)
        h.update(view)
        return h.digest()[:16]
    if _hash_pool is None:
        _hash_pool = ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1), thread_name_prefix="tabed-hash")
    pieces = _hash_pool.map(lambda i: hashlib.sha256(view[i:i + HASH_PIECE]).digest(), range(0, n, HASH_PIECE))
    h = hashlib.sha256(header + b"|pieces|")
    for d in pieces:
        h.update(d)
    return h.digest()[:16]


def _digest(t: torch.Tensor) -> bytes:
    t = t.detach().contiguous().cpu()
    return content_hash(repr((tuple(t.shape), str(t.dtype))).encode(), t.view(-1).view(torch.uint8).numpy())


def media_keys(prep: Prepared) -> list[tuple[int, int, bytes]]:
    """(start, length, pixel hash) of each image then video run of `prep` (its `media_spans`
    order), computed once and kept on `prep`. An image is hashed from the RGB image the
    processor receives, which determines its preprocessed pixels under the engine's one
    processor (same picture, same key; a different picture, a different key); not from
    `pixel_values`, whose first axis is not the image in every family (Qwen2.5-VL's holds
    patch rows of all images)."""
    keys = getattr(prep, "_media_keys", None)
    if keys is not None:
        return keys
    digests = [content_hash(repr(a.shape).encode(), a) for a in prep.host_pixels()]
    digests += [_digest(v) for v in (prep.video_pixels or [])]
    keys = [(s, n, d) for (s, n), d in zip(prep.media_spans, digests)]
    prep._media_keys = keys
    return keys


@dataclass
class Entry:
    """What a slot's target row holds: KV of `ids` at slots [0, len(ids)), with these media runs."""

    ids: list[int]
    media: list[tuple[int, int, bytes]]
    used: int                          # the index's clock at the last use (LRU)


def _shared(a: list[int], b: list[int]) -> int:
    """The length of the common start of two id lists (a bisection over slice comparisons, which
    run in C: every admission compares its prompt with every slot's row, the views' too)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n                      # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if a[lo:mid] == b[lo:mid] else (lo, mid)
    return lo


def common_prefix(a: Entry, ids: list[int], media: list[tuple[int, int, bytes]]) -> int:
    """Tokens at the start of `ids` (with its media runs) whose KV equals `a`'s: equal ids, and
    any media run starting before the cut equal in start, length and pixel hash."""
    m = _shared(a.ids, ids)
    for x, y in zip(a.media, media):
        if min(x[0], y[0]) >= m:
            break
        if x != y:
            m = min(m, x[0], y[0])
            break
    # a run present in one list only (the other ran out of runs) also cuts there
    for run in a.media[len(media):] + media[len(a.media):]:
        m = min(m, run[0])
    return m


class PrefixIndex:
    """Per batch slot, the entry its target row holds (see the module docstring).

    `limit`: the most tokens an entry keeps. `min_reuse`: shorter matches are not reused.
    `max_suffix`: a match is reused only when at most this many prompt tokens are left to
    prefill (None: any; see `new_index`)."""

    def __init__(self, slots: int, limit: int, min_reuse: int = 1, max_suffix: Optional[int] = None):
        self.entries: list[Optional[Entry]] = [None] * slots
        self.limit, self.min_reuse, self.max_suffix = limit, min_reuse, max_suffix
        self.clock = 0
        self.lookups = self.hits = 0           # admissions and those that reused a prefix
        self.cached_tokens = self.prompt_tokens = 0

    def _tick(self) -> int:
        self.clock += 1
        return self.clock

    def match(self, prep: Prepared) -> list[int]:
        """Each slot's reusable length for `prep` (at most len(ids) - 1)."""
        ids, media = prep.ids, media_keys(prep)
        n = len(ids)
        m = [0 if e is None else min(common_prefix(e, ids, media), n - 1) for e in self.entries]
        return m if self.max_suffix is None else [c if n - c <= self.max_suffix else 0 for c in m]

    def pick(self, prep: Prepared, free: list[int], bucket) -> int:
        """The free slot a request takes: among the free slots below the bucket that the lowest
        free slot gives the batch (`bucket(slots) -> rows`), the longest match, else the least
        recently used (never used first, then the lowest index)."""
        live_top = max((i + 1 for i in range(len(self.entries)) if i not in free), default=0)
        top = bucket(max(live_top, free[0] + 1))
        cands = [i for i in free if i < top]
        m = self.match(prep)
        best = max(cands, key=lambda i: (m[i], -i))
        if m[best] >= self.min_reuse:
            return best
        return min(cands, key=lambda i: (-1 if self.entries[i] is None else self.entries[i].used, i))

    def source(self, prep: Prepared, slot: int) -> tuple[int, Optional[int]]:
        """(cached length, slot to copy it from: `slot` itself, another, or None for no reuse)."""
        m = self.match(prep)
        best = max(range(len(m)), key=lambda i: (m[i], i == slot))
        if m[best] < self.min_reuse:
            return 0, None
        return m[best], best

    def account(self, cached: int, n: int):
        self.lookups += 1
        self.hits += cached > 0
        self.cached_tokens += cached
        self.prompt_tokens += n

    def hold(self, slot: int, prep: Prepared):
        """`slot`'s row now holds `prep`'s prompt."""
        self.entries[slot] = Entry(list(prep.ids[: self.limit]), [r for r in media_keys(prep) if r[0] < self.limit],
                                   self._tick())

    def release(self, slot: int, prep: Prepared, tokens: list[int]):
        """The request in `slot` finished with `tokens`: its row holds the prompt and all of them
        but the last (whose KV the next step would have written)."""
        e = self.entries[slot]
        if e is None:
            return
        e.ids = (list(prep.ids) + list(tokens[:-1]))[: self.limit]
        e.used = self._tick()

    def forget(self, slot: int):
        """`slot`'s row was written over (or may have been)."""
        self.entries[slot] = None

    def stats(self) -> dict:
        """Counters since the engine started: admissions, hits, cached and prompt tokens."""
        return dict(lookups=self.lookups, hits=self.hits, cached_tokens=self.cached_tokens,
                    prompt_tokens=self.prompt_tokens)


# ---------------------------------------------------------------------- the runner's side
# With CUDA graphs the rest of a prompt after its cached prefix (or a prefill chunk after the
# chunks before it) runs as a captured graph per padded length (any slot: `staged_row`): rests of
# up to SUFFIX_STEP * 4 tokens in SUFFIX_STEP-token buckets, longer ones in PREFILL_STEP-token
# buckets up to the runner's `prefill_graph_max`; past that eagerly. Their attention is the
# kernels' (a causal mode past 64 tokens: `ForwardContext.causal`), so a graph does not depend on
# the prefix's length. Eagerly, the 7B target's forward of a 41-token rest took 39 ms of kernel
# launches against 18 ms for the whole 616-token prompt's graph (H200,
# benchmarks/results/multiturn_llava-1.5-7b_eager_suffix.md).
SUFFIX_STEP = 16
SUFFIX_GRAPH_MAX = 64        # the draft views' rests (engine/view_cache.py) reuse up to this many tokens


def suffix_bucket(T: int, limit: int) -> Optional[int]:
    """The padded length of a rest of T tokens (None: above `limit`, eager)."""
    from tabed_engine.engine.prefill import PREFILL_STEP
    step = SUFFIX_STEP if T <= 4 * SUFFIX_STEP else PREFILL_STEP
    P = -(-T // step) * step
    return P if P <= limit else None


def suffix_buckets(limit: int) -> list[int]:
    """Every bucket `suffix_bucket` returns up to `limit`, ascending."""
    return sorted({suffix_bucket(T, limit) for T in range(1, limit + 1)} - {None})


def new_index(runner) -> Optional[PrefixIndex]:
    """The runner's index (None with `Engine(prefix_cache=False)`)."""
    if not runner.eng.prefix_cache:
        return None
    return PrefixIndex(runner.max_batch, runner.max_len)


def suffix_step(lm, cache, x: torch.Tensor, pos: torch.Tensor, lens: torch.Tensor, last: torch.Tensor,
                kv_len: Optional[int] = None) -> torch.Tensor:
    """The rest of one prompt, padded: x [1, P, hidden] at positions pos [1, P] (M-RoPE: [3, 1,
    P], less the row's offset) after a committed prefix of lens [1] tokens of the one-row
    `cache`; the logits of position `last` [1, 1] of the P [1, V]. The padding after the prompt
    writes K/V past it (the next forward overwrites it)."""
    return lm(cache, pos, embeds=x, lengths=lens, logits_index=last, kv_len=kv_len)[:, -1]


def staged_row(runner, slot: int):
    """A one-row view of the target cache at fixed addresses (its own block-table row, length and
    position offset), loaded with `slot`'s: a graph captured over it serves every slot, its KV
    writes reaching the slot's pages through the copied table row."""
    tc = runner.tcache
    stage = getattr(runner, "_suffix_stage", None)
    if stage is None or stage.k is not tc.k:
        with torch.inference_mode(False):    # normal tensors: loaded in and out of inference mode
            stage = runner._suffix_stage = cache_rows(tc, 0, 1)
            stage.block_table, stage.lengths = tc.block_table[:1].clone(), tc.lengths[:1].clone()
            stage.pos_offset = tc.pos_offset[:1].clone()
    stage.block_table.copy_(tc.block_table[slot:slot + 1])
    stage.lengths.copy_(tc.lengths[slot:slot + 1])
    stage.pos_offset.copy_(tc.pos_offset[slot:slot + 1])
    return stage


def rest_positions(runner, cached: int, P: int, pos3: Optional[torch.Tensor], offset: int) -> torch.Tensor:
    """The positions input of a padded rest [cached, cached + P): the slots [1, P], or for an
    M-RoPE target [3, 1, P]: the prompt's ids there less the row's `offset` (the forward adds it
    back), the slots past the prompt (padding) and wherever `pos3` is None."""
    slots = torch.arange(cached, cached + P)
    if runner.target.lm.cfg.mrope_section is None:
        return slots[None]
    pos = slots.repeat(3, 1)
    if pos3 is not None:
        T = min(P, pos3.shape[1] - cached)
        pos[:, :T] = pos3[:, cached:cached + T].cpu() - offset
    return pos[:, None]


def suffix_graph(runner, x: torch.Tensor, slot: int, cached: int, P: int, pos3: Optional[torch.Tensor] = None,
                 offset: int = 0) -> torch.Tensor:
    """The rest x [T, hidden] of `slot`'s prompt after `cached` tokens through the captured graph
    of bucket P >= T (captured on first use; `capture_suffix_graphs` at warm-up): the logits of
    its last token [1, V]. pos3 / offset: an M-RoPE prompt's ids [3, n] and the row's offset."""
    dev, T = runner.device, x.shape[0]
    xp = torch.zeros(1, P, x.shape[-1], device=dev, dtype=x.dtype)
    xp[0, :T] = x
    pos = rest_positions(runner, cached, P, pos3, offset)
    inputs = dict(x=xp, pos=pos.pin_memory().to(dev, non_blocking=True) if dev.type == "cuda" else pos,
                  lens=torch.full((1,), cached, dtype=torch.int32, device=dev),
                  last=torch.full((1, 1), T - 1, dtype=torch.long, device=dev))
    stage = staged_row(runner, slot)
    return runner.graphs.run(("suffix", P), partial(suffix_step, runner.target.lm, stage), inputs)


def capture_suffix_graphs(runner) -> int:
    """Capture every bucket's rest graph (on an idle runner, over slot 0 with its pages released:
    the writes land in scratch). Returns how many were captured."""
    if runner.graphs is None:
        return 0
    todo = [P for P in suffix_buckets(min(runner.prefill_graph_max, runner.max_len))
            if ("suffix", P) not in runner.graphs.graphs]
    if todo:
        runner.pages.scribble(0)
        hidden = runner.target.lm.cfg.hidden_size
        for P in todo:
            suffix_graph(runner, torch.zeros(P, hidden, device=runner.device, dtype=runner.dtype), 0, 0, P)
    return len(todo)


def pick_slot(runner, req, slots: list) -> int:
    """The free slot (`slots[i] is None`) that `req` is admitted into (see `PrefixIndex.pick`;
    the lowest free slot without the cache)."""
    free = [i for i, r in enumerate(slots) if r is None]
    if runner.prefix is None:
        return free[0]
    from tabed_engine.engine.runner import bucket_of
    return runner.prefix.pick(req.prep, free, lambda n: bucket_of(n, runner.max_batch))


def retire(runner, req):
    """`req` leaves its slot: the rows keep the pages of what their entries hold for later
    requests (a failed request's rows, and every row without the cache, return theirs)."""
    if req.slot is None or runner.pages is None:
        return
    runner.pages.draft_reserved.pop(req.slot, None)        # (views it never prefilled)
    views = getattr(runner, "view_prefix", None)
    if runner.prefix is None or req.finish_reason == "error":
        if runner.prefix is not None:
            runner.prefix.forget(req.slot)
            if views is not None:
                views.forget(req.slot)
        runner.pages.retire(req, None, None)
        return
    runner.prefix.release(req.slot, req.prep, req.tokens)
    entry = runner.prefix.entries[req.slot]
    keep_draft = None
    if views is not None and req.speculative and req.view_len:   # (an AR request leaves its draft rows alone)
        views.release(req.slot, req.tokens[:req.draft_valid])
        keep_draft = [0 if e is None else len(e.ids) for e in views.entries[req.slot * views.K:(req.slot + 1) * views.K]]
    runner.pages.retire(req, None if entry is None else len(entry.ids), keep_draft)


def prefill_suffix(runner, prep: Prepared, x: torch.Tensor, slot: int, cached: int,
                   pos3: Optional[torch.Tensor], end: Optional[int] = None) -> torch.Tensor:
    """Prefill target row `slot` from `cached` on: the prompt's tokens [cached, end) (default: to
    the prompt's end) run as new tokens of a row whose committed length is `cached` (its pages
    hold the cached prefix: `PagePool.assign`): through the captured graph of its padded length
    (`suffix_graph`) where there is one, else eagerly (on CUDA the kernels, a causal attention
    past 64 tokens; elsewhere the masked SDPA path). A chunk of a chunked prefill is the same
    call (`PrefillSteps.prefill_chunk`). x: those tokens' embeddings [end - cached, hidden];
    pos3: the whole prompt's M-RoPE ids [3, n] or None (the row's `pos_offset` is already the
    prompt's: the forward adds it back). Returns the logits of position end - 1 [1, V]."""
    n = len(prep.ids) if end is None else end
    P = suffix_bucket(n - cached, runner.prefill_graph_max) if runner.prefill_graphs else None
    if runner.graphs is not None and P is not None and cached + P <= runner.tcache.max_len:
        return suffix_graph(runner, x, slot, cached, P, pos3, rope_offset(prep, pos3))
    return runner.target.lm(**suffix_args(runner, prep, x, slot, cached, pos3, end))[:, -1]


def rope_offset(prep: Prepared, pos3: Optional[torch.Tensor]) -> int:
    """The row's `pos_offset` for a prompt with M-RoPE ids pos3 [3, n] (0 for None)."""
    return 0 if pos3 is None else int(pos3.max()) + 1 - len(prep.ids)


def suffix_args(runner, prep: Prepared, x: torch.Tensor, slot: int, cached: int, pos3: Optional[torch.Tensor],
                end: Optional[int] = None) -> dict:
    """The eager `LlamaLM.forward` arguments of `prefill_suffix` (the same arguments): the
    prompt's tokens [cached, end) as new tokens of row `slot` after its `cached` committed ones,
    the logits of the last wanted."""
    n = len(prep.ids) if end is None else end
    dev = runner.device
    if pos3 is None:
        pos = torch.arange(cached, n, device=dev)[None]
    else:
        pos = (pos3[:, cached:n] - rope_offset(prep, pos3)).to(dev)[:, None]
    return dict(cache=cache_rows(runner.tcache, slot, slot + 1), positions=pos, embeds=x[None],
                lengths=torch.full((1,), cached, dtype=torch.int32, device=dev),
                logits_index=torch.full((1, 1), n - 1 - cached, dtype=torch.long, device=dev),
                kv_len=runner.kv_bucket(n))
