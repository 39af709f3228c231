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
    prompt (OpenAI's default). temperature 0 = greedy; top_k 0 and top_p 1.0 disable those filters;
    seed None draws a fresh seed per generation (from the OS, not from torch's global RNG); a
    seeded request reproduces its tokens when it runs alone and its blocks are the same (the cost
    model picks AR or a chain length from block times measured on the machine: `adaptive=False`
    fixes them); in a batch the draws of later tokens are shared with the other requests (seeded
    by the batch's first request). Each request is distributed exactly as the target's whatever
    the seed.
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

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
