"""What a generation returns: the tokens, the text and what happened on the way."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass
class GenerationStats:
    """What happened during one generation (times in seconds).

    `time_first_token` and `time_total` are always measured. The per-phase times
    (`time_draft`, `time_verify`, `time_ensemble`, `time_other`) are measured only with
    `Engine(timing=True)`, which synchronizes the device after every phase and so slows
    speculative decoding down; with the default they stay 0.
    """

    speculative: bool
    prompt_tokens: int = 0
    cached_tokens: int = 0            # prompt tokens whose prefill a cached prefix saved (prefix caching)
    draft_cached_tokens: int = 0      # the same for the draft's view rows, summed over the views
    new_tokens: int = 0
    target_forwards: int = 0          # decode/verify forwards after the prefill
    accepted_lengths: list[int] = field(default_factory=list)   # drafted tokens accepted per block
    weights: list[list[float]] = field(default_factory=list)    # ensemble weights per block
    # the view whose own chain the first block's view tree accepted (None: no view tree; the
    # first block then drafted the mixture with weights[0])
    view_tree_view: Optional[str] = None
    views: tuple[str, ...] = ()
    prefill_chunks: int = 0           # target forwards of the prompt's prefill (> 1: chunked prefill)
    time_queued: float = 0.0          # from add_request to the start of the request's prefill
    # from the prefill's start to the first token: with chunked prefill, the steps between its
    # chunks (the running requests' blocks) included, as in time_first_token; the draft's views
    # too, unless deferred to the request's first drafting block (`Runner.views_deferred`)
    time_prefill: float = 0.0
    time_first_token: float = 0.0     # from add_request to the first new token on the host
    time_draft: float = 0.0
    time_verify: float = 0.0
    time_ensemble: float = 0.0
    time_other: float = 0.0           # host bookkeeping between blocks (token lists, stats)
    time_total: float = 0.0

    @property
    def block_efficiency(self) -> float:
        """Tokens per target decode/verify forward (the prefill's first token excluded);
        1.0 for autoregressive decoding."""
        if self.target_forwards == 0:
            return 1.0
        return (self.new_tokens - 1) / self.target_forwards

    def as_dict(self) -> dict:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        d["block_efficiency"] = self.block_efficiency
        return d


@dataclass
class GenerationOutput:
    """One request's result: generated token ids, their decoded text, the stats, and why it
    ended: "stop" (EOS, a stop token or a stop string), "length" (max_new_tokens), "abort"
    (`Engine.abort`) or "error" (then `error` says what went wrong)."""

    token_ids: list[int]
    text: str
    stats: GenerationStats
    finish_reason: str = "length"
    error: Optional[str] = None
