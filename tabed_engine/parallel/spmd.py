"""Every rank runs the same engine steps (SPMD); rank 0, the user's process, decides.

Rank 0 runs the real `Engine` (a `TensorParallelEngine`); each worker runs a plain engine
over its shard (`startup.run_worker`) and follows rank 0's messages, in order:

* ("step", inbox): the requests added and aborted since the last step (each request as rank 0
  built it: its token ids, images, sampling settings, resolved seed and captions), then one
  `Scheduler.step` on every rank. Adds and aborts from other threads wait in rank 0's inbox
  until a step ships them, so every rank's scheduler sees them at the same step.
* ("choose", g) inside a step: the cost model's block kind, decided on rank 0 (it measures
  wall times, which differ per rank: `SharedCostModel`).
* ("drop", ids), ("configure", kwargs), ("set", name, value) (the settings that may change
  between steps: `prefill_chunk`, `mixed_steps`, a benchmark's `bench_accept_schedule`), ("runner", method, args) (prefill-graph
  capture and the draft's prefill warm-up of `warmup`, `prefill_target`), ("sync",), ("close",).

Anything else a step does depends only on what every rank holds alike: the request (its seed
drawn once, on rank 0), the replicated draft and vision tower, and the target's gathered logits
(the same bytes on every rank). Each worker returns a running digest of its steps' outputs;
rank 0 compares them with its own (as they arrive, and all of them in `verify_ranks`), so
ranks that drifted apart fail loudly instead of decoding different tokens.
"""
from __future__ import annotations

import hashlib
import pickle
import weakref
from functools import partial
from typing import Optional


from tabed_engine.engine.engine import Engine
from tabed_engine.engine.request import Request
from tabed_engine.engine.runner import Runner
from tabed_engine.engine.scheduler import CostModel, Scheduler
from tabed_engine.parallel.comm import TPGroup, destroy_group
from tabed_engine.parallel.workers import ParentLink, WorkerPool

COLLECTIVE_TIMEOUT_S = 600.0   # a collective waiting this long fails (a first CUDA-graph capture fits)
START_TIMEOUT_S = 120.0        # the rendezvous of the process group


class Spmd:
    """One rank's end of the decisions: rank 0 sends (`pool`), workers receive (`link`)."""

    def __init__(self, tp: TPGroup, pool: Optional[WorkerPool] = None, link: Optional[ParentLink] = None):
        self.tp, self.pool, self.link = tp, pool, link
        self.broken: Optional[str] = None
        # the running digest of this rank's step outputs (kept across `configure`, which
        # replaces the scheduler); rank 0 keeps its digests until every worker matched them
        self.steps, self.h = 0, b""
        self.digests: dict[int, bytes] = {}
        self.seen = [0] * (tp.world - 1)

    @property
    def leader(self) -> bool:
        return self.tp.rank == 0

    def check(self):
        if self.broken is not None:
            raise RuntimeError(f"the tensor-parallel engine is unusable: {self.broken}")
        if self.leader:
            self.pool.check()

    def send(self, msg):
        self.check()
        self.pool.send(msg)

    def decide(self, tag: str, fn):
        """fn() on rank 0, sent to every worker; the workers' return is rank 0's value."""
        if self.leader:
            value = fn()
            self.send((tag, value))
            return value
        msg = self.link.recv()
        if msg[0] != tag:
            raise RuntimeError(f"rank {self.tp.rank} expected {tag!r} from rank 0, got {msg[0]!r}")
        return msg[1]

    def record(self, outputs):
        """Digest one step's outputs (a worker sends its digest to rank 0)."""
        self.steps, self.h = self.steps + 1, digest(self.h, outputs)
        if self.leader:
            self.digests[self.steps] = self.h
        else:
            self.link.send(("digest", (self.steps, self.h)))

    def compare(self, block: bool):
        """(rank 0) Check the workers' step digests received so far (with `block`, wait for
        every step's): RuntimeError naming the first rank and step that differ."""
        pool = self.pool
        for i in range(len(pool.procs)):
            while pool.pending(i) or (block and self.seen[i] < self.steps):
                step, h = pool.recv(i, "digest", COLLECTIVE_TIMEOUT_S)
                if self.digests.get(step) != h:
                    why = f"rank {i + 1}'s outputs at step {step} differ from rank 0's"
                    self.fail(why)
                    raise RuntimeError(f"tensor-parallel ranks diverged: {why}")
                self.seen[i] = step
        done = min(self.seen, default=self.steps)
        for s in [s for s in self.digests if s < done]:
            del self.digests[s]

    def fail(self, why: str, wait: float = 0.0):
        """Mark the group unusable and stop the workers (rank 0): after a failed step they may
        sit in a collective that never completes, so they are terminated at once unless
        `wait` seconds are given for them to leave on a "close" (an idle engine's `close()`)."""
        if self.broken is None:
            self.broken = why
        if self.leader:
            self.pool.close(wait)


class SharedCostModel(CostModel):
    """The cost model whose choice rank 0 makes and every rank follows."""

    def __init__(self, spmd: Spmd, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.spmd = spmd

    def choose(self, b: int, counts: list) -> int:
        return self.spmd.decide("choose", partial(super().choose, b, counts))


def picklable(x) -> bool:
    """Whether `x` can be sent to the workers."""
    try:
        pickle.dumps(x)
        return True
    except Exception:     # pickle raises many types
        return False


def request_payload(r: Request) -> dict:
    """What a worker needs to rebuild `r` exactly (its generator as its seed)."""
    return dict(request_id=r.request_id, prep=r.prep, sp=r.sp, caption=r.caption, speculative=r.speculative,
                eos_ids=r.eos_ids, max_new=r.max_new, view_mask=r.view_mask, pieces=r.pieces,
                seed=r.generator.initial_seed())


def digest(h: bytes, outputs) -> bytes:
    """The running digest of a rank's step outputs (request, new tokens, finished)."""
    m = hashlib.sha256(h)
    m.update(repr([(o.request_id, o.new_token_ids, o.finished) for o in outputs]).encode())
    return m.digest()


class SpmdScheduler(Scheduler):
    """Rank 0's scheduler: adds and aborts wait in an inbox that the next step ships to the
    workers before it runs; every step's outputs are digested and compared with the workers'."""

    def __init__(self, runner, cost, spmd: Spmd, engine):
        super().__init__(runner, cost)
        self.spmd, self.engine = spmd, engine
        self._inbox: list = []         # ("add", Request) / ("abort", request id), in call order

    def add(self, req: Request):
        eng = self.engine
        if (req.speculative and "C" in eng.views and req.caption is None and eng.captioner is not None
                and req.prep.num_images):
            # the captioner (the user's callable) runs here only; the workers get its captions
            from tabed_engine.speculation.views import _captions
            req.caption = _captions(eng, req.prep, None)
        with self._lock:
            rid = req.request_id
            if any(r.request_id == rid for r in self.waiting) or \
                    any(r is not None and r.request_id == rid for r in self.slots) or \
                    any(k == "add" and r.request_id == rid for k, r in self._inbox):
                raise ValueError(f"request id {rid!r} is already queued or running")
            self._inbox.append(("add", req))

    def abort(self, request_id: str):
        with self._lock:
            self._inbox.append(("abort", request_id))

    def has_unfinished(self) -> bool:
        return super().has_unfinished() or any(k == "add" for k, _ in self._inbox)

    def drop(self, reqs: list[Request]):
        ids = {r.request_id for r in reqs}
        with self._lock:
            self._inbox = [(k, x) for k, x in self._inbox if not (k == "add" and x.request_id in ids)]
        if self.spmd.broken is None:
            try:
                self.spmd.send(("drop", sorted(ids)))
            except RuntimeError as e:      # (a stream closed after a failure: drop it here alone)
                self.spmd.fail(str(e))
        super().drop(reqs)

    def step(self):
        self.spmd.check()
        self.spmd.compare(block=False)
        with self._lock:
            inbox, self._inbox = self._inbox, []
        self.spmd.send(("step", [(k, request_payload(x) if k == "add" else x) for k, x in inbox]))
        for k, x in inbox:
            Scheduler.add(self, x) if k == "add" else Scheduler.abort(self, x)
        try:
            outs = super().step()
            # a worker that died in this step fails it: the collective that noticed (a request
            # failed with a RuntimeError) may have been faster than the worker's exit
            failed = any(o.finished and o.output is not None and o.output.finish_reason == "error"
                         and not str(o.output.error).startswith(("ValueError", "TypeError")) for o in outs)
            self.spmd.pool.wait_exit(2.0 if failed else 0.0)
        except BaseException as e:            # (Ctrl-C included): the ranks are out of step
            self.spmd.fail(f"a step failed on rank 0: {type(e).__name__}: {e}")
            raise
        self.spmd.record(outs)
        return outs


class SpmdRunner(Runner):
    """Rank 0's runner: the steps an engine runs outside the scheduler are sent first."""

    def _mirror(self, name: str, *args):
        self.eng._spmd.send(("runner", name, args))

    def capture_prefill(self, buckets=None) -> int:
        self._mirror("capture_prefill", buckets)
        return super().capture_prefill(buckets)

    def warm_draft_prefill(self) -> int:
        self._mirror("warm_draft_prefill")
        return super().warm_draft_prefill()

    def prefill_target(self, prep, slot: int):
        self._mirror("prefill_target", prep, slot)
        return super().prefill_target(prep, slot)


class _SpmdEngine(Engine):
    """What every rank's engine shares: the batch size all ranks fit, the shared cost model."""

    def __init__(self, *args, spmd: Spmd, **kwargs):
        self._spmd = spmd
        super().__init__(*args, **kwargs)

    def _max_batch(self, given: int, fraction: float) -> int:
        try:
            fit, why = super()._max_batch(given, fraction), None
        except ValueError as e:
            fit, why = 0, str(e)
        spmd = self._spmd
        if spmd.leader:
            fits = [(fit, why)] + spmd.pool.recv_all("fit", START_TIMEOUT_S)
            bad = next(((r, w) for r, (_, w) in enumerate(fits) if w is not None), None)
            decided = (min(f for f, _ in fits), None) if bad is None else (0, f"rank {bad[0]}: {bad[1]}")
        else:
            spmd.link.send(("fit", (fit, why)))
            decided = None
        fit, why = spmd.decide("fit", lambda: decided)
        if why is not None:
            raise ValueError(why)
        return fit

    def _cost_args(self):
        return (self.adaptive, self.gamma), dict(chains=self.tree is None,
                                                 tree_depth=None if self.tree is None else self.tree.depth)


class TensorParallelEngine(_SpmdEngine):
    """Rank 0's engine (the user's): `Engine` whose target is sharded over `tensor_parallel`
    processes, this one and the workers it owns. Build it with
    `Engine.from_pretrained(..., tensor_parallel=N)`; `close()` (or a `with` block, or garbage
    collection, or the interpreter's exit) stops the workers."""

    runner_class = SpmdRunner

    def __init__(self, *args, spmd: Spmd, **kwargs):
        super().__init__(*args, spmd=spmd, **kwargs)
        self._finalizer = weakref.finalize(self, _shutdown, spmd)
        self._mirrored = True       # the workers were built with the same settings; later changes are sent

    @property
    def tensor_parallel(self) -> int:
        return self._spmd.tp.world

    @property
    def worker_pids(self) -> list[int]:
        """The worker processes' ids (ranks 1..N-1)."""
        return self._spmd.pool.pids

    def _new_scheduler(self) -> Scheduler:
        args, kwargs = self._cost_args()
        return SpmdScheduler(self.runner, SharedCostModel(self._spmd, *args, **kwargs), self._spmd, self)

    def configure(self, **kwargs):
        self._spmd.check()
        super().configure(**kwargs)
        self._spmd.send(("configure", kwargs))

    def verify_ranks(self) -> int:
        """Compare every worker's outputs with this rank's, step by step so far (digests of the
        request ids, new tokens and finishes): RuntimeError on the first difference. Returns the
        steps compared."""
        with self._lock:
            self._spmd.check()
            self._spmd.compare(block=True)
            return self._spmd.steps

    def _set(self, name: str, prop: property, value):
        """A step-time setting (checked here), then on every worker before its next step."""
        prop.fset(self, value)
        if getattr(self, "_mirrored", False):
            self._spmd.check()
            self._spmd.send(("set", name, getattr(self, name)))

    @Engine.mixed_steps.setter
    def mixed_steps(self, value):
        self._set("mixed_steps", Engine.mixed_steps, value)

    @Engine.prefill_chunk.setter
    def prefill_chunk(self, value):
        self._set("prefill_chunk", Engine.prefill_chunk, value)

    @Engine.bench_accept_schedule.setter
    def bench_accept_schedule(self, fn):
        if fn is not None and not picklable(fn):
            raise ValueError("a tensor-parallel engine's bench_accept_schedule must be picklable (a module-level "
                             "class or function) to reach its workers")
        self._set("bench_accept_schedule", Engine.bench_accept_schedule, fn)

    def close(self):
        """Stop the workers and leave the process group (idempotent)."""
        self._finalizer()


def _shutdown(spmd: Spmd):
    spmd.fail("the engine was closed", wait=10.0)
    destroy_group()


class WorkerEngine(_SpmdEngine):
    """A worker's engine: a plain scheduler driven by rank 0's messages, rank 0's cost choices."""

    def _new_scheduler(self) -> Scheduler:
        args, kwargs = self._cost_args()
        return Scheduler(self.runner, SharedCostModel(self._spmd, *args, **kwargs))
