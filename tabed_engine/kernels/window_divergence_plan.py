"""Launch plans of `window_divergence` (its module docstring describes the modes): how V is
split over programs, the views per program and the tile sizes, from the shapes and the SM
count alone (no host sync, so the launcher runs in graph capture); the launch constants
tuned on the H200; the validation of given normalisers."""
from dataclasses import dataclass

import torch
import triton

from ._common import _MAX_SPLITS, tile_warps

# Launch constants from H200 sweeps at the engine's shapes (benchmarks/results/ensemble_ops_wd.json;
# the sweeps in benchmarks/results/kernels_backed_out.md).
# With a weight grid, by the launch's mixture rows B * P * G: (most rows, vectors per
# [G_BLOCK, columns] tile, tile elements, programs per SM). Few mixture rows leave the launch
# latency bound (small tiles, more per SM); many share each column's loads among 16 mixtures.
_GRID_TILES = ((128, 4, 1024, 4), (512, 8, 1024, 8), (None, 16, 2048, 8))
# Two launches without a grid: programs per SM, [KP + 1, columns] elements per step, warps.
_TV_PROGRAMS_PER_SM = 8
_TV_TILE = 2048
_TV_DIV_WARPS = 4
# The one-pass kernels: elements per step over the target and its views, the shortest
# chunk, warps, programs per SM. Few rows (B * P <= _KL_SPLIT_ROWS, the engine's B = 1): one
# view per program, the target read once per view, at _KL_SPLIT_TILE // 2 columns per step.
_KL_TILE = 4096
_KL_MIN_CHUNK = 1024
_KL_WARPS = 4
_KL_PROGRAMS_PER_SM = 8
_KL_SPLIT_ROWS = 16
_KL_SPLIT_TILE = 2048


def check_normalisers(p_lse, q_lse, B, K, P, device):
    """Validate optional given log-normalisers: both or neither, float32 [B, P] and
    [B, K, P] on `device`. Returns whether they are given."""
    if p_lse is None and q_lse is None:
        return False
    if p_lse is None or q_lse is None:
        raise ValueError("p_lse and q_lse are given together or not at all")
    for name, t, shape in (("p_lse", p_lse, (B, P)), ("q_lse", q_lse, (B, K, P))):
        if tuple(t.shape) != shape or t.dtype != torch.float32 or t.device != device:
            raise ValueError(f"{name} must be float32 {list(shape)} on {device}, got {t.dtype} "
                             f"{list(t.shape)} on {t.device}")
    return True


def _split(V, unit, rows, target, max_splits=_MAX_SPLITS):
    """(chunk length, number of chunks) of V: `rows * chunks` near `target` programs,
    chunks a multiple of `unit` elements and at most `max_splits` of them."""
    n_units = triton.cdiv(V, unit)
    per = max(1, (n_units * rows) // max(target, 1), triton.cdiv(n_units, max_splits))
    chunk = per * unit
    return chunk, triton.cdiv(V, chunk)


@dataclass(frozen=True)
class OnePassPlan:
    """Launch of the one-pass kernels (`_wd_kl_kernel`, `_wd_given_kernel`): grid
    (B * P, splits, groups)."""
    B: int
    K: int
    P: int
    V: int
    vec: int      # columns per 16-byte group
    kb: int       # views per program
    groups: int   # view groups per row
    chunk: int    # columns per split
    splits: int
    block: int    # columns per step
    rpt: int      # groups per thread slot and step


def one_pass_plan(B, K, P, V, *, itemsize, sms, programs=None, block=None, split_views=None):
    """`OnePassPlan` for B * P rows of K views over V columns of `itemsize`-byte logits (the
    larger of the two inputs) on `sms` SMs. Overrides: `programs` the launch's target
    program count, `block` the columns per step, `split_views` one view per program."""
    R = B * P
    if split_views is None:
        split_views = K > 1 and R <= _KL_SPLIT_ROWS
    kb = 1 if split_views else K
    groups = K // kb
    tile = _KL_SPLIT_TILE if split_views else _KL_TILE
    step = block or max(16, 1 << ((tile // (kb + 1)).bit_length() - 1))
    if programs is None:
        programs = _KL_PROGRAMS_PER_SM * sms
    chunk, ns = _split(V, max(step, _KL_MIN_CHUNK), R * groups, programs)
    block = max(16, min(step, triton.next_power_of_2(chunk)))
    vec = 16 // itemsize
    return OnePassPlan(B=B, K=K, P=P, V=V, vec=vec, kb=kb, groups=groups, chunk=chunk, splits=ns, block=block,
                       rpt=max(1, block // (vec * 32 * _KL_WARPS)))


@dataclass(frozen=True)
class TwoPassPlan:
    """Launch of the stats and divergence kernels: grids (B * P, splits1) and
    (B * P, splits2, g_chunks)."""
    B: int
    K: int
    P: int
    V: int
    G: int
    vec: int
    block1: int     # columns per step of both launches' view tiles
    chunk1: int
    splits1: int
    rpt1: int
    warps1: int
    g_block: int    # weight vectors per grid chunk
    block_g: int    # columns per step of the mixtures
    g_chunks: int
    chunk2: int
    splits2: int
    block2: int     # columns per step of the divergences
    warps2: int


def two_pass_plan(B, K, P, V, G, *, itemsize, sms, programs=None, max_splits=_MAX_SPLITS):
    """`TwoPassPlan` for B * P rows of K views over V columns and a grid of G weight vectors
    (0: none). Overrides: `programs` the launches' target program count, `max_splits`."""
    R = B * P
    has_grid = G > 0
    if has_grid:
        g_max, g_tile, per_sm = next(t[1:] for t in _GRID_TILES if t[0] is None or R * G <= t[0])
    else:
        per_sm = _TV_PROGRAMS_PER_SM
    if programs is None:
        programs = per_sm * sms
    KP = triton.next_power_of_2(K)
    # [KP, BLOCKV] tiles of the K views plus a BLOCKV target row: ~2-4K elements per step.
    block1 = max(16, min(triton.next_power_of_2(V), (2048 if has_grid else _TV_TILE) // KP))
    ch1, ns1 = _split(V, block1, R, programs, max_splits)
    if has_grid:
        # Each thread holds one V column of a [G_BLOCK, BLOCKG] tile for all G_BLOCK weight
        # vectors: the per-column work (K exps, loads) is shared by G_BLOCK mixtures.
        # Registers per thread ~ G_BLOCK * (K + 3): 16 rows up to K = 4.
        g_block = min(g_max, triton.next_power_of_2(G), 1 << (max(1, 96 // (K + 2)).bit_length() - 1))
        block_g = g_tile // g_block
        g_chunks = triton.cdiv(G, g_block)
        ch2, ns2 = _split(V, block_g, R * g_chunks, programs, max_splits)
    else:
        g_block, block_g, g_chunks = 1, 16, 1
        ch2, ns2 = _split(V, block1, R, programs, max_splits)
    vec = min(16 // itemsize, block1)
    warps1 = tile_warps((KP + 1) * block1)
    return TwoPassPlan(B=B, K=K, P=P, V=V, G=G, vec=vec, block1=block1, chunk1=ch1, splits1=ns1,
                       rpt1=max(1, block1 // (vec * 32 * warps1)), warps1=warps1, g_block=g_block, block_g=block_g,
                       g_chunks=g_chunks, chunk2=ch2, splits2=ns2,
                       block2=max(16, min(block1, triton.next_power_of_2(ch2))),
                       warps2=4 if has_grid else _TV_DIV_WARPS)

