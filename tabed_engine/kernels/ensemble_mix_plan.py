"""Launch plans of `ensemble_mix` (a function of the shapes: testable without a GPU) and the
tuning constants they read."""
from dataclasses import dataclass

import torch
import triton

from ._common import ONE_STEP, chunk_block, chunking, n_vsplit, tile_warps


_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Launch constants, chosen by H200 sweeps at the engine's shapes (benchmarks/results/
# ensemble_ops.json; the sweeps in benchmarks/results/kernels_backed_out.md):
_TILE = 2048                     # pass 1: elements per step over its views
_PER_THREAD = 16                 # pass 1: elements per thread and step (sets the warps)
_PROGRAMS_PER_SM = 4             # greedy K = 1, and pass 1 one view row per program
_VIEWS_PROGRAMS_PER_SM = 8       # greedy K > 1 with the mixture row
_SAMPLE_PROGRAMS_PER_SM = 16     # sampling, K views per program
_CHUNK_TILE = 2048               # pass 2: elements per step over the K views
_CHUNK_PER_THREAD = 16
# Sampling's draw order (`_slot_draw`): period P and slot width SW in columns, P // SW slots.
_DRAW_PERIOD = 512
_DRAW_WIDTH = 16
_DRAW_WARPS = 4
_DRAW_TILE = 4096                # slot sums loaded in one tile (V = 32064: 32 chunks x 4 views x 32)


@dataclass(frozen=True)
class MixPlan:
    """How `ensemble_mix` launches for one shape (`mix_plan`)."""
    B: int
    K: int
    V: int
    greedy: bool
    write_mix: bool   # the mixture row is written
    rowwise: bool     # pass 1: one view row per program, grid (B * K, S)
    picked: bool      # greedy, one view: pass 1 finds the argmax
    cert: bool        # greedy K > 1 without the mixture row: the certificate may skip pass 2
    splits: int       # S, chunks per request
    chunk: int        # columns per chunk
    block1: int       # pass 1: columns per view and step
    block2: int       # pass 2: columns per step
    vec: int          # columns per 16-byte group
    rpt: int          # pass 1: groups per thread slot and step
    warps1: int
    warps2: int
    n_prog: int       # pass-2 programs per request
    period: int       # draw order: P (sampling; greedy: SW)
    width: int        # draw order: SW
    sb: int           # draw: chunks' slot sums per tile
    nb: int           # draw: periods per step of its walk
    evict1: str       # pass 1's loads when a second pass reads the logits again

    @property
    def rows1(self):
        """Pass 1's rows (the grid's first dimension)."""
        return self.B * self.K if self.rowwise else self.B


def mix_plan(B, K, V, *, itemsize, greedy, write_mix, sms, splits=None, tile=_TILE, one_step=ONE_STEP,
             period=_DRAW_PERIOD, width=_DRAW_WIDTH, draw_tile=_DRAW_TILE, certify=True):
    """The launch plan of `ensemble_mix` for B requests of K views over V columns of
    `itemsize`-byte logits on a device of `sms` SMs. The keywords after `sms` override the
    launch constants (tests use them to split small vocabularies: `splits` requested chunks,
    `tile` pass-1 elements per step, `one_step` the longest chunk read in one step, the draw
    order's `period` and `width`, `draw_tile`; `certify=False` always runs pass 2)."""
    KP = triton.next_power_of_2(K)
    greedy = bool(greedy)
    rowwise = K > 1 and not write_mix
    picked = greedy and K == 1
    if greedy:
        per_sm = _PROGRAMS_PER_SM if K == 1 or rowwise else _VIEWS_PROGRAMS_PER_SM
        period = width
    else:
        per_sm = _PROGRAMS_PER_SM if rowwise else _SAMPLE_PROGRAMS_PER_SM
        # V <= period: natural order whatever P; chunks and pass-1 steps are multiples of it
        period = min(period, max(width, triton.next_power_of_2(V)))
    rows1 = B * K if rowwise else B
    if splits is None:
        splits = n_vsplit(rows1, V, per_sm * sms)
    S, chunk = chunking(V, splits, period)
    kp1 = 1 if rowwise else KP
    block1 = max(chunk_block(chunk, tile // kp1, one_step), period)
    block2 = max(chunk_block(chunk, _CHUNK_TILE // KP, one_step), period)
    vec = 16 // itemsize
    warps1 = tile_warps(kp1 * block1, _PER_THREAD)
    rpt = max(1, min(block1 // (vec * 32 * warps1), block1 // period))   # sampling: a slot in one draw slot
    n_slots = 1 if greedy else period // width
    if write_mix:
        n_prog = S + (not greedy)          # every chunk, and sampling's draw
    else:
        n_prog = S if greedy and not picked else 1
    return MixPlan(
        B=B, K=K, V=V, greedy=greedy, write_mix=bool(write_mix), rowwise=rowwise, picked=picked,
        cert=certify and greedy and not picked and not write_mix, splits=S, chunk=chunk, block1=block1,
        block2=block2, vec=vec, rpt=rpt, warps1=warps1,
        warps2=_DRAW_WARPS if n_prog == 1 and not greedy else tile_warps(KP * block2, _CHUNK_PER_THREAD),
        n_prog=n_prog, period=period, width=width,
        sb=min(triton.next_power_of_2(S), max(1, draw_tile // (KP * n_slots))),
        nb=min(triton.next_power_of_2(triton.cdiv(V, period)), max(1, 1024 // width)),
        evict1="evict_last" if write_mix or not picked else "")
