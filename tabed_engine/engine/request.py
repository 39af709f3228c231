"""One request's state (nano-vllm's `Sequence`): its prompt, sampling parameters, generated
tokens, where its rows live in the batch, what the draft rows hold, stop conditions, text
pieces for streaming and stats. The scheduler owns requests; the runner reads and updates
the fields it needs."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from tabed_engine.config import SamplingParams
from tabed_engine.engine.outputs import GenerationOutput, GenerationStats
from tabed_engine.engine.prompt import Prepared
from tabed_engine.serving.detok import Detokenizer


@dataclass
class RequestOutput:
    """What one `Engine.step()` produced for one request: the new tokens and the text piece
    they add (pieces of a request join to its final text), and when the request finished, its
    `GenerationOutput`."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    output: Optional[GenerationOutput] = None


ACCEPT_DECAY = 0.95    # per block: the acceptance estimate follows the last ~20 blocks


@dataclass(eq=False)
class Request:
    """A request from `add_request` to its end. `tokens` are the generated tokens so far;
    `slot` its row in the target batch (draft rows slot*K .. slot*K + K - 1) while it runs."""

    request_id: str
    prep: Prepared
    sp: SamplingParams
    caption: Any
    speculative: bool
    generator: torch.Generator
    tokenizer: Any
    eos_ids: frozenset
    max_new: int = 0                      # sp.max_new_tokens, or what the cache holds (None)
    view_mask: Optional[tuple] = None     # the engine's views this request mixes (None: all)
    pieces: bool = True                   # text pieces per step (generate() needs only the end)
    arrival: float = field(default_factory=time.perf_counter)
    tokens: list[int] = field(default_factory=list)
    slot: Optional[int] = None
    finish_reason: Optional[str] = None
    error: Optional[str] = None
    aborted: bool = False
    # draft rows: each view's prompt length and last prompt token, and how many generated
    # tokens their KV holds (the rows must hold all but the last two before a draft block)
    view_len: list[int] = field(default_factory=list)
    prompt_tail: list[int] = field(default_factory=list)
    draft_valid: int = 0
    # the draft's views, left by the prefill to the request's first drafting block (`Runner.views_deferred`)
    views_pending: Any = None
    blocks: int = 0                       # speculative blocks run
    # the cost model's running acceptance: drafts accepted and rejections, decayed per block
    accepted: float = 0.0
    rejected: float = 0.0
    stats: GenerationStats = None
    # text: made final a window at a time (detok); `_recent` its last characters that a stop
    # string may still start in; `_unshown` final text not yet returned as a piece
    detok: Detokenizer = None
    _n_text: int = 0                      # characters made final so far
    _recent: str = ""
    _unshown: str = ""
    _shown: list = field(default_factory=list)   # the pieces returned
    _cut: Optional[int] = None            # where a stop string cut the text
    _final: Optional[str] = None          # the final text, decoded once at the end

    def __post_init__(self):
        if self.stats is None:
            self.stats = GenerationStats(speculative=self.speculative, prompt_tokens=len(self.prep.ids))
        if self.detok is None:
            self.detok = Detokenizer(self.tokenizer)

    @property
    def _hold(self) -> int:
        """Characters of final text held back: the longest stop string less one."""
        return max((len(s) for s in self.sp.stop), default=1) - 1

    @property
    def n_prompt(self) -> int:
        return len(self.prep.ids)

    def record_block(self, n: int, depth: int):
        """A speculative block of `depth` drafted positions accepted `n` of them."""
        self.blocks += 1
        self.accepted = ACCEPT_DECAY * self.accepted + n
        self.rejected = ACCEPT_DECAY * self.rejected + (n < depth)

    @property
    def alpha(self) -> Optional[float]:
        """Running per-draft acceptance rate (None before any speculative block): drafts
        accepted over drafts verified up to and including the first rejected one."""
        total = self.accepted + self.rejected
        return self.accepted / total if total > 0 else None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def batch_key(self) -> tuple:
        """Requests of one batch share this: whether a draft runs (sampling settings may differ
        per request: `sampling.RowSampling`)."""
        return (self.speculative,)

    def append(self, new: list[int]) -> list[int]:
        """Add a block's tokens, cut exactly where decoding one token at a time would stop
        (max_new_tokens, EOS or a stop token inclusive, a stop string); sets `finish_reason`.
        Returns the tokens kept."""
        sp = self.sp
        new = new[: self.max_new - len(self.tokens)]
        for i, t in enumerate(new):
            if (sp.stop_at_eos and t in self.eos_ids) or t in sp.stop_token_ids:
                new = new[: i + 1]
                self.finish_reason = "stop"
                break
        base = len(self.tokens)
        self.tokens += new
        if sp.stop:
            # one token at a time, as the whole text's decode after each token would find it:
            # a stop string ends in the tokens' text, final or still pending (it may cross
            # tokens and blocks, never lies before the last `_hold` final characters)
            for i in range(len(new)):
                done, pending = self.detok.update(self.tokens, base + i + 1, tail=True)
                window = self._recent + done + pending
                cut = min((j for j in (window.find(s) for s in sp.stop) if j >= 0), default=-1)
                if cut >= 0:
                    self._cut = self._n_text - len(self._recent) + cut
                    del self.tokens[base + i + 1:]
                    new = new[: i + 1]
                    self.finish_reason = "stop"
                    break
                self._take(done)
        if self.finish_reason is None and len(self.tokens) >= self.max_new:
            self.finish_reason = "length"
        return new

    def _take(self, done: str):
        """Account for text the detokenizer made final."""
        if not done:
            return
        self._n_text += len(done)
        hold = self._hold
        self._recent = (self._recent + done)[-hold:] if hold else ""
        if self.pieces:
            self._unshown += done

    def text(self) -> str:
        """The final text: the whole decode (once, at the end), cut before a stop string."""
        if self._final is not None:
            return self._final
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        if self._cut is not None:
            text = text[: self._cut]
        if self.finished:
            self._final = text
        return text

    def piece(self) -> str:
        """The text added since the last piece. While running: the text the detokenizer made
        final (never a byte group or UTF-8 sequence that may still change), less the characters
        that may still turn into a stop string; at the end, everything left."""
        if self.finished:
            text, shown = self.text(), "".join(self._shown)
            if len(text) <= len(shown) or not text.startswith(shown):
                return ""
            out = text[len(shown):]
        else:
            if not self.sp.stop:           # (with stop strings `append` keeps the text up to date)
                self._take(self.detok.update(self.tokens, len(self.tokens))[0])
            out = self._unshown[: max(len(self._unshown) - self._hold, 0)]
            if not out:
                return ""
            self._unshown = self._unshown[len(out):]
        self._shown.append(out)
        return out

    def finish(self, reason: str, error: Optional[str] = None):
        if self.finish_reason is None:
            self.finish_reason = reason
        self.error = error if error is not None else self.error

    def output(self) -> GenerationOutput:
        st = self.stats
        st.new_tokens = len(self.tokens)
        st.time_total = time.perf_counter() - self.arrival
        return GenerationOutput(list(self.tokens), self.text(), st, self.finish_reason or "abort", self.error)
