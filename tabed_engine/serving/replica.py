"""One engine replica of a data-parallel server, in a process of its own (the child side of
`serving.data_parallel`).

The process builds its engine (`build(device)`), says "ready", then runs two threads: the main
thread steps the engine while requests are in flight (as the single-engine server's engine
thread does) and a reader thread takes commands from the front (add, abort, stop). Everything
goes over one duplex `multiprocessing` pipe:

    front -> replica   ("add", rid, ParsedRequest) | ("abort", rid) | ("stop",)
    replica -> front   ("ready", info) | ("load_failed", message)
                       ("added", rid) | ("refused", rid, message, param, status, kind)
                       ("outputs", [RequestOutput, ...])   one message per engine step
                       ("failed", message)                  engine.step() raised; the replica exits

The replica ignores SIGINT: Ctrl-C reaches the whole process group, and the front must drain
in-flight answers before it stops the replicas itself. A replica whose front is gone (its end of
the pipe closed, even by SIGKILL; or, while it loads, its parent gone) exits at once, so no
replica outlives its server.
"""
from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from tabed_engine.parallel.comm import NVLS_OFF   # machine rule: in every process the server starts

log = logging.getLogger("tabed_engine.serving.replica")



@dataclass
class ReplicaPlan:
    """Where replica `index` runs: the device its engine is built on and the environment its
    process gets (on CUDA, CUDA_VISIBLE_DEVICES narrowed to its GPU or tensor-parallel group,
    so that inside the replica its GPUs are cuda:0..N-1)."""

    index: int
    device: str
    env: dict = field(default_factory=dict)
    label: str = ""          # for logs and /health: "cpu", "GPU 1", "GPUs 2,3"
    threads: Optional[int] = None   # CPU: torch threads of this replica (None: torch's default)


def plan_replicas(replicas: int, device: Optional[str] = None, tensor_parallel: int = 1) -> list[ReplicaPlan]:
    """The placement of `replicas` engine replicas: on the CPU, M processes sharing the cores
    (each gets cores // M torch threads unless OMP_NUM_THREADS is set); on CUDA replica i gets
    the i-th GPU, or the i-th group of `tensor_parallel` GPUs, of the visible ones. Raises
    ValueError for a degree that is not a positive int, `cuda:N` (pick the GPUs with
    CUDA_VISIBLE_DEVICES) or too few GPUs."""
    for name, v in (("data_parallel", replicas), ("tensor_parallel", tensor_parallel)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    import torch

    kind = (device or ("cuda" if torch.cuda.is_available() else "cpu")).strip().lower()
    if kind == "cpu":
        threads = None if "OMP_NUM_THREADS" in os.environ else max(1, (os.cpu_count() or 1) // replicas)
        return [ReplicaPlan(i, "cpu", dict(NVLS_OFF), "cpu", threads) for i in range(replicas)]
    if kind != "cuda":
        if kind.startswith("cuda:"):
            raise ValueError(f"--device {device}: with data parallelism replica i runs on GPU i (or GPU group i "
                             "with tensor parallelism); choose the GPUs with CUDA_VISIBLE_DEVICES and pass "
                             "--device cuda")
        raise ValueError(f"device must be cpu or cuda for data parallelism, got {device!r}")
    if not torch.cuda.is_available():
        raise ValueError("device cuda was asked for but no CUDA GPU is usable")
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    visible = [d.strip() for d in listed.split(",") if d.strip()] if listed is not None else \
        [str(i) for i in range(torch.cuda.device_count())]
    visible = visible[:torch.cuda.device_count()]
    need = replicas * tensor_parallel
    if need > len(visible):
        raise ValueError(f"{replicas} replica(s) x tensor parallel {tensor_parallel} need {need} GPUs, "
                         f"{len(visible)} visible")
    plans = []
    for i in range(replicas):
        group = visible[i * tensor_parallel:(i + 1) * tensor_parallel]
        env = dict(NVLS_OFF, CUDA_VISIBLE_DEVICES=",".join(group))
        label = ("GPU " if len(group) == 1 else "GPUs ") + ",".join(group)
        plans.append(ReplicaPlan(i, "cuda", env, label))
    return plans


def load_engine(target: str, draft: Optional[str], kwargs: dict, warmup: bool, index: int, device: str):
    """The `serve` CLI's replica `index`: `Engine.from_pretrained` on `device`, warmed up as
    `serve --warmup` does when `warmup`; progress lines on stderr start with "[replica i] "."""
    from tabed_engine import Engine
    from tabed_engine.serving.cli import serve_warmup

    prefix = f"[replica {index}] "

    fresh = [True]          # at the start of a line: the prefix goes first

    def say(s):
        print(prefix + s if fresh[0] else s, end="", file=sys.stderr, flush=True)
        fresh[0] = s.endswith("\n")
    engine = Engine.from_pretrained(target, draft, device=device, log=say, **kwargs)
    if warmup:
        print(f"{prefix}warm-up done in {serve_warmup(engine):.1f} s", file=sys.stderr, flush=True)
    return engine


def replica_main(plan: ReplicaPlan, conn, build: Callable[[int, str], object], front: int):
    """The replica process: build the engine, report, then serve commands until told to stop.
    `front`: the front's pid (this process's parent)."""
    os.environ.update(plan.env)          # the front set it for the start too (see ReplicaPool)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # the front's pid comes from the front: it may have died while this process was starting
    threading.Thread(target=_exit_with_parent, args=(front,), name="replica-parent-watch", daemon=True).start()
    import torch

    if plan.threads is not None:
        torch.set_num_threads(plan.threads)
    t0 = time.perf_counter()
    try:
        engine = build(plan.index, plan.device)
    except BaseException as e:       # the front reports it and stops the other replicas
        conn.send(("load_failed", f"{type(e).__name__}: {' '.join(str(e).split())}"))
        return
    conn.send(("ready", {"pid": os.getpid(), "device": plan.label, "load_s": time.perf_counter() - t0}))
    try:
        _ReplicaLoop(engine, conn).run()
    finally:
        close = getattr(engine, "close", None)     # a tensor-parallel engine stops its workers
        if close is not None:
            close()


def _exit_with_parent(parent: int, every: float = 1.0):
    """Exit when the front is gone, also while the engine loads (the command pipe is read only
    once it is built): a SIGKILLed front must not leave a replica holding its GPUs."""
    while os.getppid() == parent:
        time.sleep(every)
    os._exit(0)


class _ReplicaLoop:
    """The replica's step loop (main thread) and command reader (a thread)."""

    def __init__(self, engine, conn):
        from tabed_engine.serving.server import SWITCH_INTERVAL

        self.engine, self.conn = engine, conn
        self.send_lock = threading.Lock()    # both threads send on the one pipe
        self.wake, self.stop = threading.Event(), threading.Event()
        sys.setswitchinterval(SWITCH_INTERVAL)    # as the single-engine server: see server.py

    def send(self, msg):
        with self.send_lock:
            self.conn.send(msg)

    def run(self):
        threading.Thread(target=self._read, name="replica-commands", daemon=True).start()
        while not self.stop.is_set():
            self.wake.clear()       # cleared before the check: a command after it wakes the wait
            if not self.engine.has_unfinished():
                self.wake.wait()
                continue
            try:
                outputs = self.engine.step()
            except Exception as e:   # the engine is broken: say so and exit (the front fails its requests)
                log.exception("engine.step() failed")
                self.send(("failed", f"engine.step() raised {type(e).__name__}: {' '.join(str(e).split())}"))
                return
            if outputs:
                self.send(("outputs", outputs))

    def _read(self):
        from tabed_engine.serving.protocol import ApiError, submit_to_engine

        while True:
            try:
                msg = self.conn.recv()
            except (EOFError, OSError):      # the front is gone: nobody is left to answer
                os._exit(0)
            if msg[0] == "add":
                _, rid, req = msg
                try:
                    submit_to_engine(self.engine, rid, req)
                except ApiError as e:
                    self.send(("refused", rid, e.message, e.param, e.status, e.kind))
                    continue
                except Exception as e:       # not the input's fault: a server error for this request
                    self.send(("refused", rid, f"{type(e).__name__}: {e}", None, 500, "server_error"))
                    continue
                self.send(("added", rid))
                self.wake.set()
            elif msg[0] == "abort":
                self.engine.abort(msg[1])
                self.wake.set()
            elif msg[0] == "stop":
                self.stop.set()
                self.wake.set()
                return
