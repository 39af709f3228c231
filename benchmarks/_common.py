"""Shared helpers for the benchmark scripts: synchronized wall-clock timing, the
device-to-device copy bandwidth ceiling, and run provenance for committed results."""
from __future__ import annotations

import datetime
import os
import platform
import statistics
import subprocess
import sys
import time
from typing import Callable

import torch


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def wall_ms(fn: Callable, device):
    """(fn(), milliseconds) with the device synchronized before and after."""
    sync(device)
    t = time.perf_counter()
    out = fn()
    sync(device)
    return out, (time.perf_counter() - t) * 1e3


def median_ms(fn: Callable, device, reps: int, warmup: int = 1) -> float:
    """Median synchronized wall-clock milliseconds of fn() over `reps` calls."""
    for _ in range(warmup):
        fn()
    return statistics.median(wall_ms(fn, device)[1] for _ in range(reps))


def event_ms(fn: Callable, reps: int, inner: int = 1) -> float:
    """CUDA: median over `reps` of (CUDA-event time of `inner` back-to-back fn() calls) / inner."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(inner):
            fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / inner)
    return statistics.median(times)


def graph_ms(fn, inner, reps):
    """CUDA: milliseconds per fn() when `inner` calls are replayed from one CUDA graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(inner):
            fn()
    return event_ms(graph.replay, reps) / inner


def copy_bandwidth_gbs(device, nbytes: int, reps: int = 10) -> float:
    """Device-to-device copy bandwidth (bytes read + written / time, median), GB/s."""
    device = torch.device(device)
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    if device.type == "cuda":
        ms = event_ms(lambda: dst.copy_(src), reps)
    else:
        ms = median_ms(lambda: dst.copy_(src), device, reps)
    del src, dst
    return 2 * nbytes / (ms * 1e-3) / 1e9


def git_commit(repo_dir: str) -> dict:
    """HEAD commit and whether tracked files differ from it ("unknown" without git)."""
    def run(*args):
        return subprocess.run(["git", *args], cwd=repo_dir, capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()
    try:
        head = run("rev-parse", "HEAD")
    except (OSError, subprocess.SubprocessError):
        return {"commit": "unknown", "dirty": None}
    try:
        dirty = bool(run("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.SubprocessError):
        dirty = None
    return {"commit": head, "dirty": dirty}


def provenance(device) -> dict:
    """GPU/CPU name, library versions, CUDA version, UTC date, command line, git commit."""
    device = torch.device(device)
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    try:
        import transformers

        transformers_version = transformers.__version__
    except ImportError:
        transformers_version = None
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else \
        f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"
    return {
        "device": name,
        "torch": torch.__version__, "triton": triton_version, "transformers": transformers_version,
        "cuda": torch.version.cuda,
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "git": git_commit(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
        "python": platform.python_version(),
    }
