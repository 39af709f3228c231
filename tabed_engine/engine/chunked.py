"""Chunked prefill: each scheduler step spends at most `Engine.prefill_chunk` prompt tokens on
prefills, so an arriving long prompt does not stall the running requests' decoding for its
whole prefill.

A prompt longer than the budget is prefilled in chunks (`PrefillSteps.prefill_chunk`): chunk k
runs the prompt's tokens [start, end) as new tokens of the request's target row, which holds the
KV of [0, start) (the prefix cache's suffix prefill, `prefix_cache.prefill_suffix`, is the same
call). The vision tower runs once, before the first chunk, and the embeddings of the whole prompt
are built then and sliced per chunk, so a chunk may end inside an image's run of tokens; M-RoPE
ids are the whole prompt's, sliced alike. Between chunks the request's slot is reserved (no other
request takes it) and parked: the blocks the running batch runs meanwhile write the slot's
garbage row from the prefilled length on, where the next chunk writes over it
(`Runner.parked`). The draft's views are prefilled whole with the last chunk (the draft is small
and its views are other token sequences than the target's: see docs/serving.md), and the request
joins the batch with its first token.

One step with chunking on: the block queued ahead, if any, is finished (a chunk must not run
between a block queued with the slot parked at one length and its successor), then the prefill
work (the request between chunks first, then waiting requests first come, first served, while
the budget lasts; a prompt that would need splitting starts only at the start of a step's
budget), then, if requests were decoding at the start of the step and no block ran yet, one
block.

Mixed steps (`Engine(mixed_steps=True)`): the running batch's AR step, or its speculative
block's verification (chain or tree), and the step's chunks (and whole short prompts) run as one
target forward (`LlamaLM.forward_mixed`: the weights read once, the attention per part), so a
step costs about the longer of the two rather than their sum. The block's rows count in the
budget (bucket × rows per request), so the forward's tokens stay within it, but a step always
gives a prompt at least MIN_CHUNK tokens (or the whole budget, if smaller). The step's part
comes first in the packing (a parked row's garbage lands where its chunk writes over it);
requests whose prefill ends in the step decode from the next one (their first token comes out of
the forward). With graphs (CUDA) a step packs one chunk, padded to a bucket
(`prefill.mixed_bucket`) and written through a staged one-row view of its slot, and replays the
captured graph of (block kind, batch bucket, chunk bucket) (`Runner.run_mixed`); the budget that
chunk leaves prefills the prompts waiting behind it after the mixed forward, as forwards of
their own (one prompt a step admitted fewer prompts than arrived under load:
benchmarks/results/README.md, 2026-12-03). Elsewhere the forward is eager, with every chunk the
budget allows. A mixed step queues no block behind it. A tree's verification compacts only the
live requests' accepted paths (a chunk's slot keeps what its part wrote). The first block's view
tree runs the chunks and the block as separate forwards.
"""
from __future__ import annotations

import logging
import math
import numbers
import random
from typing import Optional

from tabed_engine.engine.prefill import PREFILL_GRAPH_MAX, PrefillJob
from tabed_engine.engine.prefix_cache import pick_slot
from tabed_engine.engine.request import RequestOutput
from tabed_engine.engine.runner import bucket_of

# the budget by default: the longest prompt the target prefills as one captured graph. Prompts up
# to it (a LLaVA-1.5 prompt) prefill in one replay as before; a longer one is split, its first
# chunk a prefill graph and the later ones the rest graphs of their padded lengths
# (`prefix_cache.suffix_graph`); smaller chunks are a choice for a server whose decode latency
# matters more than its prompts' TTFT (docs/serving.md)
DEFAULT_PREFILL_CHUNK = PREFILL_GRAPH_MAX
# the fewest prompt tokens a mixed step runs when the block's rows take its whole budget
MIN_CHUNK = 16


log = logging.getLogger("tabed_engine.engine")


def log_failure(e: Exception, what: str):
    """Log a request's failure: the caller's error (a ValueError / TypeError: a request the
    engine refuses) as a warning without a stack, anything else (a device or engine fault) at
    ERROR with its traceback; the request itself ends with the message (`finish("error")`)."""
    if isinstance(e, (ValueError, TypeError)):
        log.warning("%s failed: %s: %s", what, type(e).__name__, e)
    else:
        log.error("%s failed; it ends with an error", what, exc_info=e)


def check_prefill_chunk(value) -> Optional[int]:
    """`Engine(prefill_chunk=)`: prompt tokens a step may prefill, as an int >= 1, or None for no
    limit (None or 0: each prompt prefills whole, as one step)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"prefill_chunk must be an int (prompt tokens per step) or None, got "
                        f"{type(value).__name__} {value!r}")
    if value < 0:
        raise ValueError(f"prefill_chunk must be a positive int (prompt tokens per step), or 0 / None for "
                         f"unchunked prefill, got {value}")
    return int(value) or None


def merged(outputs: list[RequestOutput]) -> list[RequestOutput]:
    """One output per request, in the order of their first appearance (a request that joined
    the batch this step has its first token and the step's block's tokens)."""
    by_id: dict[str, RequestOutput] = {}
    for o in outputs:
        m = by_id.get(o.request_id)
        if m is None:
            by_id[o.request_id] = RequestOutput(o.request_id, list(o.new_token_ids), o.new_text, o.finished, o.output)
        else:
            m.new_token_ids += o.new_token_ids
            m.new_text += o.new_text
            m.finished = m.finished or o.finished
            m.output = o.output if o.output is not None else m.output
    return list(by_id.values())


class ChunkedAdmission:
    """The scheduler's chunked-prefill steps (a mixin of `Scheduler`: it reads its slots, queue,
    lock and block runner). `filling`: the request between prefill chunks, or None."""

    filling: Optional[PrefillJob] = None
    joining: tuple = ()          # jobs whose last chunk a mixed step has planned (their slots are taken)
    mixed_steps: int = 0         # steps whose chunks ran in the batch's AR step's forward

    def taken(self) -> list:
        """The slots, with the one reserved for the request between chunks taken (and those of
        requests a mixed step is prefilling)."""
        slots = list(self.slots)
        for job in (self.filling, *self.joining):
            if job is not None:
                slots[job.slot] = job.req
        return slots

    def step_chunked(self, outputs: list, budget: Optional[int]):
        """One step with a prefill budget of `budget` tokens (None: unlimited; see the module
        docstring). Returns nothing; the step's outputs are appended to `outputs`."""
        if self.filling is None and not self._admissible():
            self._block(outputs)
            return
        decoding = any(r is not None and not r.finished for r in self.slots)
        kind = self.runner.pending_kind(self.slots)
        blocked = kind is not None
        if blocked:                     # the block queued ahead first: a chunk would make it stale
            self._block(outputs, kind)
        left = math.inf if budget is None else budget
        live = [r for r in self.slots if r is not None and not r.finished]
        g = self._mixed_kind(live) if decoding and live else None
        if g is not None:
            self._mixed_step(outputs, left, live, blocked, g)
        else:
            self._prefill_work(outputs, left)
            self._last = None           # the next block's time includes no prefill
            self._next = None
            if decoding and not blocked:
                self._block(outputs)
        outputs[:] = merged(outputs)

    def _mixed_kind(self, live: list) -> Optional[int]:
        """The block a mixed step runs for the live requests: 0 (an AR step) or a chain of g
        (the cost model's choice; a tree: the engine's γ), or None when the step's forwards stay
        separate (mixed steps off, the first block's view tree)."""
        if not self.runner.eng.mixed_steps:
            return None
        if not live[0].speculative:
            return 0
        b = bucket_of(max(r.slot for r in live) + 1, self.runner.max_batch)
        if self.runner.takes_view_tree(live, b):
            return None
        g = self._next if self._next is not None else self.cost.choose(b, [(r.accepted, r.rejected) for r in live])
        self._next = None
        return g

    def _mixed_step(self, outputs: list, left, live: list, blocked: bool, g: int):
        """The step's prefill work packed into the running batch's block, an AR step (g = 0) or
        a chain of g (see the module docstring); without prefill work to run (no pages yet,
        failures) the block alone, unless a block already ran."""
        if g:
            self._pending_views(outputs)
        live = [r for r in live if not r.finished]
        if not live:
            self._prefill_work(outputs, left)
            return
        b = bucket_of(max(r.slot for r in live) + 1, self.runner.max_batch)
        reqs = self.slots[:b]           # (a copy: the requests joining in the step are not in it)
        plan: list = []
        # the block's rows count in the budget (the forward's tokens stay within it), yet a
        # prompt keeps moving when they take all of it
        left = max(left - b * self.block_rows(g), min(left, MIN_CHUNK))
        # with graphs, one chunk a step: a captured mixed step packs one
        graphs = self.runner.graphs is not None
        spent = self._prefill_work(outputs, left, plan, 1 if graphs else math.inf)
        # the budget a mixed graph's one chunk leaves: prompts waiting behind it, prefilled after
        # the mixed forward as their own (so a step admits as many as a step without mixing)
        spare = left - spent if graphs and plan else 0
        self._last = None               # the next block's time includes no prefill
        self._next = None
        if not plan:
            if not blocked:
                self._block(outputs, choice=g)
            return
        gen = live[0].generator if len(live) == 1 else self._batch_gen
        try:
            parts = self.runner.mixed_chunk(*plan[0]) if len(plan) == 1 else None
            parts = parts or [self.runner.chunk_part(job, end) for job, end in plan]
            if g:
                new, logits = self.runner.sd_mixed(reqs, b, gen, g, parts)
            else:
                new, logits = self.runner.ar_mixed(reqs, b, gen, parts)
        except Exception as e:          # a device failure: the batch and the prefills end
            log_failure(e, f"a mixed step of {len(live)} request(s) and {len(plan)} prefill chunk(s)")
            self.joining = ()
            for job, _ in plan:
                self._fail(job.req, job, e, outputs)
            for r in live:
                r.finish("error", f"{type(e).__name__}: {e}")
                outputs.append(self._output(r, []))
            return
        self.kinds[g] += 1
        self.mixed_steps += 1
        for r, toks in zip(reqs, new):
            if r is not None and (toks or r.finished):
                outputs.append(self._output(r, toks))
        self.joining = ()
        for (job, end), lg in zip(plan, logits):
            self.runner.chunk_done(job, end, lg[:, -1])
            self._after_chunk(job, outputs)
        if spare > 0 and self.filling is None:
            self._prefill_work(outputs, spare)

    def block_rows(self, g: int) -> int:
        """The target rows a request takes in a block of kind g: 1 in an AR step (g = 0), the
        chain's g + 1, or the tree's nodes."""
        tree = self.runner.eng.tree
        return 1 if g == 0 else tree.nodes if tree is not None else g + 1

    def _prefill_work(self, outputs: list, budget, plan: Optional[list] = None, max_parts=math.inf):
        """Chunks and whole prefills of at most `budget` prompt tokens in all; with `plan`, their
        forwards are not run but planned into it, at most `max_parts` (see `_run_chunk`).
        Returns the prompt tokens spent (or planned)."""
        left = budget
        if self.filling is not None:
            left -= self._run_chunk(self.filling, left, outputs, plan)
        while left > 0 and self.filling is None and (plan is None or len(plan) < max_parts):
            with self._lock:
                if not self._head_fits():
                    break
                head = self.waiting[0]
                if left < budget and head.n_prompt > left:
                    break                # it would be split: it starts the next step's budget
                self.waiting.popleft()
            slot = pick_slot(self.runner, head, self.taken())
            if not self._pages_for(head, slot, self.taken()):
                break
            try:
                job = self.runner.prefill_begin(head, slot)
            except Exception as e:       # this request fails alone
                self._fail(head, None, e, outputs)
                continue
            left -= self._run_chunk(job, left, outputs, plan)
        return 0 if budget == math.inf else budget - left

    def _run_chunk(self, job: PrefillJob, left, outputs: list, plan: Optional[list] = None) -> int:
        """The job's next chunk (at most `left` tokens); after its last, the request joins the
        batch. With `plan`: (job, end) is appended there instead, the caller runs the chunk
        (a job whose last chunk it is: in `joining` until then). Returns the tokens spent."""
        self.filling = job
        tokens = None if left == math.inf else int(left)
        if plan is not None:
            start = job.done
            end = job.n if tokens is None else min(job.n, start + tokens)
            plan.append((job, end))
            if end == job.n:
                self.filling = None
                self.joining += (job,)
            return end - start
        try:
            ran = self.runner.prefill_chunk(job, tokens)
        except Exception as e:           # this request fails alone
            self._fail(job.req, job, e, outputs)
            return 0 if left == math.inf else left
        return ran if self._after_chunk(job, outputs) else 0 if left == math.inf else left

    def _after_chunk(self, job: PrefillJob, outputs: list) -> bool:
        """After a chunk of the job ran: after its last, its first token and the request joins
        the batch. False when the request failed there."""
        if job.left:
            return True
        self.filling = None
        try:
            first_in_batch = all(r is None for r in self.slots)
            self.runner.prefill_finish(job)
            if first_in_batch:
                self._seed_batch(job.req)
        except Exception as e:           # this request fails alone
            self._fail(job.req, job, e, outputs)
            return False
        if not job.req.finished:
            self.slots[job.slot] = job.req
        outputs.append(self._output(job.req, list(job.req.tokens)))
        return True

    def _fail(self, req, job: Optional[PrefillJob], e: Exception, outputs: list):
        log_failure(e, f"the prefill of request {req.request_id}")
        self.runner.pending = None
        if job is not None:
            self.runner.prefill_abandon(job)
        if self.filling is job:
            self.filling = None
        req.finish("error", f"{type(e).__name__}: {e}")
        outputs.append(self._output(req, []))

    def _drop_filling(self, ids: set, reason: str, outputs: Optional[list] = None):
        """End the request between chunks if its id is in `ids` (an abort or a closed stream)."""
        job = self.filling
        if job is None or job.req.request_id not in ids:
            return
        self.filling = None
        self.runner.prefill_abandon(job)
        job.req.finish(reason)
        if outputs is not None:
            outputs.append(self._output(job.req, []))

    def _seed_batch(self, head):
        """The batch's draws follow its first request's seed: a seeded batch call reproduces
        (the runner's noise seed, the batch generator). Derived on the host: a device draw read
        here would wait for the draft views' prefill queued behind the first token."""
        rng = random.Random(head.generator.initial_seed())
        self.runner.seed.fill_(rng.getrandbits(62))
        self.runner.offset.zero_()
        self._batch_gen.manual_seed(rng.getrandbits(62))
