"""The scheduler: a queue of waiting requests, the batch's slots, and one `step` at a time:
admit waiting requests into free slots (prefill), run one block for the batch (an
autoregressive step, or a speculative block when the cost model expects it to pay), emit
each request's new tokens and retire finished requests.

Requests of one batch share how target tokens are picked (`Request.sampling_key`: greedy or
the same temperature / top-k / top-p, speculating or not); a request of another kind waits
until the batch drains, and once it is the oldest waiting request no newer request of the
running kind is admitted before it (first come, first served).
"""
from __future__ import annotations

import secrets
import threading
import time
from collections import deque
from typing import Optional

import torch

from .request import Request, RequestOutput
from .runner import Runner, bucket_of

TAU_PRIOR = 2.0   # tokens per block assumed for a request that has not speculated yet


class CostModel:
    """Whether the next block speculates: from block times measured per (mode, batch bucket)
    on this machine and the running requests' tokens per block (τ). Speculating pays when
    mean τ / t_sd > 1 / t_ar. A time is a block's steady cost: the interval between two
    consecutive blocks of the same mode and bucket; each key's first such interval is dropped
    and later ones are capped at twice the estimate (graph capture and kernel compilation are
    one-off costs, not the block's). While decoding autoregressively, `probe_len` speculative
    blocks every `probe_every` steps re-measure τ and t_sd (a request's draft may start to
    help)."""

    def __init__(self, enabled: bool, probe_every: int = 64, probe_len: int = 2, prior_ratio: float = 1.25):
        self.enabled, self.probe_every, self.probe_len = enabled, probe_every, probe_len
        self.prior_ratio = prior_ratio
        self.times: dict[tuple[str, int], float] = {}
        self._seen: dict[tuple[str, int], int] = {}
        self.ar_run = 0
        self._probe = 0           # speculative blocks of a probe still to run

    def record(self, mode: str, b: int, seconds: float):
        key = (mode, b)
        self._seen[key] = self._seen.get(key, 0) + 1
        if self._seen[key] == 1:
            return
        old = self.times.get(key)
        self.times[key] = seconds if old is None else 0.8 * old + 0.2 * min(seconds, 2 * old)

    def choose(self, b: int, taus: list[float]) -> str:
        """"sd" or "ar" for a batch in bucket b whose requests have running τ `taus` (0 = none)."""
        if not self.enabled:
            return "sd"
        known = [t for t in taus if t > 0]
        fill = sum(known) / len(known) if known else TAU_PRIOR
        tau = sum(t if t > 0 else fill for t in taus) / len(taus)
        t_sd = self.times.get(("sd", b))
        t_ar = self.times.get(("ar", b))
        if self._probe > 0:
            self._probe -= 1
            mode = "sd"
        elif t_sd is None:
            mode = "sd"                              # measure speculative blocks first
        else:
            ratio = t_sd / t_ar if t_ar is not None else self.prior_ratio
            mode = "sd" if tau > ratio else "ar"
            if mode == "ar" and self.ar_run >= self.probe_every:
                mode, self._probe = "sd", self.probe_len - 1
        self.ar_run = self.ar_run + 1 if mode == "ar" else 0
        return mode


class Scheduler:
    """Waiting queue, batch slots and the step loop (see the module docstring)."""

    def __init__(self, runner: Runner, cost: CostModel):
        self.runner, self.cost = runner, cost
        self.slots: list[Optional[Request]] = [None] * runner.max_batch
        self.waiting: deque[Request] = deque()
        self._lock = threading.Lock()        # add / abort may come from other threads
        self._aborts: set[str] = set()
        self._last: Optional[tuple] = None   # (mode, bucket, time) of the last block's end
        self._batch_gen = torch.Generator(device=runner.device)
        self._batch_gen.manual_seed(secrets.randbits(63))

    # ------------------------------------------------------------------ queue
    def add(self, req: Request):
        with self._lock:
            rid = req.request_id
            if any(r.request_id == rid for r in self.waiting) or \
                    any(r is not None and r.request_id == rid for r in self.slots):
                raise ValueError(f"request id {rid!r} is already queued or running")
            self.waiting.append(req)

    def drop(self, reqs: list[Request]):
        """Remove unfinished requests now, without output (a stream closed early)."""
        ids = {r.request_id for r in reqs}
        with self._lock:
            self.waiting = deque(r for r in self.waiting if r.request_id not in ids)
        for i, r in enumerate(self.slots):
            if r is not None and r.request_id in ids:
                self.slots[i] = None
        for r in reqs:
            r.finish("abort")

    def abort(self, request_id: str):
        with self._lock:
            self._aborts.add(request_id)

    def has_unfinished(self) -> bool:
        return bool(self.waiting) or any(r is not None for r in self.slots)

    # ------------------------------------------------------------------ step
    def step(self) -> list[RequestOutput]:
        """Admit waiting requests (their first tokens are this step's output) or, when none
        was admitted, run one block for the batch. Never raises for one request's failure:
        that request finishes with finish_reason "error" and the others go on."""
        outputs: list[RequestOutput] = []
        with torch.inference_mode():
            self._apply_aborts(outputs)
            if self._admit(outputs):
                self._last = None                    # the next block's time includes no prefill
            else:
                self._block(outputs)
        for i, r in enumerate(self.slots):            # retire
            if r is not None and r.finished:
                self.slots[i] = None
        return outputs

    def _block(self, outputs):
        live = [r for r in self.slots if r is not None and not r.finished]
        if not live:
            return
        b = bucket_of(max(r.slot for r in live) + 1, self.runner.max_batch)
        reqs = self.slots[:b]
        sp = live[0].sp
        gen = live[0].generator if len(live) == 1 else self._batch_gen
        mode = self.cost.choose(b, [r.tau for r in live]) if live[0].speculative else "ar"
        try:
            if mode == "sd":
                new = self.runner.sd_block(reqs, b, sp, gen)
            else:
                new = self.runner.ar_step(reqs, b, sp, gen)
        except Exception as e:                       # a device failure: the batch cannot go on
            self.runner.pending = None
            for r in live:
                r.finish("error", f"{type(e).__name__}: {e}")
            new = [[] for _ in reqs]
        # steady state (the same mode and bucket as the block before): the interval between
        # two block ends is the device's time per block
        now = time.perf_counter()
        if self._last is not None and self._last[:2] == (mode, b):
            self.cost.record(mode, b, now - self._last[2])
        self._last = (mode, b, now)
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
        for i, r in enumerate(self.slots):
            if r is not None and r.request_id in aborts and not r.finished:
                r.finish("abort")
                outputs.append(self._output(r, []))
                self.slots[i] = None

    def _admit(self, outputs) -> list[Request]:
        """Prefill waiting requests of the batch's kind into free slots (first come, first
        served). Returns the requests admitted or failed (their outputs are in `outputs`)."""
        admitted = []
        while True:
            with self._lock:
                if not self.waiting:
                    break
                live = [r for r in self.slots if r is not None]
                key = live[0].sampling_key if live else self.waiting[0].sampling_key
                head = self.waiting[0]
                if head.sampling_key != key or None not in self.slots:
                    break                            # the oldest waits for the batch to drain
                self.waiting.popleft()
            slot = self.slots.index(None)
            first_in_batch = not live
            admitted.append(head)
            try:
                self.runner.prefill(head, slot)
                if first_in_batch:
                    # the batch's draws follow its first request's seed: a seeded batch call
                    # reproduces (the runner's noise seed, the batch generator)
                    seed = torch.randint(0, 2 ** 62, (2,), generator=head.generator, device=self.runner.device)
                    self.runner.seed.copy_(seed[:1])
                    self.runner.offset.zero_()
                    self._batch_gen.manual_seed(int(seed[1]))
            except Exception as e:                   # this request fails alone
                self.runner.pending = None
                head.finish("error", f"{type(e).__name__}: {e}")
                outputs.append(self._output(head, []))
                continue
            if not head.finished:
                self.slots[slot] = head
            outputs.append(self._output(head, list(head.tokens)))
        return admitted
