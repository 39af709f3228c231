"""Chunked prefill (engine/chunked.py): a prompt longer than `Engine.prefill_chunk` is prefilled
in chunks over several scheduler steps, the running requests decoding between them. Greedy
tokens equal unchunked prefill's and transformers' (float32, CPU) at budgets whose chunk
boundaries fall inside image token runs, autoregressively and speculatively (chains, trees),
with prefix caching on and off; a long prompt arriving while another request decodes is
prefilled one chunk a step while that request keeps decoding; M-RoPE (Qwen2.5-VL); the option's
checks, the CLI flag, an abort between chunks."""
import functools
import math

import pytest
import torch

from tabed_engine import Engine, SamplingParams, TreeConfig
from tabed_engine.engine.chunked import DEFAULT_PREFILL_CHUNK, check_prefill_chunk
from test_real_checkpoints import PROMPTS, images, loaded, reference

N_NEW = 16                    # test_real_checkpoints.reference's token count
SP = SamplingParams(max_new_tokens=N_NEW)
MODES = [
    pytest.param(False, None, id="ar"),
    pytest.param(True, None, id="chain"),
    pytest.param(True, TreeConfig(3, 2, 2), id="tree"),
]


@functools.lru_cache(maxsize=None)
def engine(tree=None, prefix_cache: bool = False, max_batch: int = 2):
    target, draft, processor = loaded("llama")
    return Engine(target, processor, draft=draft, device="cpu", dtype=torch.float32, views=("M", "T"),
                  gamma=3, tree=tree, max_len=256, max_batch=max_batch, adaptive=False,
                  prefix_cache=prefix_cache)


def run(eng, budget, prompt_name, speculative, sp=SP):
    eng.prefill_chunk = budget
    prompt, n = PROMPTS[prompt_name]
    return eng.generate(prompt, images=images(n), sampling=sp, speculative=speculative)


def cuts_inside_images(eng, prompt_name, budget) -> int:
    """How many chunk boundaries of `budget` fall strictly inside an image's token run."""
    prompt, n = PROMPTS[prompt_name]
    prep = eng._request(prompt, images(n), None, None, False).prep
    cuts = range(budget, len(prep.ids), budget)
    return sum(s < c < s + m for c in cuts for s, m in prep.image_spans)


@pytest.mark.parametrize("speculative,tree", MODES)
@pytest.mark.parametrize("budget", [7, 16, 37])
def test_greedy_equals_unchunked_and_transformers(speculative, tree, budget):
    """Two images in the prompt: every budget splits it into several chunks, boundaries inside
    image runs among them; the tokens are transformers' and the unchunked prefill's."""
    eng = engine(tree)
    want = reference("llama", "separated")
    whole = run(eng, None, "separated", speculative)
    out = run(eng, budget, "separated", speculative)
    n = out.stats.prompt_tokens
    assert whole.stats.prefill_chunks == 1 and out.stats.prefill_chunks == math.ceil(n / budget) > 1
    assert cuts_inside_images(eng, "separated", budget) > 0
    assert out.token_ids == whole.token_ids == want
    assert 0 < out.stats.time_prefill < out.stats.time_total and out.stats.time_queued < out.stats.time_first_token
    if speculative:
        assert sum(out.stats.accepted_lengths) > 0


@pytest.mark.parametrize("speculative,tree", MODES)
def test_prefix_cache_hit_then_chunks(speculative, tree):
    """A second turn reuses the first turn's row (prefix cache) and prefills the rest in chunks
    of 7 tokens (the first chunk copies the cached prefix); tokens equal the engine's without
    the cache or chunks."""
    on, off = engine(tree, prefix_cache=True), engine(tree)
    on.runner.prefix.entries = [None] * len(on.runner.prefix.entries)
    on.prefill_chunk, off.prefill_chunk = 16, None
    img = images(1)
    first = on.generate("<image>\nWhat is it?", images=img, sampling=SP, speculative=speculative)
    assert first.stats.prefill_chunks > 1
    prompt = on._request("<image>\nWhat is it?", img, None, None, False).prep.ids
    turn2 = prompt + first.token_ids + on.tokenizer.encode(" And the colors of it?", add_special_tokens=False)
    on.prefill_chunk = 7
    a = on.generate(turn2, images=img, sampling=SP, speculative=speculative)
    b = off.generate(turn2, images=img, sampling=SP, speculative=speculative)
    assert a.stats.cached_tokens == len(prompt) + len(first.token_ids) - 1
    assert a.stats.prefill_chunks == math.ceil((len(turn2) - a.stats.cached_tokens) / 7) > 1
    assert a.token_ids == b.token_ids


@pytest.mark.parametrize("speculative", [False, True], ids=["ar", "chain"])
def test_running_request_decodes_between_chunks(speculative):
    """A long prompt arriving while another request decodes: each step runs one chunk of at most
    the budget and a block that gives the running request tokens, until the long prompt's last
    chunk, after which it decodes with the batch. The long prompt takes slot 0 (a short request
    there finished) below the running request's slot 1, so the blocks between its chunks run over
    its half-filled row (parked: their garbage lands where the next chunk writes). Every
    request's tokens are as alone."""
    eng = engine(None, max_batch=2)
    budget = 16
    sp_a = SamplingParams(max_new_tokens=60, stop_at_eos=False)
    sp_x = SamplingParams(max_new_tokens=2, stop_at_eos=False)
    a_alone = run(eng, None, "text", speculative, sp_a).token_ids
    b_alone = run(eng, None, "separated", speculative).token_ids
    eng.prefill_chunk = budget
    prompt_a, _ = PROMPTS["text"]
    prompt_b, n_b = PROMPTS["separated"]
    x = eng.add_request(prompt_a, sampling=sp_x, speculative=speculative)
    a = eng.add_request(prompt_a, sampling=sp_a, speculative=speculative)
    got = {x: [], a: []}
    while len(got[x]) < 2 or len(got[a]) < 3:      # x in slot 0 done, a in slot 1 decoding
        for o in eng.step():
            got[o.request_id] += o.new_token_ids
    b = eng.add_request(prompt_b, images=images(n_b), sampling=SP, speculative=speculative)
    got[b] = []
    sched = eng.scheduler
    chunk_steps = 0
    while eng.has_unfinished():
        before = len(got[a])
        done_before = 0 if sched.filling is None else sched.filling.done
        for o in eng.step():
            got[o.request_id] += o.new_token_ids
        if sched.filling is not None:              # b between chunks after this step
            chunk_steps += 1
            assert sched.filling.slot == 0 and sched.filling.done - done_before <= budget
            assert len(got[a]) > before, "the running request made no progress during a chunk step"
            assert not got[b]
    n = len(eng._request(prompt_b, images(n_b), None, None, False).prep.ids)
    assert chunk_steps == math.ceil(n / budget) - 1 >= 3
    assert got[a] == a_alone and got[b] == b_alone == reference("llama", "separated")


@pytest.mark.parametrize("speculative,tree", [(False, None), (True, None), (True, TreeConfig(3, 2, 2))],
                         ids=["ar", "chain", "tree"])
def test_qwen2_5_vl_m_rope_chunks(tmp_path_factory, speculative, tree):
    """M-RoPE: chunks slice the prompt's 3-D position ids (boundaries inside the image runs and in
    the text between and after them); tokens equal the unchunked prefill's, with the prefix
    cache on (a second turn hitting it, then chunked) and off."""
    from tabed_engine.models.tiny import random_image

    eng = qwen_engine(str(tmp_path_factory.getbasetemp() / "qwen_chunked"), tree)
    turns = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "left"}, {"type": "image"},
                                          {"type": "text", "text": "Describe the image in detail."}]}]
    text = eng.processor.apply_chat_template(turns, add_generation_prompt=True, tokenize=False)
    imgs = [random_image(0, 40), random_image(1, 56).resize((24, 56))]
    outs = {}
    for budget in (None, 9, 24):
        eng.prefill_chunk = budget
        eng.runner.prefix.entries = [None] * len(eng.runner.prefix.entries)
        outs[budget] = eng.generate(text, images=imgs, sampling=SP, speculative=speculative)
    n = outs[None].stats.prompt_tokens
    assert [outs[b].stats.prefill_chunks for b in (9, 24)] == [math.ceil(n / 9), math.ceil(n / 24)]
    assert outs[9].token_ids == outs[24].token_ids == outs[None].token_ids
    # turn 2: the prefix cache holds turn 1; the rest (a new image among it) in chunks of 9
    prep = eng._request(text, imgs, None, None, False).prep
    turn2 = (prep.ids + outs[9].token_ids + eng.tokenizer.encode("<|im_end|>\n<|im_start|>user\n<|vision_start|>"
                                                                 "<|image_pad|><|vision_end|>compare<|im_end|>\n"
                                                                 "<|im_start|>assistant\n",
                                                                 add_special_tokens=False))
    imgs2 = imgs + [random_image(2, 40)]
    got = {}
    for budget in (9, None):
        eng.prefill_chunk = budget
        got[budget] = eng.generate(turn2, images=imgs2, sampling=SP, speculative=speculative)
        eng.runner.prefix.entries = [None] * len(eng.runner.prefix.entries)
    assert got[9].stats.cached_tokens > 0 and got[9].stats.prefill_chunks > 1
    assert got[9].token_ids == got[None].token_ids


@functools.lru_cache(maxsize=None)
def qwen_engine(root: str, tree):
    import os

    from tabed_engine.models.tiny_qwen2_5_vl import build_tiny_qwen2_5_vl
    if not os.path.isdir(os.path.join(root, "d")):
        build_tiny_qwen2_5_vl(os.path.join(root, "t"))
        build_tiny_qwen2_5_vl(os.path.join(root, "d"), layout="nested", perturb=0.05)
    return Engine.from_pretrained(os.path.join(root, "t"), os.path.join(root, "d"), device="cpu",
                                  dtype=torch.float32, views=("M", "T"), gamma=3, tree=tree, adaptive=False)


def test_abort_between_chunks_frees_the_slot():
    """A request aborted between its chunks ends with finish_reason "abort" and no tokens; its
    slot is free again and the next request's tokens are as alone."""
    eng = engine(None, max_batch=1)
    eng.prefill_chunk = 16
    prompt, n = PROMPTS["separated"]
    rid = eng.add_request(prompt, images=images(n), sampling=SP)
    eng.step()
    assert eng.scheduler.filling is not None and eng.runner.parked
    eng.abort(rid)
    outs = eng.step()
    assert [(o.request_id, o.finished, o.output.finish_reason) for o in outs] == [(rid, True, "abort")]
    assert eng.scheduler.filling is None and not eng.runner.parked and not eng.has_unfinished()
    assert run(eng, 16, "separated", True).token_ids == reference("llama", "separated")


def test_option_checks_and_cli():
    assert check_prefill_chunk(None) is None and check_prefill_chunk(0) is None
    assert check_prefill_chunk(64) == 64
    with pytest.raises(ValueError, match="prefill_chunk must be a positive int"):
        check_prefill_chunk(-3)
    for bad in ("64", 1.5, True):
        with pytest.raises(TypeError, match="prefill_chunk"):
            check_prefill_chunk(bad)
    with pytest.raises(ValueError, match="prefill_chunk"):       # before any checkpoint is read
        Engine.from_pretrained("/nonexistent/target", prefill_chunk=-1)
    eng = engine(None)
    with pytest.raises(ValueError, match="prefill_chunk"):
        eng.prefill_chunk = -1
    target, draft, processor = loaded("llama")
    assert Engine(target, processor, device="cpu", max_len=64).prefill_chunk == DEFAULT_PREFILL_CHUNK
    from tabed_engine.serving.cli import build_parser, engine_kwargs
    for argv, want in (([], None), (["--prefill-chunk", "128"], 128), (["--prefill-chunk", "0"], 0)):
        args = build_parser().parse_args(["generate", "--target", "t", "--prompt", "p", *argv])
        assert engine_kwargs(args).get("prefill_chunk") == want
        args = build_parser().parse_args(["serve", "--target", "t", *argv])
        assert engine_kwargs(args).get("prefill_chunk") == want
