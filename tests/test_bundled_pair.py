"""The bundled demo target/draft pair on the CPU: greedy speculative decoding is lossless
and the draft is actually useful (block efficiency well above 1)."""
import os

import pytest
import torch

from tabed_engine.config import SamplingParams
from tabed_engine.engine import Engine
from tabed_engine.world.scenarios import examples

DEMO = os.path.join(os.path.dirname(__file__), "..", "tabed_engine", "assets", "demo")


def _demo(name):
    d = os.path.join(DEMO, name)
    if not os.path.exists(os.path.join(d, "config.json")):
        pytest.skip(f"no bundled checkpoint at {d}")
    return d


@pytest.fixture(scope="module")
def pair():
    torch.set_num_threads(1)
    base = Engine.from_pretrained(_demo("target"), _demo("draft"), device="cpu", views=("M", "T"),
                                  policy="w-grid", gamma=5)
    m_only = Engine(base.target, base.processor, draft=base.draft, device=base.device, dtype=base.dtype,
                    views=("M",), policy="uniform", gamma=5)
    return base, m_only


@pytest.mark.parametrize("scenario", ["S1", "S3"])
def test_greedy_sd_matches_ar(pair, scenario):
    eng, _ = pair
    sp = SamplingParams(max_new_tokens=48)
    for ex in examples(scenario, 4, seed=0):
        sd = eng.generate(ex.prompt, images=ex.images, sampling=sp)
        ar = eng.generate(ex.prompt, images=ex.images, sampling=sp, speculative=False)
        assert sd.token_ids == ar.token_ids, (scenario, ex.prompt)
        assert sd.stats.speculative and sd.stats.target_forwards >= 1
        assert len(sd.stats.weights) == len(sd.stats.accepted_lengths)


def test_m_view_block_efficiency_s1(pair):
    _, eng = pair
    sp = SamplingParams(max_new_tokens=48)
    new = fwd = 0
    for ex in examples("S1", 5, seed=0):
        s = eng.generate(ex.prompt, images=ex.images, sampling=sp).stats
        new += s.new_tokens - 1
        fwd += s.target_forwards
    assert fwd > 0 and new / fwd > 1.5, new / max(fwd, 1)
