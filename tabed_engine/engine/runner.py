"""The runner: owns the paged KV caches (one target row per batch slot, K draft rows per
slot, their pages lent by `engine/pages.py`), the ensemble history, the CUDA graphs (one per batch bucket and step) and the step
functions: a request's prefill into its slot, an autoregressive step and a speculative block
for the running batch.

A block's inputs come from the requests' host state (`Request.tokens` and lengths), or,
when the batch did not change since the last block, from that block's device outputs: the
next block's first half (the draft, or the next AR forward) is queued before the host waits
for the current one, so the device does not idle while the host reads a block, emits its
tokens and launches the next graphs. Rows of finished or empty slots compute garbage that
nobody reads, from the length of what the slot still holds (`SlotPages.free_lengths`), so a
cached prefix survives; their lengths stay put (`active` masks every device-side update).
"""
from __future__ import annotations

import math
from functools import partial
from typing import Optional

import torch

from tabed_engine.engine.blocks import SpeculativeSteps
from tabed_engine.engine.graphs import GraphCache
from tabed_engine.engine.pages import SlotPages
from tabed_engine.engine.prefill import PREFILL_GRAPH_MAX, GraphChunk, PrefillSteps
from tabed_engine.engine.prefix_cache import new_index
from tabed_engine.engine.view_cache import new_view_index
from tabed_engine.models.decoder import PAGE_SIZE, KVCache, cache_rows
from tabed_engine.speculation.ensemble import EnsembleState, state_rows
from tabed_engine.speculation.sampling import RowSampling, pick_tokens

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
DRAFT_TEMPERATURES = (0.3, 0.5, 0.7, 1.0, 1.4, 2.0)   # the draft's softmax temperature when sampling
def bucket_of(n: int, max_batch: int) -> int:
    """The smallest batch bucket holding n slots (graphs are captured per bucket)."""
    return min(next((b for b in BUCKETS if b >= n), n), max_batch)


def decode_args(cache: KVCache, tok: torch.Tensor, lens: torch.Tensor, kv_len: Optional[int] = None) -> dict:
    """The `LlamaLM.forward` arguments of one autoregressive step: tok [R, 1] written at slots
    lens [R] int32 (a part of a mixed forward, `LlamaLM.forward_mixed`)."""
    return dict(cache=cache, positions=lens.long()[:, None], input_ids=tok, lengths=lens, kv_len=kv_len)


def decode_step(lm, cache: KVCache, tok: torch.Tensor, lens: torch.Tensor,
                kv_len: Optional[int] = None, parts: Optional[list] = None):
    """One autoregressive step: tok [R, 1] written at slots lens [R]; returns logits [R, V].
    Idempotent in its inputs (the caller advances the lengths), as a captured graph's
    warm-up run must be. `parts`: other forwards' arguments packed into the step's forward
    (`LlamaLM.forward_mixed`, the step first); their logits are then returned second, a list."""
    if parts:
        logits, *extra = lm.forward_mixed([decode_args(cache, tok, lens, kv_len), *parts])
        return logits[:, -1], extra
    return lm(**decode_args(cache, tok, lens, kv_len))[:, -1]


def with_chunk(fn, stage: KVCache, cx: torch.Tensor, cpos: torch.Tensor, clens: torch.Tensor, clast: torch.Tensor,
               kv_len: Optional[int] = None, **inputs):
    """fn (`decode_step`, `verify_block`, `tree_verify`: a step taking `parts`) with one padded
    prompt chunk packed into its target forward, the graph of a captured mixed step: the chunk's
    embeddings cx [1, P, hidden] at positions cpos as new tokens of the one-row cache view
    `stage` after its clens [1] committed ones. Returns fn's outputs, then the chunk's logits at
    position clast [1, 1] of the P [1, V]."""
    part = dict(cache=stage, positions=cpos, embeds=cx, lengths=clens, logits_index=clast, kv_len=kv_len)
    *out, extra = fn(**inputs, kv_len=kv_len, parts=[part])
    return (*out, extra[0][:, -1])


class Runner(PrefillSteps, SpeculativeSteps):
    """Caches, graphs and steps for up to `max_batch` requests at once. `page_size`: slots per
    KV page (a multiple of 64 on CUDA; set before the first request to change it)."""

    page_size = PAGE_SIZE

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
        # a request's draft views at its first drafting block, after its first token (None: by the
        # draft's weight, `PrefillSteps.views_deferred`)
        self.defer_views: Optional[bool] = None
        self._views_share: Optional[float] = None
        self._prefill_bufs = None
        self._prefill_pos = None          # M-RoPE targets: the padded prefill's ids [3, 1, max_len]
        self._side = None
        self._views: dict = {}
        self._host_bufs: dict = {}
        self._allocated = False
        self.pages: Optional[SlotPages] = None
        self.bench_accept_schedule = None
        self.prefix = new_index(self)       # what each slot's target row holds (prefix caching)
        self.view_prefix = new_view_index(self)   # ... and each of its draft rows (engine/view_cache.py)
        # slots whose request is between prefill chunks -> the prompt tokens their target row
        # holds: a block writes the slot's garbage row from there (the next chunk overwrites it)
        self.parked: dict[int, int] = {}

    # ------------------------------------------------------------------ memory
    def allocate(self):
        """The page pools, block tables and per-slot state (on first use: loading stays fast).
        The target's pool holds `Engine.kv_cache_tokens` tokens, the draft's K times that (a
        view row per view) and at least a whole row per view (a request the target's pool takes
        always fits the draft's)."""
        if self._allocated:
            return
        dev, B, K, page = self.device, self.max_batch, self.K, self.page_size
        pages = -(-self.eng.kv_cache_tokens // page)
        with torch.inference_mode(False):   # normal tensors: usable in and out of inference mode
            self.tcache = KVCache(self.target.lm.cfg, B, self.max_len, dev, self.dtype, pages + 1, page)
            self.dcache = self.state = None
            if self.draft is not None:
                self.dcache = KVCache(self.draft.lm.cfg, B * K, self.max_len, dev, self.dtype, K * max(pages, -(-self.max_len // page)) + 1, page)
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
            self.row_seed = torch.zeros(B, dtype=torch.long, device=dev)        # seeded rows: the coupling
            self.row_coupled = torch.zeros(B, dtype=torch.bool, device=dev)
            self.seed = torch.zeros(1, dtype=torch.long, device=dev)
            self.offset = torch.zeros(1, dtype=torch.long, device=dev)
            self.pages = SlotPages(self)
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
        in one copy to the device; sets `active` [b]. A slot without a live request sits at the
        length of what it holds (`SlotPages.free_lengths`)."""
        free, _ = self.pages.free_lengths(reqs, b)
        rows = [[r.n_prompt + len(r.tokens) - 1, r.tokens[-1], 1] if r is not None and not r.finished
                else [free[i], 0, 0] for i, r in enumerate(reqs[:b])]
        v = self.to_device(rows)                                  # [b, 3]
        self.active[:b].copy_(v[:, 2])
        return v[:, 0].int(), v[:, 1], max((row[0] for row in rows if row[2]), default=0)

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
        temperature / top-k / top-p, seeded rows by the Gumbel coupling; one graph serves any
        values); and the temperature its draft
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
                           any_greedy=any(sp.greedy for sp in sps), seed=self.row_seed[:b],
                           coupled=self.row_coupled[:b], any_coupled=any(sp.coupled for sp in sps))
        return rows, min(DRAFT_TEMPERATURES, key=lambda t: abs(math.log(t / first.temperature)))

    def ar_step(self, reqs: list, b: int, gen, queue_next: bool = True) -> list[list[int]]:
        """One autoregressive step for slots [0, b): returns each slot's new tokens (empty for
        empty or finished slots). `queue_next`: queue the next step before reading this one's
        tokens (False when the next block is not an AR step of this batch)."""
        sp, _ = self.batch_sampling(reqs, b)
        p = self._pending_for("ar", b, reqs)
        if p is None:
            tl, last, longest = self._target_inputs(reqs, b)
            logits = self.run_graph(("ar", b), self._ar_fn(b), {"tok": last[:, None], "lens": tl},
                                    kv_len=self.kv_bucket(longest + 1))
            tok = pick_tokens(logits, sp, gen, tl.long() + 1)     # the new token's position
        else:
            tok, tl, longest = p["tok"], p["tl"], p["longest"]
        return self._ar_emit(reqs, b, gen, sp, tok, tl, longest, queue_next)

    def ar_mixed(self, reqs: list, b: int, gen, parts) -> tuple[list[list[int]], list[torch.Tensor]]:
        """`ar_step` with other target forwards packed into its forward (`LlamaLM.forward_mixed`,
        the step's part first): `parts` are a step's prompt chunks, their `forward` arguments
        (`PrefillSteps.chunk_part`, run eagerly) or one `GraphChunk` (`mixed_chunk`: a captured
        graph per batch bucket and chunk bucket). Nothing is queued after it; a block queued
        ahead is dropped (the caller finished it). Returns each slot's new tokens and each
        part's logits [1, n, V]."""
        self.pending = None
        sp, _ = self.batch_sampling(reqs, b)
        tl, last, longest = self._target_inputs(reqs, b)
        logits, extra = self.run_mixed(("ar", b), self._ar_fn(b), {"tok": last[:, None], "lens": tl},
                                       self.kv_bucket(longest + 1), parts)
        tok = pick_tokens(logits, sp, gen, tl.long() + 1)
        return self._ar_emit(reqs, b, gen, sp, tok, tl, longest, queue_next=False), extra

    def run_mixed(self, key, fn, inputs: dict, kv_len: int, parts):
        """fn(**inputs) (a step that takes `parts`) with a step's prompt chunks packed into its
        target forward: one `GraphChunk` through the captured graph of (key, its bucket), a
        list of `forward` arguments eagerly. Returns fn's outputs, its last item the parts'
        logits, a list of [1, n, V] (a graph's copied out of its output buffer)."""
        if isinstance(parts, GraphChunk):
            # its outputs in the plain step's buffers (or another chunk bucket's): a mixed step
            # runs with no block queued ahead, and its outputs are read before the next step
            mkey = ("mixed", *key, parts.P)
            donors = () if mkey in self.graphs.graphs else \
                [key] + [k for k in self.graphs.graphs if k[0] == "mixed" and k[1:-1] == tuple(key)]
            *out, lg = self.graphs.run(mkey, partial(with_chunk, fn, parts.stage), {**inputs, **parts.inputs},
                                       shared=parts.shared, outputs_of=donors)
            return (*out, [lg[:, None].clone()])
        return fn(**inputs, kv_len=kv_len, parts=parts)

    def _ar_fn(self, b: int):
        return partial(decode_step, self.target.lm, self.views(b)[0])

    def _ar_emit(self, reqs: list, b: int, gen, sp, tok, tl, longest: int, queue_next: bool) -> list[list[int]]:
        """An AR step's tokens tok [b] (at lengths tl [b]) to the host and into the requests,
        the next step queued first when `queue_next` (see `ar_step`)."""
        host = self._host("ar", (b,))
        host.copy_(tok, non_blocking=True)
        ready = self._record()
        # queue the next step before waiting for this one (its input never leaves the device)
        if queue_next and not all(r is None or r.finished or len(r.tokens) + 1 >= r.max_new for r in reqs[:b]):
            tl2 = torch.clamp(tl + self.active[:b].int(), max=self.max_len - 1)
            logits = self.run_graph(("ar", b), self._ar_fn(b), {"tok": tok[:, None], "lens": tl2},
                                    kv_len=self.kv_bucket(longest + 2))
            self.pending = dict(mode="ar", b=b, slots=self._slots_key(reqs), tok=pick_tokens(logits, sp, gen, tl2.long() + 1),
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
