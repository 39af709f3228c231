"""Seeded sampling that does not depend on speculation or batching (Gumbel coupling).

A seeded request's token at absolute position p (its token index, the prompt counted) is

    argmax_v( log p_v + G(seed, p, v) ),   G ~ Gumbel(0, 1) i.i.d. over v

p the target's processed distribution (temperature, top-k / top-p: filtered tokens -inf), G a
counter-based hash of (seed, position, token id) computed on the device. That is an exact
sample of p (the Gumbel-max trick), and it depends only on the request's own prefix and seed:
not on the rows it shares a batch with, not on the draft, not on the block shape.

The draft proposes with the same noise over its mixture q, argmax_v(log q_v + G(seed, p, v))
(drafter-invariant coupling, Daliri, Musco & Suresh 2024); the verification accepts a drafted
token iff it equals the target's own Gumbel-argmax there and emits the target's token at the
first mismatch (a tree: the child equal to it). Whatever the draft proposes, every emitted
token is the target's Gumbel-argmax given the tokens before it: exactly what autoregressive
decoding with that seed emits, so the output is lossless by construction. The draft agrees
with probability >= (1 - TV(p, q)) / (1 + TV(p, q)), below rejection sampling's 1 - TV
(benchmarks/results/coupling_acceptance_cpu.md measures the cost), which is why unseeded
requests keep rejection sampling.

Everything here is plain torch on device tensors (seeds and positions included): no host
sync, no generator state, safe inside a captured CUDA graph.
"""
from __future__ import annotations

import torch

# splitmix64 constants as int64 (torch integer arithmetic wraps modulo 2^64)
_M1, _M2, _GOLD = -4658895280553007687, -7723592293110705685, -7046029254386353131
_GOLD2 = 0x632BE59BD9B4E019        # a second odd constant: the token counter's stride
_SEED_SALT = 0x2545F4914F6CDD1D     # keeps a seed's key away from small raw counters


def _shr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def mix64(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer on int64 tensors: a bijection of 64-bit words whose every output
    bit depends on every input bit."""
    z = (z ^ _shr(z, 30)) * _M1
    z = (z ^ _shr(z, 27)) * _M2
    return z ^ _shr(z, 31)


def seed_value(seed: int) -> int:
    """A request's seed (an int in [0, 2^64)) as the int64 the device tensors hold (the same
    64 bits)."""
    return seed - (1 << 64) if seed >= 1 << 63 else seed


def gumbel(seed: torch.Tensor, pos: torch.Tensor, V: int) -> torch.Tensor:
    """Gumbel(0, 1) noise G(seed, pos, v) for v in [0, V), float32 [*pos.shape, V].

    seed: int64 tensor broadcastable against pos (e.g. [R, 1] with pos [R, T]); pos: int64
    absolute positions. A pure function of the values (counter-based): the same numbers for a
    (seed, position) on any device, in any batch, in any call. A row key
    mix64(mix64(seed ^ salt) + pos * gold) starts a splitmix64 stream over the token ids; the top
    32 bits of each word give w in (0, 1) and G = -log(-log1p(-w)), which keeps the upper tail
    (where the argmax lives) to G ~ 22.9 instead of float32's 1 - 2^-24 limit of 16.6."""
    key = mix64(mix64(seed ^ _SEED_SALT) + pos * _GOLD)                        # [...]
    v = torch.arange(1, V + 1, device=pos.device, dtype=torch.int64)
    z = mix64(key[..., None] + v * _GOLD2)                                    # [..., V]
    w = (_shr(z, 32).float() + 0.5) * 2.0 ** -32
    # float32 rounds the largest words' w to 1: log1p(-1) = -inf would give G = -inf there, a
    # token that could never win (a bias of 2^-25 per token); clamped below 1 instead
    w = w.clamp(max=1.0 - 2.0 ** -24)
    return -torch.log(-torch.log1p(-w))


def _rows(t: torch.Tensor, dims: int) -> torch.Tensor:
    """A per-row tensor [R] shaped [R, 1, ...] to broadcast against a [R, ...] of `dims` dims."""
    return t.view((-1,) + (1,) * (dims - 1))


def coupled_scores(logits: torch.Tensor, probs: torch.Tensor, temperature, seed: torch.Tensor,
                   pos: torch.Tensor) -> torch.Tensor:
    """The target's perturbed scores; their argmax is a seeded row's token.

    logits: [R, ..., V] target logits; probs: the same shape, the processed distribution
    (`sampling.target_probs`: zero where top-k / top-p filter, one-hot on greedy rows);
    temperature: a float or [R] float32; seed: [R] int64; pos: [R, ...] int64, the absolute
    position each row's logits predict. Returns float32 [R, ..., V]: logits / T + G where
    probs > 0, -inf elsewhere (log p differs by a per-row constant: the same argmax, and the
    kept logits do not depend on the renormalisation a batch's top-p adds to other rows)."""
    x = logits.float()
    if isinstance(temperature, torch.Tensor):
        x = x / _rows(temperature, x.dim())
    else:
        x = x / temperature
    x = x.masked_fill(probs <= 0, float("-inf"))
    return x + gumbel(_rows(seed, pos.dim()), pos, x.shape[-1])


# below any kept token's log q + G (log q >= -104 in float32, G in [-3.2, 22.9]) and below
# CHAIN_BONUS, so a tree's coupled chain still ranks first
FILTERED_PENALTY = 256.0


def coupled_proposals(q: torch.Tensor, seed: torch.Tensor, pos: torch.Tensor, k: int = 1,
                      keep: torch.Tensor | None = None):
    """The draft's proposals under the shared noise: the top k of log q + G(seed, pos).

    q: [R, ..., V] draft mixture probabilities, seed [R] int64, pos [R] int64 (one position per
    row: a tree's frontier nodes of one request sit at the same depth). k = 1 is the coupled
    draft token (the chain); k > 1 adds the next guesses (a tree node's children, distinct).
    keep: optional bool [R, ..., V], the tokens the request's top-k / top-p keep (the draft's
    estimate of the target's filter): the others score FILTERED_PENALTY lower, so the first
    proposal is a kept token and a tree's further children are kept ones first, then the best
    of the rest (not arbitrary ids: the draft's kept set can be narrower than the target's).
    Returns (ids [R, ..., k] int64, their perturbed scores log q + G [R, ..., k] float32)."""
    logq = torch.log(q.float())
    g = gumbel(seed, pos, q.shape[-1])                                         # [R, V]
    g = g.view(g.shape[:1] + (1,) * (q.dim() - 2) + g.shape[1:])
    scores = logq + g
    if keep is not None:
        scores = torch.where(keep, scores, scores - FILTERED_PENALTY)
    top = scores.topk(k, dim=-1)
    return top.indices, top.values


CHAIN_BONUS = 1000.0


def tree_child_scores(perturbed: torch.Tensor) -> torch.Tensor:
    """What a coupled tree's frontier ranks children by (their cumulative sum picks the nodes
    expanded): the perturbed score, plus CHAIN_BONUS for each node's first child. A path's
    cumulative score then counts its first children before anything else, so the coupled
    chain (every node's first child: the proposal a chain would make) is always expanded, and
    the other nodes are the paths that leave it least, likeliest under the shared noise first;
    ranked by log q alone the chain was dropped (a draft equal to the target then missed
    tokens it had proposed). perturbed: [..., k] in rank order; the bonus (x depth <= 64)
    stays far above the perturbed scores' spread and within float32's exact steps."""
    bonus = torch.zeros_like(perturbed)
    bonus[..., 0] = CHAIN_BONUS
    return perturbed + bonus
