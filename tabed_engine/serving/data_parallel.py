"""Data-parallel serving: M engine replicas, each in a process of its own, behind the one HTTP
front (`OpenAIServer(None, ..., backend=ReplicaPool(...))`).

Why processes and pipes: every replica steps its engine in a loop that holds the GIL for its
host work, and replicas on several GPUs (or CPU replicas) must not share one interpreter; each
replica is a `multiprocessing` spawn process (`serving.replica`) with one duplex pipe to the
front. The front parses and formats as the single-engine server does (serving/protocol.py), picks
a replica, sends it the parsed request and reads the replica's per-step outputs back. Each
replica has a reader thread in the front (a blocking `recv`, which also sees the replica die as
end-of-file) that hands its messages to the event loop, where they go to per-request asyncio
queues: the handlers cannot tell a replica from the in-process EngineLoop.

Routing is least-loaded: the live replica with the fewest requests in flight, then the fewest
tokens still owed to requests with a max_tokens, ties to the lowest index. A request's load is
counted from the moment it is routed, so requests arriving together spread out.

A replica that dies (killed, or its engine's step raised) fails its requests with an OpenAI
error body naming it; it is not routed to again, /health turns "degraded" (still 200: the others
serve) or "error" (503) when none is left, and /metrics reports `tabed_replica_up 0` for it.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from typing import Callable, Optional

from tabed_engine.serving.metrics import ServerMetrics
from tabed_engine.serving.protocol import ApiError, ParsedRequest
from tabed_engine.serving.replica import ReplicaPlan, replica_main

log = logging.getLogger("tabed_engine.serving.data_parallel")
STOP_TIMEOUT = 30.0     # seconds a replica gets to exit after "stop" before it is terminated


@dataclass
class _Flight:
    """A request in flight on a replica."""

    queue: asyncio.Queue
    replica: "_Replica"
    ack: asyncio.Future               # the replica accepted (None) or refused (ApiError) it
    owed: int = 0                     # tokens still to come when max_tokens was given
    arrival: float = field(default_factory=time.perf_counter)
    first: Optional[float] = None


@dataclass(eq=False)
class _Replica:
    plan: ReplicaPlan
    process: multiprocessing.Process
    conn: object
    metrics: ServerMetrics
    send_lock: threading.Lock = field(default_factory=threading.Lock)
    flights: dict = field(default_factory=dict)     # rid -> _Flight
    pid: Optional[int] = None
    error: Optional[str] = None                      # why it is dead (None: alive)
    ready: bool = False                              # its engine is built: it reads commands

    @property
    def index(self) -> int:
        return self.plan.index

    @property
    def load(self) -> tuple:
        return len(self.flights), sum(f.owed for f in self.flights.values()), self.index

    def send(self, msg):
        with self.send_lock:
            self.conn.send(msg)


class ReplicaPool:
    """The replicas' processes and the front's side of them. `start_processes()` (before the
    server runs) starts every replica and waits until each has built its engine; the server's
    lifespan calls `start()` / `stop()`; `close()` stops what is left (idempotent).

    build: a picklable callable `build(index, device) -> engine`, run in each replica process
    (e.g. `functools.partial(replica.load_engine, target, draft, kwargs, warmup)`), on the
    placement `plans` (from `replica.plan_replicas`)."""

    def __init__(self, build: Callable[[int, str], object], plans: list[ReplicaPlan]):
        if not plans:
            raise ValueError("a replica pool needs at least one replica")
        self.build, self.plans = build, plans
        self.metrics = ServerMetrics(replicas=len(plans))
        self.replicas: list[_Replica] = []
        self._where: dict[str, _Replica] = {}
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._closing = False
        self._pumps: list[threading.Thread] = []

    # ------------------------------------------------------------------ processes
    def start_processes(self, say: Callable[[str], object] = lambda s: None) -> list[dict]:
        """Start every replica at once and wait until each is ready; returns their infos (pid,
        device, load seconds). A replica that fails to load (or dies) stops them all and
        raises RuntimeError naming it; so does Ctrl-C meanwhile (after the clean-up)."""
        ctx = multiprocessing.get_context("spawn")
        try:
            for plan in self.plans:
                mine, theirs = ctx.Pipe()
                # not a daemon: a replica may start processes of its own (tensor-parallel ranks);
                # close() (always reached: the server's lifespan, the CLI's finally) ends it, and a
                # replica whose pipe closes exits by itself
                proc = ctx.Process(target=replica_main, args=(plan, theirs, self.build, os.getpid()),
                                   name=f"tabed-replica-{plan.index}")
                with _environment(plan.env):    # from the child's first instruction: its imports
                    proc.start()                # may touch CUDA before replica_main runs
                theirs.close()      # the replica holds its end: its death reads as EOF here
                self.replicas.append(_Replica(plan, proc, mine, self.metrics.replicas[plan.index], pid=proc.pid))
            infos, pending = [None] * len(self.replicas), {r.conn: r for r in self.replicas}
            while pending:
                for conn in wait(list(pending)):
                    rep = pending.pop(conn)
                    try:
                        msg = conn.recv()
                    except (EOFError, OSError):
                        msg = ("load_failed", f"the process exited ({_exit_reason(rep.process)})")
                    if msg[0] != "ready":
                        raise RuntimeError(f"replica {rep.index} ({rep.plan.label}) failed to start: {msg[1]}")
                    infos[rep.index], rep.ready = msg[1], True
                    say(f"replica {rep.index} ready on {rep.plan.label} (pid {rep.pid}, "
                        f"{msg[1]['load_s']:.1f} s)\n")
            return infos
        except BaseException:
            self.close()
            raise

    def close(self):
        """Stop every replica process: "stop" to a ready one (SIGTERM to one still loading: it
        reads no commands yet), then SIGTERM and SIGKILL for one that does not exit."""
        self._closing = True
        for rep in self.replicas:
            if not rep.process.is_alive():
                continue
            if rep.ready:
                try:
                    rep.send(("stop",))
                except OSError:
                    pass
            else:
                rep.process.terminate()
        deadline = time.monotonic() + STOP_TIMEOUT
        for rep in self.replicas:
            rep.process.join(max(0.0, deadline - time.monotonic()))
            if rep.process.is_alive():
                rep.process.terminate()
                rep.process.join(5)
            if rep.process.is_alive():
                rep.process.kill()
                rep.process.join(5)
        for pump in self._pumps:    # they read EOF now; closing a pipe under a blocked read could
            pump.join(5)            # hand its descriptor's number to another file meanwhile
        for rep in self.replicas:
            rep.conn.close()

    # ------------------------------------------------------------------ the server's backend
    def start(self):
        """Bind to the running event loop and start one reader thread per replica."""
        self._loop = asyncio.get_running_loop()
        for rep in self.replicas:
            self._pumps.append(threading.Thread(target=self._pump, args=(rep,), name=f"replica-{rep.index}-outputs",
                                                daemon=True))
            self._pumps[-1].start()

    def stop(self):
        """Abort what is still in flight and stop the replicas."""
        for rid in list(self._where):
            self.abort(rid)
        self.close()

    async def submit(self, rid: str, req: ParsedRequest) -> asyncio.Queue:
        """Route a parsed request to the least-loaded live replica; its outputs arrive on the
        returned queue. Raises ApiError for input the replica refuses, 503 when none is alive."""
        live = [r for r in self.replicas if r.error is None]
        if not live:
            raise ApiError("no engine replica is running: " + "; ".join(r.error for r in self.replicas),
                           status=503, kind="server_error")
        rep = min(live, key=lambda r: r.load)
        flight = _Flight(asyncio.Queue(), rep, self._loop.create_future(), req.sampling.get("max_new_tokens") or 0)
        rep.flights[rid] = flight        # counted from now: a request arriving meanwhile goes elsewhere
        self._where[rid] = rep
        rep.metrics.running = len(rep.flights)
        try:
            await asyncio.to_thread(rep.send, ("add", rid, req))
        except OSError:
            pass         # the replica is gone: its reader reports the death and fails `ack`
        try:
            await flight.ack
        except ApiError:
            self._forget(rid)
            raise
        self.metrics.routed.inc(value=str(rep.index))
        return flight.queue

    def abort(self, rid: str):
        """Stop a request (its client went away); its replica finishes it at the next step."""
        rep = self._where.get(rid)
        if rep is not None and rep.error is None:
            try:
                rep.send(("abort", rid))
            except OSError:
                pass

    def health(self) -> tuple[dict, int]:
        """GET /health: "ok" when every replica serves, "degraded" (still 200) when some died,
        "error" (503) when none is left; with each replica's state."""
        reps = [{"replica": r.index, "device": r.plan.label, "pid": r.pid, "running": len(r.flights),
                 "status": "ok" if r.error is None else "dead", **({"error": r.error} if r.error else {})}
                for r in self.replicas]
        dead = sum(r.error is not None for r in self.replicas)
        status = "ok" if not dead else "degraded" if dead < len(self.replicas) else "error"
        return {"status": status, "replicas": reps}, 503 if status == "error" else 200

    # ------------------------------------------------------------------ replica -> front
    def _pump(self, rep: _Replica):
        """A replica's messages onto the event loop, until its pipe closes."""
        while True:
            try:
                msg = rep.conn.recv()
            except (EOFError, OSError):
                break
            if not self._post(self._on_message, rep, msg, time.perf_counter()):
                return
        if not self._closing:
            rep.process.join(5)     # for its exit status
            self._post(self._on_death, rep, _exit_reason(rep.process))

    def _post(self, fn, *args) -> bool:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
            return True
        except RuntimeError:        # the event loop is closed: the server is gone
            return False

    def _on_message(self, rep: _Replica, msg: tuple, now: float):
        kind = msg[0]
        if kind == "outputs":
            self._deliver(rep, msg[1], now)
        elif kind in ("added", "refused"):
            flight = rep.flights.get(msg[1])
            if flight is not None and not flight.ack.done():
                if kind == "added":
                    flight.ack.set_result(None)
                else:
                    flight.ack.set_exception(ApiError(msg[2], msg[3], status=msg[4], kind=msg[5]))
        elif kind == "failed":
            rep.error = msg[1]      # the process exits next; its death fails the requests

    def _deliver(self, rep: _Replica, outputs: list, now: float):
        rep.metrics.step_outputs.observe(len(outputs))
        for out in outputs:
            flight = rep.flights.get(out.request_id)
            if flight is None:
                continue
            if out.new_token_ids and flight.first is None:
                flight.first = now
            flight.owed = max(0, flight.owed - len(out.new_token_ids))
            flight.queue.put_nowait(out)
            if out.finished:
                self._forget(out.request_id)
                rep.metrics.finished(out.output, flight.arrival, flight.first, now)
        rep.metrics.running = len(rep.flights)

    def _forget(self, rid: str):
        rep = self._where.pop(rid, None)
        if rep is not None:
            rep.flights.pop(rid, None)
            rep.metrics.running = len(rep.flights)

    def _on_death(self, rep: _Replica, reason: str):
        cause = f"{rep.error}; " if rep.error else ""
        rep.error = f"replica {rep.index} ({rep.plan.label}, pid {rep.pid}) died: {cause}the process {reason}"
        self.metrics.up[rep.index] = 0
        log.error("%s; %d request(s) in flight on it failed; %d replica(s) left", rep.error, len(rep.flights),
                  sum(r.error is None for r in self.replicas))
        err = ApiError(f"{rep.error}; this request was lost with it (the other replicas keep serving: retry)",
                       status=500, kind="server_error")
        for rid, flight in list(rep.flights.items()):
            if not flight.ack.done():
                flight.ack.set_exception(err)
            else:
                flight.queue.put_nowait(err)
            self._forget(rid)


@contextlib.contextmanager
def _environment(env: dict):
    """os.environ with `env` set, restored on exit (a spawned child inherits it as it starts)."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _exit_reason(process) -> str:
    code = process.exitcode
    if code is None:
        return "is still running but closed its pipe"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"
