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
    finally:
        cost.forced, cost.prior = None, prior
    with engine._lock:              # idle (generate has returned): row 0 is free to scribble on
        if not engine.scheduler.has_unfinished():
            engine.runner.capture_prefill()
            engine.runner.warm_draft_prefill()
    return time.perf_counter() - t0
