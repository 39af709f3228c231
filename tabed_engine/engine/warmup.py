"""Engine warm-up: every CUDA graph and compiled kernel a server meets, captured before the
first real request (`Engine.warmup` documents what runs)."""
from __future__ import annotations

import dataclasses
import itertools
import time

from tabed_engine.config import SamplingParams, check_int
from tabed_engine.engine.runner import BUCKETS


def run_warmup(engine, max_batch, images: bool, sampling) -> float:
    """`Engine.warmup`'s work; returns the seconds taken."""
    from PIL import Image

    t0 = time.perf_counter()
    n = engine.runner.max_batch if max_batch is None else min(check_int("max_batch", max_batch, 1),
                                                             engine.runner.max_batch)
    buckets = sorted({b for b in BUCKETS if b < n} | {n})
    vc = engine.target.config.get("vision_config", {})
    side = vc.get("image_size", 336)
    prompt = (getattr(engine.processor, "image_token", "<image>") + "\n" if images else "") + "Describe it."
    img = [Image.new("RGB", (side, side), (127, 127, 127))] if images else None
    settings = [SamplingParams()] if sampling is None else \
        list(sampling) if isinstance(sampling, (list, tuple)) else [sampling]
    if not settings or not all(isinstance(x, SamplingParams) for x in settings):
        raise TypeError("sampling must be a SamplingParams or a non-empty list of them, got "
                        f"{sampling!r}")
    sps = [dataclasses.replace(x, max_new_tokens=2 * engine.lookahead + 4, stop_at_eos=False, stop=(),
                               stop_token_ids=()) for x in settings]
    cost = engine.scheduler.cost
    # every kind of block the cost model may pick: AR and, speculating, each chain length
    kinds = [0] + ([] if engine.draft is None else list(range(1, engine.gamma + 1)) if cost.chains and cost.enabled
                   else [engine.gamma])
    prior = cost.prior                   # a gray image's acceptance says nothing about real requests
    try:
        for b, sp in itertools.product(buckets, sps):
            # AR steps and the draft's catch-up run the same graphs whatever the sampling:
            # once per bucket, with the first setting
            first = sp is sps[0]
            for g in kinds if first else kinds[1:]:
                cost.forced = g
                engine.generate([prompt] * b, images=[img] * b, sampling=sp, speculative=g > 0)
            if engine.draft is not None and first:
                # AR steps, then speculative blocks: the draft's catch-up forward (kernels
                # compiled on first use) runs here, not at a real request's first probe
                cost.forced = 0
                reqs = engine._requests([prompt] * b, [img] * b, sp, None, None, True, True)
                for _ in engine._drive(reqs):
                    if len(reqs[0].tokens) >= 3:     # the first token and two AR steps'
                        cost.forced = kinds[-1]
        if engine.mixed_steps and engine.runner.graphs is not None and engine.prefill_chunk:
            warm_mixed(engine, [b for b in buckets if b < engine.runner.max_batch], kinds, sps[0])
    finally:
        cost.forced, cost.prior = None, prior
    with engine._lock:              # idle (generate has returned): row 0 is free to scribble on
        if not engine.scheduler.has_unfinished():
            engine.runner.capture_prefill()
            engine.runner.warm_draft_prefill()
    return time.perf_counter() - t0


def warm_mixed(engine, buckets: list, kinds: list, sp: SamplingParams):
    """The captured mixed steps a long prompt's full chunks meet (`Engine(mixed_steps=True)`):
    for each batch bucket b (below the engine's largest: the prompt needs a free slot) and each
    block kind g, b requests decode with blocks of kind g while a text prompt of two full chunks
    (the budget less the block's rows) arrives; both of its chunks run inside those blocks. The
    chunks of other lengths (a prompt's last, whole short prompts) capture theirs on first use."""
    from tabed_engine.engine.chunked import MIN_CHUNK

    sched, budget = engine.scheduler, engine.prefill_chunk
    ids = engine._request("Describe it.", None, None, None, False).prep.ids
    decode = dataclasses.replace(sp, max_new_tokens=min(64, engine.max_len // 2))  # outlasting the prompt's chunks
    first = dataclasses.replace(sp, max_new_tokens=1)
    for b, g in itertools.product(buckets, kinds):
        chunk = max(budget - b * sched.block_rows(g), min(budget, MIN_CHUNK))
        n = min(2 * chunk, engine.max_len - 2)
        if n <= chunk:
            continue                         # no room for two chunks
        sched.cost.forced = g
        running = [engine.add_request("Describe it.", sampling=decode, speculative=g > 0) for _ in range(b)]
        # decode until each has run a block (a lone request's first block may be the views' tree)
        tokens = dict.fromkeys(running, 0)
        for _ in range(8 * decode.max_new_tokens):
            if min(tokens.values()) >= 3:
                break
            for o in engine.step():
                tokens[o.request_id] = tokens.get(o.request_id, 0) + len(o.new_token_ids)
        long = engine.add_request(ids[:1] + ids[-1:] * (n - 1), sampling=first, speculative=g > 0)
        for _ in range(8 * decode.max_new_tokens):         # until its chunks ran: its first token
            if any(o.request_id == long and (o.new_token_ids or o.finished) for o in engine.step()):
                break
        for rid in running + [long]:
            engine.abort(rid)
        while engine.has_unfinished():
            engine.step()
