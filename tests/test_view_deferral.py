"""A request's draft views prefilled before its first drafting block instead of with its prompt
(`Runner.views_deferred`, the default for a draft whose view rows weigh >= 50% of the target): the
first token goes out before the draft's work, the tokens and blocks are those of the prefill that
runs the views beside the prompt, a request that ends at its first token never runs them, and
their draft pages are promised to it meanwhile (float32, CPU)."""
import dataclasses

import pytest

from tabed_engine import SamplingParams
from test_batch import batch_inputs, engine, expected


def run_batch(defer: bool, **options):
    eng = engine(max_batch=4, **options)
    eng.runner.defer_views = defer
    names, prompts, imgs, sps = batch_inputs()
    # (the first request seeded: a batch's draft noise follows its first request's seed)
    seeded = [dataclasses.replace(sp, temperature=0.8, top_k=20, seed=i) if i % 2 == 0 else sp
              for i, sp in enumerate(sps)]
    outs = eng.generate(prompts, images=imgs, sampling=seeded)
    return names, outs


@pytest.mark.parametrize("options", [dict(policy="hedge"), dict(tree="4x2x2")], ids=["chain", "tree"])
def test_deferred_views_give_the_same_tokens_and_blocks(options):
    """Greedy and seeded requests in one batch: with the views deferred the tokens, accepted
    lengths and view weights are the same as with the views prefilled beside the prompt, and the
    greedy ones are transformers'."""
    names, now = run_batch(False, **options)
    _, later = run_batch(True, **options)
    for name, a, b in zip(names, now, later):
        assert b.token_ids == a.token_ids, name
        assert b.stats.accepted_lengths == a.stats.accepted_lengths, name
        assert b.stats.weights == a.stats.weights, name
    for i, (name, out) in enumerate(zip(names, later)):
        if i % 2:
            assert out.token_ids == expected(name), name


def test_first_token_goes_out_before_the_views():
    """Deferred: the admission step returns the first token with the draft rows untouched and
    their pages promised; the next step prefills them before its block."""
    eng = engine()
    eng.runner.defer_views = True
    names, prompts, imgs, _ = batch_inputs()
    rid = eng.add_request(prompts[1], images=imgs[1], sampling=SamplingParams(max_new_tokens=8))
    outs = eng.step()
    assert [o.request_id for o in outs] == [rid] and len(outs[0].new_token_ids) == 1
    req = next(r for r in eng.scheduler.slots if r is not None)
    assert req.views_pending is not None and not req.view_len
    pages = eng.runner.pages
    assert pages.draft_reserved == {req.slot: pages._draft_hint(req)} and pages.draft_reserved[req.slot] > 0
    assert not any(pages.draft.rows[r] for r in pages.draft_rows(req.slot))
    eng.step()
    assert req.views_pending is None and req.view_len and not pages.draft_reserved
    while eng.has_unfinished():
        eng.step()


def test_a_request_ending_at_its_first_token_runs_no_views():
    eng = engine()
    eng.runner.defer_views = True
    _, prompts, imgs, _ = batch_inputs()
    out = eng.generate(prompts[1], images=imgs[1], sampling=SamplingParams(max_new_tokens=1))
    assert len(out.token_ids) == 1 and out.stats.draft_cached_tokens == 0
    pages = eng.runner.pages
    assert not pages.draft_reserved and not any(pages.draft.rows)


@pytest.mark.parametrize("pattern", [("ar", "ar", "ar", "sd"), ("ar",)], ids=["ar-then-sd", "ar-only"])
def test_views_wait_through_ar_steps(pattern):
    """Deferred views run before a request's first block that drafts, not before an AR step:
    through the cost model's AR steps they stay pending (their pages promised), a request ending
    before any drafting block never runs them, and the tokens are transformers' (the draft's
    rows catch up on the AR steps' tokens)."""
    from test_batch import Scripted

    eng = engine(max_batch=4)
    eng.runner.defer_views = True
    eng.scheduler.cost = Scripted(pattern)
    names, prompts, imgs, sps = batch_inputs()
    ids = [eng.add_request(p, images=i, sampling=sp, speculative=True) for p, i, sp in zip(prompts, imgs, sps)]
    ran_views, outs = [], {}
    runner = eng.runner
    prefill_pending_views = runner.prefill_pending_views

    def spy(req):
        ran_views.append((req.request_id, len(req.tokens)))
        return prefill_pending_views(req)

    runner.prefill_pending_views = spy
    try:
        while eng.has_unfinished():
            for o in eng.step():
                if o.finished:
                    outs[o.request_id] = o.output
    finally:
        del runner.prefill_pending_views
    for rid, name in zip(ids, names):
        assert outs[rid].token_ids == expected(name), name
    if pattern == ("ar",):                      # no drafting block: no views, no promised pages left
        assert ran_views == [] and not any(o.stats.accepted_lengths for o in outs.values())
    else:   # the first four (one batch) draft after three AR steps, the later ones after at least one
        assert [n for _, n in ran_views[:4]] == [4] * 4 and all(n >= 2 for _, n in ran_views), ran_views
        assert any(o.stats.accepted_lengths for o in outs.values())
    assert not runner.pages.draft_reserved


def test_promised_draft_pages_hold_back_an_admission():
    """`make_room` counts the draft pages promised to another slot's deferred views as taken."""
    eng = engine()
    eng.runner.allocate()
    _, prompts, imgs, _ = batch_inputs()
    req = eng._request(prompts[1], imgs[1], SamplingParams(max_new_tokens=8), None, True)
    pages = eng.runner.pages
    need = pages._draft_hint(req)
    free = pages.draft.free
    try:
        pages.draft.free = free[:need + 4]
        pages.draft_reserved = {1: 5}
        assert not pages.make_room(req, 0, [None] * len(eng.scheduler.slots))
        pages.draft_reserved = {1: 4}
        assert pages.make_room(req, 0, [None] * len(eng.scheduler.slots))
    finally:
        pages.draft.free, pages.draft_reserved = free, {}


@pytest.mark.gpu
def test_gpu_deferred_views_give_the_same_tokens_and_blocks():
    """On the GPU (the views on the second stream, the blocks through graphs), float32: a batch's
    tokens and accepted lengths with the views deferred equal those with them beside the prompt."""
    import torch

    from models import model_dir
    from tabed_engine import Engine
    from test_prefill_graphs import _prompt

    cases = [_prompt(i % 3, 3 + 7 * i) for i in range(6)]
    got = {}
    for defer in (False, True):
        eng = Engine.from_pretrained(model_dir("mha"), model_dir("mha", perturb=0.6), device="cuda",
                                     dtype=torch.float32, max_batch=4, max_len=512, adaptive=False)
        eng.runner.defer_views = defer
        outs = eng.generate([c[0] for c in cases], images=[c[1] for c in cases],
                            sampling=SamplingParams(max_new_tokens=24))
        got[defer] = [(o.token_ids, o.stats.accepted_lengths) for o in outs]
        assert not eng.runner.pages.draft_reserved
    assert got[True] == got[False]
