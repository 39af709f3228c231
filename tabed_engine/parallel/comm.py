"""The tensor-parallel group and its collectives: the machine rule on NVLink multicast, the
process group (gloo on the CPU, NCCL on GPUs) and the three collectives the sharded target
runs: `all_reduce` (row-parallel outputs, the vocab-parallel embedding), `gather_last` (the
vocab-parallel logits) and nothing else.

Every rank must pick the same token, so every collective must give every rank bitwise the
same result: gloo's and NCCL's all-reduce compute each element's sum once and hand the same
bytes to every rank (ring and tree alike), and a gather only moves bytes.
"""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

# NVLink multicast (NVLS) stays off on these machines: set in every process the engine starts
# (the user's process before its workers are spawned, and again in each worker's entry point)
NVLS_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def nvls_off(env: Optional[dict] = None) -> dict:
    """Set the NVLS-off variables in `env` (default: this process's environment), overriding
    any other value; returns `env`."""
    env = os.environ if env is None else env
    env.update(NVLS_OFF)
    return env


def free_port() -> int:
    """A TCP port free on this host now (the process group's rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class TPGroup:
    """One rank's view of the tensor-parallel group: its rank, the degree, the backend and the
    torch.distributed group handle (None: the default group)."""

    rank: int
    world: int
    backend: str = "gloo"
    group: Optional[object] = None

    def __post_init__(self):
        if not 0 <= self.rank < self.world:
            raise ValueError(f"rank {self.rank} is outside a group of {self.world}")


def init_group(rank: int, world: int, device: torch.device, addr: str, port: int,
               timeout_s: float) -> TPGroup:
    """Join the default process group (NCCL for a CUDA device, gloo otherwise) at
    tcp://addr:port. `timeout_s` bounds every collective (a peer that died fails the call
    instead of hanging it)."""
    nvls_off()
    backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs = {}
    if backend == "nccl":
        kwargs["device_id"] = device       # eager NCCL init, bound to this rank's GPU
    dist.init_process_group(backend, init_method=f"tcp://{addr}:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s), **kwargs)
    return TPGroup(rank, world, backend)


def destroy_group():
    """Leave the default process group (a no-op when none)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def all_reduce(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """The sum of `x` over the group, in place (x must be contiguous); every rank gets the
    same bytes. The one entry point for every reduction of the sharded target, so a
    low-latency path (a one-shot all-reduce over peer-mapped memory inside the CUDA graphs,
    chosen by message size) can sit beside NCCL here; today: the process group's all-reduce
    (NCCL on GPUs, capturable in CUDA graphs; gloo on the CPU)."""
    if tp.world == 1:
        return x
    dist.all_reduce(x, group=tp.group)
    return x


# torch >= 2.10 names it all_gather_single (all_gather_into_tensor is its deprecated alias)
_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def gather_last(x: torch.Tensor, tp: TPGroup, size: int) -> torch.Tensor:
    """Every rank's `x` [..., n] (equal shapes) concatenated in rank order along the last
    dim, cut to its first `size` columns (the padding of the last shard dropped):
    [..., size], contiguous, the same bytes on every rank."""
    if tp.world == 1:
        return x[..., :size].contiguous()
    x = x.contiguous()
    flat = x.new_empty(tp.world * x.numel())
    _gather_flat(flat, x.reshape(-1), group=tp.group)                # [world * numel], rank order
    out = flat.view(tp.world, *x.shape).movedim(0, -2).reshape(*x.shape[:-1], -1)   # [..., world * n]
    return out if out.shape[-1] == size else out[..., :size].contiguous()
