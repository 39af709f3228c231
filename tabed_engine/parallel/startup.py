"""Starting a tensor-parallel engine: the degree checked before anything loads, the workers
started, the process group joined, every rank's shard loaded (`from_pretrained_tp`); and a
worker's life (`run_worker`: the same start-up, then `follow`ing rank 0's messages, which
parallel/spmd.py describes)."""
from __future__ import annotations

import os
from functools import partial
from typing import Optional

import torch

from tabed_engine.engine.engine import Engine
from tabed_engine.engine.request import Request
from tabed_engine.models.loader import load_lvlm, random_lvlm, read_config
from tabed_engine.models.registry import family_of
from tabed_engine.parallel.comm import TPGroup, destroy_group, free_port, init_group, nvls_off
from tabed_engine.parallel.load import load_shard
from tabed_engine.parallel.shard import check_degree
from tabed_engine.parallel.spmd import (COLLECTIVE_TIMEOUT_S, START_TIMEOUT_S, Spmd, TensorParallelEngine,
                                        WorkerEngine, picklable)
from tabed_engine.parallel.workers import ParentLink, WorkerPool


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank's device: cuda:(base + rank) on GPUs, the CPU otherwise."""
    return torch.device("cuda", (device.index or 0) + rank) if device.type == "cuda" else device


def from_pretrained_tp(target_dir: str, draft_dir: Optional[str], device: torch.device, dtype, log, n, kwargs,
                       random_weights: bool = False):
    """`Engine.from_pretrained(..., tensor_parallel=n)`: the degree checked before anything loads,
    n - 1 workers started, the process group joined, every rank's shard loaded (drawn at random
    with `random_weights`: `loader.random_lvlm`); returns rank 0's `TensorParallelEngine`. Any
    failure stops the workers before it is raised."""
    import torch.distributed as dist

    raw = read_config(target_dir)
    cfg = family_of(raw, repr(target_dir)).lm_config(raw)
    check_degree(n, cfg.num_heads, cfg.num_kv_heads, device)
    if dist.is_initialized():
        raise ValueError("torch.distributed is already initialised in this process (another tensor-parallel "
                         "engine still open? close() it first): a tensor-parallel engine starts its own process "
                         "group, one at a time per process (see docs/parallel.md)")
    sent = {k: v for k, v in kwargs.items() if k != "captioner"}   # captions are made on rank 0
    if not picklable(sent):
        raise ValueError("the engine's options must be picklable to reach the tensor-parallel workers "
                         "(a draft_processor given by hand?)")
    nvls_off()
    port = free_port()
    spec = dict(world=n, port=port, target_dir=target_dir, draft_dir=draft_dir, device=str(device),
                dtype=dtype, kwargs=sent, threads=torch.get_num_threads(), random_weights=random_weights)
    pool = WorkerPool(n, spec)
    spmd = Spmd(TPGroup(0, n), pool=pool)
    try:
        pool.recv_all("hello", START_TIMEOUT_S)
        spmd.tp = init_group(0, n, rank_device(device, 0), "127.0.0.1", port, COLLECTIVE_TIMEOUT_S)
        target, processor, draft = Engine.load_parts(target_dir, draft_dir, rank_device(device, 0), dtype, log,
                                                     kwargs, *loaders(spmd.tp, random_weights))
        engine = TensorParallelEngine(target, processor, draft=draft, device=rank_device(device, 0), dtype=dtype,
                                      spmd=spmd, **kwargs)
        pool.recv_all("ready", COLLECTIVE_TIMEOUT_S)
    except BaseException:
        pool.close()
        destroy_group()
        raise
    return engine


def loaders(tp: TPGroup, random_weights: bool):
    """(load_target, load_draft) of a rank: its shard of the target, the whole draft; drawn at
    random (`random_lvlm`) or read from the checkpoints."""
    if random_weights:
        return partial(random_lvlm, tp=tp), random_lvlm
    return partial(load_shard, tp=tp), load_lvlm


def run_worker(spec: dict, link: ParentLink):
    """A worker's life: join the group, load its shard, build its engine, follow rank 0."""
    torch.set_num_threads(spec["threads"])
    rank, n = spec["rank"], spec["world"]
    link.send(("hello", os.getpid()))
    device = rank_device(torch.device(spec["device"]), rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    tp = init_group(rank, n, device, "127.0.0.1", spec["port"], COLLECTIVE_TIMEOUT_S)
    spmd = Spmd(tp, link=link)
    kwargs = spec["kwargs"]
    target, processor, draft = Engine.load_parts(spec["target_dir"], spec["draft_dir"], device, spec["dtype"], None,
                                                 kwargs, *loaders(tp, spec["random_weights"]))
    engine = WorkerEngine(target, processor, draft=draft, device=device, dtype=spec["dtype"], spmd=spmd, **kwargs)
    link.send(("ready",))
    try:
        follow(engine, link)
    finally:
        destroy_group()


def follow(engine: WorkerEngine, link: ParentLink):
    """Apply rank 0's messages until "close" (see the module docstring)."""
    reqs: dict[str, Request] = {}
    while True:
        msg = link.recv()
        kind = msg[0]
        if kind == "close":
            return
        if kind == "step":
            for k, x in msg[1]:
                if k == "add":
                    gen = torch.Generator(device=engine.device)
                    gen.manual_seed(x.pop("seed"))
                    r = Request(**x, generator=gen, tokenizer=engine.tokenizer)
                    reqs[r.request_id] = r
                    engine.scheduler.add(r)
                else:
                    engine.scheduler.abort(x)
            outs = engine.scheduler.step()
            for o in outs:
                if o.finished:
                    reqs.pop(o.request_id, None)
            engine._spmd.record(outs)
        elif kind == "drop":
            engine.scheduler.drop([reqs.pop(i) for i in msg[1] if i in reqs])
        elif kind == "configure":
            engine.configure(**msg[1])
        elif kind == "set" and msg[1] in ("prefill_chunk", "mixed_steps", "bench_accept_schedule"):
            setattr(engine, msg[1], msg[2])
        elif kind == "runner":
            engine.runner.allocate()
            engine.runner.pending = None
            getattr(engine.runner, msg[1])(*msg[2])
        else:
            raise RuntimeError(f"unknown message {kind!r} from rank 0")
