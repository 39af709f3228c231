"""The user-facing sampling parameters and the small validators every config uses."""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from functools import partial
from typing import Optional


def check_int(name: str, value, low: int) -> int:
    """`value` as an int >= low; bools and floats are refused (True is not a token count)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value}")
    return int(value)


def check_real(name: str, value) -> float:
    """`value` as a finite float (NaN or inf would silently decode garbage)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return float(value)


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens. max_new_tokens None = as many as the engine's cache holds after the
    prompt (OpenAI's default). temperature 0 = greedy; top_k 0 and top_p 1.0 disable those filters.
    Each request is distributed exactly as the target's whatever the seed.

    seed: a sampled request with a seed draws its token at position p (its token index, the
    prompt counted) as argmax(log p_filtered + Gumbel noise hashed from (seed, p, token)), and
    the draft proposes with the same noise (a Gumbel coupling, `speculation/coupling.py`): its
    tokens depend only on the prompt, the models and the seed, the same alone or in any batch,
    with or without the draft, chain or tree, whatever the cost model picks. That is what a seed
    is for, so it is the default; the price is acceptance: the draft's token is accepted only
    where it equals the target's own draw, a little less often than rejection sampling accepts
    (benchmarks/results/coupling_acceptance_cpu.md). reproducible=False gives a seeded request
    rejection sampling instead (more drafts accepted, reproducible only alone with the same blocks:
    `adaptive=False` fixes them; in a batch its draws come from the batch's first request's seed).
    seed None draws a fresh seed per generation (from the OS, not from torch's global RNG) and
    samples by rejection sampling. Greedy requests ignore both.
    stop: strings that end the generation (the text ends before the first one; the tokens up
    to the one that completed it are kept). stop_token_ids: tokens that end it like EOS does.
    stop_at_eos=False decodes past EOS (ignore_eos).

    Frozen and validated once here: the engine never re-checks a params object it was given.
    Derive variants with `dataclasses.replace(sp, seed=1)`."""

    max_new_tokens: Optional[int] = 128
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: Optional[int] = None
    stop_at_eos: bool = True
    stop: tuple = ()
    stop_token_ids: tuple = ()
    reproducible: bool = True

    def __post_init__(self):
        fix = partial(object.__setattr__, self)   # frozen: normalise numpy scalars to int/float
        if self.max_new_tokens is not None:
            fix("max_new_tokens", check_int("max_new_tokens", self.max_new_tokens, 1))
        fix("temperature", check_real("temperature", self.temperature))
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        fix("top_k", check_int("top_k", self.top_k, 0))
        fix("top_p", check_real("top_p", self.top_p))
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.seed is not None:
            fix("seed", check_int("seed", self.seed, 0))
            if self.seed >= 2 ** 64:
                raise ValueError(f"seed must be < 2**64, got {self.seed}")
        if not isinstance(self.stop_at_eos, bool):
            raise TypeError(f"stop_at_eos must be a bool, got {type(self.stop_at_eos).__name__}")
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, (list, tuple)) or not all(isinstance(x, str) and x for x in stop):
            raise TypeError(f"stop must be a string or a list of non-empty strings, got {self.stop!r}")
        fix("stop", tuple(stop))
        ids = self.stop_token_ids
        if not isinstance(ids, (list, tuple)):
            raise TypeError(f"stop_token_ids must be a list of token ids, got {type(ids).__name__}")
        fix("stop_token_ids", tuple(check_int("stop_token_ids item", t, 0) for t in ids))
        if not isinstance(self.reproducible, bool):
            raise TypeError(f"reproducible must be a bool, got {type(self.reproducible).__name__}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def coupled(self) -> bool:
        """Whether tokens are drawn by the seeded Gumbel coupling (sampled, seeded, reproducible)."""
        return self.seed is not None and self.reproducible and not self.greedy
