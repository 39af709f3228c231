"""Prefix caching (engine/prefix_cache.py): a later request whose prompt starts with what a
slot's row holds (tokens, and for images the same pixels) prefills only the rest, and its greedy
tokens equal the engine's without the cache (float32, CPU): multi-turn chats with an image (AR,
chains, a tree), the same image in a new conversation, a different image with the same text,
eviction and rows written over by running blocks, a batch mixing hits and misses, M-RoPE
(Qwen2.5-VL), the off switch and what the server reports."""
import functools

import pytest
import torch

from realistic import image
from tabed_engine import Engine, SamplingParams, TreeConfig
from tabed_engine.engine import prefix_cache
from tabed_engine.engine.prefix_cache import Entry, PrefixIndex, common_prefix, media_keys
from tabed_engine.engine.prompt import Prepared
from test_real_checkpoints import loaded

SP = SamplingParams(max_new_tokens=8)
MODES = [
    pytest.param(False, {}, id="ar"),
    pytest.param(True, {}, id="chain"),
    pytest.param(True, dict(tree=TreeConfig(3, 2, 2)), id="tree"),
]


@functools.lru_cache(maxsize=None)
def engine(cache: bool, max_batch: int = 4, tree=None):
    target, draft, processor = loaded("llama")
    return Engine(target, processor, draft=draft, device="cpu", dtype=torch.float32, views=("M", "T"),
                  max_len=256, max_batch=max_batch, tree=tree, adaptive=False, prefix_cache=cache)


def pair(max_batch: int = 4, tree=None):
    """(engine with the cache, engine without), each with its own caches; idle, no resident rows."""
    on, off = engine(True, max_batch, tree), engine(False, max_batch, tree)
    if on.runner.prefix is not None:
        on.runner.prefix.entries = [None] * len(on.runner.prefix.entries)
    return on, off


def user(text: str, with_image: bool) -> list[dict]:
    content = ([{"type": "image"}] if with_image else []) + [{"type": "text", "text": text}]
    return [{"role": "user", "content": content}]


def ids_of(eng, messages, images) -> list[int]:
    """The prompt's token ids, image runs expanded (a token-id prompt the engine takes as it is)."""
    return eng._request(messages, images, None, None, False).prep.ids


def tail_ids(eng, text: str, with_image: bool = False) -> list[int]:
    """A follow-up question's tokens as the chat template puts them after an answer (an image in
    it: one image token, which the engine expands)."""
    full = eng.processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "text", "text": "x"}]},
         {"role": "assistant", "content": [{"type": "text", "text": "@@@"}]}] + user(text, with_image),
        add_generation_prompt=True, tokenize=False)
    return eng.tokenizer(full.split("@@@", 1)[1], add_special_tokens=False)["input_ids"]


def shared(a: list[int], b: list[int]) -> int:
    """The length of the common start of two id lists."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def both(on, off, prompt, images, speculative, sp=SP):
    a = on.generate(prompt, images=images, sampling=sp, speculative=speculative)
    b = off.generate(prompt, images=images, sampling=sp, speculative=speculative)
    assert a.token_ids == b.token_ids
    assert b.stats.cached_tokens == 0
    return a


@pytest.mark.parametrize("speculative,options", MODES)
def test_multi_turn_chat_with_an_image(speculative, options):
    """Turns 2 and 3 re-send the conversation (the image, the answers) plus a new question: all of
    the previous turn's row is reused (its prompt and answer but the answer's last token, whose KV
    the next step would have written) and the tokens equal the uncached engine's."""
    on, off = pair(tree=options.get("tree"))
    img = [image(10)]
    prompt = ids_of(on, user("What is shown in this photo?", True), img)
    held = 1                                       # turn 1 reuses nothing
    for question in ["Why is that?", "Tell me more about the colors."]:
        out = both(on, off, prompt, img, speculative)
        assert out.stats.cached_tokens == held - 1
        held = len(prompt) + len(out.token_ids)
        prompt = prompt + out.token_ids + tail_ids(on, question)
    last = both(on, off, prompt, img, speculative)
    assert last.stats.cached_tokens == held - 1


def test_vision_tower_skipped_for_cached_images(monkeypatch):
    """AR: an image wholly inside the reused prefix is not encoded again."""
    on, off = pair()
    img = [image(11)]
    prompt = ids_of(on, user("Describe it.", True), img)
    first = both(on, off, prompt, img, False)
    calls = []
    real = type(on.runner).encode
    monkeypatch.setattr(type(on.runner), "encode", lambda self, prep: calls.append(1) or real(self, prep))
    out = on.generate(prompt + first.token_ids + tail_ids(on, "Why?"), images=img, sampling=SP, speculative=False)
    assert out.stats.cached_tokens > 0 and calls == []


@pytest.mark.parametrize("speculative", [False, True])
def test_same_image_in_a_new_conversation(speculative):
    """A new conversation about the same picture (another question) reuses the prompt up to where
    the questions differ: the image's tokens included."""
    on, off = pair()
    img = [image(12)]
    both(on, off, user("What is shown in this photo?", True), img, speculative)
    img2 = [image(12)]                                 # the same picture, another object
    second = user("How many colors are there?", True)
    a, b = ids_of(on, user("What is shown in this photo?", True), img), ids_of(on, second, img2)
    common = shared(a, b)
    start, n = on._request(second, img2, None, None, False).prep.image_spans[0]
    assert common >= start + n
    out = both(on, off, second, img2, speculative)
    assert out.stats.cached_tokens == common


@pytest.mark.parametrize("defer", [False, True], ids=["views-beside", "views-deferred"])
def test_host_pixels_kept_until_the_last_upload(defer):
    """A picture's array (`Prepared.host_pixels`: the cache key's bytes, every upload's source)
    is dropped once the prefill and the draft's views are done: at the first token, or after
    the views a deferred request prefills before its first drafting block."""
    on = engine(True)
    on.runner.defer_views = defer
    try:
        rid = on.add_request(user("What is shown in this photo?", True), images=[image(14)], speculative=True,
                             sampling=SamplingParams(max_new_tokens=6))
        on.step()                                      # the admission: the first token
        req = next(r for r in on.scheduler.slots if r is not None and r.request_id == rid)
        assert req.prep._media_keys and (req.prep._arrays is not None) == defer
        on.step()                                      # the first block (a deferred request's views first)
        assert req.prep._arrays is None and req.views_pending is None
    finally:
        while on.has_unfinished():
            on.step()
        on.runner.defer_views = None


@pytest.mark.parametrize("speculative", [False, True])
def test_different_image_same_text(speculative):
    """Another picture with the same text: the image tokens' ids are the same, the pixels not, so
    the reuse stops where the image starts."""
    on, off = pair()
    msgs = user("What is shown in this photo?", True)
    both(on, off, msgs, [image(13)], speculative)
    start = on._request(msgs, [image(14)], None, None, False).prep.image_spans[0][0]
    out = both(on, off, msgs, [image(14)], speculative)
    assert 0 < out.stats.cached_tokens == start


@pytest.mark.parametrize("speculative", [False, True])
def test_eviction_and_a_batch_mixing_hits_and_misses(speculative):
    """Two slots: a resident conversation is overwritten when both slots are taken by other
    requests; its next turn then misses its image (and stays right), and a batch of a hit and a
    miss gives each its uncached tokens."""
    on, off = pair(max_batch=2)
    img = [image(15)]
    prompt = ids_of(on, user("What is shown in this photo?", True), img)
    first = both(on, off, prompt, img, speculative)
    start, n = on._request(prompt, img, None, None, False).prep.image_spans[0]
    others = ["Question: how many people stand near the old house?\nAnswer:",
              "Count the windows of the red barn, then the doors:"]
    for a, b in zip(on.generate(others, sampling=[SP, SP], speculative=speculative),
                    off.generate(others, sampling=[SP, SP], speculative=speculative)):
        assert a.token_ids == b.token_ids
    turn2 = prompt + first.token_ids + tail_ids(on, "Why?")
    out = both(on, off, turn2, img, speculative)
    assert out.stats.cached_tokens <= start                  # the image's KV was evicted
    # now turn 2's row is resident: its turn 3 hits, a new text prompt beside it misses
    turn3 = turn2 + out.token_ids + tail_ids(on, "And then?")
    prompts, imgs = [turn3, "The weather on the coast of the island today:"], [img, []]
    hits = on.generate(prompts, images=imgs, sampling=[SP, SP], speculative=speculative)
    ref = off.generate(prompts, images=imgs, sampling=[SP, SP], speculative=speculative)
    assert [o.token_ids for o in hits] == [o.token_ids for o in ref]
    assert hits[0].stats.cached_tokens == len(turn2) + len(out.token_ids) - 1
    assert hits[1].stats.cached_tokens == shared(ids_of(on, prompts[1], []), turn3) < 3   # a miss


@pytest.mark.parametrize("speculative", [False, True])
def test_free_rows_keep_their_prefix_while_blocks_run(speculative):
    """A request that finishes while another runs leaves a free slot inside the batch: the next
    blocks compute a garbage row for it, written from the length its entry holds on (paged KV),
    so its prefix survives and the next turn reuses all of it, with the uncached engine's tokens."""
    on, off = pair()
    img = [image(16)]
    short = ids_of(on, user("What is shown in this photo?", True), img)
    prompts, imgs = [short, "Question: how many people stand near the old house?\nAnswer:"], [img, []]
    sps = [SamplingParams(max_new_tokens=2), SamplingParams(max_new_tokens=14)]
    outs = on.generate(prompts, images=imgs, sampling=sps, speculative=speculative)
    ref = off.generate(prompts, images=imgs, sampling=sps, speculative=speculative)
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    turn2 = short + outs[0].token_ids + tail_ids(on, "Why?")
    again = both(on, off, turn2, img, speculative)
    assert again.stats.cached_tokens == len(short) + len(outs[0].token_ids) - 1


def test_the_off_switch():
    eng = engine(False)
    assert eng.runner.prefix is None
    img = [image(17)]
    msgs = user("What is shown in this photo?", True)
    for _ in range(2):
        assert eng.generate(msgs, images=img, sampling=SP, speculative=False).stats.cached_tokens == 0
    target, draft, processor = loaded("llama")
    with pytest.raises(TypeError, match="prefix_cache"):
        Engine(target, processor, device="cpu", dtype=torch.float32, prefix_cache="yes")
    from tabed_engine.serving.cli import build_parser, engine_kwargs
    args = build_parser().parse_args(["generate", "--target", "t", "--prompt", "p", "--no-prefix-cache"])
    assert engine_kwargs(args)["prefix_cache"] is False
    assert "prefix_cache" not in engine_kwargs(build_parser().parse_args(["serve", "--target", "t"]))


def graphed_pair(max_batch: int):
    """(an engine with the cache on emulated CUDA graphs (`test_batch.emulated_graphs`: caches
    poisoned) and the GPU's 64-token limit on rests, the uncached engine)."""
    from test_batch import emulated_graphs
    target, draft, processor = loaded("llama")
    on = Engine(target, processor, draft=draft, device="cpu", dtype=torch.float32, views=("M", "T"),
                max_len=256, max_batch=max_batch, adaptive=False)
    emulated_graphs(on)
    return on, engine(False, max_batch)


@pytest.mark.parametrize("speculative", [False, True])
def test_graph_path_suffix(speculative):
    """What the GPU runs, on the CPU: the rest of the prompt padded to a 16-token bucket through
    the (emulated) graph of its bucket, every cache slot poisoned first; a rest longer than 64
    tokens reuses the prefix as well, through a 64-token bucket's graph."""
    on, off = graphed_pair(2)
    img = [image(18)]
    prompt = ids_of(on, user("What is shown in this photo?", True), img)
    first = both(on, off, prompt, img, speculative)
    turn2 = prompt + first.token_ids + tail_ids(on, "Why is that? Say it in other words, please.")
    out = both(on, off, turn2, img, speculative)
    assert out.stats.cached_tokens == len(prompt) + len(first.token_ids) - 1
    rest = len(turn2) - out.stats.cached_tokens
    assert ("suffix", -(-rest // 16) * 16) in on.runner.graphs.graphs
    long_rest = turn2 + out.token_ids + tail_ids(on, "a b c d e f g h i j " * 8)
    cached = len(turn2) + len(out.token_ids) - 1
    assert len(long_rest) - cached > 64
    assert both(on, off, long_rest, img, speculative).stats.cached_tokens == cached
    assert ("suffix", -(-(len(long_rest) - cached) // 64) * 64) in on.runner.graphs.graphs


@pytest.mark.parametrize("speculative", [False, True])
def test_one_suffix_graph_serves_every_slot(speculative):
    """A bucket's rest graph is captured once and serves every slot: two chats held in slots 0
    and 1 ask follow-ups of the same length; the second replays the graph the first captured,
    over the staging row loaded with its own slot's table (emulated graphs, caches poisoned), and
    both give the uncached engine's tokens (a graph bound to slot 0 would read and write slot 0's
    pages for the second)."""
    on, off = graphed_pair(2)
    imgs = [[image(18)], [image(19)]]
    prompts = [ids_of(on, user(q, True), im) for q, im in zip(("What is shown in this photo?", "Describe it."), imgs)]
    firsts = on.generate(prompts, images=imgs, sampling=[SP, SP], speculative=speculative)
    for f, p, im in zip(firsts, prompts, imgs):
        assert f.token_ids == off.generate(p, images=im, sampling=SP, speculative=speculative).token_ids
    turn2 = [p + f.token_ids + tail_ids(on, "Why is that?") for f, p in zip(firsts, prompts)]
    outs = on.generate(turn2, images=imgs, sampling=[SP, SP], speculative=speculative)
    for out, t, p, f, im in zip(outs, turn2, prompts, firsts, imgs):
        assert out.token_ids == off.generate(t, images=im, sampling=SP, speculative=speculative).token_ids
        assert out.stats.cached_tokens == len(p) + len(f.token_ids) - 1
    held = [next(i for i, p in enumerate(prompts) if e.ids[:len(p)] == p) for e in on.runner.prefix.entries]
    assert sorted(held) == [0, 1]                      # the two chats' second turns ran in both slots
    suffix = [k for k in on.runner.graphs.graphs if k[0] == "suffix"]
    assert len(suffix) == 1, suffix


def test_warmup_captures_the_rest_graphs():
    """`warmup()` captures every bucket's rest graph (emulated graphs): a chat's cache-hit
    follow-up then captures nothing and gives the uncached engine's tokens."""
    on, off = graphed_pair(1)
    on.warmup()
    buckets = prefix_cache.suffix_buckets(min(on.runner.prefill_graph_max, on.runner.max_len))
    assert buckets[:5] == [16, 32, 48, 64, 128] and buckets[-1] == 256
    assert {("suffix", P) for P in buckets} <= set(on.runner.graphs.graphs)
    img = [image(21)]
    prompt = ids_of(on, user("What is shown in this photo?", True), img)
    first = both(on, off, prompt, img, False)
    keys = set(on.runner.graphs.graphs)
    out = both(on, off, prompt + first.token_ids + tail_ids(on, "Why is that?"), img, False)
    assert out.stats.cached_tokens > 0 and set(on.runner.graphs.graphs) == keys


# ---------------------------------------------------------------- the index alone
def test_matching_needs_equal_pixels_not_only_equal_ids():
    img = 99
    ids = [1, 5, img, img, img, img, 7, 8]
    same = [(2, 2, b"a"), (4, 2, b"b")]                    # two adjacent images: one run of ids
    e = Entry(list(ids), same, 0)
    assert common_prefix(e, ids, same) == len(ids)
    assert common_prefix(e, ids, [(2, 2, b"a"), (4, 2, b"c")]) == 4      # the second picture differs
    assert common_prefix(e, ids, [(2, 2, b"x"), (4, 2, b"b")]) == 2
    assert common_prefix(e, ids, [(2, 4, b"a")]) == 2                    # one image of 4 tokens instead
    assert common_prefix(e, ids[:3] + [6], [(2, 1, b"a")]) == 2         # the same picture, fewer tokens
    assert common_prefix(Entry(ids[:2], [], 0), ids, same) == 2


def test_pixel_keys_follow_the_picture():
    def prep(seed):
        im = image(seed)
        return Prepared([0, 9, 9], None, [(1, 2)], [im])
    assert media_keys(prep(20)) == media_keys(prep(20))
    assert media_keys(prep(20)) != media_keys(prep(21))
    # keyed by the picture the processor receives (its pixels follow from it), whatever
    # pixel_values hold: a picture one pixel different is another key
    other = image(20).copy()
    other.putpixel((0, 0), tuple((c + 1) % 256 for c in other.getpixel((0, 0))))
    assert media_keys(Prepared([0, 9], None, [(1, 1)], [other])) != media_keys(Prepared([0, 9], None, [(1, 1)],
                                                                                         [image(20)]))


def test_content_hash_of_a_large_picture_by_pieces():
    """A picture of more than two HASH_PIECE pieces is hashed piece by piece on threads: the same
    bytes give the same key, and one byte changed in the first, a middle or the last (short)
    piece, or a different header (the picture's size), gives another; sizes at the boundary
    between the one-pass and the piecewise hash are keys of their own too."""
    import numpy as np

    from tabed_engine.engine.prefix_cache import HASH_PIECE, content_hash

    n = 3 * HASH_PIECE + 1234
    data = np.random.default_rng(0).integers(0, 256, n, dtype=np.uint8)
    key = content_hash(b"(RGB, (1, 1))", data)
    assert len(key) == 16 and key == content_hash(b"(RGB, (1, 1))", data.copy())
    for i in (0, HASH_PIECE + 7, n - 1):
        d = data.copy()
        d[i] ^= 1
        assert content_hash(b"(RGB, (1, 1))", d) != key, i
    assert content_hash(b"(RGB, (2, 1))", data) != key
    small = [content_hash(b"h", data[:m]) for m in (2 * HASH_PIECE, 2 * HASH_PIECE + 1)]
    assert small[0] != small[1] and small[0] == content_hash(b"h", bytes(data[:2 * HASH_PIECE]))


def test_media_hash_benchmark_smoke(tmp_path):
    """benchmarks/bench_media_hash.py at two small sizes: a row per size with every timing."""
    import json

    from bench_scripts import load_benchmark

    out = tmp_path / "media_hash.json"
    load_benchmark("bench_media_hash").main(["--out", str(out), "--reps", "1", "--sizes", "64", "48", "30", "20"])
    rows = json.loads(out.read_text())["rows"]
    assert [(r["width"], r["height"]) for r in rows] == [(64, 48), (30, 20)]
    assert all(r[k + "_ms"] > 0 for r in rows for k in ("tobytes", "array", "blake2b", "before", "now"))


def test_slot_choice_prefers_a_hit_then_least_recently_used():
    idx = PrefixIndex(4, 64)
    idx.hold(1, Prepared([1, 2, 3, 4], None, [], []))
    idx.hold(0, Prepared([7, 7, 7], None, [], []))
    p = Prepared([1, 2, 3, 5, 6], None, [], [])
    bucket = lambda n: 1 << (n - 1).bit_length()           # noqa: E731
    # an idle batch: slot 0 keeps it at bucket 1; slot 1's [1, 2, 3] is copied there
    assert idx.pick(p, [0, 1, 2, 3], bucket) == 0 and idx.source(p, 0) == (3, 1)
    assert idx.pick(p, [1, 2, 3], bucket) == 1             # slot 0 runs: bucket 2, slot 1 taken, no copy
    assert idx.source(p, 1) == (3, 1)
    q = Prepared([8, 8], None, [], [])
    assert idx.source(q, 1) == (0, None)
    assert idx.pick(q, [2, 3], bucket) == 2                # slots 0, 1 run: 2 and 3 never used, the lower
    idx.hold(2, Prepared([5], None, [], []))
    assert idx.pick(q, [2, 3], bucket) == 3                # slot 2 holds a prefix, slot 3 nothing
    idx.hold(3, Prepared([6], None, [], []))
    assert idx.pick(q, [2, 3], bucket) == 2                # both hold one: the least recently used
    idx.forget(0)
    assert idx.entries[0] is None


# ---------------------------------------------------------------- M-RoPE
@pytest.mark.parametrize("speculative", [False, True])
def test_qwen2_5_vl_multi_turn(tmp_path_factory, speculative):
    """M-RoPE rows: the reused prefix keeps its 3-D positions and the row's offset is the new
    prompt's; turn 2 (the image, the answer, a question) equals the uncached engine's tokens."""
    from tabed_engine.models.tiny import random_image
    from tabed_engine.models.tiny_qwen2_5_vl import build_tiny_qwen2_5_vl
    root = tmp_path_factory.mktemp("qwen_prefix")
    build_tiny_qwen2_5_vl(str(root / "t"))
    build_tiny_qwen2_5_vl(str(root / "d"), layout="nested", perturb=0.05)
    kw = dict(device="cpu", dtype=torch.float32, views=("M", "T"), gamma=3, adaptive=False)
    on = Engine.from_pretrained(str(root / "t"), str(root / "d"), **kw)
    off = Engine.from_pretrained(str(root / "t"), str(root / "d"), prefix_cache=False, **kw)
    img = [random_image(3, 40)]
    sp = SamplingParams(max_new_tokens=10)
    prompt = ids_of(on, user("What is shown?", True), img)
    first = both(on, off, prompt, img, speculative, sp)
    turn2 = prompt + first.token_ids + tail_ids(on, "And the colors?")
    out = both(on, off, turn2, img, speculative, sp)
    assert out.stats.cached_tokens == len(prompt) + len(first.token_ids) - 1
    # a second image after the cached prefix: its M-RoPE ids follow the reused ones
    turn3 = turn2 + out.token_ids + tail_ids(on, "Compare:", with_image=True)
    imgs = img + [random_image(4, 56)]
    third = both(on, off, turn3, imgs, speculative, sp)
    assert third.stats.cached_tokens == len(turn2) + len(out.token_ids) - 1


def test_media_keys_follow_each_picture_not_the_pixel_rows():
    """Qwen2.5-VL's pixel_values hold patch rows of every image ([patches, 1176]), so a key taken
    from `pixel_values[i]` would be a patch row: two pictures sharing their first patch would
    share a key. Keys follow the whole picture: equal for the same picture, different when one
    pixel differs, even with such flat pixel values."""
    from PIL import Image

    a = Image.new("RGB", (28, 28), (10, 20, 30))
    b = a.copy()
    b.putpixel((27, 27), (11, 20, 30))
    flat = torch.zeros(8, 1176)                       # identical rows for both images
    keys = lambda ims: media_keys(Prepared([1] * 8, flat, [(0, 4), (4, 4)], ims))  # noqa: E731
    assert keys([a, b])[0][2] != keys([a, b])[1][2]
    assert keys([a, a.copy()])[0][2] == keys([a, a.copy()])[1][2]
