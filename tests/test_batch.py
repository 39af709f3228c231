"""Many requests at once: batched generation equals each request alone and transformers
(float32, greedy) whatever joins or leaves the batch, stop conditions cut each request as
decoding one token at a time would, a failing request fails alone, the step loop and abort
work, the cost model's choices, and sampling stays lossless per request in a batch."""
import dataclasses
import functools
from collections import Counter

import pytest
import torch

from realistic import image
from tabed_engine import Engine, SamplingParams
from tabed_engine.engine.graphs import CapturedFn, GraphCache
from tabed_engine.engine.scheduler import CostModel
from test_real_checkpoints import N_NEW, PROMPTS, images, loaded, reference
from test_speculative import exact_dist  # noqa: F401  (fixture: the target's exact distribution)

# per prompt: how many new tokens (several lengths: requests leave the batch at different blocks)
LENGTHS = {"one_image": 16, "separated": 9, "adjacent": 13, "chat": 16, "chat_turns": 5, "text": 11}


def engine(**kw):
    target, draft, processor = loaded("llama")
    kw = {"views": ("M", "T"), "max_len": 256, **kw}
    return Engine(target, processor, draft=draft, device="cpu", dtype=torch.float32, **kw)


def batch_inputs():
    names = list(LENGTHS)
    return (names, [PROMPTS[n][0] for n in names], [images(PROMPTS[n][1]) for n in names],
            [SamplingParams(max_new_tokens=LENGTHS[n]) for n in names])


def expected(name):
    """transformers' greedy tokens, cut at the prompt's length (N_NEW tokens or fewer)."""
    return reference("llama", name)[:LENGTHS[name]]


@pytest.mark.parametrize("speculative,options", [
    (False, {}),
    (True, dict(policy="hedge")),
    (True, dict(views=("M", "T", "P"), policy="w-grid", gamma=3)),
    (True, dict(tree="4x2x2")),
])
def test_batch_equals_transformers(speculative, options):
    """Six requests of different image counts (none, one, separated, adjacent), chat and text
    prompts, and lengths through four slots: requests queue, join as others leave, and every
    one equals transformers' greedy decoding of it alone."""
    assert max(LENGTHS.values()) <= N_NEW
    eng = engine(max_batch=4, **options)
    names, prompts, imgs, sps = batch_inputs()
    outs = eng.generate(prompts, images=imgs, sampling=sps, speculative=speculative)
    for name, out in zip(names, outs):
        assert out.token_ids == expected(name), name
        assert out.finish_reason in ("stop", "length") and out.error is None
        assert out.text == eng.tokenizer.decode(out.token_ids, skip_special_tokens=True)
        if speculative:
            assert len(out.stats.accepted_lengths) == out.stats.target_forwards
    assert not eng.has_unfinished()


@pytest.mark.parametrize("speculative", [False, True])
def test_images_preprocessed_on_the_device_equal_transformers(speculative):
    """device_images=True (the GPU default where image_ops reproduces the processor): prompts are
    tokenized without the image processor, pixels computed in the prefill; the tokens equal
    transformers' for separated, adjacent and chat prompts, alone and in a batch."""
    eng = engine(device_images=True)
    names = ["one_image", "adjacent", "separated", "chat_turns", "text"]
    prep = eng._request(PROMPTS["adjacent"][0], images(2), None, None, True).prep
    assert prep.pixel_values is None and prep.num_images == 2
    outs = eng.generate([PROMPTS[n][0] for n in names], images=[images(PROMPTS[n][1]) for n in names],
                        sampling=[SamplingParams(max_new_tokens=LENGTHS[n]) for n in names], speculative=speculative)
    for name, out in zip(names, outs):
        assert out.token_ids == expected(name), name
    one = eng.generate(PROMPTS["chat"][0], images=images(1), sampling=SamplingParams(max_new_tokens=LENGTHS["chat"]))
    assert one.token_ids == expected("chat")


class Scripted(CostModel):
    """A cost model that follows a fixed pattern of modes (exercises every switch)."""

    def __init__(self, pattern, gamma=5):
        super().__init__(True, gamma)
        self.pattern, self.i = pattern, 0

    def choose(self, b, counts):
        if self.forced is not None:          # warm-up
            return self.forced
        self.i += 1
        kind = self.pattern[(self.i - 1) % len(self.pattern)]
        return {"ar": 0, "sd": self.gamma}.get(kind, kind)


@pytest.mark.parametrize("pattern", [("ar", "ar", "ar", "sd"), ("sd", "ar", "sd", "sd", "ar", "ar")])
def test_switching_between_ar_and_sd_is_lossless(pattern):
    """Blocks decoded autoregressively leave the draft rows behind; the draft catches up before
    its next block, and the tokens stay the target's."""
    eng = engine(max_batch=8)
    eng.scheduler.cost = Scripted(pattern)
    names, prompts, imgs, sps = batch_inputs()
    outs = eng.generate(prompts, images=imgs, sampling=sps)
    for name, out in zip(names, outs):
        assert out.token_ids == expected(name), name
    assert any(o.stats.accepted_lengths for o in outs)          # speculative blocks ran
    assert any(o.stats.target_forwards > len(o.stats.accepted_lengths) for o in outs)   # and AR steps


@pytest.mark.parametrize("name", ["one_image", "chat"])
def test_first_speculative_block_after_ar_blocks(name):
    """A lone request's first speculative block (the view tree) after autoregressive ones:
    the draft rows catch up first."""
    eng = engine()
    eng.scheduler.cost = Scripted(("ar",) * 5 + ("sd",))
    prompt, n = PROMPTS[name]
    out = eng.generate(prompt, images=images(n), sampling=SamplingParams(max_new_tokens=LENGTHS[name]))
    assert out.token_ids == expected(name)
    assert out.stats.view_tree_view is not None


def test_draft_rows_catch_up_after_ar_blocks():
    """Draft = target and one view: after autoregressive blocks, the caught-up draft rows
    predict exactly what the target does, so every speculative block accepts all γ drafts
    (rows missing the AR tokens would draft from a wrong context)."""
    target, _, processor = loaded("llama")
    eng = Engine(target, processor, draft=target, device="cpu", dtype=torch.float32, views=("M",), gamma=3,
                 max_len=256, max_batch=8)
    eng.scheduler.cost = Scripted(("ar", "ar", "sd", "ar", "sd", "sd"), gamma=3)
    names, prompts, imgs, _ = batch_inputs()
    sps = [SamplingParams(max_new_tokens=40, stop_at_eos=False)] * len(names)
    for out in eng.generate(prompts, images=imgs, sampling=sps):
        full = [a for a in out.stats.accepted_lengths[:-1]]          # the last block may be cut
        assert full and all(a == 3 for a in full), out.stats.accepted_lengths


def test_catch_up_leaves_rows_that_need_none_intact():
    """Draft = target, one view: request A decodes autoregressively, then B joins (its draft rows
    fresh from prefill, nothing to catch up) and every later block speculates. A's catch-up runs
    with B in the batch; B's draft rows must keep their prompt, so B accepts every draft (the
    padding of a catch-up once landed at slot 0 of such rows and B's drafts went wrong)."""
    target, _, processor = loaded("llama")
    eng = Engine(target, processor, draft=target, device="cpu", dtype=torch.float32, views=("M",), gamma=3,
                 max_len=256, max_batch=2, prefix_cache=False)
    eng.scheduler.cost = Scripted(("ar", "ar", "ar") + ("sd",) * 40, gamma=3)
    names, prompts, imgs, _ = batch_inputs()
    sp = SamplingParams(max_new_tokens=24, stop_at_eos=False)
    a = eng.add_request(prompts[0], images=imgs[0], sampling=sp)
    for _ in range(4):                                   # A's prefill, then three AR steps
        eng.step()
    b = eng.add_request(prompts[1], images=imgs[1], sampling=sp)
    outs = {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o
    for rid in (a, b):
        full = outs[rid].output.stats.accepted_lengths[:-1]          # the last block may be cut
        assert full and all(x == 3 for x in full), (rid, outs[rid].output.stats.accepted_lengths)


def _counts(alpha, n=1000):
    """(accepted, rejected) drafts of a request with acceptance rate `alpha` over n drafts."""
    return alpha * n, (1 - alpha) * n


def test_cost_model_choices():
    c = _counts
    cm = CostModel(True, gamma=4, probe_every=4, probe_len=2)
    assert cm.choose(4, [(0, 0), (0, 0)]) == 4         # nothing measured: measure gamma-chains first
    cm.record(4, 4, 5.0)                               # the first steady interval: dropped (capture)
    assert cm.choose(4, [c(0.0), c(0.1)]) == 4
    cm.record(4, 4, 0.012)
    cm.record(4, 4, 0.5)                               # a spike counts as at most twice the estimate
    assert cm.times[4, 4] == pytest.approx(0.8 * 0.012 + 0.2 * 0.024)
    t4 = cm.times[4, 4]
    # no AR time yet: t_ar = t4 / 1.25 and chains in between interpolated linearly
    assert cm.time(0, 4) == pytest.approx(t4 / 1.25)
    assert cm.time(2, 4) == pytest.approx(t4 / 1.25 + (t4 - t4 / 1.25) / 2)
    assert cm.choose(4, [c(0.02), c(0.02)]) == 0       # a useless draft: AR
    cm.record(0, 4, 1.0)
    cm.record(0, 4, 0.011)                             # measured: AR 11 ms, a 4-chain 14.4 ms
    assert cm.choose(4, [c(0.9), c(0.9)]) == 4         # a good draft: the longest chain pays most
    cm.record(1, 4, 1.0)
    cm.record(1, 4, 0.0115)                            # a 1-chain: 11.5 ms
    # alpha 0.3: 1.3 tokens / 11.5 ms beats 1.39 / 12.5 ms (2-chain, interpolated), 1.43 / 14.4 ms
    # and 1 / 11 ms
    assert cm.choose(4, [c(0.3), c(0.3)]) == 1
    assert cm.choose(4, [c(0.36), c(0.36)]) == 1       # a 2-chain 1% faster, within the margin: stays
    # one block that accepted nothing is not a useless draft: a pseudo-draft at the prior 0.5
    assert cm.choose(4, [(0, 1)]) > 0
    cm2 = CostModel(True, gamma=4, probe_every=4, probe_len=2)
    cm2.times = {(4, 4): 0.0144, (0, 4): 0.011}
    # a useless draft: AR, 2-block probes, each finding nothing doubles the interval (up to 16)
    cm2.probe_max = 16
    modes = "".join(str(cm2.choose(4, [c(0.0)])) for _ in range(70))
    assert modes == "0000" "11" + "0" * 8 + "11" + ("0" * 16 + "11") * 3, modes
    cm3 = CostModel(True, gamma=4, probe_every=4, probe_len=2)
    cm3.times = {(4, 4): 0.0144, (0, 4): 0.011}
    modes = "".join(str(cm3.choose(4, [c(0.0)])) for _ in range(12))
    assert modes == "000011" "000000" and cm3._every == 8, modes
    assert cm3.choose(4, [c(0.9)]) == 4 and cm3._every == 4    # a draft that helps again: the interval resets
    for _ in range(10):
        cm2.observe(0.0)                               # finished requests never accepted a draft:
    assert cm2.prior < 0.06
    assert cm2.choose(4, [c(0.0), (0, 0)]) == 0        # a new request beside measured ones: the prior
    # a batch of new requests probes its own acceptance first (the prior may be another draft's)
    assert [cm2.choose(4, [(0, 0)]) for _ in range(2)] == [1, 1]
    assert cm2.choose(4, [c(0.0)]) == 0
    ar_only = CostModel(True, gamma=4)                 # only AR measured (AR requests came first)
    ar_only.times = {(0, 4): 0.01}
    assert ar_only.time(4, 4) == pytest.approx(0.0125) and ar_only.time(2, 4) == pytest.approx(0.01125)
    assert ar_only.choose(4, [c(0.9)]) == 4 and ar_only.choose(4, [c(0.0)]) == 0
    tree = CostModel(True, gamma=3, chains=False)      # trees: their own shape or AR
    tree.times = {(3, 1): 0.01, (0, 1): 0.008}
    assert tree.choose(1, [c(0.6)]) == 3 and tree.choose(1, [c(0.1)]) == 0
    # a depth-8 tree's block is worth 1 + a + ... + a^8 tokens at a per-depth acceptance a: at
    # a = 0.5 a 20 ms block (2.00 tokens) beats a 10.4 ms AR step, which a depth-3 count (1.875)
    # would not
    deep = CostModel(True, gamma=3, chains=False, tree_depth=8)
    deep.times = {(3, 1): 0.02, (0, 1): 0.0104}
    assert deep.choose(1, [c(0.5)]) == 3
    shallow = CostModel(True, gamma=3, chains=False)
    shallow.times = dict(deep.times)
    assert shallow.choose(1, [c(0.5)]) == 0
    assert CostModel(False, gamma=4).choose(4, [c(0.0)]) == 4   # off: always the full chain
    forced = CostModel(True, gamma=4)
    forced.forced = 2
    assert forced.choose(4, [c(0.9)]) == 2


def test_cost_model_measures_ar_before_the_prior_decides():
    """With only speculative blocks measured at a bucket, AR's time there is measured (up to
    `ar_measure` AR steps), not taken from the prior (a γ-chain = 1.25 AR steps), which would keep
    an expensive draft speculating forever: the draft a third of the target's size makes a chain
    cost several AR steps, and AR, never chosen, would never be measured."""
    c = _counts
    cm = CostModel(True, gamma=4)
    cm.times = {(4, 8): 0.040}                         # a 4-chain: 40 ms
    # the prior alone: AR 32 ms, a 4-chain 2.31 tokens / 40 ms beats 1 / 32 ms
    assert cm.time(0, 8) == pytest.approx(0.032)
    assert [cm.choose(8, [c(0.6)]) for _ in range(2)] == [0, 0]   # AR's time measured instead
    cm.record(0, 8, 1.0)                               # the first interval: dropped
    cm.record(0, 8, 0.010)                             # AR 10 ms: 100 tokens/s
    assert cm.choose(8, [c(0.6)]) == 0                 # chains interpolated: 1.6 / 17.5 ms at best
    assert cm.choose(8, [c(0.97)]) > 0                 # a draft that pays still speculates
    assert cm.choose(16, [c(0.6)]) == 4                # another bucket: its chains measured first
    cm.record(4, 16, 1.0)
    cm.record(4, 16, 0.050)
    assert cm.choose(16, [c(0.6)]) == 0                # then its own AR
    # AR steps that never give a steady interval (admissions between them): after ar_measure
    # tries the prior decides
    stuck = CostModel(True, gamma=4, ar_measure=3)
    stuck.times = {(4, 8): 0.040}
    assert [stuck.choose(8, [c(0.6)]) for _ in range(5)] == [0, 0, 0, 4, 4]


def test_chain_length_per_block_is_lossless():
    """Blocks of different chain lengths in a row (and AR steps between them): tokens stay the
    target's, each block drafts no more than its chain."""
    eng = engine(max_batch=8, gamma=4)
    eng.scheduler.cost = Scripted((1, 3, "ar", 4, 2, 2, 1, "ar", "ar", 3), gamma=4)
    names, prompts, imgs, sps = batch_inputs()
    outs = eng.generate(prompts, images=imgs, sampling=sps)
    for name, out in zip(names, outs):
        assert out.token_ids == expected(name), name
    assert any(a > 0 for o in outs for a in o.stats.accepted_lengths)


def test_the_next_block_is_queued_before_a_block_is_read():
    """Speculative blocks in a row: when the host reads a block's tokens, the next block's
    verification (of the chain length chosen for it) is queued already; tokens stay the target's."""
    eng = engine(views=("M",), gamma=4)
    eng.scheduler.cost = Scripted((4, 4, 2, 3, 1, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4), gamma=4)
    events, run_graph = [], eng.runner.run_graph

    def record(key, fn, inputs, kv_len=None):
        if key[0] == "verify":
            events.append(key[2])         # the chain length verified
        return run_graph(key, fn, inputs, kv_len=kv_len)

    eng.runner.run_graph = record
    eng.runner._wait = lambda ev: events.append("read")
    name = "one_image"
    out = eng.generate(PROMPTS[name][0], images=images(PROMPTS[name][1]), sampling=SamplingParams(max_new_tokens=16))
    assert out.token_ids == expected(name)[:16]
    reads = [i for i, e in enumerate(events) if e == "read"][1:]           # after the prefill's read
    assert len(reads) >= 3 and events[reads[0] - 2:reads[0]] == [4, 4]     # block 1 and block 2 queued
    assert all(len(events[a + 1:b]) <= 1 for a, b in zip(reads, reads[1:]))  # one block queued ahead
    assert [e for e in events if e != "read"][:5] == [4, 4, 2, 3, 1]       # each block as chosen


def test_timing_times_each_phase_and_queues_nothing_ahead():
    """Engine(timing=True): per-phase times of the speculative blocks (each phase synchronizes,
    so no block is queued ahead); tokens stay the target's."""
    eng = engine(views=("M",), timing=True)
    name = "one_image"
    queued = []
    sd_block = eng.runner.sd_block

    def record(*a, **k):
        out = sd_block(*a, **k)
        queued.append(eng.runner.pending is not None)
        return out

    eng.runner.sd_block = record
    out = eng.generate(PROMPTS[name][0], images=images(PROMPTS[name][1]), sampling=SamplingParams(max_new_tokens=16))
    assert out.token_ids == expected(name)[:16]
    st = out.stats
    assert queued and not any(queued)
    assert min(st.time_draft, st.time_verify, st.time_ensemble, st.time_other) > 0


def emulated_graphs(eng, cache=None):
    """`eng` with the GPU's CUDA-graph buffers emulated on the CPU (`GraphCache(emulate=True)`:
    static inputs and outputs, graphs fed each other's outputs, every output overwritten by
    the next call), the prefill padded to its bucket as its graphs run it, and every KV cache
    slot poisoned (K +1000, V -1000: a read of a slot not yet written would show)."""
    r = eng.runner
    r.graphs, r.prefill_graphs = GraphCache(emulate=True) if cache is None else cache, True
    r.allocate()
    for c in (r.tcache, r.dcache):
        c.k.fill_(1000.0)
        c.v.fill_(-1000.0)
    return eng


class StaleInputs(GraphCache):
    """Broken on purpose: each graph keeps the inputs of its first call (never refreshed)."""

    def run(self, key, fn, inputs, shared=()):
        g = self.graphs.get(key)
        if g is None:
            g = self.graphs[key] = CapturedFn(fn, inputs, None, capture=False)
        return CapturedFn.__call__(g, {})


@pytest.mark.parametrize("options,pattern", [
    (dict(gamma=4), ("ar", 3, "ar", "ar", 2, 2, 4, "ar", 1, 4)),
    (dict(tree="4x2x2"), ("sd", "ar", "sd", "sd", "ar", "ar")),
])
def test_emulated_graph_buffers_keep_switching_lossless(options, pattern):
    """What only the GPU runs, on the CPU: the graphs' static buffers (emulated), the next
    block queued ahead of each one, AR steps, chains of several lengths or a tree, requests
    joining and leaving four slots: every request equals transformers' greedy decoding."""
    eng = emulated_graphs(engine(max_batch=4, **options))
    eng.scheduler.cost = Scripted(pattern, gamma=eng.gamma)
    names, prompts, imgs, sps = batch_inputs()
    outs = eng.generate(prompts, images=imgs, sampling=sps)
    for name, out in zip(names, outs):
        assert out.token_ids == expected(name), name
    kinds = {k[0] for k in eng.runner.graphs.graphs}
    assert {"ar", "draft", "verify", "prefill"} <= kinds, kinds
    assert any(o.stats.accepted_lengths for o in outs)
    assert any(o.stats.target_forwards > len(o.stats.accepted_lengths) for o in outs)


def test_emulated_graphs_with_stale_inputs_leave_the_targets_tokens():
    """The test above can fail: graphs that keep replaying their first call's inputs (a
    static buffer never refreshed) decode other tokens."""
    eng = emulated_graphs(engine(max_batch=4, gamma=4), StaleInputs(emulate=True))
    eng.scheduler.cost = Scripted(("ar", 3, "ar", 4), gamma=4)
    names, prompts, imgs, sps = batch_inputs()
    outs = eng.generate(prompts, images=imgs, sampling=sps)
    assert any(out.token_ids != expected(name) for name, out in zip(names, outs))


def captured_after_warmup(warm, sampling: list) -> set:
    """Graph keys that requests with each of `sampling` (three prompts each, seeded) capture
    after `warm(engine)`, on emulated graphs with a scripted cost model (AR / chain switches)."""
    eng = emulated_graphs(engine(max_batch=1, gamma=3))
    eng.scheduler.cost = Scripted(("ar", "ar", 3, 1, "ar", 2, 3), gamma=3)
    assert warm(eng) > 0
    keys = set(eng.runner.graphs.graphs)
    names, prompts, imgs, _ = batch_inputs()
    for i, (p, im) in enumerate(zip(prompts[:3], imgs[:3])):
        for sp in sampling:
            eng.generate(p, images=im, sampling=dataclasses.replace(sp, max_new_tokens=12, seed=i))
    return set(eng.runner.graphs.graphs) - keys


def test_warmup_with_the_requests_sampling_leaves_nothing_to_capture():
    """warmup(sampling=sp) captures every graph sampled requests like sp need (any block kind,
    switches between AR and chains); warmed up greedy, the same requests capture more. (The
    requests are seeded, so the setting is: seeded requests draft and verify by the coupling.)"""
    sp = SamplingParams(temperature=0.8, top_k=20, seed=0)
    assert not captured_after_warmup(lambda e: e.warmup(sampling=sp), [sp])
    assert captured_after_warmup(lambda e: e.warmup(), [sp])


def test_warmup_rejects_sampling_that_is_not_sampling_params():
    for bad in ({"temperature": 0.8}, [], [SamplingParams(), 0.8]):
        with pytest.raises(TypeError, match="SamplingParams"):
            engine().warmup(sampling=bad)


def test_serve_warmup_covers_greedy_and_the_apis_default_sampling():
    """`serve --warmup` (cli.serve_warmup): neither greedy requests nor requests with the
    OpenAI API's defaults (temperature 1) capture graphs afterwards; a greedy-only warm-up
    leaves the latter to capture (so the check can fail)."""
    from tabed_engine.serving.cli import serve_warmup
    from tabed_engine.serving.protocol import parse_sampling

    requests = [SamplingParams(), SamplingParams(**parse_sampling({}, None))]
    assert not captured_after_warmup(serve_warmup, requests)
    assert captured_after_warmup(lambda e: e.warmup(), requests)


def test_switches_between_ar_and_sd_discard_no_queued_block():
    """The cost model switching between AR steps and chains of several lengths: every block
    queued ahead is the one that runs next (none is computed and thrown away)."""
    eng = engine(gamma=4)
    eng.scheduler.cost = Scripted(("ar", 3, "ar", "ar", 2, 2, 4, "ar", 1, "ar"), gamma=4)
    discarded, pending_for = [], eng.runner._pending_for

    def record(mode, b, reqs):
        queued = eng.runner.pending
        p = pending_for(mode, b, reqs)
        discarded.append(queued is not None and p is None)
        return p

    eng.runner._pending_for = record
    names, prompts, imgs, sps = batch_inputs()
    outs = eng.generate(prompts[:2], images=imgs[:2], sampling=[SamplingParams(max_new_tokens=16)] * 2)
    assert [o.token_ids for o in outs] == [reference("llama", n)[:16] for n in names[:2]]
    assert len(discarded) >= 6 and not any(discarded)


def test_stop_conditions_cut_each_request_as_one_token_at_a_time():
    """stop strings, stop tokens and EOS inside a block: the request keeps exactly the tokens
    one-at-a-time decoding would; the text ends before the stop string; streamed pieces never
    show text past it and join to the final text."""
    eng = engine(gamma=5)
    name = "one_image"
    prompt, n = PROMPTS[name]
    full = eng.generate(prompt, images=images(n), sampling=SamplingParams(max_new_tokens=N_NEW,
                                                                          stop_at_eos=False))
    toks = full.token_ids
    text = full.text
    stop_tok = toks[6]
    cut_tok = toks[: toks.index(stop_tok) + 1]
    word = next(w for w in text.split()[2:] if len(w) >= 2)
    stop_str = word[:2]
    cut = text.index(stop_str)
    sps = [SamplingParams(max_new_tokens=N_NEW, stop_at_eos=False, stop_token_ids=(stop_tok,)),
           SamplingParams(max_new_tokens=N_NEW, stop_at_eos=False, stop=(stop_str, "\u00a7never")),
           SamplingParams(max_new_tokens=7, stop_at_eos=False)]
    outs = eng.generate([prompt] * 3, images=[images(n)] * 3, sampling=sps)
    assert outs[0].token_ids == cut_tok and outs[0].finish_reason == "stop"
    assert outs[1].text == text[:cut] and outs[1].finish_reason == "stop"
    k = len(outs[1].token_ids)
    assert outs[1].token_ids == toks[:k]
    assert stop_str in eng.tokenizer.decode(toks[:k], skip_special_tokens=True)
    assert stop_str not in eng.tokenizer.decode(toks[:k - 1], skip_special_tokens=True)
    assert outs[2].token_ids == toks[:7] and outs[2].finish_reason == "length"
    pieces = {}
    for i, piece in eng.stream_batch([prompt] * 3, images=[images(n)] * 3, sampling=sps):
        pieces[i] = pieces.get(i, "") + piece
        assert stop_str not in pieces[i] or i != 1
    assert [pieces.get(i, "") for i in range(3)] == [o.text for o in outs]


def test_step_loop_abort_and_request_ids():
    eng = engine(max_batch=2)
    names, prompts, imgs, sps = batch_inputs()
    ids = [eng.add_request(p, images=i, sampling=s) for p, i, s in zip(prompts, imgs, sps)]
    with pytest.raises(ValueError, match="already"):
        eng.add_request(prompts[0], images=imgs[0], request_id=ids[0])
    victim = ids[2]                                         # queued behind the first two
    eng.abort(victim)
    done, text = {}, {}
    while eng.has_unfinished():
        for o in eng.step():
            text[o.request_id] = text.get(o.request_id, "") + o.new_text
            if o.finished:
                assert o.request_id not in done
                done[o.request_id] = o.output
    assert done[victim].finish_reason == "abort" and done[victim].token_ids == []
    for rid, name in zip(ids, names):
        if rid != victim:
            assert done[rid].token_ids == expected(name), name
            assert text[rid] == done[rid].text
    # abort a running request
    rid = eng.add_request(prompts[0], images=imgs[0], sampling=SamplingParams(max_new_tokens=16))
    other = eng.add_request(prompts[5], images=imgs[5], sampling=sps[5])
    outs = eng.step() + eng.step()
    eng.abort(rid)
    while eng.has_unfinished():
        outs += eng.step()
    final = {o.request_id: o.output for o in outs if o.finished}
    assert final[rid].finish_reason == "abort" and 0 < len(final[rid].token_ids) < 16
    assert final[other].token_ids == expected("text")


@pytest.mark.parametrize("mixed", [False, True], ids=["separate", "mixed"])
@pytest.mark.parametrize("speculative", [False, True])
def test_an_admission_finishes_the_block_queued_ahead(speculative, mixed):
    """A request admitted while the next block is queued already: that block is finished first
    (its work is not discarded) and nothing is queued after it; with mixed steps the batch then
    runs its next block with the prefill in its target forward (`engine/chunked.py`), else the
    prefill alone; tokens stay transformers'."""
    eng = engine(max_batch=2)
    eng.mixed_steps = mixed
    names, prompts, imgs, sps = batch_inputs()
    a = eng.add_request(prompts[0], images=imgs[0], sampling=sps[0], speculative=speculative)
    outs = eng.step() + eng.step() + eng.step()         # admit, then two blocks (the first: a view tree)
    assert eng.runner.pending_kind(eng.scheduler.slots) == (eng.gamma if speculative else 0)
    blocks = sum(eng.scheduler.kinds.values())
    b = eng.add_request(prompts[5], images=imgs[5], sampling=sps[5], speculative=speculative)
    mixed0 = eng.scheduler.mixed_steps
    step = eng.step()                        # the queued block, then b's prefill (mixed: in a block's forward)
    assert sum(eng.scheduler.kinds.values()) == blocks + 1 + mixed and eng.runner.pending is None
    assert eng.scheduler.mixed_steps == mixed0 + mixed
    assert [o.request_id for o in step] == [a, b]
    outs += step
    while eng.has_unfinished():
        outs += eng.step()
    final = {o.request_id: o.output.token_ids for o in outs if o.finished}
    assert final[a] == expected(names[0]) and final[b] == expected(names[5])


def test_per_request_views():
    """An engine with M, T and C: a request without a caption mixes M and T only (its C row runs
    with weight 0), next to one that mixes all three; both equal transformers, the left-out
    view's weight is 0 in every block, and a view set the engine lacks is refused."""
    eng = engine(views=("M", "T", "C"), policy="hedge")
    sp = SamplingParams(max_new_tokens=LENGTHS["one_image"])
    prompt, n = PROMPTS["one_image"]
    with pytest.raises(ValueError, match="caption"):
        eng.generate(prompt, images=images(n), sampling=sp)
    outs = eng.generate([prompt, prompt], images=[images(n)] * 2, sampling=sp, captions=[None, "a street"],
                        views=[("M", "T"), None])
    for o in outs:
        assert o.token_ids == expected("one_image")
    assert all(w[2] == 0 for w in outs[0].stats.weights) and any(w[2] > 0 for w in outs[1].stats.weights)
    alone = eng.generate(prompt, images=images(n), sampling=sp, views="M,T")
    assert alone.token_ids == expected("one_image") and all(w[2] == 0 for w in alone.stats.weights)
    with pytest.raises(ValueError, match="subset"):
        eng.generate(prompt, images=images(n), sampling=sp, views=("M", "P"))
    with pytest.raises(ValueError, match="policy"):
        engine(views=("M", "T"), policy="w-grid").generate(prompt, images=images(n), sampling=sp, views=("M",))


def test_max_new_tokens_none_fills_the_cache():
    """max_new_tokens=None: as many tokens as the cache holds after the prompt (and after the
    longest draft view: here a long caption in the C view), cut like any other length."""
    eng = engine(views=("M", "T", "C"), max_len=160, gamma=3)
    prompt, n = PROMPTS["one_image"]
    sp = SamplingParams(max_new_tokens=None, stop_at_eos=False)
    caption = "a long caption " * 12
    req = eng._request(prompt, images(n), sp, caption, True)
    room = eng.max_len - len(req.prep.ids) - eng.lookahead - 2
    assert req.max_new == room
    out, alone = eng.generate([prompt, prompt], images=[images(n)] * 2, sampling=sp, captions=[caption, "short"])
    longest = max(len(out.token_ids), len(alone.token_ids))
    assert len(alone.token_ids) == room and out.finish_reason == alone.finish_reason == "length"
    assert len(out.token_ids) < room and longest == room            # the long C view leaves less room
    assert out.token_ids == alone.token_ids[:len(out.token_ids)]
    ar = eng.generate(prompt, images=images(n), sampling=sp, speculative=False)
    assert ar.token_ids == alone.token_ids
    with pytest.raises(ValueError, match="no room for new tokens"):
        eng.generate("w " * 200, sampling=sp)
    # every request of a batch fills its own room: rows run to the cache's end while others go on
    names = ["one_image", "text", "separated"]
    for speculative in (False, True):
        outs = eng.generate([PROMPTS[n][0] for n in names], images=[images(PROMPTS[n][1]) for n in names],
                            sampling=sp, captions=["c"] * 3, speculative=speculative)
        for name, o in zip(names, outs):
            room = eng._request(PROMPTS[name][0], images(PROMPTS[name][1]), sp, "c", True).max_new
            assert len(o.token_ids) == room and o.finish_reason == "length", name


def test_warmup_runs_every_bucket_and_leaves_the_engine_as_it_was():
    eng = engine(max_batch=4)
    caught_up, catch_up = set(), eng.runner.catch_up

    def record(reqs, b):
        if any(r is not None and r.draft_valid < len(r.tokens) - 2 for r in reqs[:b]):
            caught_up.add(b)
        catch_up(reqs, b)

    eng.runner.catch_up = record
    assert eng.warmup() > 0
    assert {b for _, b in eng.scheduler.cost.times} == {1, 2, 4}       # block times of every bucket
    assert caught_up == {1, 2, 4}          # the draft caught up after AR steps at every bucket
    assert eng.scheduler.cost.forced is None
    assert not eng.has_unfinished()
    names, prompts, imgs, sps = batch_inputs()
    assert [o.token_ids for o in eng.generate(prompts, images=imgs, sampling=sps)] == [expected(n) for n in names]


def test_draft_view_prefill_is_padded_to_a_bucket(monkeypatch):
    """The draft views' eager prefill runs at a 64-token bucket, not at each prompt's length
    (per-shape costs are paid once per bucket, and warm-up pays them), and the tokens stay
    transformers'. (A request whose views reuse cached rows prefills only their rests instead:
    tests/test_prefix_cache_views.py.)"""
    import tabed_engine.engine.prefill as runner_mod
    import tabed_engine.engine.view_cache as view_mod

    eng = engine()
    calls, prefill_draft = [], runner_mod.prefill_draft

    def record(runner, rows, cache, pad_to=0, step=0):
        lens, logits = prefill_draft(runner, rows, cache, pad_to, step)
        calls.append((max(len(r.ids) for r in rows), pad_to))
        return lens, logits

    monkeypatch.setattr(runner_mod, "prefill_draft", record)
    monkeypatch.setattr(view_mod, "prefill_draft", record)
    assert eng.runner.warm_draft_prefill() == len(calls) - 1 == 256 // 64
    # every bucket, once, then views of two buckets packed
    assert [n for n, _ in calls] == [64, 128, 192, 256, 128] and calls[-1][1] == 128
    calls.clear()
    names, prompts, imgs, sps = batch_inputs()
    outs = eng.generate(prompts, images=imgs, sampling=sps)
    assert [o.token_ids for o in outs] == [expected(n) for n in names]
    hits = sum(o.stats.draft_cached_tokens > 0 for o in outs)
    assert len(calls) == len(names) - hits and all(p % 64 == 0 and 0 < n <= p for n, p in calls)


def pack_views(monkeypatch, step: int = 16):
    """Prompt buckets of `step` tokens (the fixtures' views are short) and a switch between the
    draft views' packed prefill and one batch padded to the longest row: returns (pack(on),
    calls), `calls` holding each packed prefill's rows' padded lengths."""
    import tabed_engine.engine.prefill as prefill_mod
    import tabed_engine.engine.view_cache as view_mod
    from tabed_engine.models.decoder import LlamaLM

    monkeypatch.setattr(prefill_mod, "PREFILL_STEP", step)
    prefill_draft, mixed, calls = view_mod.prefill_draft, LlamaLM.forward_mixed, []

    def spy(self, parts, *a, **k):
        calls.append([p["embeds"].shape[1] for p in parts])
        return mixed(self, parts, *a, **k)

    def padded(runner, rows, cache, pad=0, step=0):
        return prefill_draft(runner, rows, cache, pad)

    monkeypatch.setattr(LlamaLM, "forward_mixed", spy)
    return lambda on: monkeypatch.setattr(view_mod, "prefill_draft", prefill_draft if on else padded), calls


@pytest.mark.parametrize("options", [{}, dict(tree="4x2x2")], ids=["chain", "tree"])
def test_views_of_different_buckets_prefill_packed(monkeypatch, options):
    """View rows whose lengths fall in different prompt buckets (the image view and the
    text-only one) prefill as one packed stream, each row padded to its own bucket: the tokens,
    accepted lengths and view weights equal those of the views prefilled as one batch padded to
    the longest row (float32; the drafts read every row's KV), and the tokens are transformers'."""
    pack, packed = pack_views(monkeypatch)
    names, prompts, imgs, sps = batch_inputs()
    runs = []
    for on in (False, True):
        pack(on)
        eng = engine(views=("M", "T"), prefix_cache=False, **options)
        runs.append(eng.generate(prompts, images=imgs, sampling=sps))
        assert bool(packed) == on
    for name, a, b in zip(names, *runs):
        assert b.token_ids == a.token_ids == expected(name), name
        assert b.stats.accepted_lengths == a.stats.accepted_lengths, name
        assert b.stats.weights == a.stats.weights, name
    # the image prompts' views packed, each at its own bucket
    assert len(packed) >= 3 and all(len(set(p)) == len(p) == 2 and all(n % 16 == 0 for n in p)
                                    for p in packed), packed


def test_speculative_and_autoregressive_requests_take_turns():
    """An autoregressive request (speculative=False) queued between speculative ones waits for
    their batch to drain (one kind per batch), and the speculative request queued after it does
    not overtake it."""
    eng = engine(max_batch=4)
    names, prompts, imgs, sps = batch_inputs()
    spec = [True, True, False, True]
    ids = [eng.add_request(prompts[i], images=imgs[i], sampling=sps[i], speculative=spec[i]) for i in range(4)]
    first, done, out, step = {}, {}, {}, 0
    while eng.has_unfinished():
        step += 1
        for o in eng.step():
            first.setdefault(o.request_id, step)
            if o.finished:
                out[o.request_id], done[o.request_id] = o.output, step
    assert first[ids[0]] == first[ids[1]] < first[ids[2]] < first[ids[3]]
    assert first[ids[2]] > max(done[ids[0]], done[ids[1]])      # admitted once the speculative batch drained
    for i in range(4):
        assert out[ids[i]].token_ids == expected(names[i])
    assert not out[ids[2]].stats.accepted_lengths and out[ids[3]].stats.accepted_lengths


def test_generate_keeps_other_callers_outputs():
    """Requests added with add_request before a generate() call are stepped by it; their outputs
    are kept for the next step()."""
    eng = engine(max_batch=4)
    names, prompts, imgs, sps = batch_inputs()
    early = eng.add_request(prompts[0], images=imgs[0], sampling=sps[0])
    outs = eng.generate([prompts[1], prompts[3]], images=[imgs[1], imgs[3]], sampling=[sps[1], sps[3]])
    assert [o.token_ids for o in outs] == [expected(names[1]), expected(names[3])]
    rest = []
    while eng.has_unfinished():
        rest += eng.step()
    final = [o for o in rest if o.request_id == early and o.finished]
    assert len(final) == 1 and final[0].output.token_ids == expected(names[0])
    assert "".join(o.new_text for o in rest if o.request_id == early) == final[0].output.text


def test_requests_added_from_other_threads():
    import threading

    eng = engine(max_batch=4)
    names, prompts, imgs, sps = batch_inputs()
    ids = {}

    def add(i):
        ids[i] = eng.add_request(prompts[i], images=imgs[i], sampling=sps[i])
    threads = [threading.Thread(target=add, args=(i,)) for i in range(len(names))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    done = {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o.output
    assert {i: done[ids[i]].token_ids for i in ids} == {i: expected(n) for i, n in enumerate(names)}


def test_a_failing_request_fails_alone():
    """A request whose prefill fails (here: the captioner raises on its image) ends with
    finish_reason "error" and the message; the others in the batch finish as alone."""
    bad = image(99, size=(41, 41))

    def captioner(im):
        if im.size == bad.size and im.tobytes() == bad.tobytes():
            raise RuntimeError("captioner failed on this image")
        return "a photo"

    eng = engine(views=("M", "T", "C"), captioner=captioner)
    prompt = PROMPTS["one_image"][0]
    sp = SamplingParams(max_new_tokens=LENGTHS["one_image"])
    outs = eng.generate([prompt, prompt, PROMPTS["text"][0]], images=[images(1), [bad], []],
                        sampling=[sp, sp, SamplingParams(max_new_tokens=LENGTHS["text"])])
    assert outs[1].finish_reason == "error" and "captioner failed" in outs[1].error
    assert outs[0].token_ids == expected("one_image") and outs[2].token_ids == expected("text")
    with pytest.raises(RuntimeError, match="captioner failed"):
        eng.generate(prompt, images=[bad], sampling=sp)
    assert eng.generate(prompt, images=images(1), sampling=sp).token_ids == expected("one_image")


# ---------------------------------------------------------------- sampling in a batch
# (the first 3 tokens of a request sampled among other requests follow the exact target
# distribution: tests/test_speculative.py's MT-kld configuration, 16,000 samples in batches of
# 14 measured requests and 2 of another prompt)
SHARDS = 4


@functools.lru_cache(maxsize=None)
def sampling_engine():
    from models import model_dir
    from test_speculative import target_dir
    return Engine.from_pretrained(target_dir(), model_dir("mha", perturb=0.25), device="cpu", dtype=torch.float32,
                                  views=("M", "T"), policy="kld", gamma=2, max_batch=16)


@pytest.mark.gpu
@pytest.mark.parametrize("speculative", [False, True])
def test_batch_on_the_gpu_equals_alone(speculative):
    """CUDA graphs per batch bucket, the pipelined next block, rows leaving and joining: each
    request of a batch (float32) equals it alone, up to float ties (kernels for different row
    counts sum in different orders)."""
    from models import model_dir
    from test_gpu_engine import assert_same_or_fp_tie
    from test_speculative import word_prompt

    eng = Engine.from_pretrained(model_dir("mha"), model_dir("mha", perturb=0.6), device="cuda",
                                 dtype=torch.float32, max_batch=4, max_len=512)
    reqs = [word_prompt(n) for n in (1, 0, 2, 1, 2, 0)]
    sps = [SamplingParams(max_new_tokens=m, stop_at_eos=False) for m in (30, 12, 25, 7, 40, 18)]
    alone = [eng.generate(t, images=i, sampling=sp, speculative=speculative).token_ids
             for (t, i), sp in zip(reqs, sps)]
    outs = eng.generate([t for t, _ in reqs], images=[i for _, i in reqs], sampling=sps, speculative=speculative)
    for (t, i), a, o in zip(reqs, alone, outs):
        assert len(o.token_ids) == len(a)
        assert_same_or_fp_tie(eng, t, i, a, o.token_ids)
    assert len(eng.graphs) > 0


# ---------------------------------------------------------------- different sampling settings in one batch
def test_row_sampling_equals_each_rows_own_settings():
    """`target_probs` with per-row settings (RowSampling) gives every row what its own
    SamplingParams give it alone; greedy rows are one-hot at the argmax; lse per row."""
    from tabed_engine.speculation.sampling import RowSampling, target_probs

    g = torch.Generator().manual_seed(0)
    sps = [SamplingParams(temperature=0.7, top_k=3), SamplingParams(), SamplingParams(temperature=1.3, top_p=0.6),
           SamplingParams(temperature=0.9, top_k=5, top_p=0.8), SamplingParams(temperature=1.0)]
    rows = RowSampling(torch.tensor([1.0 if s.greedy else s.temperature for s in sps]),
                       torch.tensor([s.top_k for s in sps]), torch.tensor([s.top_p for s in sps]),
                       torch.tensor([s.greedy for s in sps]), use_top_k=True, use_top_p=True, any_greedy=True)
    for shape in ((5, 37), (5, 3, 37)):
        logits = torch.randn(*shape, generator=g) * 3
        lse = torch.empty(shape[:-1])
        probs = target_probs(logits, rows, lse)
        for i, sp in enumerate(sps):
            if sp.greedy:
                want = torch.zeros_like(logits[i]).scatter_(-1, logits[i].argmax(-1, keepdim=True), 1.0)
            else:
                want = target_probs(logits[i], sp)
                assert torch.allclose(lse[i], torch.logsumexp(logits[i] / sp.temperature, -1))
            assert torch.allclose(probs[i], want, atol=1e-6), (i, sp)


def test_requests_with_different_sampling_share_a_batch():
    """Greedy and sampling requests with different temperatures / top-k / top-p are admitted
    into one batch at once (no waiting for the batch to drain); the greedy ones still equal
    transformers' greedy output, AR and speculative."""
    eng = engine(max_batch=16)
    names, prompts, imgs, sps = batch_inputs()
    # (the batch's draws follow its first, unseeded request: EOS must not end a sampled one early)
    others = [SamplingParams(max_new_tokens=12, temperature=0.8, seed=1, stop_at_eos=False),
              SamplingParams(max_new_tokens=12, temperature=1.2, top_p=0.7, seed=2, stop_at_eos=False),
              SamplingParams(max_new_tokens=12, temperature=0.5, top_k=4, seed=3, stop_at_eos=False)]
    for speculative in (False, True):
        ids = [eng.add_request(p, images=i, sampling=sp, speculative=speculative)
               for p, i, sp in zip(prompts + prompts[:3], imgs + imgs[:3], sps + others)]
        eng.step()
        assert not eng.scheduler.waiting and sum(r is not None for r in eng.scheduler.slots) == len(ids)
        done = {}
        while eng.has_unfinished():
            for o in eng.step():
                if o.finished:
                    done[o.request_id] = o.output
        for name, rid in zip(names, ids):
            assert done[rid].token_ids == expected(name), (name, speculative)
        assert all(len(done[rid].token_ids) == 12 for rid in ids[len(names):])


MIXED_SECOND = SamplingParams(max_new_tokens=3, temperature=1.0, top_k=4, top_p=0.8, stop_at_eos=False)


@pytest.fixture(scope="module")
def exact_dist_second():
    from test_speculative import exact_first_tokens, target_dir, word_prompt

    text, imgs = word_prompt(1)
    return exact_first_tokens(Engine.from_pretrained(target_dir(), device="cpu", dtype=torch.float32), text, imgs,
                              MIXED_SECOND, 3)


@pytest.mark.slow
@pytest.mark.parametrize("shard", range(SHARDS))
def test_mixed_sampling_in_a_batch_is_lossless(shard, exact_dist, exact_dist_second, tmp_path_factory):
    """One batch of 12: 6 requests at the first setting (T 0.6, top-k 3), 4 at a second (T 1.0,
    top-k 4, top-p 0.8; seeded: the Gumbel coupling, the first group's rejection sampling), a
    greedy one and one at T 0.9 with another prompt. Each group's first
    3 tokens follow its own exact distribution; the second group's do NOT follow the first
    group's (a batch that applied one request's settings to all rows fails); the greedy row is
    the target's greedy output."""
    from test_speculative import SAMPLING, assert_matches, check_when_complete, word_prompt

    eng = sampling_engine()
    text, imgs = word_prompt(1)
    other, other_imgs = word_prompt(2)
    greedy = eng.generate(text, images=imgs, sampling=SamplingParams(max_new_tokens=3, stop_at_eos=False)).token_ids
    calls = 90      # 4 shards: 2,160 and 1,440 samples, >= 99.9% power against a 5% shift
    first, second, accepted = Counter(), Counter(), 0
    for call in range(calls):
        seed = (shard * 1000 + call) * 12
        # the first group by rejection sampling, the second by the seeded coupling: both in one batch
        sps = ([dataclasses.replace(SAMPLING, seed=seed + i, reproducible=False) for i in range(6)]
               + [dataclasses.replace(MIXED_SECOND, seed=seed + 6 + i) for i in range(4)]
               + [SamplingParams(max_new_tokens=3, stop_at_eos=False),
                  SamplingParams(max_new_tokens=3, temperature=0.9, stop_at_eos=False, seed=seed + 11)])
        outs = eng.generate([text] * 11 + [other], images=[imgs] * 11 + [other_imgs], sampling=sps)
        for o in outs[:6]:
            first[tuple(o.token_ids)] += 1
        for o in outs[6:10]:
            second[tuple(o.token_ids)] += 1
        assert outs[10].token_ids == greedy
        accepted += sum(sum(o.stats.accepted_lengths) for o in outs)
    assert accepted > calls * 12 * 0.15              # drafts really were accepted
    n1, n2 = SHARDS * calls * 6, SHARDS * calls * 4
    check_when_complete(tmp_path_factory, "lossless-mixed-1", shard, SHARDS, first, exact_dist, n1, 0.05)
    check_when_complete(tmp_path_factory, "lossless-mixed-2", shard, SHARDS, second, exact_dist_second, n2, 0.05)
    if shard == 0:     # the groups' distributions differ: a uniform-settings batch could not pass both
        with pytest.raises(AssertionError):
            assert_matches(second, exact_dist, calls * 4)


@pytest.mark.gpu
@pytest.mark.parametrize("speculative", [False, True])
def test_mixed_sampling_batch_on_the_gpu(speculative):
    """Per-row sampling settings through the CUDA graphs (float32): greedy requests in a batch
    with sampling ones equal themselves alone (up to float ties); seeded sampling requests run
    to their length."""
    from models import model_dir
    from test_gpu_engine import assert_same_or_fp_tie
    from test_speculative import word_prompt

    eng = Engine.from_pretrained(model_dir("mha"), model_dir("mha", perturb=0.6), device="cuda",
                                 dtype=torch.float32, max_batch=8, max_len=512, adaptive=False)
    reqs = [word_prompt(n) for n in (1, 0, 2, 1, 2)]
    sps = [SamplingParams(max_new_tokens=20, stop_at_eos=False),
           SamplingParams(max_new_tokens=20, temperature=0.8, seed=1, stop_at_eos=False),
           SamplingParams(max_new_tokens=20, stop_at_eos=False),
           SamplingParams(max_new_tokens=20, temperature=1.1, top_p=0.7, seed=2, stop_at_eos=False),
           SamplingParams(max_new_tokens=20, temperature=0.6, top_k=5, seed=3, stop_at_eos=False)]
    outs = eng.generate([t for t, _ in reqs], images=[i for _, i in reqs], sampling=sps, speculative=speculative)
    for (t, i), sp, o in zip(reqs, sps, outs):
        assert len(o.token_ids) == 20
        if sp.greedy:
            alone = eng.generate(t, images=i, sampling=sp, speculative=speculative).token_ids
            assert_same_or_fp_tie(eng, t, i, alone, o.token_ids)


def test_greedy_requests_share_one_verification_graph_key():
    """Greedy requests differing only in top-k / top-p (which greedy ignores) key the same graph;
    sampling settings go through per-row tensors, so their values key nothing."""
    from types import SimpleNamespace

    from tabed_engine.speculation.sampling import sampling_key

    assert sampling_key(SamplingParams(top_k=5)) == sampling_key(SamplingParams(top_p=0.5)) == ("greedy",)
    eng = engine(max_batch=4)
    eng.runner.allocate()
    reqs = [[SimpleNamespace(sp=SamplingParams(temperature=t), finished=False),
             SimpleNamespace(sp=SamplingParams(), finished=False)] for t in (0.7, 1.3)]
    a, _ = eng.runner.batch_sampling(reqs[0], 2)
    b, _ = eng.runner.batch_sampling(reqs[1], 2)
    assert sampling_key(a) == sampling_key(b)
