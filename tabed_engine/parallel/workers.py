"""The worker processes of a tensor-parallel engine, owned by the user's process (rank 0).

Each worker is a fresh interpreter (`python -m tabed_engine.parallel.workers FD`: nothing of
the user's script is imported or re-run in it) joined to rank 0 by a socket pair: rank 0
sends its decisions down it in order (`WorkerPool.send`), the worker replies on it (start-up
handshakes, step digests, errors). The same socket is each side's liveness: a worker whose
parent is gone reads end-of-file (or notices its parent changed) and exits; rank 0 polls each
worker's exit status before every call and while waiting for a reply, so a dead worker fails
the call with a `RuntimeError` naming its rank and exit code instead of hanging it.

Workers ignore SIGINT (Ctrl-C reaches the whole terminal process group: rank 0 gets the
KeyboardInterrupt and tears the workers down, they never die half-way through a collective on
their own) and are stopped by rank 0: a "close" message, then SIGTERM, then SIGKILL.
"""
from __future__ import annotations

import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any, Optional

from tabed_engine.parallel.comm import nvls_off


def _send(conn: Connection, msg: Any):
    # plain pickle: Connection.send uses the multiprocessing pickler, to which torch adds
    # tensor reductions that pass storage by file descriptor to processes multiprocessing made
    conn.send_bytes(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))


def _recv(conn: Connection) -> Any:
    return pickle.loads(conn.recv_bytes())


class WorkerPool:
    """Rank 0's handle on ranks 1..N-1: start, send, receive, liveness, tear-down."""

    def __init__(self, world: int, spec: dict):
        self.world = world
        self.procs: list[subprocess.Popen] = []
        self.conns: list[Connection] = []
        self.errors: dict[int, str] = {}         # rank -> the error a worker reported before exiting
        self.closed = False
        env = nvls_off(dict(os.environ))        # the machine rule, in every process we start
        try:
            for rank in range(1, world):
                mine, theirs = socket.socketpair()
                with theirs:
                    proc = subprocess.Popen([sys.executable, "-m", "tabed_engine.parallel.workers",
                                             str(theirs.fileno())], pass_fds=(theirs.fileno(),), env=env)
                self.procs.append(proc)
                self.conns.append(Connection(mine.detach()))
                _send(self.conns[-1], dict(spec, rank=rank))
        except BaseException:
            self.close()
            raise

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def _dead(self, i: int) -> RuntimeError:
        rank, code = i + 1, self.procs[i].poll()
        self._read_error(i)
        why = f": {self.errors[rank]}" if rank in self.errors else ""
        return RuntimeError(f"tensor-parallel worker rank {rank} (pid {self.procs[i].pid}) exited with code "
                            f"{code}{why}; the engine cannot go on: close it and build a new one")

    def _read_error(self, i: int):
        """Pick up an error message the worker sent before it exited (if any)."""
        try:
            while self.conns[i].poll(0):
                msg = _recv(self.conns[i])
                if msg[0] == "error":
                    self.errors[i + 1] = msg[1]
        except (EOFError, OSError):
            pass

    def check(self):
        """RuntimeError naming the first worker that exited (its rank and exit code)."""
        if self.closed:
            raise RuntimeError("the tensor-parallel workers were shut down: build a new engine")
        for i, p in enumerate(self.procs):
            if p.poll() is not None:
                raise self._dead(i)

    def wait_exit(self, timeout: float):
        """Wait up to `timeout` seconds for a worker to exit (one whose collective failed may
        still be on its way out), then `check`."""
        end = time.monotonic() + timeout
        while time.monotonic() < end and all(p.poll() is None for p in self.procs):
            time.sleep(0.01)
        self.check()

    def send(self, msg: Any):
        """Send one message to every worker, in order."""
        self.check()
        for i, c in enumerate(self.conns):
            try:
                _send(c, msg)
            except OSError:
                raise self._dead(i) from None

    def recv(self, i: int, tag: str, timeout: Optional[float] = None) -> Any:
        """The next message of worker i (rank i + 1), which must carry `tag`; its payload.
        Polls the worker's liveness while waiting; RuntimeError if it exited, reported an
        error or `timeout` seconds passed."""
        end = None if timeout is None else time.monotonic() + timeout
        c, p = self.conns[i], self.procs[i]
        while True:
            try:
                ready = c.poll(0.05)
            except (EOFError, OSError):
                ready = False
            if ready:
                try:
                    msg = _recv(c)
                except (EOFError, OSError):
                    p.wait(5)
                    raise self._dead(i) from None
                if msg[0] == "error":
                    self.errors[i + 1] = msg[1]
                    p.wait(30)
                    raise self._dead(i)
                if msg[0] != tag:
                    raise RuntimeError(f"tensor-parallel worker rank {i + 1} sent {msg[0]!r} where {tag!r} was due: "
                                       "the ranks lost step")
                return msg[1] if len(msg) > 1 else None
            if p.poll() is not None:
                raise self._dead(i)
            if end is not None and time.monotonic() > end:
                raise RuntimeError(f"tensor-parallel worker rank {i + 1} sent no {tag!r} within {timeout:.0f} s")

    def recv_all(self, tag: str, timeout: Optional[float] = None) -> list:
        return [self.recv(i, tag, timeout) for i in range(len(self.procs))]

    def pending(self, i: int) -> bool:
        """Whether worker i has a message waiting (no wait)."""
        try:
            return self.conns[i].poll(0)
        except (EOFError, OSError):
            return False

    def close(self, timeout: float = 10.0):
        """Stop every worker: "close", then SIGTERM, then SIGKILL; reap them. Idempotent."""
        if self.closed:
            return
        self.closed = True
        for c, p in zip(self.conns, self.procs):
            if p.poll() is None:
                try:
                    _send(c, ("close",))
                except OSError:
                    pass
        end = time.monotonic() + timeout
        for p in self.procs:
            try:
                p.wait(max(0.01, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.terminate()
                try:
                    p.wait(5)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        for c in self.conns:
            c.close()


# ---------------------------------------------------------------- the worker side

class ParentLink:
    """A worker's end of its socket to rank 0."""

    def __init__(self, conn: Connection):
        self.conn = conn

    def recv(self) -> Any:
        try:
            return _recv(self.conn)
        except (EOFError, OSError):
            os._exit(0)          # rank 0 is gone: nothing left to serve

    def send(self, msg: Any):
        try:
            _send(self.conn, msg)
        except OSError:
            os._exit(0)


def _watch_parent(parent: int):
    """Exit when the parent process is gone, even while blocked in a collective."""
    while True:
        time.sleep(1.0)
        if os.getppid() != parent:
            os._exit(1)


def main(fd: int):
    """A worker's entry point: the machine rule, SIGINT ignored, a parent watchdog, then
    `spmd.run_worker` with the spec rank 0 sent first."""
    nvls_off()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()
    link = ParentLink(Connection(fd))
    spec = link.recv()
    try:
        from tabed_engine.parallel.startup import run_worker

        run_worker(spec, link)
    except BaseException:
        link.send(("error", traceback.format_exc(limit=8)))
        sys.stderr.write(f"tensor-parallel worker rank {spec.get('rank')} failed:\n{traceback.format_exc()}")
        sys.stderr.flush()
        os._exit(1)
    os._exit(0)


if __name__ == "__main__":
    main(int(sys.argv[1]))
