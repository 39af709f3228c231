"""Mixed forwards (`LlamaLM.forward_mixed`): a decode step, a verification-like block and prompt
chunks packed into one pass through the weights give each part the logits and the KV its own
`forward` gives (float32, CPU), with 1-D RoPE and with M-RoPE (Qwen2.5-VL: 3-D ids of a prompt
whose chunk starts inside an image's tokens, the rows' position offsets)."""
import copy
import math

import pytest
import torch

from tabed_engine import SamplingParams
from tabed_engine.models.config import LMConfig
from tabed_engine.models.decoder import KVCache, LlamaLM, cache_rows

V = 97
SP = SamplingParams(max_new_tokens=16)


def tiny_lm(mrope: bool, seed: int = 0) -> LlamaLM:
    cfg = LMConfig(vocab_size=V, hidden_size=48, intermediate_size=80, num_layers=2, num_heads=4, num_kv_heads=2,
                   head_dim=12, qkv_bias=True, mrope_section=(2, 2, 2) if mrope else None)
    torch.manual_seed(seed)
    lm = LlamaLM(cfg)
    for p in lm.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return lm.eval()


def image_positions(n_text: int, grid: tuple[int, int], n_after: int) -> torch.Tensor:
    """M-RoPE ids [3, n] of `n_text` text tokens, an image of grid (h, w) tokens, `n_after` text
    tokens (Qwen2.5-VL's layout: the image's ids are t = start, (start + row, start + col))."""
    h, w = grid
    text = torch.arange(n_text).repeat(3, 1)
    rows, cols = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
    img = torch.stack([torch.zeros(h * w, dtype=torch.long), rows.reshape(-1), cols.reshape(-1)]) + n_text
    after = torch.arange(n_after).repeat(3, 1) + int(img.max()) + 1
    return torch.cat([text, img, after], 1)


def random_cache(lm: LlamaLM, rows: int, lengths: list[int], offsets: list[int], seed: int = 1) -> KVCache:
    g = torch.Generator().manual_seed(seed)
    cache = KVCache(lm.cfg, rows, 128, "cpu", torch.float32)
    cache.k.copy_(torch.randn(cache.k.shape, generator=g))
    cache.v.copy_(torch.randn(cache.v.shape, generator=g))
    cache.lengths.copy_(torch.tensor(lengths))
    cache.pos_offset.copy_(torch.tensor(offsets))
    return cache


def parts_for(lm: LlamaLM, cache: KVCache, mrope: bool, seed: int = 2) -> list[dict]:
    """A decode step of rows 0-2, a causal block of γ + 1 = 4 tokens on rows 3-4 (a chain's
    verification), the chunk [17, 29) of row 5's prompt after its first 17 tokens (embeds; with
    M-RoPE it starts inside the image, which spans [8, 26)) and a fresh prefill of row 6's first
    13 tokens. Each part's cache is a view of `cache`."""
    g = torch.Generator().manual_seed(seed)
    H = lm.cfg.hidden_size
    lens = cache.lengths.long()
    dec = dict(cache=cache_rows(cache, 0, 3), positions=lens[0:3, None],
               input_ids=torch.randint(0, V, (3, 1), generator=g), kv_len=128)
    ver = dict(cache=cache_rows(cache, 3, 5), positions=lens[3:5, None] + torch.arange(4),
               input_ids=torch.randint(0, V, (2, 4), generator=g), kv_len=64)
    pos3 = image_positions(8, (3, 6), 20)                                      # a prompt of 46 tokens
    offset = int(pos3.max()) + 1 - pos3.shape[1]
    start, end = 17, 29
    pos = (pos3[:, start:end] - offset)[:, None] if mrope else torch.arange(start, end)[None]
    chunk = dict(cache=cache_rows(cache, 5, 6), positions=pos, embeds=torch.randn(1, end - start, H, generator=g),
                 lengths=torch.tensor([start], dtype=torch.int32), logits_index=torch.tensor([[end - start - 1]]),
                 kv_len=128)
    n = 13
    fresh = dict(cache=cache_rows(cache, 6, 7), positions=pos3[:, None, :n] if mrope else torch.arange(n)[None],
                 embeds=torch.randn(1, n, H, generator=g), logits_index=torch.tensor([[n - 1]]), fresh=True,
                 kv_len=n)
    return [dec, ver, chunk, fresh]


@pytest.mark.parametrize("mrope", [False, True], ids=["rope", "m-rope"])
def test_mixed_equals_separate_forwards(mrope):
    """Logits and the KV cache after one mixed forward equal those after the parts' own forwards
    (the parts in the same order)."""
    lm = tiny_lm(mrope)
    offsets = [3, 0, 5, 2, 0, 9, 0] if mrope else [0] * 7
    base = random_cache(lm, 7, [21, 9, 30, 12, 25, 17, 0], offsets)
    alone, mixed = copy.deepcopy(base), copy.deepcopy(base)
    with torch.inference_mode():
        want = [lm(**p) for p in parts_for(lm, alone, mrope)]
        got = lm.forward_mixed(parts_for(lm, mixed, mrope))
    assert [tuple(g.shape) for g in got] == [tuple(w.shape) for w in want] == [(3, 1, V), (2, 4, V), (1, 1, V),
                                                                                (1, 1, V)]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(mixed.k, alone.k, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(mixed.v, alone.v, atol=1e-5, rtol=1e-5)
    assert torch.equal(mixed.lengths, base.lengths)                  # a forward does not advance lengths
    # the parts did write: the chunk's slots of row 5 differ from the random fill
    W = base.block_table.shape[1]
    assert not torch.allclose(mixed.k[:, 1 + 5 * W], base.k[:, 1 + 5 * W])


def test_one_part_is_forward():
    """A mixed call of one part is that part's forward, bit for bit on the CPU."""
    lm = tiny_lm(False)
    base = random_cache(lm, 7, [21, 9, 30, 12, 25, 17, 0], [0] * 7)
    with torch.inference_mode():
        for i in range(4):
            a, b = copy.deepcopy(base), copy.deepcopy(base)
            pa, pb = parts_for(lm, a, False)[i], parts_for(lm, b, False)[i]
            assert torch.equal(lm.forward_mixed([pa])[0], lm(**pb))
            assert torch.equal(a.k, b.k)


def test_refuses_parts_of_different_caches():
    lm = tiny_lm(False)
    a, b = random_cache(lm, 7, [1] * 7, [0] * 7), random_cache(lm, 7, [1] * 7, [0] * 7)
    pa, pb = parts_for(lm, a, False)[0], parts_for(lm, b, False)[0]
    with pytest.raises(ValueError, match="same page pools"):
        lm.forward_mixed([pa, pb])
    with pytest.raises(ValueError, match="at least one part"):
        lm.forward_mixed([])


# ---------------------------------------------------------------------- engine: mixed steps
def arrivals(eng, budget: int, prompt_a: str, prompt_b: str, images_b: list, sp_a, sp_b, speculative=False,
             mixed=True):
    """Request a decodes alone for a few steps, then b (images) arrives and is prefilled in chunks
    of `budget` while a decodes (`Engine.mixed_steps` = `mixed` meanwhile, then off again, the
    default): a's and b's tokens, b's prefill chunks and the mixed steps run meanwhile."""
    eng.mixed_steps = mixed
    try:
        return _arrivals(eng, budget, prompt_a, prompt_b, images_b, sp_a, sp_b, speculative)
    finally:
        eng.mixed_steps = False


def _arrivals(eng, budget: int, prompt_a: str, prompt_b: str, images_b: list, sp_a, sp_b, speculative):
    eng.prefill_chunk = budget
    a = eng.add_request(prompt_a, sampling=sp_a, speculative=speculative)
    got = {a: []}
    while len(got[a]) < 3:
        for o in eng.step():
            got[o.request_id] += o.new_token_ids
    b = eng.add_request(prompt_b, images=images_b, sampling=sp_b, speculative=speculative)
    got[b] = []
    mixed0 = eng.scheduler.mixed_steps
    while eng.has_unfinished():
        for o in eng.step():
            got[o.request_id] += o.new_token_ids
            if o.request_id == b and o.finished:
                chunks = o.output.stats.prefill_chunks
    return got[a], got[b], chunks, eng.scheduler.mixed_steps - mixed0


@pytest.mark.parametrize("budget,speculative", [(7, False), (16, False), (37, False), (24, True)],
                         ids=["ar-7", "ar-16", "ar-37", "chain-24"])
def test_mixed_steps_equal_unchunked_llava(budget, speculative):
    """A LLaVA prompt with two images arriving while a text request decodes (autoregressively, or
    in chains of 3): its chunks (boundaries inside the image runs) run in the running request's AR
    steps' or verifications' forwards, and both requests' greedy tokens are those of unchunked
    prefill (and transformers'). The block's rows count in the budget: a chain of 3 leaves a
    budget of 24 20 prompt tokens a step (an AR step 36 of 37; at least 16, or the budget)."""
    from test_chunked_prefill import PROMPTS, cuts_inside_images, engine, images, reference, run

    eng = engine(None, max_batch=2)
    (prompt_a, _), (prompt_b, n_b) = PROMPTS["text"], PROMPTS["separated"]
    n = len(eng._request(prompt_b, images(n_b), None, None, False).prep.ids)
    # a decodes past b's last chunk
    per_step = max(budget - (1 + 3 * speculative), min(budget, 16))
    assert per_step == {7: 7, 16: 16, 37: 36, 24: 20}[budget]
    sp_a = SamplingParams(max_new_tokens=(1 + 3 * speculative) * math.ceil(n / per_step) + 8, stop_at_eos=False)
    a_alone = run(eng, None, "text", speculative, sp_a).token_ids
    b_alone = run(eng, None, "separated", speculative).token_ids
    got_a, got_b, chunks, mixed = arrivals(eng, budget, prompt_a, prompt_b, images(n_b), sp_a, SP, speculative)
    assert cuts_inside_images(eng, "separated", per_step) > 0
    # every chunk of b ran mixed (a decodes until after b's last chunk)
    assert mixed == chunks == math.ceil(n / per_step) > 1
    assert got_a == a_alone and got_b == b_alone == reference("llama", "separated")


@pytest.mark.parametrize("below", [False, True], ids=["slot-above", "slot-below"])
def test_mixed_steps_with_trees_equal_unchunked(below):
    """Trees: an image prompt's chunks (budget 16, boundaries inside the image runs) run in the
    running request's tree verifications, and both requests' greedy tokens are those of unchunked
    prefill. `below`: a short request admitted first ends before the image prompt arrives, which
    takes its slot 0 under the running request's slot 1, so the chunks write a row of the tree's
    verification: its accepted-path compaction must leave that row to them."""
    from tabed_engine.speculation.tree import TreeConfig
    from test_chunked_prefill import PROMPTS, engine, images, run

    budget = 16
    eng = engine(TreeConfig(3, 2, 2), max_batch=2)
    (prompt_a, _), (prompt_b, n_b) = PROMPTS["text"], PROMPTS["separated"]
    n = len(eng._request(prompt_b, images(n_b), None, None, False).prep.ids)
    sp_a = SamplingParams(max_new_tokens=4 * math.ceil(n / budget) + 8, stop_at_eos=False)
    a_alone = run(eng, None, "text", True, sp_a).token_ids
    b_alone = run(eng, None, "separated", True).token_ids
    eng.prefill_chunk, eng.mixed_steps = budget, True
    try:
        if below:
            x = eng.add_request(prompt_a, sampling=SamplingParams(max_new_tokens=2, stop_at_eos=False))
        a = eng.add_request(prompt_a, sampling=sp_a, speculative=True)
        got = {a: []}
        while len(got[a]) < 3 or (below and eng.scheduler.slots[0] is not None):
            for o in eng.step():
                got.setdefault(o.request_id, []).extend(o.new_token_ids)
        assert eng.scheduler.slots[int(below)].request_id == a
        b = eng.add_request(prompt_b, images=images(n_b), sampling=SP, speculative=True)
        got[b], mixed0, slot_b = [], eng.scheduler.mixed_steps, set()
        while eng.has_unfinished():
            for o in eng.step():
                got.setdefault(o.request_id, []).extend(o.new_token_ids)
                if o.request_id == b and o.finished:
                    chunks = o.output.stats.prefill_chunks
            if eng.scheduler.filling is not None:
                slot_b.add(eng.scheduler.filling.slot)
        mixed = eng.scheduler.mixed_steps - mixed0
    finally:
        eng.prefill_chunk, eng.mixed_steps = None, False
    assert slot_b == {1 - below}
    assert mixed == chunks == math.ceil(n / budget) > 1
    assert got[a] == a_alone and got[b] == b_alone
    if below:
        assert got[x] == a_alone[:2]


@pytest.mark.parametrize("mode", ["ar", "chain", "tree", "ar-seeded", "chain-seeded", "tree-seeded"])
def test_captured_mixed_steps_equal_unchunked(mode):
    """What the GPU runs, on the CPU: mixed steps through captured graphs (emulated: static
    buffers, outputs overwritten by the next call, the KV poisoned before use), one chunk a step
    padded to its bucket over the staged row of its slot. The image prompt's chunks of 16 run in
    the running request's AR steps, chain or tree verifications, every one through a mixed
    graph, and both requests' tokens equal the unchunked prefill's (also emulated): greedy, or
    seeded sampling (top-k 20, T 0.8; the coupling makes a seeded request's tokens its own)."""
    from tabed_engine.speculation.tree import TreeConfig
    from test_batch import emulated_graphs
    from test_chunked_prefill import PROMPTS, engine, images, run

    budget, speculative, seeded = 16, not mode.startswith("ar"), mode.endswith("seeded")
    eng = emulated_graphs(engine(TreeConfig(3, 2, 2) if mode.startswith("tree") else None, max_batch=2))
    (prompt_a, _), (prompt_b, n_b) = PROMPTS["text"], PROMPTS["separated"]
    n = len(eng._request(prompt_b, images(n_b), None, None, False).prep.ids)
    sample = dict(temperature=0.8, top_k=20) if seeded else {}
    sp_a = SamplingParams(max_new_tokens=(1 + 3 * speculative) * math.ceil(n / budget) + 8, stop_at_eos=False,
                          **sample, **({"seed": 5} if seeded else {}))
    sp_b = SamplingParams(max_new_tokens=16, **sample, **({"seed": 6} if seeded else {}))
    a_alone = run(eng, None, "text", speculative, sp_a).token_ids
    b_alone = run(eng, None, "separated", speculative, sp_b).token_ids
    assert not any(k[0] == "mixed" for k in eng.runner.graphs.graphs)
    got_a, got_b, chunks, mixed = arrivals(eng, budget, prompt_a, prompt_b, images(n_b), sp_a, sp_b, speculative)
    keys = [k for k in eng.runner.graphs.graphs if k[0] == "mixed"]
    assert mixed == chunks == math.ceil(n / budget) > 1
    assert {k[1] for k in keys} == {"verify" if speculative else "ar"}
    assert {k[-1] for k in keys} == {budget}        # (the last chunk, shorter, padded to it)
    assert got_a == a_alone and got_b == b_alone
    # the mixed graphs write into the plain step's output buffers (none is live at the other's time)
    graphs = eng.runner.graphs.graphs
    for k in keys:
        plain, mixed_ = graphs[k[1:-1]].outputs, graphs[k].outputs
        plain = (plain,) if isinstance(plain, torch.Tensor) else plain
        assert all(m.data_ptr() == p.data_ptr() for p, m in zip(plain, mixed_)), k


@pytest.mark.parametrize("speculative", [False, True], ids=["ar", "chain"])
@pytest.mark.parametrize("below", [False, True], ids=["slots-above", "slots-below"])
def test_captured_mixed_step_admits_the_prompts_behind_its_chunk(speculative, below):
    """With graphs a mixed step packs one chunk; the budget it leaves prefills the prompts
    waiting behind it (after the mixed forward, as their own forwards), so three prompts
    arriving together all give their first token in the one step, as a step without mixing
    would, and every request's tokens equal its tokens alone (emulated graphs, poisoned KV).
    `below`: the running request sits in the last slot, so the step's block spans the slots the
    arriving prompts take (its rows there are garbage the prefills must write over)."""
    from test_batch import emulated_graphs
    from test_chunked_prefill import PROMPTS, engine

    eng = emulated_graphs(engine(None, max_batch=4))
    texts = [PROMPTS["text"][0], "Question: which color is the door of the barn?\nAnswer:",
             "Question: how tall is the tree near the old house?\nAnswer:", "Describe a quiet street."]
    sps = [SamplingParams(max_new_tokens=n, stop_at_eos=False) for n in (24, 9, 11, 10)]
    eng.prefill_chunk = None
    alone = [eng.generate(t, sampling=sp, speculative=speculative).token_ids for t, sp in zip(texts, sps)]
    eng.prefill_chunk, eng.mixed_steps = 128, True
    try:
        fill = [eng.add_request(texts[0], sampling=SamplingParams(max_new_tokens=2, stop_at_eos=False),
                                speculative=speculative) for _ in range(3 if below else 0)]
        a = eng.add_request(texts[0], sampling=sps[0], speculative=speculative)
        got = {i: [] for i in fill + [a]}
        while len(got[a]) < 3 or any(len(got[f]) < 2 for f in fill):
            for o in eng.step():
                got[o.request_id] += o.new_token_ids
        a_slot = next(r.slot for r in eng.scheduler.slots if r is not None and r.request_id == a)
        assert a_slot == 3 or not below
        ids = [eng.add_request(t, sampling=sp, speculative=speculative) for t, sp in zip(texts[1:], sps[1:])]
        got.update({i: [] for i in ids})
        mixed0 = eng.scheduler.mixed_steps
        first = eng.step()                   # one mixed step: a's block and b's chunk, then c and d
        assert eng.scheduler.mixed_steps == mixed0 + 1
        assert {o.request_id for o in first if o.new_token_ids} >= set(ids)
        for o in first:
            got[o.request_id] += o.new_token_ids
        while eng.has_unfinished():
            for o in eng.step():
                got[o.request_id] += o.new_token_ids
    finally:
        eng.prefill_chunk, eng.mixed_steps = None, False
    assert any(k[0] == "mixed" for k in eng.runner.graphs.graphs)
    assert [got[i] for i in [a] + ids] == alone


@pytest.mark.parametrize("seed", range(3))
def test_random_arrivals_through_captured_mixed_steps(seed):
    """Random schedules through the captured mixed steps (emulated graphs, poisoned KV): requests
    of text and one or two images arriving at random steps, budgets from 16 tokens to more than a
    prompt, AR or speculative, blocks of AR steps and chains in a scripted order, the draft's
    views deferred or not. Every request's greedy tokens equal its tokens alone."""
    import random

    from test_batch import Scripted, emulated_graphs
    from test_chunked_prefill import PROMPTS, engine, images

    names = ["text", "one_image", "separated", "adjacent", "chat"]
    eng = emulated_graphs(engine(None, max_batch=4))
    rng = random.Random(seed)
    alone, cost0 = {}, eng.scheduler.cost

    def request(name, n_new, spec):
        prompt, n_img = PROMPTS[name]
        return dict(prompt=prompt, images=images(n_img), speculative=spec,
                    sampling=SamplingParams(max_new_tokens=n_new, stop_at_eos=False))

    try:
        for _ in range(4):
            spec = rng.random() < 0.6
            reqs = [(rng.choice(names), rng.choice([3, 7, 12, 20]), rng.randint(0, 6)) for _ in range(rng.randint(3, 7))]
            eng.prefill_chunk, eng.mixed_steps, eng.runner.defer_views = None, False, None
            eng.scheduler.cost = Scripted(("sd",), gamma=3)
            for name, n_new, _ in reqs:
                if (name, n_new, spec) not in alone:
                    alone[name, n_new, spec] = eng.generate(**request(name, n_new, spec)).token_ids
            eng.prefill_chunk, eng.mixed_steps = rng.choice([16, 24, 40, 64, 128, 300]), True
            eng.runner.defer_views = rng.choice([None, True, False])
            eng.scheduler.cost = Scripted(rng.choice([("sd",), ("ar", "sd"), ("ar", "ar", 2, "sd"), (1, "ar", 3)]),
                                          gamma=3)
            pending, got, which, step = sorted(reqs, key=lambda r: r[2]), {}, {}, 0
            while pending or eng.has_unfinished():
                while pending and pending[0][2] <= step:
                    name, n_new, _ = pending.pop(0)
                    rid = eng.add_request(**request(name, n_new, spec))
                    which[rid], got[rid] = (name, n_new, spec), []
                for o in eng.step():
                    got[o.request_id] += o.new_token_ids
                step += 1
            for rid, k in which.items():
                assert got[rid] == alone[k], (rid, k, eng.prefill_chunk, eng.runner.defer_views)
        assert eng.scheduler.mixed_steps > 0
    finally:
        eng.prefill_chunk, eng.mixed_steps, eng.runner.defer_views = None, False, None
        eng.scheduler.cost = cost0


def test_warmup_captures_the_mixed_steps_of_full_chunks():
    """With mixed steps on (emulated graphs), `warmup` captures the mixed step of a full chunk
    for each block kind at the buckets below the largest, and leaves the engine idle and clean:
    an image prompt then arriving beside a decoding request (chunks of 16, its last one padded
    to 16) captures no mixed graph, with the unchunked prefill's tokens."""
    from test_batch import emulated_graphs
    from test_chunked_prefill import PROMPTS, engine, images, run

    eng = emulated_graphs(engine(None, max_batch=2))
    (prompt_a, _), (prompt_b, n_b) = PROMPTS["text"], PROMPTS["separated"]
    sp_a = SamplingParams(max_new_tokens=40, stop_at_eos=False)
    want = {s: (run(eng, None, "text", s, sp_a).token_ids, run(eng, None, "separated", s).token_ids)
            for s in (False, True)}
    eng.mixed_steps, eng.prefill_chunk = True, 16
    assert eng.warmup(images=False) > 0
    assert not eng.has_unfinished() and all(r is None for r in eng.scheduler.slots)
    keys = set(eng.runner.graphs.graphs)
    assert {(k[1], k[2], k[-1]) for k in keys if k[0] == "mixed"} == {("ar", 1, 16), ("verify", 1, 16)}
    for speculative in (False, True):
        got_a, got_b, _, mixed = arrivals(eng, 16, prompt_a, prompt_b, images(n_b), sp_a, SP, speculative)
        assert mixed > 1 and (got_a, got_b) == want[speculative]
    assert not {k for k in set(eng.runner.graphs.graphs) - keys if k[0] == "mixed"}


def test_mixed_steps_off_by_default_and_checked():
    """Without `mixed_steps` the chunks and the block stay two forwards of the step (no mixed
    step), with the same tokens; a non-bool setting is refused."""
    from test_chunked_prefill import PROMPTS, engine, images, run

    eng = engine(None, max_batch=2)
    assert eng.mixed_steps is False
    (prompt_a, _), (prompt_b, n_b) = PROMPTS["text"], PROMPTS["separated"]
    sp_a = SamplingParams(max_new_tokens=40, stop_at_eos=False)
    a_alone = run(eng, None, "text", False, sp_a).token_ids
    b_alone = run(eng, None, "separated", False).token_ids
    got_a, got_b, chunks, mixed = arrivals(eng, 16, prompt_a, prompt_b, images(n_b), sp_a, SP, mixed=False)
    assert mixed == 0 and chunks > 1
    assert got_a == a_alone and got_b == b_alone
    with pytest.raises(TypeError, match="mixed_steps must be a bool"):
        eng.mixed_steps = 1


@pytest.mark.parametrize("speculative,captured", [(False, False), (True, False), (True, True)],
                         ids=["ar", "chain", "chain-captured"])
def test_mixed_steps_equal_unchunked_qwen2_5_vl(tmp_path_factory, speculative, captured):
    """M-RoPE (Qwen2.5-VL): an image prompt arriving while a text request decodes, its chunks of 9
    tokens (boundaries inside the image runs: the 3-D ids sliced per chunk, the row's offset)
    mixed into the AR steps or the chains' verifications; tokens equal the unchunked prefill's.
    `captured`: through the mixed graphs (emulated, `test_captured_mixed_steps_equal_unchunked`:
    the chunk's 3-D ids padded in the shared buffer)."""
    from tabed_engine.models.tiny import random_image
    from test_batch import emulated_graphs
    from test_chunked_prefill import qwen_engine

    eng = qwen_engine(str(tmp_path_factory.getbasetemp() / "qwen_chunked"), None)
    if captured:
        emulated_graphs(eng)
    turns = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "left"}, {"type": "image"},
                                          {"type": "text", "text": "Describe the image in detail."}]}]
    text_b = eng.processor.apply_chat_template(turns, add_generation_prompt=True, tokenize=False)
    text_a = eng.processor.apply_chat_template([{"role": "user", "content": "Tell me a long story."}],
                                               add_generation_prompt=True, tokenize=False)
    imgs = [random_image(0, 40), random_image(1, 56).resize((24, 56))]
    n = len(eng._request(text_b, imgs, None, None, False).prep.ids)
    sp_a = SamplingParams(max_new_tokens=(1 + 3 * speculative) * math.ceil(n / 9) + 8, stop_at_eos=False)
    eng.runner.prefix.entries = [None] * len(eng.runner.prefix.entries)
    eng.prefill_chunk = None
    a_alone = eng.generate(text_a, sampling=sp_a, speculative=speculative).token_ids
    b_alone = eng.generate(text_b, images=imgs, sampling=SP, speculative=speculative).token_ids
    eng.runner.prefix.entries = [None] * len(eng.runner.prefix.entries)
    got_a, got_b, chunks, mixed = arrivals(eng, 9, text_a, text_b, imgs, sp_a, SP, speculative)
    spans = eng._request(text_b, imgs, None, None, False).prep.image_spans
    assert any(s < c < s + m for c in range(9, n, 9) for s, m in spans)
    assert mixed == chunks > 1          # (chunks <= n / 9: b's prompt may hit a's cached chat prefix)
    assert got_a == a_alone and got_b == b_alone
    assert any(k[0] == "mixed" for k in eng.runner.graphs.graphs) if captured else eng.runner.graphs is None


@pytest.mark.gpu
@pytest.mark.parametrize("tree", [None, "4x2x2"], ids=["chain", "tree"])
def test_gpu_invariant_mixed_steps_equal_alone_bitwise(tree):
    """bf16 on the GPU with `invariant=True`, mixed steps through their captured graphs: requests
    arriving one a step while others decode, prefilled in chunks of at most 40 tokens inside the
    running batch's AR steps and chain (or tree) verifications, give bit for bit the tokens each
    gives alone autoregressively."""
    from models import model_dir
    from tabed_engine import Engine
    from test_prefill_graphs import _prompt

    eng = Engine.from_pretrained(model_dir("mha"), model_dir("mha", perturb=0.6), device="cuda",
                                 dtype=torch.bfloat16, invariant=True, max_batch=8, max_len=512, adaptive=False,
                                 tree=tree)
    cases = [_prompt(i % 3, 3 + (7 * i) % 61) for i in range(12)]
    sp = SamplingParams(max_new_tokens=32, stop_at_eos=False)
    alone = [eng.generate(t, images=im, sampling=sp, speculative=False).token_ids for t, im in cases]
    eng.prefill_chunk, eng.mixed_steps = 40, True
    for speculative in (False, True):
        got, ids = {}, []
        for t, im in cases:
            ids.append(eng.add_request(t, images=im, sampling=sp, speculative=speculative))
            for o in eng.step():
                got.setdefault(o.request_id, []).extend(o.new_token_ids)
        while eng.has_unfinished():
            for o in eng.step():
                got.setdefault(o.request_id, []).extend(o.new_token_ids)
        assert [got[i] for i in ids] == alone, speculative
    kinds = {k[1] for k in eng.runner.graphs.graphs if k[0] == "mixed"}
    assert kinds == {"ar", "verify"}, kinds
