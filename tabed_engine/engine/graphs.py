"""CUDA-graph capture of the engine's fixed-shape steps (draft loop, verification, AR
decode), one graph per shape key, all sharing one memory pool.

A captured function takes only tensors and must be idempotent in them (its warm-up run
executes for real before capture): inputs are copied into static buffers before each
replay and the outputs are static tensors overwritten by the next replay. An input that is
the output of another graph of the same cache (the verification logits fed to the history
update, say) is captured by reference: passing that same tensor again costs no copy.
Lengths, positions and RNG seed/offset are device tensors, so a replay needs no host sync.

Each cache warms up and captures on a stream of its own (`private_stream`): cuBLAS keeps one
workspace per (handle, stream) and a captured GEMM keeps its workspace's address, so graphs
captured on one stream (torch's default capture stream serves every capture in the process)
share a workspace, and replaying two of them at once on two streams (the target's prefill on
the main stream, the draft's vision tower beside it) would let their GEMMs race in it.

`GraphCache(emulate=True)` keeps exactly these buffer semantics but runs each function
eagerly instead of replaying a graph (any device): tests on the CPU use it to exercise the
engine's handling of static buffers (blocks queued ahead, graphs fed each other's outputs).
"""
from __future__ import annotations

import warnings
import weakref
from typing import Callable

import torch

_HELD: set = set()   # (device, stream handle) of the streams `private_stream` has handed out


def private_stream(owner, device=None) -> "torch.cuda.Stream":
    """A CUDA stream that no other holder of a `private_stream` has, kept until `owner` is
    garbage-collected. torch hands streams out round-robin from pools of 32 (per priority),
    so two `torch.cuda.Stream()` calls can return the same stream, and with it the same
    cuBLAS workspace; work that may run at the same time must not share one. Past 64 held
    streams (both pools) a held one is shared, with a warning."""
    stream = None
    for priority in (0, -1):
        for _ in range(32):
            stream = torch.cuda.Stream(device, priority=priority)
            key = (stream.device_index, stream.cuda_stream)
            if key not in _HELD:
                _HELD.add(key)
                weakref.finalize(owner, _HELD.discard, key)
                return stream
    warnings.warn("more than 64 private CUDA streams held (engines and graph caches alive at once): one is "
                  "shared, and graphs replayed at once on it may race in one cuBLAS workspace", RuntimeWarning,
                  stacklevel=2)
    return stream


class CapturedFn:
    def __init__(self, fn: Callable, inputs: dict[str, torch.Tensor], pool, static: frozenset = frozenset(),
                 capture: bool = True, stream=None, reuse: tuple = ()):
        # inputs whose storage is another graph's output (`static` data pointers) are used in
        # place; everything else gets its own buffer, a normal tensor (not an inference one:
        # a graph captured under inference mode is fed outside it too)
        with torch.inference_mode(False):
            self.inputs = {k: v if v.data_ptr() in static else v.clone() for k, v in inputs.items()}
        self.fn, self.graph = fn, None
        if capture:
            if stream is None:      # a cache passes its own; a lone graph takes one
                stream = private_stream(self)
            # warm up on the capture stream (Triton compilation, cuBLAS handles), as capture requires
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                warm = fn(**self.inputs)
            torch.cuda.current_stream().wait_stream(stream)
        else:                  # emulation: the same buffers, fn run eagerly on each call
            warm = fn(**self.inputs)
        # Outputs live OUTSIDE the shared pool: a graph captured later may be handed memory
        # that was internal to an earlier one, so an output inside the pool would be
        # overwritten when the earlier graph replays (seen: drafted tokens clobbered by the
        # verification graph). Intermediates are dead between replays and can share.
        # `reuse`: another graph's outputs, taken in order where shape, dtype and device match
        # (graphs of which at most one's outputs are live at a time)
        self.single = isinstance(warm, torch.Tensor)
        with torch.inference_mode(False):
            outputs = [reuse[i] if i < len(reuse) and (reuse[i].shape, reuse[i].dtype, reuse[i].device)
                       == (t.shape, t.dtype, t.device) else torch.empty_like(t)
                       for i, t in enumerate(self._seq(warm))]
        if capture:
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph, pool=pool, stream=stream):
                res = fn(**self.inputs)
                for buf, t in zip(outputs, self._seq(res)):
                    buf.copy_(t)
        self.outputs = outputs[0] if self.single else tuple(outputs)

    def _seq(self, out):
        return (out,) if self.single else out

    def __call__(self, inputs: dict[str, torch.Tensor]):
        for k, v in inputs.items():
            buf = self.inputs[k]
            if v.data_ptr() != buf.data_ptr() or v.shape != buf.shape or v.stride() != buf.stride():
                buf.copy_(v, non_blocking=True)
        if self.graph is not None:
            self.graph.replay()
        else:
            for buf, t in zip(self._seq(self.outputs), self._seq(self.fn(**self.inputs))):
                buf.copy_(t)
        return self.outputs


class GraphCache:
    """Lazily captured graphs by key; `run(key, fn, inputs)` captures on first use.
    `emulate`: no capture, the same static buffers around eager calls (see the module)."""

    def __init__(self, emulate: bool = False):
        self.emulate = emulate
        self.pool = None if emulate else torch.cuda.graph_pool_handle()
        self.stream = None if emulate else private_stream(self)   # warm-ups and captures
        self.graphs: dict = {}

    def run(self, key, fn: Callable, inputs: dict[str, torch.Tensor], shared: tuple = (), outputs_of=()):
        """Replay the graph of `key` on `inputs` (captured on first use). `shared`: tensors the
        caller keeps as static buffers of its own (one buffer serving several graphs), used in
        place instead of copied into the graph's own. `outputs_of`: keys of graphs whose outputs
        are never live while this one's are; the first captured lends its output buffers to a
        new graph, in order where their shapes match."""
        g = self.graphs.get(key)
        if g is None:
            static = frozenset(t.data_ptr() for c in self.graphs.values() for t in c._seq(c.outputs))
            static |= {t.data_ptr() for t in shared}
            donor = next((self.graphs[k] for k in outputs_of if k in self.graphs), None)
            reuse = () if donor is None else donor._seq(donor.outputs)
            g = self.graphs[key] = CapturedFn(fn, inputs, self.pool, static, capture=not self.emulate,
                                              stream=self.stream, reuse=reuse)
        return g(inputs)

    def __len__(self):
        return len(self.graphs)
