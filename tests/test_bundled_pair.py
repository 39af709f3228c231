"""The bundled demo target/draft pair on the CPU: greedy speculative decoding is lossless
and the draft is actually useful (block efficiency well above 1)."""
import os

import pytest
import torch

from tabed_engine.config import SamplingParams
from tabed_engine.engine.engine import Engine
from benchmarks.world.scenarios import examples

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


@pytest.mark.parametrize("policy", ["kld", "hedge"])
def test_view_tree_first_block_accepts_the_best_views_chain(pair, policy):
    """With several views the first block verifies each view's own greedy chain as a branch
    of one tree: it accepts exactly as many drafts as the better view would alone (single-view
    engines, same draft), output stays token-identical to AR and to the mixture-chain engine."""
    base, _ = pair

    def mk(views, pol, **kw):
        return Engine(base.target, base.processor, draft=base.draft, device=base.device, dtype=base.dtype,
                      views=views, policy=pol, gamma=5, **kw)

    eng, chain = mk(("M", "T"), policy), mk(("M", "T"), policy, view_tree=False)
    single = {v: mk((v,), "uniform") for v in ("M", "T")}
    sp = SamplingParams(max_new_tokens=24)
    differed = 0
    for sc in ("S1", "S3", "S4"):
        for ex in examples(sc, 2, seed=0):
            kw = dict(images=ex.images, sampling=sp)
            out = eng.generate(ex.prompt, **kw)
            assert out.token_ids == eng.generate(ex.prompt, speculative=False, **kw).token_ids
            by_chain = chain.generate(ex.prompt, **kw)
            assert out.token_ids == by_chain.token_ids and by_chain.stats.view_tree_view is None
            firsts = [single[v].generate(ex.prompt, **kw).stats.accepted_lengths[0]
                      for v in ("M", "T")]
            assert out.stats.accepted_lengths[0] == max(firsts), (sc, out.stats.accepted_lengths, firsts)
            assert firsts[("M", "T").index(out.stats.view_tree_view)] == max(firsts)
            differed += firsts[0] != firsts[1]
    assert differed, "M and T accepted the same in every first block: the test shows nothing"


@pytest.mark.gpu
def test_gpu_bf16_invariant_sd_equals_ar_bitwise():
    """The bundled pair in bf16 on the GPU with `invariant=True`, 200 requests over the five
    scenarios: each request's greedy tokens with SD (alone, batched by 16 and by 64) equal its
    tokens decoded autoregressively alone, bit for bit."""
    from benchmarks.world.scenarios import SCENARIOS

    eng = Engine.from_pretrained(_demo("target"), _demo("draft"), device="cuda", dtype=torch.bfloat16,
                                 views=("M", "T"), invariant=True, max_batch=64, adaptive=False)
    exs = [ex for s in SCENARIOS for ex in examples(s, 40, seed=3)]
    prompts, images = [ex.prompt for ex in exs], [ex.images for ex in exs]
    sp = SamplingParams(max_new_tokens=32)
    alone_ar = [eng.generate(p, images=im, sampling=sp, speculative=False).token_ids for p, im in zip(prompts, images)]
    alone_sd = [eng.generate(p, images=im, sampling=sp).token_ids for p, im in zip(prompts, images)]
    assert alone_sd == alone_ar
    for B in (16, 64):
        batched = []
        for i in range(0, len(exs), B):
            batched += [o.token_ids for o in eng.generate(prompts[i:i + B], images=images[i:i + B], sampling=sp)]
        assert batched == alone_ar, B
