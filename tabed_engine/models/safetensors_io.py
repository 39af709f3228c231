"""Reading safetensors checkpoints: headers validated against the file sizes, sharded
indexes, and streaming each tensor's bytes straight into its destination.

Loading streams: every file's header is read and matched first (a bad file fails before any
weight moves), then each shard is read in fixed-size chunks and every checkpoint tensor's bytes
go straight into its slice of a parameter, converted on the device when the dtypes differ. Host
memory holds a few chunks, never the state dict.
"""
from __future__ import annotations

import json
import math
import os
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Optional

import torch

_WEIGHTS = "model.safetensors"
_INDEX = "model.safetensors.index.json"
FIX = "re-download the checkpoint or write it again with save_pretrained"
_FIX = FIX


def read_json(file: str) -> dict:
    """A JSON object from `file`; ValueError naming the file when it is unreadable or not an object."""
    try:
        with open(file, encoding="utf-8") as f:
            out = json.load(f)
    except OSError as e:
        raise ValueError(f"cannot read {file}: {e}; check that it exists and is readable") from e
    except ValueError as e:   # JSONDecodeError, UnicodeDecodeError
        raise ValueError(f"{file} is not valid JSON ({e}); {_FIX}") from e
    if not isinstance(out, dict):
        raise ValueError(f"{file} holds a JSON {type(out).__name__}, expected an object; {_FIX}")
    return out


# ---------------------------------------------------------------- safetensors files

_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
           "U8": torch.uint8, "BOOL": torch.bool}
_DTYPES.update({k: getattr(torch, v) for k, v in (("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2"))
                if hasattr(torch, v)})


@dataclass(frozen=True)
class TensorEntry:
    """One tensor a safetensors file declares; begin/end are absolute byte offsets in the file."""

    file: str
    name: str
    dtype: torch.dtype
    shape: tuple
    begin: int
    end: int


def read_header(file: str) -> list[TensorEntry]:
    """The tensors of one safetensors file, in file order, checked against the file's size
    (a truncated or empty file fails here, before any data is read)."""
    try:
        size = os.path.getsize(file)
        with open(file, "rb") as f:
            head = f.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else -1
            if n < 2 or n > min(size - 8, 1 << 28):
                raise ValueError(f"{file} is {'empty' if size == 0 else 'truncated or not a safetensors file'} "
                                 f"({size} bytes); {_FIX}")
            raw = f.read(n)
    except OSError as e:
        raise ValueError(f"cannot read checkpoint file {file}: {e}; check that it exists and is readable") from e
    try:
        header = json.loads(raw)
        entries = []
        for name, info in header.items():
            if name == "__metadata__":
                continue
            dtype = _DTYPES.get(info["dtype"])
            if dtype is None:
                raise ValueError(f"tensor {name!r} has unsupported dtype {info['dtype']!r}")
            shape = tuple(int(s) for s in info["shape"])
            b, e = (int(x) for x in info["data_offsets"])
            if b < 0 or e - b != math.prod(shape) * dtype.itemsize:
                raise ValueError(f"tensor {name!r}: data_offsets {[b, e]} do not fit shape {shape} {info['dtype']}")
            if 8 + n + e > size:
                raise ValueError(f"truncated: tensor {name!r} ends at byte {8 + n + e}, the file has {size}")
            entries.append(TensorEntry(file, name, dtype, shape, 8 + n + b, 8 + n + e))
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{file} is damaged ({e}); {_FIX}") from e
    return sorted(entries, key=lambda t: t.begin)


def weight_files(path: str) -> list[list[TensorEntry]]:
    """The headers of the checkpoint's safetensors files (one list per file), validated:
    every shard an index lists exists and holds the tensors the index places in it."""
    single, index = os.path.join(path, _WEIGHTS), os.path.join(path, _INDEX)
    if os.path.isfile(single):
        return [read_header(single)]
    if not os.path.isfile(index):
        raise ValueError(f"no {_WEIGHTS} or {_INDEX} in {path!r} (only safetensors checkpoints load)")
    weight_map = read_json(index).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map or \
            not all(isinstance(v, str) for v in weight_map.values()):
        raise ValueError(f"{index} has no weight_map of tensor names to file names; {_FIX}")
    out = []
    for shard in sorted(set(weight_map.values())):
        file = os.path.join(path, shard)
        if not os.path.isfile(file):
            raise ValueError(f"checkpoint shard {file} listed in {index} is missing; {_FIX}")
        entries = read_header(file)
        held = {e.name for e in entries}
        absent = [k for k, v in weight_map.items() if v == shard and k not in held]
        if absent:
            raise ValueError(f"{index} places tensor {absent[0]!r} in {file}, which does not hold it "
                             f"({len(absent)} such tensors); {_FIX}")
        out.append(entries)
    return out


def read_state_dict(path: str) -> dict[str, torch.Tensor]:
    """All tensors of a (possibly sharded) safetensors checkpoint, on the CPU, through
    safetensors' own reader. Not on the engine's path (that streams); kept for tools/tests."""
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for entries in weight_files(path):   # validates every file first
        out.update(load_file(entries[0].file) if entries else {})
    return out


# ---------------------------------------------------------------- streaming copies

@dataclass(frozen=True)
class StreamPlan:
    """How a file is streamed: `depth` host buffers of `chunk_bytes` each, filled by `depth`
    reader threads ahead of the copies. Pinned on CUDA so host-to-device copies run async.
    direct: host destinations of the file's own dtype are read into straight, no buffer."""

    chunk_bytes: int
    depth: int
    pinned: bool
    direct: bool = False


def stream_plan(device: torch.device, cpus: Optional[int] = None) -> StreamPlan:
    """CUDA: up to 8 readers x 32 MiB pinned (256 MiB, kept by torch's pinned-memory cache):
    one thread copies from the page cache at a few GB/s, a PCIe 5 DMA takes ~50, so the reads
    run in parallel. CPU: 2 x 8 MiB."""
    if device.type == "cuda":
        return StreamPlan(32 << 20, max(2, min(8, (cpus or os.cpu_count() or 2) // 2)), True)
    return StreamPlan(8 << 20, 2, False, direct=True)


def _pread_into(fd: int, buf: memoryview, offset: int, file: str):
    got = 0
    while got < len(buf):
        if hasattr(os, "preadv"):
            n = os.preadv(fd, [buf[got:]], offset + got)
        else:   # no preadv (Windows): a private handle per read, seek + readinto
            with open(file, "rb", buffering=0) as f:
                f.seek(offset + got)
                n = f.readinto(buf[got:]) or 0
        if n <= 0:
            raise ValueError(f"{file} ended at byte {offset + got} while reading its tensors "
                             f"(truncated while loading?); {_FIX}")
        got += n


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """The tensor's own bytes as a flat uint8 view (writes land in `t`)."""
    if not t.is_contiguous():
        raise RuntimeError("loader destinations are contiguous rows of a parameter")
    return t.detach().reshape(-1).view(torch.uint8)


@torch.no_grad()
def stream_file(entries: list[TensorEntry], dests: list[Optional[torch.Tensor]], device: torch.device,
                plan: StreamPlan, pool: Optional[ThreadPoolExecutor] = None):
    """Copy each entry's bytes from its file into `dests[i]` (None: skip), converting dtype on
    the device; the file is read once, in `plan.chunk_bytes` pieces, up to `plan.depth` ahead
    (by `pool`'s threads, one made for the call when None)."""
    if pool is None:
        with ThreadPoolExecutor(plan.depth) as own:
            return stream_file(entries, dests, device, plan, own)
    work = [(e, d) for e, d in zip(entries, dests) if d is not None and e.end > e.begin]
    if plan.direct:
        straight = [(e, d) for e, d in work if d.device.type == "cpu" and d.dtype == e.dtype]
        if straight:
            fd = os.open(straight[0][0].file, os.O_RDONLY)
            try:
                for e, d in straight:
                    _pread_into(fd, memoryview(_bytes(d).numpy()), e.begin, e.file)
            finally:
                os.close(fd)
            work = [(e, d) for e, d in work if not (d.device.type == "cpu" and d.dtype == e.dtype)]
    if not work:
        return
    file = work[0][0].file
    lo, hi = work[0][0].begin, max(e.end for e, _ in work)   # entries in file order (read_header)
    nchunks = -(-(hi - lo) // plan.chunk_bytes)
    slots = [torch.empty(min(plan.chunk_bytes, hi - lo), dtype=torch.uint8, pin_memory=plan.pinned)
             for _ in range(min(plan.depth, nchunks))]
    done: list = [None] * len(slots)   # CUDA event after the copies out of each slot
    stream = torch.cuda.current_stream(device) if device.type == "cuda" else None

    def read(i: int):
        s = i % len(slots)
        if done[s] is not None:
            done[s].synchronize()
        off = lo + i * plan.chunk_bytes
        n = min(plan.chunk_bytes, hi - off)
        _pread_into(fd, memoryview(slots[s].numpy())[:n], off, file)
        return s, off, n

    fd = os.open(file, os.O_RDONLY)
    ahead = deque()
    try:
        ahead.extend(pool.submit(read, i) for i in range(len(slots)))
        first, staged = 0, {}   # first entry not fully copied; entry -> its device bytes
        for i in range(nchunks):
            s, off, n = ahead.popleft().result()
            end = off + n
            k = first
            while k < len(work) and work[k][0].begin < end:
                e, dest = work[k]
                a, b = max(e.begin, off), min(e.end, end)
                if a < b:
                    if k not in staged:   # same dtype: straight into the parameter's bytes
                        staged[k] = _bytes(dest) if e.dtype == dest.dtype else \
                            torch.empty(e.end - e.begin, dtype=torch.uint8, device=device)
                    staged[k][a - e.begin:b - e.begin].copy_(slots[s][a - off:b - off], non_blocking=True)
                    if b == e.end:
                        buf = staged.pop(k)
                        if e.dtype != dest.dtype:
                            dest.copy_(buf.view(e.dtype).view(e.shape))
                k += 1
            while first < len(work) and work[first][0].end <= end:
                first += 1
            if stream is not None:
                done[s] = torch.cuda.Event()
                done[s].record(stream)
            if i + len(slots) < nchunks:
                ahead.append(pool.submit(read, i + len(slots)))
    finally:
        for f in ahead:   # no reader may touch the fd or a slot after this returns
            f.cancel() or f.exception()
        os.close(fd)
