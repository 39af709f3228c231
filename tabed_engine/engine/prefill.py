"""A request's prefill: its images through the vision tower, the target's prompt padded to a
64-token bucket and replayed as that bucket's CUDA graph (eager on the CPU and above
`PREFILL_GRAPH_MAX` tokens), and the draft's views prefilled beside it (on a second stream on
the GPU; the first token is read without waiting for them). A prefill runs in three parts
(`prefill_begin`, `prefill_chunk` once or more, `prefill_finish`) so that a long prompt can be
prefilled in chunks between the running requests' blocks (`engine/chunked.py`)."""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from functools import partial
from typing import Optional

import torch

from tabed_engine.engine.graphs import private_stream
from tabed_engine.engine.prefix_cache import (capture_suffix_graphs, prefill_suffix, rest_positions, rope_offset,
                                              staged_row, suffix_args)
from tabed_engine.engine.prompt import Prepared
from tabed_engine.engine.request import Request
from tabed_engine.engine.view_cache import prefill_views
from tabed_engine.models.decoder import KVCache, cache_rows
from tabed_engine.speculation.chain import prefill_draft
from tabed_engine.speculation.ensemble import state_rows
from tabed_engine.speculation.coupling import seed_value
from tabed_engine.speculation.sampling import pick_tokens
from tabed_engine.speculation.views import ViewRow, build_views

# prompts are padded to a multiple of 64 tokens for the prefill graphs: at most 63 wasted
# tokens (about one image's worth over ten), and a graph per 64 tokens of cache stays few (each
# bucket costs a capture and an attention plan at warm-up: results/ttft_llava-1.5-7b_16step.md)
PREFILL_STEP = 64
# longer prompts prefill eagerly: there the kernels outlast the host's launches, all a graph
# removes, and the padding costs more (benchmarks/results/ttft_llava-1.5-7b.json, graph vs eager)
PREFILL_GRAPH_MAX = 1664


def prefill_bucket(n: int, max_len: int, limit: int = PREFILL_GRAPH_MAX) -> Optional[int]:
    """The padded length P >= n a prompt of n tokens is prefilled at through the graph of
    bucket P, or None when it prefills eagerly at its own length (n above `limit` or the
    cache). P is n rounded up to a multiple of PREFILL_STEP, at most the cache length."""
    if n < 1 or n > min(limit, max_len):
        return None
    return min(-(-n // PREFILL_STEP) * PREFILL_STEP, max_len)


# The draft's views prefill beside the target's prompt (on a second stream on the GPU) and the
# device hides part of their work under the target's prefill; the first token waits for the rest.
# Left to the request's first block that drafts instead (after the first token; an AR step needs
# none) they cost it nothing but run whole, unhidden, before that block. A draft whose K view rows
# weigh at least this share of the target's decoder (`decoder_params`) is deferred: on the H200
# LLaVA-OneVision's 0.5B (two views: 14%) beside the prompt delayed its first token less than
# deferral delayed its first block, and Qwen2.5-VL's 3B (87%) beside the prompt made SD's first
# token later than transformers' (benchmarks/results/README.md, 2026-12-03); LLaVA-1.5's 68M (1.3%)
# costs nothing
DEFER_VIEWS_SHARE = 0.5


def decoder_params(cfg) -> int:
    """A decoder's weight count from its config (projections, MLP, head), the same on every
    tensor-parallel rank whatever its shard."""
    h, hd = cfg.hidden_size, cfg.head_dim
    attention = h * (cfg.num_heads + 2 * cfg.num_kv_heads) * hd + cfg.num_heads * hd * h
    return cfg.num_layers * (attention + 3 * h * cfg.intermediate_size) + cfg.vocab_size * h


def mixed_bucket(T: int, limit: int) -> Optional[int]:
    """The padded length of a prompt chunk of T tokens in a captured mixed step (None: above
    `limit`): 16 or 24 times a power of two (at most half of it padding, so a handful of graphs
    per block shape), or `limit` itself where that is smaller."""
    if T < 1 or T > limit:
        return None
    P = 16
    while P < T:
        P = P * 3 // 2 if P & (P - 1) == 0 else P * 4 // 3
    return min(P, limit)


@dataclass
class GraphChunk:
    """One prompt chunk as the inputs of a captured mixed step (`PrefillSteps.mixed_chunk`):
    padded to P tokens over `stage`, the staged one-row view of its slot; `inputs` its tensors
    (`runner.with_chunk`'s cx, cpos, clens, clast), of which `shared` are buffers every mixed
    graph shares."""
    P: int
    stage: KVCache
    inputs: dict
    shared: tuple


def prefill_buckets(max_len: int, limit: int = PREFILL_GRAPH_MAX) -> list[int]:
    """Every bucket `prefill_bucket` can return for a cache of `max_len` slots, ascending."""
    return sorted({prefill_bucket(n, max_len, limit) for n in range(1, min(limit, max_len) + 1)})


def prefill_step(lm, cache: KVCache, x: torch.Tensor, slot: torch.Tensor, last: torch.Tensor,
                 kv_len: Optional[int] = None, pos: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Causal prefill of one padded prompt into cache row `slot`; the captured graph of a
    prompt-length bucket.

    x: [1, P, hidden] embeddings, the prompt's n tokens first (the padding after them is never
    attended to by a real token; its K/V lands in slots [n, P) of the row, past the row's
    length, which the next forward overwrites or masks). slot: [1] int64 cache row; last:
    [1, 1] int64, n - 1. Returns the logits of position `last` [1, V]. `kv_len` is unused (the
    keys are the prompt's own). pos: M-RoPE ids [3, 1, P] (default: the slots)."""
    if pos is None:
        pos = torch.arange(x.shape[1], device=x.device)[None]
    return lm(cache, pos, embeds=x, logits_index=last, fresh=True, slot=slot)[:, -1]

@dataclass(eq=False)
class PrefillJob:
    """One request's prefill in progress (`PrefillSteps.prefill_begin`): the prompt's tokens
    [0, done) have their KV in target row `slot`; the first `cached` came from the prefix cache
    (row `src`'s, shared or copied when the row took its pages)."""

    req: Request
    slot: int
    cached: int
    src: Optional[int]
    x: torch.Tensor                   # embeddings of the prompt's tokens [cached, n) [n - cached, hidden]
    pos3: Optional[torch.Tensor]      # the prompt's M-RoPE ids [3, n] (None: the slots)
    sel: Optional[torch.Tensor]       # the target's selected image features (the draft's views reuse them)
    vision_done: object               # event: the vision tower done (where the views may start)
    t0: float
    done: int = 0
    chunks: int = 0
    logits: Optional[torch.Tensor] = None     # the last prompt position's [1, V], after the last chunk

    @property
    def n(self) -> int:
        return len(self.req.prep.ids)

    @property
    def left(self) -> int:
        """Prompt tokens still to prefill."""
        return self.n - self.done


class PrefillSteps:
    """`Runner`'s prefill side (a mixin: it reads the runner's caches, graphs and streams)."""

    def embed(self, model, ids: list[int], spans, feats) -> torch.Tensor:
        """Token embeddings [len(ids), hidden] with image features placed at each span."""
        x = model.lm.embed_tokens(self.to_device(ids))     # (no device sync: the draft's rows run beside the target)
        for i, (start, n) in enumerate(spans):
            if feats[i].shape[0] != n:
                raise ValueError(f"image {i} has {feats[i].shape[0]} features for {n} image tokens")
            x[start:start + n] = feats[i].to(x.dtype)
        return x

    def encode(self, prep: Prepared):
        """The target's vision tower and projector: (pre-projector image features: per image, or
        per tile of any-resolution images; projected features, one [n_i, D] per image, then one
        per video, in `prep.media_spans` order), or (None, None) for a text-only prompt."""
        vision = self.target.vision
        sel, feats = None, None
        if prep.pixel_values is not None:
            sel = vision.select_images(prep.pixel_values.to(self.device), prep.image_sizes)
            feats = vision.image_features(sel, prep.image_sizes)
        if prep.num_videos:
            feats = (feats or []) + [vision.video_features(v.to(self.device)) for v in prep.video_pixels]
        return sel, feats

    def prefill_lm(self, prep: Prepared, feats, slot: int, cached: int = 0) -> torch.Tensor:
        """Prefill the target's language model on the prompt into cache row `slot` (which holds
        its pages); returns the logits of the last prompt position [1, V] (with a graph, its
        output buffer: read it before the next prefill of the same bucket). `cached` > 0: the
        row holds the prompt's first `cached` tokens' KV already (`prefix_cache.prefill_suffix`;
        `feats` may then be None when every image lies inside them)."""
        x, pos3 = self.lm_inputs(prep, feats, slot, cached)
        return self.prefill_range(prep, x, slot, cached, len(prep.ids), pos3)

    def lm_inputs(self, prep: Prepared, feats, slot: int, cached: int = 0):
        """What every chunk of a target prefill reads: the embeddings of the prompt's tokens from
        `cached` on [n - cached, hidden] (image features in place) and its M-RoPE ids [3, n] (None:
        the slots); sets the row's `pos_offset` and drops its prefix-cache entry."""
        if self.prefix is not None:
            self.prefix.forget(slot)            # the row is written over from here on
        if cached and feats is None:            # no image after the cached prefix: its tokens alone
            x = self.target.lm.embed_tokens(torch.tensor(prep.ids[cached:], device=self.device))
        else:
            x = self.embed(self.target, prep.ids, prep.media_spans, feats)[cached:]
        # M-RoPE ids of a prompt with images (None: its slots); the row's later positions follow
        # its cache slots shifted by the offset
        pos3 = self.target.vision.positions(prep.ids, prep.image_spans, prep.image_sizes,
                                            videos=[(s, px) for (s, _), px in zip(prep.video_spans or [],
                                                                                  prep.video_pixels or [])])
        self.tcache.pos_offset[slot] = rope_offset(prep, pos3)
        return x, pos3

    def prefill_range(self, prep: Prepared, x: torch.Tensor, slot: int, start: int, end: int,
                      pos3: Optional[torch.Tensor]) -> torch.Tensor:
        """Prefill prompt tokens [start, end) into target row `slot`, whose KV holds [0, start)
        and whose pages hold [0, end); returns the logits of position end - 1
        [1, V]. x: their embeddings [end - start, hidden]; pos3: the whole prompt's M-RoPE ids or
        None. From 0 a fresh prefill (padded graph or eager), else `prefix_cache.prefill_suffix`;
        with `Engine(invariant=True)` on the GPU, `prefill_invariant`."""
        if self.invariant_prefill:
            return self.prefill_invariant(prep, x, slot, start, end, pos3)
        if start:
            return prefill_suffix(self, prep, x, slot, start, pos3, end=end)
        n = end
        P = prefill_bucket(n, self.max_len, self.prefill_graph_max) if self.prefill_graphs else None
        if P is None:           # eager at the prompt's own length
            return self.target.lm(**self.range_args(prep, x, slot, 0, n, pos3))[:, -1]
        buf, slot_t, last_t = self._prefill_inputs()
        buf[0, :n].copy_(x)
        buf[0, n:P].zero_()
        slot_t.fill_(slot)
        last_t.fill_(n - 1)
        if self._prefill_pos is not None:       # (padding: ids past the prompt, never attended to)
            self._prefill_pos[:, 0, :P].copy_(torch.arange(P).expand(3, P) if pos3 is None else
                                              torch.cat([pos3[:, :n], torch.arange(n, P).expand(3, P - n)], 1))
        return self._prefill_padded(P)

    def range_args(self, prep: Prepared, x: torch.Tensor, slot: int, start: int, end: int,
                   pos3: Optional[torch.Tensor]) -> dict:
        """The eager `LlamaLM.forward` arguments of `prefill_range` (the same arguments): from 0
        a fresh prefill (not for an invariant engine), else the rest after the row's committed
        prefix (`prefix_cache.suffix_args`); the logits of position end - 1 wanted."""
        if start or self.invariant_prefill:
            return suffix_args(self, prep, x, slot, start, pos3, end=end)
        pos = torch.arange(end, device=self.device)[None] if pos3 is None else pos3[:, None, :end].to(self.device)
        return dict(cache=cache_rows(self.tcache, slot, slot + 1), positions=pos, embeds=x[None],
                    logits_index=torch.tensor([[end - 1]], device=self.device), kv_len=self.kv_bucket(end), fresh=True)

    @property
    def invariant_prefill(self) -> bool:
        """Prefill through `prefill_invariant` (an invariant engine on the GPU)."""
        return self.eng.invariant and self.device.type == "cuda"

    def prefill_invariant(self, prep: Prepared, x: torch.Tensor, slot: int, start: int, end: int,
                          pos3: Optional[torch.Tensor]) -> torch.Tensor:
        """`prefill_range` of an invariant engine: tokens [start, end) as new tokens over the
        row's KV (`prefix_cache.prefill_suffix`: a captured graph per padded length where it
        can), through the decode path's row-count-invariant kernels (the attention in its
        causal mode). A token's KV and logits then have the same bits however the prompt is cut
        (a cold prefill, a prefix-cache hit, chunks of any budget) and the bits a decode step at
        its position would give."""
        return prefill_suffix(self, prep, x, slot, start, pos3, end=end)

    def _prefill_inputs(self):
        """The padded prefill's static inputs, one set shared by every bucket's graph: embeddings
        [1, max_len, hidden], cache row [1], last real position [1, 1]."""
        if self._prefill_bufs is None:
            with torch.inference_mode(False):
                hidden = self.target.lm.cfg.hidden_size
                self._prefill_bufs = (torch.zeros(1, self.max_len, hidden, device=self.device, dtype=self.dtype),
                                      torch.zeros(1, dtype=torch.long, device=self.device),
                                      torch.zeros(1, 1, dtype=torch.long, device=self.device))
                if self.target.lm.cfg.mrope_section is not None:   # M-RoPE ids, an input of the graphs
                    self._prefill_pos = torch.arange(self.max_len, device=self.device).repeat(3, 1, 1)
        return self._prefill_bufs

    def _prefill_padded(self, P: int) -> torch.Tensor:
        buf, slot_t, last_t = self._prefill_bufs
        fn = partial(prefill_step, self.target.lm, self.tcache)
        inputs = dict(x=buf[:, :P], slot=slot_t, last=last_t)
        shared = (buf, slot_t, last_t)
        if self._prefill_pos is not None:
            inputs["pos"] = self._prefill_pos[:, :, :P]
            shared += (self._prefill_pos,)
        if self.graphs is None:
            return fn(**inputs)
        return self.graphs.run(("prefill", P), fn, inputs, shared=shared)

    def capture_prefill(self, buckets=None) -> int:
        """Capture the target prefill graphs of `buckets` (default: every bucket of the cache
        length up to `prefill_graph_max`), and the graphs of prompt rests after cached prefixes
        and chunks (`prefix_cache.capture_suffix_graphs`), on an idle runner: each capture writes
        padding into cache row 0. Returns how many were captured."""
        if self.graphs is None or not self.prefill_graphs:
            return 0
        self.allocate()
        buf, slot_t, last_t = self._prefill_inputs()
        todo = [P for P in (buckets or prefill_buckets(self.max_len, self.prefill_graph_max))
                if ("prefill", P) not in self.graphs.graphs]
        buf.zero_()
        slot_t.zero_()
        self.pages.scribble(0)          # (its writes land in scratch)
        for P in todo:
            last_t.fill_(P - 1)
            self._prefill_padded(P)
        self.pending = None
        return len(todo) + capture_suffix_graphs(self)

    def warm_draft_prefill(self) -> int:
        """Run the draft views' prefill once at every prompt-length bucket of the draft's cache
        (on an idle runner: writes into slot 0's draft rows), and once packed (views of two
        buckets), so a request's first encounter of a bucket pays no one-off costs. Returns how
        many buckets ran."""
        if self.draft is None:
            return 0
        self.allocate()
        rows = [ViewRow([0] * P, [], []) for P in prefill_buckets(self.dcache.max_len, self.dcache.max_len)]
        self.pages.scribble_draft(0)    # (its writes land in scratch)
        cache = cache_rows(self.dcache, 0, self.K)
        for row in rows:
            prefill_draft(self, [row] * self.K, cache)
        if self.K > 1 and len(rows) > 1:
            prefill_draft(self, rows[1:2] + rows[:1] * (self.K - 1), cache, len(rows[1].ids), PREFILL_STEP)
        self.pending = None
        return len(rows)

    def prefill_target(self, prep: Prepared, slot: int):
        """Encode the images and prefill target cache row `slot` of an idle runner (diagnostics:
        the slot's target and draft rows take whole rows of pages); returns (logits of the last
        prompt position [1, V], pre-projector image features or None)."""
        self.allocate()
        self.pages.claim(slot)
        sel, feats = self.encode(prep)
        return self.prefill_lm(prep, feats, slot), sel

    def prefill(self, req: Request, slot: int):
        """Prefill `req` into `slot` (target row and, speculating, its K draft rows) and pick
        its first token, in one go. One host read (the first token)."""
        job = self.prefill_begin(req, slot)
        self.prefill_chunk(job)
        self.prefill_finish(job)

    def prefill_begin(self, req: Request, slot: int) -> PrefillJob:
        """Start `req`'s prefill in `slot`: the slot's sampling settings, the prefix-cache lookup,
        the vision tower (once for the request) and the embeddings of the whole prompt; the
        target's tokens then run in chunks (`prefill_chunk`) and `prefill_finish` ends it."""
        self.allocate()
        t0 = time.perf_counter()
        req.stats.time_queued = t0 - req.arrival
        req.slot = slot
        sp = req.sp
        v = self.to_device([1.0 if sp.greedy else sp.temperature, sp.top_k, sp.top_p, sp.greedy], torch.float32)
        self.row_temp[slot:slot + 1].copy_(v[0:1])
        self.row_top_k[slot:slot + 1].copy_(v[1:2])
        self.row_top_p[slot:slot + 1].copy_(v[2:3])
        self.row_greedy[slot:slot + 1].copy_(v[3:4])
        self.row_seed[slot:slot + 1].copy_(self.to_device([seed_value(sp.seed) if sp.coupled else 0]))
        self.row_coupled[slot:slot + 1].copy_(self.to_device([sp.coupled], torch.bool))
        # a prefix of the prompt whose KV a slot holds (0: none); images inside it need no tower
        # for the target (the draft's views then run the draft's own)
        cached, src = self.prefix.source(req.prep, slot) if self.prefix is not None else (0, None)
        # the row's pages: the cached prefix's shared (or copied) from `src`, the rest fresh
        self.pages.target.assign([(slot, src, cached, self.pages.target_tokens(req))])
        covered = cached > 0 and all(s + m <= cached for s, m in req.prep.media_spans)
        # (covered: the draft's views preprocess and encode only images their own cached
        # prefixes lack, `views.build_views`)
        if req.prep.num_images and req.prep.pixel_values is None and not covered:
            from tabed_engine.models.image_ops import device_pixels      # preprocessed here, on the device
            req.prep.pixel_values = device_pixels(req.prep.host_pixels(), self.eng.processor.image_processor,
                                                  self.device)
        sel, feats = (None, None) if covered else self.encode(req.prep)
        vision_done = self._record()         # where the draft's views may start (they share `sel`)
        x, pos3 = self.lm_inputs(req.prep, feats, slot, cached)
        return PrefillJob(req, slot, cached, src, x, pos3, sel, vision_done, t0, done=cached)

    def prefill_chunk(self, job: PrefillJob, tokens: Optional[int] = None) -> int:
        """Run the job's next chunk: at most `tokens` prompt tokens (None: all that are left)
        after those whose KV the row holds. Returns the tokens run. Until the last chunk the row
        is parked at its prefilled length (`parked`: blocks write their garbage for the slot
        there, where the next chunk writes over it)."""
        start = job.done
        end = job.n if tokens is None else min(job.n, start + tokens)
        x = job.x[start - job.cached:end - job.cached]
        self.chunk_done(job, end, self.prefill_range(job.req.prep, x, job.slot, start, end, job.pos3))
        return end - start

    def chunk_part(self, job: PrefillJob, end: int) -> dict:
        """The job's chunk [done, end) as the eager `forward` arguments of a part of a mixed
        forward (`Runner.ar_mixed`; `chunk_done` after it). Parks the row at the chunk's start:
        the garbage the step's part computes for the slot lands where the chunk, packed after it,
        writes over it."""
        self.parked[job.slot] = job.done
        x = job.x[job.done - job.cached:end - job.cached]
        return self.range_args(job.req.prep, x, job.slot, job.done, end, job.pos3)

    def mixed_chunk(self, job: PrefillJob, end: int) -> Optional[GraphChunk]:
        """The job's chunk [done, end) as the inputs of a captured mixed step, or None where no
        graph serves it (no graphs; the chunk padded past the cache's end). Its embeddings are
        padded to `mixed_bucket` in a buffer every mixed graph shares, its positions likewise
        (M-RoPE: the prompt's ids less the row's offset, `prefix_cache.rest_positions`), and
        its slot's block-table row, length and offset are loaded into the staged one-row view
        (`prefix_cache.staged_row`): one graph per block shape and bucket serves every slot.
        Parks the row at the chunk's start (see `chunk_part`)."""
        start, T = job.done, end - job.done
        budget = self.eng.prefill_chunk or self.max_len      # a chunk of the whole budget: no padding
        P = mixed_bucket(T, min(budget, self.max_len)) if self.graphs is not None else None
        if P is None or start + P > self.tcache.max_len:
            return None
        self.parked[job.slot] = start
        cx, cpos = self._mixed_buffers()
        cx[0, :T].copy_(job.x[start - job.cached:end - job.cached])
        cx[0, T:P].zero_()
        pos = rest_positions(self, start, P, job.pos3, rope_offset(job.req.prep, job.pos3))
        cpos[..., :P].copy_(pos.pin_memory() if self.device.type == "cuda" else pos, non_blocking=True)
        inputs = dict(cx=cx[:, :P], cpos=cpos[..., :P], clens=self.to_device([start], torch.int32),
                      clast=self.to_device([[T - 1]]))
        return GraphChunk(P, staged_row(self, job.slot), inputs, (cx, cpos))

    def _mixed_buffers(self) -> tuple:
        """The chunk inputs every captured mixed step shares: embeddings [1, max_len, hidden]
        and positions [1, max_len] (M-RoPE: [3, 1, max_len])."""
        bufs = getattr(self, "_mixed_bufs", None)
        if bufs is None or bufs[0].device != self.device:
            cfg, n = self.target.lm.cfg, self.tcache.max_len
            with torch.inference_mode(False):
                cx = torch.zeros(1, n, cfg.hidden_size, device=self.device, dtype=self.dtype)
                shape = (1, n) if cfg.mrope_section is None else (3, 1, n)
                bufs = self._mixed_bufs = (cx, torch.zeros(shape, dtype=torch.long, device=self.device))
        return bufs

    def chunk_done(self, job: PrefillJob, end: int, logits: torch.Tensor):
        """The job's chunk [done, end) ran; logits: its last position's [1, V]."""
        job.done, job.chunks = end, job.chunks + 1
        if end == job.n:
            job.logits = logits
            self.parked.pop(job.slot, None)
        else:
            self.parked[job.slot] = end
        self.pending = None               # a queued block saw the row parked where this chunk wrote

    def prefill_abandon(self, job: PrefillJob):
        """A prefill that will not finish (it failed or was aborted): the slot is free again."""
        self.parked.pop(job.slot, None)
        self.pages.scribble(job.slot)
        self.pending = None

    def prefill_finish(self, job: PrefillJob):
        """After the last chunk: pick the first token from the last prompt position's logits,
        prefill the draft's views (speculating; `views_deferred`: left to the request's first
        block) and set the slot's weights and history; the request then decodes with the batch."""
        req, slot, cached, logits = job.req, job.slot, job.cached, job.logits
        sp = req.sp
        req.stats.cached_tokens = cached
        req.stats.prefill_chunks = job.chunks
        # (the coupling's position of the first token: the prompt's length)
        first = pick_tokens(logits, sp, req.generator, self.to_device([req.n_prompt]) if sp.coupled else None)
        host = self._host("first", (1,))
        host.copy_(first, non_blocking=True)
        ready = self._record()
        defer = req.speculative and self.views_deferred()
        if req.speculative and not defer:
            # queued behind the target's prefill before the first token is read: their host
            # work overlaps the device's, not the token's delivery
            self._views_ready(req, job.sel, job.vision_done, logits, first)
        self._wait(ready)                    # the first token: not behind the draft's views
        if self.prefix is not None:
            self.prefix.hold(slot, req.prep)
            self.prefix.account(cached, req.n_prompt)
        if not defer:
            req.prep.release_host_pixels()   # the target's and the draft's uploads are done
        req.append([int(host[0])])
        req.stats.time_first_token = time.perf_counter() - req.arrival
        if defer and not req.finished:    # (a request ending at its first token needs none)
            # (the logits may be a graph's output buffer: a copy)
            req.views_pending = (job.sel, job.vision_done, logits.clone(), first)
            self.pages.reserve_views(req)     # the draft pages its views will take
        self.pending = None               # the batch changed: the queued block is stale
        req.stats.time_prefill = time.perf_counter() - job.t0

    def views_deferred(self) -> bool:
        """Whether a request's draft views are prefilled before its first drafting block rather
        than with its prompt (`defer_views`; None: when the draft's K rows weigh at least
        DEFER_VIEWS_SHARE of the target's decoder, see there)."""
        if self.defer_views is not None:
            return self.defer_views
        return self.views_share() >= DEFER_VIEWS_SHARE

    def views_share(self) -> float:
        """The draft's K view rows' weights over the target decoder's (`decoder_params`)."""
        if self._views_share is None:
            self._views_share = self.K * decoder_params(self.draft.lm.cfg) / decoder_params(self.target.lm.cfg)
        return self._views_share

    def prefill_pending_views(self, req: Request):
        """The draft's views of a request whose prefill left them (`views_deferred`): prefilled
        now, before its first block, with its weights and history."""
        sel, after, logits, first = req.views_pending
        req.views_pending = None
        self.pages.draft_reserved.pop(req.slot, None)
        self._views_ready(req, sel, after, logits, first)
        req.prep.release_host_pixels()

    def _views_ready(self, req: Request, sel, after, logits: torch.Tensor, first: torch.Tensor):
        """Prefill `req`'s draft views (`_prefill_views`) and set its slot's view mask, weights
        and history: the first token's target logits [1, V] and the token first [1] give each
        view's divergence there, the first block's weights."""
        slot, K, sp = req.slot, self.K, req.sp
        first_q = self._prefill_views(req, sel, slot, after)
        if self._side is not None:
            torch.cuda.current_stream().wait_stream(self._side)   # later work reads the draft rows
        self.state.reset_rows(slice(slot, slot + 1))
        self.view_mask[slot].copy_(self.to_device(req.view_mask or (True,) * K, torch.float32))
        self.w[slot] = 1.0 / K
        if self.state.adaptive:
            # the prefill already verified one position: the target's distribution of the
            # first token. Each view's divergence there gives the first block adapted weights.
            st = state_rows(self.state, slot, slot + 1)
            w, cursor = st.step(logits[:, None], first_q.view(1, K, 1, -1), torch.zeros_like(first),
                                st.cursor, temperature=1.0 if sp.greedy else sp.temperature)
            st.cursor.copy_(cursor)
            self.w[slot] = w[0]
        if req.view_mask is not None:
            self.w[slot : slot + 1] = self._masked(self.w[slot : slot + 1], slot, slot + 1)

    def _prefill_views(self, req: Request, sel, slot: int, after) -> torch.Tensor:
        """Build `req`'s draft views and prefill them into the slot's K draft rows; returns each
        view's logits of the first generated token [K, V]. With `overlap_draft` (CUDA) the work
        is queued on a second stream from event `after` (the target's vision tower done), so it
        runs beside the target's prefill; the caller joins the streams before the rows are read."""
        side = None
        if self.overlap_draft and self.device.type == "cuda":
            if self._side is None:       # a stream no graph cache holds (see graphs.py)
                self._side = private_stream(self, self.device)
            side = self._side
            side.wait_event(after)
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            skip = frozenset(v for v, m in zip(self.eng.views, req.view_mask or ()) if not m)
            rows = build_views(self.eng, req.prep, sel, req.caption, skip)
            longest = max(len(r.ids) for r in rows)
            # (the engine checked the views it could count when the request was added; a C view
            # captioned only now is checked here)
            room = self.eng.draft_len - longest - self.eng.lookahead - 2
            if req.sp.max_new_tokens is None and 1 <= room < req.max_new:  # "as many as fit": the views' too
                req.max_new = room
            if req.max_new > room:
                raise ValueError(f"a draft view of {longest} tokens + max_new_tokens exceeds the draft's "
                                 f"{self.eng.draft_len} positions")
            # padded to a prompt-length bucket: the eager forward's per-shape costs (kernel
            # selection and compilation on the GPU) are paid once per bucket, not per length
            # (views of different buckets, say an image view and the text-only one, each at its own)
            pad = prefill_bucket(longest, self.dcache.max_len, self.dcache.max_len) or 0
            # cached prefixes of the view rows reused (engine/view_cache.py)
            first_q, req.stats.draft_cached_tokens = prefill_views(self, req, rows, skip, slot, pad, PREFILL_STEP)
        if side is not None:
            # the caching allocator must not hand these to the other stream while still in use
            main = torch.cuda.current_stream()
            for t in (sel, req.prep.pixel_values):
                if t is not None and t.is_cuda:
                    t.record_stream(side)
            first_q.record_stream(main)
        req.view_len = [len(r.ids) for r in rows]
        req.prompt_tail = [r.ids[-1] for r in rows]
        req.draft_valid = 0
        return first_q

