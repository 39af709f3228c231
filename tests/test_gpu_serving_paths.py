"""On the GPU in float32 (CUDA graphs on, the suffix graphs of cache hits and chunks included):
the paths that save prefill work — the prefix cache of the target's and the draft views' rows,
and chunked prefill — give the greedy tokens of an engine with neither, over a multi-turn chat
with an image, the same image in a new conversation, and a batch whose prompts split into
chunks while others decode. The reuse is checked to happen (cached tokens > 0)."""
import pytest
import torch

from realistic import image
from test_prefix_cache import ids_of, tail_ids, user

pytestmark = pytest.mark.gpu


DEVICE = "cuda"


def _engines(tree=None, chunk=37):
    from realistic import checkpoint
    from tabed_engine import Engine

    target, draft = checkpoint("llama")
    kw = dict(device=DEVICE, dtype=torch.float32, views=("M", "T"), policy="kld", max_len=512, max_batch=4,
              tree=tree, adaptive=False)
    fast = Engine.from_pretrained(target, draft, prefix_cache=True, prefill_chunk=chunk, **kw)
    plain = Engine.from_pretrained(target, draft, prefix_cache=False, prefill_chunk=None, **kw)
    return fast, plain


# chunks of 37 tokens run the kernels' tree-mask path, of 100 their causal mode (past 64 tokens)
@pytest.mark.parametrize("tree,chunk", [(None, 37), ("4x2x2", 37), (None, 100)])
def test_gpu_cached_and_chunked_prefill_equal_plain(tree, chunk):
    from tabed_engine import SamplingParams

    fast, plain = _engines(tree, chunk)
    sp = SamplingParams(max_new_tokens=12)
    img = [image(40)]
    prompt = ids_of(fast, user("What is shown in this photo?", True), img)
    for turn, question in enumerate(["", "Why is that?", "Tell me more about the colors."]):
        if question:
            prompt = prompt + out.token_ids + tail_ids(fast, question)
        out = fast.generate(prompt, images=img, sampling=sp)
        want = plain.generate(prompt, images=img, sampling=sp, speculative=False)
        assert out.token_ids == want.token_ids, turn
        if turn:
            assert out.stats.cached_tokens > 0 and out.stats.draft_cached_tokens > 0, turn
    fresh = ids_of(fast, user("Describe the picture in one word.", True), img)
    out = fast.generate(fresh, images=img, sampling=sp)
    assert out.token_ids == plain.generate(fresh, images=img, sampling=sp, speculative=False).token_ids
    assert out.stats.cached_tokens > 0
    # a batch: prompts of several chunks each, admitted while others decode
    prompts = [ids_of(fast, user("Question %d: what colour is the sky? " % i * (1 + i % 3), True), [image(50 + i)])
               for i in range(6)]
    imgs = [[image(50 + i)] for i in range(6)]
    got = [o.token_ids for o in fast.generate(prompts, images=imgs, sampling=sp)]
    want = [o.token_ids for o in plain.generate(prompts, images=imgs, sampling=sp, speculative=False)]
    assert got == want
