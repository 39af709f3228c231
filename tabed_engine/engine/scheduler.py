"""The scheduler: a queue of waiting requests, the batch's slots, and one `step` at a time:
admit waiting requests into free slots (prefill), run one block for the batch (an
autoregressive step, or a speculative block of the chain length the cost model expects to
pay most), emit
each request's new tokens and retire finished requests. A block queued ahead (the runner
queues the next block before reading the current one) is finished before an admission, which
would otherwise discard it.

Requests of one batch either all speculate or all decode autoregressively (`Request.batch_key`;
their sampling settings may differ: greedy, temperature, top-k and top-p are per row); a request
of the other kind waits until the batch drains, and once it is the oldest waiting request no
newer request of the running kind is admitted before it (first come, first served).

An admission also needs KV pages for everything the request may write (`engine/pages.py`): when
the pool is short even after evicting cached prefixes, the request waits at the head of the
queue for running requests to return theirs.

With a prefill budget (`Engine.prefill_chunk`) a step prefills at most that many prompt tokens
and a longer prompt is prefilled in chunks over several steps, the running requests decoding
between them (`engine/chunked.py`).
"""
from __future__ import annotations

import secrets
import threading
import time
from collections import Counter, deque
from typing import Optional

import torch

from tabed_engine.engine.chunked import ChunkedAdmission, log_failure
from tabed_engine.engine.prefix_cache import pick_slot, retire
from tabed_engine.engine.request import Request, RequestOutput
from tabed_engine.engine.runner import Runner, bucket_of

ALPHA_PRIOR = 0.5   # per-draft acceptance assumed before any request has speculated


class CostModel:
    """How the next block decodes: autoregressively (0) or as a speculative chain of g drafts
    (1 <= g <= γ; a tree keeps its shape: γ only), whichever gives the batch the most tokens
    per second. A request accepting each draft with probability α gets 1 + α + ... + α^g
    tokens from a chain of g (from a tree, 1 + α + ... + α^depth with α its acceptance per
    depth: `tree_depth`); α is estimated from its running counts of accepted and rejected
    drafts (`Request.accepted`, `.rejected`) with `prior_weight` pseudo-drafts at the prior
    (one unlucky block does not make a draft look useless; a new request is the prior). Block times are measured per (g, batch
    bucket) on this machine: the steady interval between two consecutive blocks of the same
    kind; each key's first interval is dropped and later ones are capped at twice the estimate
    (graph capture and kernel compilation are one-off costs). A kind not measured yet is
    interpolated linearly in g between measured ones (an AR step is g = 0; before one is
    measured it is taken as a γ-chain's time / `prior_ratio`, and with only AR measured a
    γ-chain as `prior_ratio` AR steps). A speculating batch whose bucket has no AR time yet runs
    up to `ar_measure` AR steps there to measure one: the prior would otherwise decide for good
    (a draft a third of the target's size makes a γ-chain cost several AR steps, not 1.25, and
    AR, never chosen, would never be measured). The running choice is kept unless another promises
    `margin` times its throughput (a switch costs the overlap of one block with the host's
    work). While decoding autoregressively, `probe_len` speculative blocks every
    `probe_every` steps re-measure acceptance (a request's draft may start to help; each probe that finds
    nothing doubles the interval, up to `probe_max`), and so does a batch of
    requests none of which has speculated yet (the prior, which follows the finished requests
    (`observe`), may come from another kind of request). `forced`: always this kind (warm-up)."""

    def __init__(self, enabled: bool, gamma: int = 5, chains: bool = True, probe_every: int = 64,
                 probe_len: int = 2, prior_ratio: float = 1.25, margin: float = 1.03, prior_weight: float = 1.0,
                 probe_max: int = 1024, tree_depth: Optional[int] = None, ar_measure: int = 4):
        self.enabled, self.gamma, self.chains = enabled, gamma, chains
        # a tree block (kind γ when not `chains`) accepts up to its depth along a path
        self.tree_depth = tree_depth if not chains and tree_depth else gamma
        self.probe_every, self.probe_len, self.probe_max = probe_every, probe_len, probe_max
        self._every, self._probed = probe_every, False    # the current probe interval; a probe just ended
        self.prior_ratio, self.margin, self.prior_weight = prior_ratio, margin, prior_weight
        self.times: dict[tuple[int, int], float] = {}     # (g, bucket) -> seconds per block
        self._seen: dict[tuple[int, int], int] = {}
        self._last: dict[int, int] = {}                     # bucket -> the last choice there
        self.ar_run = 0
        self.ar_measure = ar_measure
        self._ar_tries: Counter = Counter()               # bucket -> AR steps run to measure one
        self._probe = 0           # speculative blocks of a probe still to run
        self.forced: Optional[int] = None
        self.prior = ALPHA_PRIOR

    def observe(self, alpha: Optional[float]):
        """A finished request's acceptance: the prior for the next requests moves toward it."""
        if alpha is not None:
            self.prior = 0.8 * self.prior + 0.2 * alpha

    def record(self, g: int, b: int, seconds: float):
        """One steady block interval of kind g (0 = AR) at bucket b."""
        key = (g, b)
        self._seen[key] = self._seen.get(key, 0) + 1
        if self._seen[key] == 1:
            return
        old = self.times.get(key)
        self.times[key] = seconds if old is None else 0.8 * old + 0.2 * min(seconds, 2 * old)

    def time(self, g: int, b: int) -> Optional[float]:
        """Seconds per block of kind g at bucket b: measured, or interpolated (None when no
        kind was measured at b)."""
        known = {k: t for (k, bb), t in self.times.items() if bb == b}
        if g in known or not known:
            return known.get(g)
        if 0 not in known:
            top = max(known)
            known[0] = known[top] / (1 + (self.prior_ratio - 1) * top / self.gamma)
            if g == 0:
                return known[0]
        if len(known) == 1:                 # only AR measured: a γ-chain at prior_ratio, linear in g
            return known[0] * (1 + (self.prior_ratio - 1) * g / self.gamma)
        lo = max((k for k in known if k < g), default=None)
        hi = min((k for k in known if k > g), default=None)
        if hi is None:                      # beyond the longest measured: the last two points' slope
            a, c = sorted(known)[-2:]
            return known[c] + (known[c] - known[a]) / (c - a) * (g - c)
        return known[lo] + (known[hi] - known[lo]) * (g - lo) / (hi - lo)

    def choose(self, b: int, counts: list) -> int:
        """The next block's kind for a batch in bucket b whose requests have running counts
        (accepted, rejected) of drafts: 0 = autoregressive, g = a chain of g."""
        if self.forced is not None:
            return self.forced
        if not self.enabled:
            return self.gamma
        w = self.prior_weight
        al = [(acc + w * self.prior) / (acc + rej + w) for acc, rej in counts]
        lengths = range(1, self.gamma + 1) if self.chains else (self.gamma,)

        def rate(g):
            d = self.tree_depth if g == self.gamma else g
            return sum(sum(a ** i for i in range(d + 1)) for a in al) / self.time(g, b)

        if self.time(self.gamma, b) is None:
            choice = self.gamma                     # measure speculative blocks first
        else:
            if self._probe == 0 and all(acc + rej == 0 for acc, rej in counts):
                self._probe = self.probe_len        # a fresh batch measures its own acceptance first
            best = max(lengths, key=rate)
            if self._probe > 0:
                self._probe -= 1
                choice = best
                self._probed = self._probe == 0
            elif (0, b) not in self.times and self._ar_tries[b] < self.ar_measure:
                self._ar_tries[b] += 1               # AR's time here, measured rather than assumed
                choice = 0
            else:
                choice = best if rate(best) > rate(0) else 0
                prev = self._last.get(b)
                if prev is not None and prev != choice and rate(choice) < self.margin * rate(prev):
                    choice = prev
                if choice:                           # speculation pays: probe at the base interval again
                    self._every = self.probe_every
                elif self._probed:                   # a probe that found nothing: probe half as often
                    self._every = min(2 * self._every, self.probe_max)
                self._probed = False
                if choice == 0 and self.ar_run >= self._every:
                    choice, self._probe = best, self.probe_len - 1
                    self._probed = self._probe == 0
        self._last[b] = choice
        self.ar_run = self.ar_run + 1 if choice == 0 else 0
        return choice


class Scheduler(ChunkedAdmission):
    """Waiting queue, batch slots and the step loop (see the module docstring)."""

    def __init__(self, runner: Runner, cost: CostModel):
        self.runner, self.cost = runner, cost
        self.slots: list[Optional[Request]] = [None] * runner.max_batch
        self.waiting: deque[Request] = deque()
        self._lock = threading.Lock()        # add / abort may come from other threads
        self._aborts: set[str] = set()
        self._last: Optional[tuple] = None   # (kind, bucket, time) of the last block's end
        self._next: Optional[int] = None     # the kind chosen for the next block
        self.kinds: Counter = Counter()      # blocks run per kind (0 = AR, g = a chain of g)
        self._batch_gen = torch.Generator(device=runner.device)
        self._batch_gen.manual_seed(secrets.randbits(63))
        self.filling = None                  # a request between prefill chunks (`ChunkedAdmission`)

    # ------------------------------------------------------------------ queue
    def add(self, req: Request):
        with self._lock:
            rid = req.request_id
            if any(r.request_id == rid for r in self.waiting) or \
                    any(r is not None and r.request_id == rid for r in self.taken()):
                raise ValueError(f"request id {rid!r} is already queued or running")
            self.waiting.append(req)

    def drop(self, reqs: list[Request]):
        """Remove unfinished requests now, without output (a stream closed early)."""
        ids = {r.request_id for r in reqs}
        with self._lock:
            self.waiting = deque(r for r in self.waiting if r.request_id not in ids)
        self._drop_filling(ids, "abort")
        for i, r in enumerate(self.slots):
            if r is not None and r.request_id in ids:
                self.slots[i] = None
        for r in reqs:
            r.finish("abort")

    def abort(self, request_id: str):
        with self._lock:
            self._aborts.add(request_id)

    def has_unfinished(self) -> bool:
        return bool(self.waiting) or self.filling is not None or any(r is not None for r in self.slots)

    # ------------------------------------------------------------------ step
    def step(self) -> list[RequestOutput]:
        """Admit waiting requests (their first tokens are this step's output; a block queued
        ahead is finished first) or, when none was admitted, run one block for the batch.
        Never raises for one request's failure:
        that request finishes with finish_reason "error" and the others go on."""
        outputs: list[RequestOutput] = []
        with torch.inference_mode():
            self._apply_aborts(outputs)
            budget = self.runner.eng.prefill_chunk
            if budget is not None or self.filling is not None:
                self.step_chunked(outputs, budget)
                self._retire()
                return outputs
            kind = self.runner.pending_kind(self.slots)
            if kind is not None and self._admissible():
                # the next block is queued already and an admission would discard it: finish it first
                self._block(outputs, kind)
            if self._admit(outputs):
                self._last = None                    # the next block's time includes no prefill
                self._next = None                    # nor a kind chosen for the batch before
            else:
                self._block(outputs)
        self._retire()
        return outputs

    def _pending_views(self, outputs):
        """Prefill the draft views the prefills of the batch's requests left (`Runner.views_deferred`),
        before the first block that drafts: an AR step needs none, and a request that ends before
        such a block never runs them. A request whose views fail ends with the error."""
        for r in self.slots:
            if r is not None and not r.finished and r.views_pending is not None:
                try:
                    self.runner.prefill_pending_views(r)
                except Exception as e:               # this request fails alone
                    log_failure(e, f"the draft views of request {r.request_id}")
                    r.finish("error", f"{type(e).__name__}: {e}")
                    outputs.append(self._output(r, []))

    def _retire(self):
        for i, r in enumerate(self.slots):
            if r is not None and r.finished:
                self.cost.observe(r.alpha)
                retire(self.runner, r)                # its row's KV stays for later prompts
                self.slots[i] = None

    def _admissible(self) -> bool:
        """Whether the oldest waiting request can be admitted now."""
        with self._lock:
            return self._head_fits()

    def _head_fits(self) -> bool:
        """(lock held) A free slot and the oldest waiting request of the running batch's kind
        (or no batch running): else it waits for the batch to drain."""
        slots = self.taken()
        if not self.waiting or None not in slots:
            return False
        live = next((r for r in slots if r is not None), None)
        return live is None or self.waiting[0].batch_key == live.batch_key

    def _block(self, outputs, kind: Optional[int] = None, choice: Optional[int] = None):
        """One block for the batch: the one queued ahead if the batch still has it, else of the
        cost model's choice; the block queued behind it (while its tokens are read) is of that
        choice, of the same mode (an AR step queues AR steps, a speculative block speculative
        ones). `kind`: the block queued ahead, finished before an admission: nothing is queued
        after it. `choice`: the kind the cost model chose for this block already."""
        live = [r for r in self.slots if r is not None and not r.finished]
        if not live:
            return
        b = bucket_of(max(r.slot for r in live) + 1, self.runner.max_batch)
        reqs = self.slots[:b]
        gen = live[0].generator if len(live) == 1 else self._batch_gen
        if kind is not None:
            g, g_next = kind, None
        elif live[0].speculative:
            # the block queued ahead runs, else the one chosen last time (an AR step does not
            # queue a speculative block, nor the reverse); the choice is for the block after it
            counts = [(r.accepted, r.rejected) for r in live]
            g = self.runner.pending_kind(self.slots)
            if g is None:
                g = choice if choice is not None else self._next
            if g is None:
                g = self.cost.choose(b, counts)
            g_next = self.cost.choose(b, counts)
        else:
            g = g_next = 0
        self._next = g_next
        if g and any(r.views_pending is not None for r in live):
            # (a request whose views failed has finished: its row in the block is garbage)
            self._pending_views(outputs)
            live = [r for r in live if not r.finished]
            if not live:
                return
        try:
            if g:
                new = self.runner.sd_block(reqs, b, gen, g, gamma_next=g_next or 0)
            else:
                new = self.runner.ar_step(reqs, b, gen, queue_next=g_next == 0)
        except Exception as e:                       # a device failure: the batch cannot go on
            log_failure(e, f"a decode step of {len(live)} request(s)")
            self.runner.pending = None
            for r in live:
                r.finish("error", f"{type(e).__name__}: {e}")
            new = [[] for _ in reqs]
        # steady state (the same mode and bucket as the block before): the interval between
        # two block ends is the device's time per block
        now = time.perf_counter()
        if self._last is not None and self._last[:2] == (g, b):
            self.cost.record(g, b, now - self._last[2])
        self._last = (g, b, now)
        self.kinds[g] += 1
        for r, toks in zip(reqs, new):
            if r is not None and (toks or r.finished):
                outputs.append(self._output(r, toks))

    def _output(self, r: Request, toks: list[int]) -> RequestOutput:
        piece = r.piece() if r.pieces else ""      # decoding the text each block costs host time
        return RequestOutput(r.request_id, toks, piece, r.finished, r.output() if r.finished else None)

    def _apply_aborts(self, outputs):
        with self._lock:
            aborts, self._aborts = self._aborts, set()
            if not aborts:
                return
            keep = deque()
            for r in self.waiting:
                if r.request_id in aborts:
                    r.finish("abort")
                    outputs.append(self._output(r, []))
                else:
                    keep.append(r)
            self.waiting = keep
        self._drop_filling(aborts, "abort", outputs)
        for i, r in enumerate(self.slots):
            if r is not None and r.request_id in aborts and not r.finished:
                r.finish("abort")
                outputs.append(self._output(r, []))
                self.slots[i] = None

    def _pages_for(self, head: Request, slot: int, slots: list) -> bool:
        """Whether the KV pool has (or, evicting cached prefixes, makes) room for `head` in
        `slot`; if not, it goes back to the head of the queue and waits for running requests to
        return pages (`engine/pages.py`)."""
        self.runner.allocate()
        if self.runner.pages.make_room(head, slot, slots):
            return True
        with self._lock:
            self.waiting.appendleft(head)
        return False

    def _admit(self, outputs) -> list[Request]:
        """Prefill waiting requests of the batch's kind into free slots (first come, first
        served). Returns the requests admitted or failed (their outputs are in `outputs`)."""
        admitted = []
        while True:
            with self._lock:
                if not self._head_fits():
                    break
                head = self.waiting.popleft()
            slot = pick_slot(self.runner, head, self.slots)   # (the lowest free one without prefix caching)
            if not self._pages_for(head, slot, self.slots):
                break
            first_in_batch = all(r is None for r in self.slots)
            admitted.append(head)
            try:
                self.runner.prefill(head, slot)
                if first_in_batch:
                    self._seed_batch(head)
            except Exception as e:                   # this request fails alone
                log_failure(e, f"the prefill of request {head.request_id}")
                self.runner.pending = None
                head.finish("error", f"{type(e).__name__}: {e}")
                outputs.append(self._output(head, []))
                continue
            if not head.finished:
                self.slots[slot] = head
            outputs.append(self._output(head, list(head.tokens)))
        return admitted
