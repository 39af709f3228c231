"""The runner: owns the static KV caches (one target row per batch slot, K draft rows per
slot), the ensemble history, the CUDA graphs (one per batch bucket and step) and the step
functions: a request's prefill into its slot, an autoregressive step and a speculative block
for the running batch.

A block's inputs come from the requests' host state (`Request.tokens` and lengths), or,
when the batch did not change since the last block, from that block's device outputs: the
next block's first half (the draft, or the next AR forward) is queued before the host waits
for the current one, so the device does not idle while the host reads a block, emits its
tokens and launches the next graphs. Rows of finished or empty slots compute garbage that
nobody reads; their lengths stay put (`active` masks every device-side update).
"""
from __future__ import annotations

import contextlib
import copy
import math
import time
from functools import partial
from typing import Optional

import torch

from .ensemble import EnsembleState, history_step
from .graphs import GraphCache, private_stream
from .model import KVCache
from .prompt import Prepared
from .request import Request
from .sampling import RowSampling, pick_tokens, sampling_key, target_probs
from .speculative import (catch_up_forward, draft_block, forced_tree_path, pack_head, prefill_draft,
                          verify_block, view_tree_block)
from .tree import node_depth_tensor, tree_draft, tree_history, tree_verify
from .views import ViewRow, build_views

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
CATCH_UP = 16          # tokens per draft catch-up forward (see Runner.catch_up)
DRAFT_TEMPERATURES = (0.3, 0.5, 0.7, 1.0, 1.4, 2.0)   # the draft's softmax temperature when sampling
# prompts are padded to a multiple of 64 tokens for the prefill graphs: at most 63 wasted
# tokens (about one image's worth over ten), and a graph per 64 tokens of cache stays few (each
# bucket costs a capture and an attention plan at warm-up: results/ttft_llava-1.5-7b_16step.md)
PREFILL_STEP = 64
# longer prompts prefill eagerly: there the kernels outlast the host's launches, all a graph
# removes, and the padding costs more (benchmarks/results/ttft_llava-1.5-7b.json, graph vs eager)
PREFILL_GRAPH_MAX = 1664


def bucket_of(n: int, max_batch: int) -> int:
    """The smallest batch bucket holding n slots (graphs are captured per bucket)."""
    return min(next((b for b in BUCKETS if b >= n), n), max_batch)


def prefill_bucket(n: int, max_len: int, limit: int = PREFILL_GRAPH_MAX) -> Optional[int]:
    """The padded length P >= n a prompt of n tokens is prefilled at through the graph of
    bucket P, or None when it prefills eagerly at its own length (n above `limit` or the
    cache). P is n rounded up to a multiple of PREFILL_STEP, at most the cache length."""
    if n < 1 or n > min(limit, max_len):
        return None
    return min(-(-n // PREFILL_STEP) * PREFILL_STEP, max_len)


def prefill_buckets(max_len: int, limit: int = PREFILL_GRAPH_MAX) -> list[int]:
    """Every bucket `prefill_bucket` can return for a cache of `max_len` slots, ascending."""
    return sorted({prefill_bucket(n, max_len, limit) for n in range(1, min(limit, max_len) + 1)})


def prefill_step(lm, cache: KVCache, x: torch.Tensor, slot: torch.Tensor, last: torch.Tensor,
                 kv_len: Optional[int] = None) -> torch.Tensor:
    """Causal prefill of one padded prompt into cache row `slot`; the captured graph of a
    prompt-length bucket.

    x: [1, P, hidden] embeddings, the prompt's n tokens first (the padding after them is never
    attended to by a real token; its K/V lands in slots [n, P) of the row, past the row's
    length, which the next forward overwrites or masks). slot: [1] int64 cache row; last:
    [1, 1] int64, n - 1. Returns the logits of position `last` [1, V]. `kv_len` is unused (the
    keys are the prompt's own)."""
    pos = torch.arange(x.shape[1], device=x.device)[None]
    return lm(cache, pos, embeds=x, logits_index=last, fresh=True, slot=slot)[:, -1]


def cache_rows(cache: KVCache, start: int, stop: int) -> KVCache:
    """Rows [start, stop) of a cache as a cache sharing its memory (same addresses on every
    call, so graphs captured on a view stay valid)."""
    view = copy.copy(cache)
    view.k, view.v, view.lengths = cache.k[:, start:stop], cache.v[:, start:stop], cache.lengths[start:stop]
    return view


def state_rows(state: EnsembleState, start: int, stop: int) -> EnsembleState:
    """Rows [start, stop) of an ensemble history as a history sharing its memory."""
    view = copy.copy(state)
    view.B = stop - start
    for name in ("valid", "div", "match", "gkl", "cursor", "uniform"):
        setattr(view, name, getattr(state, name)[start:stop])
    return view


def decode_step(lm, cache: KVCache, tok: torch.Tensor, lens: torch.Tensor,
                kv_len: Optional[int] = None) -> torch.Tensor:
    """One autoregressive step: tok [R, 1] written at slots lens [R]; returns logits [R, V].
    Idempotent in its inputs (the caller advances the lengths), as a captured graph's
    warm-up run must be."""
    return lm(cache, lens.long()[:, None], input_ids=tok, lengths=lens, kv_len=kv_len)[:, -1]


class Runner:
    """Caches, graphs and steps for up to `max_batch` requests at once."""

    def __init__(self, eng, max_batch: int, cuda_graphs: bool):
        self.eng = eng                      # static configuration: models, views, γ, tree, options
        self.device, self.dtype, self.max_len = eng.device, eng.dtype, eng.max_len
        self.target, self.draft = eng.target, eng.draft
        self.K = len(eng.views) if eng.draft is not None else 1
        self.max_batch = max_batch
        self.depth = eng.gamma if eng.tree is None else eng.tree.depth
        self.graphs = GraphCache() if cuda_graphs and self.device.type == "cuda" else None
        self.pending: Optional[dict] = None   # the next block, queued ahead (`sd_block`, `ar_step`)
        # the target's prefill padded to a prompt-length bucket, a captured graph per bucket (on
        # the GPU with graphs; eager elsewhere, where it only serves tests of the padding), up
        # to `prefill_graph_max` tokens; off: eager at the prompt's own length
        self.prefill_graphs = self.graphs is not None
        self.prefill_graph_max = PREFILL_GRAPH_MAX
        # CUDA: the draft's view prefill on a second stream, overlapping the target's prefill
        self.overlap_draft = self.device.type == "cuda"
        self._prefill_bufs = None
        self._side = None
        self._views: dict = {}
        self._host_bufs: dict = {}
        self._allocated = False
        self.bench_accept_schedule = None

    # ------------------------------------------------------------------ memory
    def allocate(self):
        """The static caches and per-slot state (on first use: loading stays fast)."""
        if self._allocated:
            return
        dev, B, K = self.device, self.max_batch, self.K
        with torch.inference_mode(False):   # normal tensors: usable in and out of inference mode
            self.tcache = KVCache(self.target.lm.cfg, B, self.max_len, dev, self.dtype)
            self.dcache = self.state = None
            if self.draft is not None:
                self.dcache = KVCache(self.draft.lm.cfg, B * K, self.max_len, dev, self.dtype)
                # a request records at most depth positions a block, one block a token
                cap = 1 << (self.depth * (self.max_len + 2) - 1).bit_length()
                self.state = EnsembleState(self.eng.ensemble, B, cap, dev)
            self.w = torch.full((B, K), 1.0 / K, device=dev)
            self.view_mask = torch.ones(B, K, device=dev)     # per slot: the views its request mixes
            self.active = torch.zeros(B, dtype=torch.long, device=dev)
            # each slot's target sampling settings (batches that mix them: `RowSampling`)
            self.row_temp = torch.ones(B, device=dev)
            self.row_top_k = torch.zeros(B, dtype=torch.long, device=dev)
            self.row_top_p = torch.ones(B, device=dev)
            self.row_greedy = torch.zeros(B, dtype=torch.bool, device=dev)
            self.seed = torch.zeros(1, dtype=torch.long, device=dev)
            self.offset = torch.zeros(1, dtype=torch.long, device=dev)
        self._allocated = True

    def views(self, b: int):
        """(target cache, draft cache, ensemble history) of slots [0, b)."""
        v = self._views.get(b)
        if v is None:
            K = self.K
            v = self._views[b] = (cache_rows(self.tcache, 0, b),
                                  cache_rows(self.dcache, 0, b * K) if self.dcache is not None else None,
                                  state_rows(self.state, 0, b) if self.state is not None else None)
        return v

    # ------------------------------------------------------------------ helpers
    def run_graph(self, key, fn, inputs: dict, kv_len: Optional[int] = None):
        """fn(**inputs) as a captured CUDA graph (per key) on the GPU; eagerly with a bucketed
        attention span (`kv_len`) elsewhere."""
        if self.graphs is not None:
            return self.graphs.run(key, fn, inputs)
        return fn(**inputs, kv_len=kv_len)

    def kv_bucket(self, needed: int) -> int:
        """Attend over a bucketed cache prefix (fewer bytes than S_max, few distinct shapes)."""
        return min(self.max_len, -(-needed // 128) * 128)

    def to_device(self, values, dtype=torch.long) -> torch.Tensor:
        """A host list as a device tensor without a device sync (pinned, non-blocking)."""
        t = torch.tensor(values, dtype=dtype)
        if self.device.type == "cuda":
            return t.pin_memory().to(self.device, non_blocking=True)
        return t

    def sync(self):
        if self.eng.timing and self.device.type == "cuda":
            torch.cuda.synchronize()

    # ------------------------------------------------------------------ prefill
    def embed(self, model, ids: list[int], spans, feats) -> torch.Tensor:
        """Token embeddings [len(ids), hidden] with image features placed at each span."""
        x = model.lm.embed_tokens(torch.tensor(ids, device=self.device))
        for i, (start, n) in enumerate(spans):
            if feats[i].shape[0] != n:
                raise ValueError(f"image {i} has {feats[i].shape[0]} features for {n} image tokens")
            x[start:start + n] = feats[i].to(x.dtype)
        return x

    def encode(self, prep: Prepared):
        """The target's vision tower and projector: (pre-projector image features: per image, or
        per tile of any-resolution images; projected features, one [n_i, D] per image), or
        (None, None) for a text-only prompt."""
        if prep.pixel_values is None:
            return None, None
        vision = self.target.vision
        sel = vision.select_images(prep.pixel_values.to(self.device), prep.image_sizes)
        return sel, vision.image_features(sel, prep.image_sizes)

    def prefill_lm(self, prep: Prepared, feats, slot: int) -> torch.Tensor:
        """Prefill the target's language model on the prompt into cache row `slot`; returns the
        logits of the last prompt position [1, V] (with a graph, its output buffer: read it
        before the next prefill of the same bucket)."""
        n = len(prep.ids)
        x = self.embed(self.target, prep.ids, prep.image_spans, feats)
        P = prefill_bucket(n, self.max_len, self.prefill_graph_max) if self.prefill_graphs else None
        if P is None:           # eager at the prompt's own length
            pos = torch.arange(n, device=self.device)[None]
            return self.target.lm(cache_rows(self.tcache, slot, slot + 1), pos, embeds=x[None],
                                  logits_index=torch.tensor([[n - 1]], device=self.device),
                                  kv_len=self.kv_bucket(n), fresh=True)[:, -1]
        buf, slot_t, last_t = self._prefill_inputs()
        buf[0, :n].copy_(x)
        buf[0, n:P].zero_()
        slot_t.fill_(slot)
        last_t.fill_(n - 1)
        return self._prefill_padded(P)

    def _prefill_inputs(self):
        """The padded prefill's static inputs, one set shared by every bucket's graph: embeddings
        [1, max_len, hidden], cache row [1], last real position [1, 1]."""
        if self._prefill_bufs is None:
            with torch.inference_mode(False):
                hidden = self.target.lm.cfg.hidden_size
                self._prefill_bufs = (torch.zeros(1, self.max_len, hidden, device=self.device, dtype=self.dtype),
                                      torch.zeros(1, dtype=torch.long, device=self.device),
                                      torch.zeros(1, 1, dtype=torch.long, device=self.device))
        return self._prefill_bufs

    def _prefill_padded(self, P: int) -> torch.Tensor:
        buf, slot_t, last_t = self._prefill_bufs
        fn = partial(prefill_step, self.target.lm, self.tcache)
        inputs = dict(x=buf[:, :P], slot=slot_t, last=last_t)
        if self.graphs is None:
            return fn(**inputs)
        return self.graphs.run(("prefill", P), fn, inputs, shared=(buf, slot_t, last_t))

    def capture_prefill(self, buckets=None) -> int:
        """Capture the target prefill graphs of `buckets` (default: every bucket of the cache
        length up to `prefill_graph_max`) on an idle runner: each capture writes padding into
        cache row 0. Returns how many were captured."""
        if self.graphs is None or not self.prefill_graphs:
            return 0
        self.allocate()
        buf, slot_t, last_t = self._prefill_inputs()
        todo = [P for P in (buckets or prefill_buckets(self.max_len, self.prefill_graph_max))
                if ("prefill", P) not in self.graphs.graphs]
        buf.zero_()
        slot_t.zero_()
        for P in todo:
            last_t.fill_(P - 1)
            self._prefill_padded(P)
        self.pending = None
        return len(todo)

    def warm_draft_prefill(self) -> int:
        """Run the draft views' prefill once at every prompt-length bucket of the draft's cache
        (on an idle runner: writes into slot 0's draft rows), so a request's first encounter of
        a bucket pays no one-off costs. Returns how many buckets ran."""
        if self.draft is None:
            return 0
        self.allocate()
        rows = [ViewRow([0] * P, [], []) for P in prefill_buckets(self.dcache.max_len, self.dcache.max_len)]
        for row in rows:
            prefill_draft(self, [row] * self.K, cache_rows(self.dcache, 0, self.K))
        self.pending = None
        return len(rows)

    def prefill_target(self, prep: Prepared, slot: int):
        """Encode the images and prefill target cache row `slot`; returns (logits of the last
        prompt position [1, V], pre-projector image features or None)."""
        sel, feats = self.encode(prep)
        return self.prefill_lm(prep, feats, slot), sel

    def prefill(self, req: Request, slot: int):
        """Prefill `req` into `slot` (target row and, speculating, its K draft rows) and pick
        its first token. One host read (the first token)."""
        self.allocate()
        t0 = time.perf_counter()
        req.stats.time_queued = t0 - req.arrival
        req.slot = slot
        sp, K = req.sp, self.K
        v = self.to_device([1.0 if sp.greedy else sp.temperature, sp.top_k, sp.top_p, sp.greedy], torch.float32)
        self.row_temp[slot:slot + 1].copy_(v[0:1])
        self.row_top_k[slot:slot + 1].copy_(v[1:2])
        self.row_top_p[slot:slot + 1].copy_(v[2:3])
        self.row_greedy[slot:slot + 1].copy_(v[3:4])
        if req.prep.num_images and req.prep.pixel_values is None:    # preprocessed here, on the device
            from .image_ops import device_pixels
            req.prep.pixel_values = device_pixels(req.prep.images, self.eng.processor.image_processor, self.device)
        sel, feats = self.encode(req.prep)
        vision_done = self._record()         # where the draft's views may start (they share `sel`)
        logits = self.prefill_lm(req.prep, feats, slot)
        first = pick_tokens(logits, sp, req.generator)                         # [1]
        host = self._host("first", (1,))
        host.copy_(first, non_blocking=True)
        ready = self._record()
        if req.speculative:
            first_q = self._prefill_views(req, sel, slot, vision_done)
            # the slot's views, weights and history queued behind the target's prefill before the
            # first token is read: their host work overlaps the device's, not the token's delivery
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
        self._wait(ready)                    # the first token: not behind the draft's views
        req.append([int(host[0])])
        req.stats.time_first_token = time.perf_counter() - req.arrival
        self.pending = None               # the batch changed: the queued block is stale
        req.stats.time_prefill = time.perf_counter() - t0

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
        K = self.K
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
            pad = prefill_bucket(longest, self.dcache.max_len, self.dcache.max_len) or 0
            _, first_q = prefill_draft(self, rows, cache_rows(self.dcache, slot * K, slot * K + K), pad)
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

    # ------------------------------------------------------------------ steps
    def _slots_key(self, reqs):
        return tuple(None if r is None or r.finished else r.request_id for r in reqs)

    def pending_kind(self, slots: list) -> Optional[int]:
        """The kind of the block queued ahead if it is still good for the batch in `slots` (0 =
        an AR step, g = a chain of g; a tree: γ), else None."""
        p = self.pending
        live = [r.slot for r in slots if r is not None and not r.finished]
        if p is None or not live or not self._matches(p, p["mode"], bucket_of(max(live) + 1, self.max_batch), slots):
            return None
        return 0 if p["mode"] == "ar" else p["mode"][1]

    def _matches(self, p: dict, mode, b: int, reqs) -> bool:
        """Whether queued block `p` was queued for this mode, bucket and these requests (slots
        whose request finished since are fine: their rows are garbage nobody reads)."""
        if p["mode"] != mode or p["b"] != b:
            return False
        now = self._slots_key(reqs)
        return not any(n is not None and n != then for n, then in zip(now, p["slots"]))

    def _pending_for(self, mode, b: int, reqs) -> Optional[dict]:
        """The queued block if it was queued for this mode, bucket and these requests; it is
        taken (used or stale) either way."""
        p, self.pending = self.pending, None
        return p if p is not None and self._matches(p, mode, b, reqs) else None

    def _target_inputs(self, reqs, b):
        """Host-built (committed target lengths [b] int32, last tokens [b], the longest length),
        in one copy to the device; sets `active` [b]."""
        rows = [[r.n_prompt + len(r.tokens) - 1, r.tokens[-1], 1] if r is not None and not r.finished else [0, 0, 0]
                for r in reqs[:b]]
        v = self.to_device(rows)                                  # [b, 3]
        self.active[:b].copy_(v[:, 2])
        return v[:, 0].int(), v[:, 1], max(row[0] for row in rows)

    def _host(self, name: str, shape: tuple, dtype=torch.long) -> torch.Tensor:
        """A pinned host buffer for a block's one read, kept per name and shape (each is read
        back before the next block copies into it)."""
        key = (name, shape, dtype)
        buf = self._host_bufs.get(key)
        if buf is None:
            buf = self._host_bufs[key] = torch.empty(shape, dtype=dtype, pin_memory=self.device.type == "cuda")
        return buf

    def batch_sampling(self, reqs: list, b: int):
        """How the batch in slots [0, b) picks target tokens: greedy `SamplingParams` when all
        its requests are greedy, else `RowSampling` over the slots (each request's own
        temperature / top-k / top-p; one graph serves any values); and the temperature its draft
        mixes and its history compares at: 1 greedy, else the grid value nearest the first
        sampling request's (it shapes which drafts are proposed and how views are weighted,
        never the output distribution; a grid bounds the graphs a server with many
        temperatures captures)."""
        sps = [r.sp for r in reqs[:b] if r is not None and not r.finished]
        first = next((sp for sp in sps if not sp.greedy), None)
        if first is None:
            return sps[0], 1.0
        rows = RowSampling(self.row_temp[:b], self.row_top_k[:b], self.row_top_p[:b], self.row_greedy[:b],
                           use_top_k=any(sp.top_k > 0 and not sp.greedy for sp in sps),
                           use_top_p=any(sp.top_p < 1.0 and not sp.greedy for sp in sps),
                           any_greedy=any(sp.greedy for sp in sps))
        return rows, min(DRAFT_TEMPERATURES, key=lambda t: abs(math.log(t / first.temperature)))

    def ar_step(self, reqs: list, b: int, gen, queue_next: bool = True) -> list[list[int]]:
        """One autoregressive step for slots [0, b): returns each slot's new tokens (empty for
        empty or finished slots). `queue_next`: queue the next step before reading this one's
        tokens (False when the next block is not an AR step of this batch)."""
        sp, _ = self.batch_sampling(reqs, b)
        tcache, _, _ = self.views(b)
        step_fn = partial(decode_step, self.target.lm, tcache)
        p = self._pending_for("ar", b, reqs)
        if p is None:
            tl, last, longest = self._target_inputs(reqs, b)
            logits = self.run_graph(("ar", b), step_fn, {"tok": last[:, None], "lens": tl},
                                    kv_len=self.kv_bucket(longest + 1))
            tok = pick_tokens(logits, sp, gen)
        else:
            tok, tl, longest = p["tok"], p["tl"], p["longest"]
        host = self._host("ar", (b,))
        host.copy_(tok, non_blocking=True)
        ready = self._record()
        # queue the next step before waiting for this one (its input never leaves the device)
        if queue_next and not all(r is None or r.finished or len(r.tokens) + 1 >= r.max_new for r in reqs[:b]):
            tl2 = torch.clamp(tl + self.active[:b].int(), max=self.max_len - 1)
            logits = self.run_graph(("ar", b), step_fn, {"tok": tok[:, None], "lens": tl2},
                                    kv_len=self.kv_bucket(longest + 2))
            self.pending = dict(mode="ar", b=b, slots=self._slots_key(reqs), tok=pick_tokens(logits, sp, gen),
                                tl=tl2, longest=longest + 1)
        self._wait(ready)
        toks = host.tolist()
        out = []
        for i, r in enumerate(reqs[:b]):
            if r is None or r.finished:
                out.append([])
                continue
            r.stats.target_forwards += 1
            out.append(r.append([toks[i]]))
        return out

    def _masked(self, w: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        """Weights w [n, K] of slots [start, stop) restricted to the views their requests mix."""
        m = self.view_mask[start:stop]
        w = w * m
        total = w.sum(-1, keepdim=True)
        # every kept view's weight underflowed (a left-out view dominated): uniform over the kept
        return torch.where(total > 0, w / total.clamp_min(1e-30), m / m.sum(-1, keepdim=True))

    def _record(self):
        if self.device.type != "cuda":
            return None
        ev = torch.cuda.Event()
        ev.record()
        return ev

    @staticmethod
    def _wait(ev):
        if ev is not None:
            ev.synchronize()                 # the block's one host wait

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
        while need:
            n = min(CATCH_UP, max(len(t) for t in need.values()))
            top = max(max(reqs[s_].view_len) + reqs[s_].draft_valid for s_ in need)
            T = CATCH_UP
            if top + T > self.eng.draft_len:      # no room for the padding: the exact length
                T = n
            toks, lens = [[0] * T for _ in range(b * K)], [0] * (b * K)
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
        """Host-built draft inputs: each row's last two tokens [b*K, 2] and length [b*K]."""
        K = self.K
        inp2, dl = [[0, 0]] * (b * K), [0] * (b * K)
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
        schedule = self.bench_accept_schedule
        timer = _Timer(self, live)

        p = self._pending_for(("sd", gamma), b, reqs)   # taken now: whatever runs, it is used or stale
        first = [r for r in live if r.blocks == 0]
        if (b == 1 and first and eng.view_tree and tree is None and greedy and K > 1 and schedule is None
                and eng.ensemble.policy in ("kld", "tvd", "hedge")
                and live[0].n_prompt + K * gamma + 2 <= self.max_len):
            return self._view_tree(live[0], timer)

        if p is None:
            self.catch_up(reqs, b)
            inp2, dl = self._draft_inputs(reqs, b)
            tl, last, t_max = self._target_inputs(reqs, b)
            blk = self._queue_block(b, gamma, sp, temp, gen, inp2, dl, tl, last, t_max,
                                    max(len(r.tokens) for r in live), live, timer=timer)
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
        return out

    def _normalisers(self, sp) -> bool:
        """Whether the verification returns the target's log-normalisers for the history (they
        serve it only at the history's own temperature: chains, one sampling setting)."""
        return self.state.uses_normalisers and self.eng.tree is None and not isinstance(sp, RowSampling)

    def _queue_block(self, b: int, gamma: int, sp, temp: float, gen, inp2, dl, tl, last, t_max: int, g_max: int,
                     live, ahead: int = 0, timer: Optional["_Timer"] = None) -> dict:
        """Queue one block's draft and verification (nothing read back): draft rows at lengths
        `dl` [b*K] fed `inp2` [b*K, 2], target rows at lengths `tl` [b] int32 fed `last` [b];
        `t_max` bounds the target lengths and `g_max` the requests' generated tokens (for the
        eager attention spans). `ahead`: blocks between the host's view of the live requests
        and this one (the benchmark's forced acceptance follows the block index).
        Returns dict(res = the draft's outputs, v = the verification's (tlogits, n_acc, nxt,
        packed, d_last, t_lse or path), dl, tl, t_max)."""
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
        res = self.run_graph(("draft", b, K, gamma, tree, greedy, temp, confidence), draft_fn,
                             dict(inp2=inp2, lens=dl, w=self.w[:b], seed=self.seed, offset=self.offset),
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
            tlogits, path, n_acc, nxt, packed = self.run_graph(verify_key, verify_fn, inputs,
                                                               kv_len=self.kv_bucket(t_max + 1 + tree.nodes))
            d_last = tokens.gather(1, path.gather(1, n_acc[:, None]))   # [b, 1]: d_n, or the root
        else:
            drafted, q_logits, mixture, q_lse = res
            vin = torch.cat([last[:, None], drafted], dim=1)
            inputs = dict(vin=vin, tlens=tl)
            if not greedy:
                inputs.update(mixture=mixture, uniforms=torch.rand(b, gamma + 1, generator=gen, device=dev))
            tlogits, n_acc, nxt, packed, v["t_lse"] = self.run_graph(
                verify_key, verify_fn, inputs, kv_len=self.kv_bucket(t_max + 1 + gamma + 1))
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
        return dict(res=res, v=v, dl=dl, tl=tl, t_max=t_max)

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
