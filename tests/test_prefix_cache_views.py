"""Prefix caching of the draft's view rows (engine/view_cache.py): a speculative request whose
view rows start as rows the draft still holds prefills only the rest of each, and everything
equals the engine's without the cache (float32, CPU): the greedy tokens, each view's first-token
distribution (`first_q`, which sets the first block's weights) and the weights. The probes also
check that the reuse happened (the view plans, and the tokens the draft's prefill forward ran) so
a reuse that silently does nothing fails: multi-turn chats (M+T, M+T+P, a tree, an AR turn
between), the same picture in a new conversation, another picture with the same text, eviction,
rows written over by running blocks, chunked prefill, M-RoPE (Qwen2.5-VL) and a draft with its
own processor."""
import functools

import pytest
import torch

from realistic import image
from tabed_engine import Engine, SamplingParams, TreeConfig
from tabed_engine.engine.prefix_cache import Entry
from tabed_engine.engine.runner import Runner
from tabed_engine.engine.view_cache import ViewIndex, fit_plan, view_keys
from test_prefix_cache import ids_of, shared, tail_ids, user
from test_real_checkpoints import loaded

SP = SamplingParams(max_new_tokens=8)


@functools.lru_cache(maxsize=None)
def engine(cache: bool, views=("M", "T"), max_batch: int = 4, tree=None):
    target, draft, processor = loaded("llama")
    return Engine(target, processor, draft=draft, device="cpu", dtype=torch.float32, views=views, policy="kld",
                  max_len=256, max_batch=max_batch, tree=tree, prefix_cache=cache)


def reset(eng):
    """No resident rows (engines are shared between tests)."""
    for index in (eng.runner.prefix, eng.runner.view_prefix):
        if index is not None:
            index.entries = [None] * len(index.entries)


def pair(views=("M", "T"), max_batch: int = 4, tree=None):
    on, off = engine(True, views, max_batch, tree), engine(False, views, max_batch, tree)
    reset(on)
    return on, off


class Probe:
    """Records, per engine, each request's views (their ids), reuse plan and first-token logits
    [K, V], and the sequence length of every draft prefill forward (calls with embeddings)."""

    def __init__(self, monkeypatch, *engines):
        self.q, self.plans, self.keys, self.calls = {}, [], [], []
        real_views, real_plan = Runner._prefill_views, ViewIndex.plan

        def views(runner, req, sel, slot, after):
            q = real_views(runner, req, sel, slot, after)
            self.q.setdefault(id(runner), []).append(q.clone())
            return q

        def plan(index, keys, slot):
            self.keys.append(keys)
            self.plans.append(real_plan(index, keys, slot))
            return self.plans[-1]

        monkeypatch.setattr(Runner, "_prefill_views", views)
        monkeypatch.setattr(ViewIndex, "plan", plan)
        self.towers = []       # vision tower runs (target's or draft's): (images,) per call
        for vision in {id(v): v for e in engines for v in (e.target.vision, e.draft.vision)}.values():
            def select(*a, _real=vision.select_images, **kw):
                self.towers.append(a[0].shape[0])
                return _real(*a, **kw)

            monkeypatch.setattr(vision, "select_images", select)
        for lm in {id(e.draft.lm): e.draft.lm for e in engines}.values():
            real = lm.forward

            def forward(*a, _real=real, **kw):
                if kw.get("embeds") is not None:
                    self.calls.append(tuple(kw["embeds"].shape[:2]))
                return _real(*a, **kw)

            monkeypatch.setattr(lm, "forward", forward)

    def first_q(self, eng) -> torch.Tensor:
        return self.q[id(eng.runner)][-1]


def both(probe, on, off, prompt, images, sp=SP, **kw):
    """The same request on both engines: equal tokens, first-token draft logits and weights.
    Returns (the cached engine's output, its view plan, its views' ids, its draft prefill calls)."""
    probe.calls.clear()
    probe.towers.clear()
    n_plans = len(probe.plans)
    a = on.generate(prompt, images=images, sampling=sp, **kw)
    calls, probe.on_towers = list(probe.calls), list(probe.towers)
    assert len(probe.plans) == n_plans + 1                  # one view lookup
    plan, keys = probe.plans[-1], probe.keys[-1]
    b = off.generate(prompt, images=images, sampling=sp, **kw)
    assert a.token_ids == b.token_ids
    torch.testing.assert_close(probe.first_q(on), probe.first_q(off), atol=1e-4, rtol=1e-4)
    assert torch.allclose(torch.tensor(a.stats.weights[0]), torch.tensor(b.stats.weights[0]), atol=1e-3)
    assert b.stats.draft_cached_tokens == 0
    assert a.stats.draft_cached_tokens == sum(c for c, _ in plan)
    if a.stats.draft_cached_tokens:     # the views' prefill ran only the rests (one padded forward)
        rest = max(len(ids) - c for (ids, _), (c, _) in zip(keys, plan))
        assert calls == [(len(keys), -(-rest // 16) * 16)], (calls, rest)
    return a, plan, [ids for ids, _ in keys], calls


def image_span(ids, token) -> tuple[int, int]:
    start = ids.index(token)
    return start, ids.count(token)


MODES = [
    pytest.param(("M", "T"), None, id="chain-MT"),
    pytest.param(("M", "T", "P"), None, id="chain-MTP"),
    pytest.param(("M", "T"), TreeConfig(3, 2, 2), id="tree-MT"),
]


@pytest.mark.parametrize("views,tree", MODES)
def test_multi_turn_chat(monkeypatch, views, tree):
    """Turns 2 and 3 reuse every view row of the turn before (its prompt and at least the
    answer's tokens the draft's KV held) and prefill the rest only; all equals the uncached
    engine's."""
    on, off = pair(views, tree=tree)
    probe = Probe(monkeypatch, on)
    img = [image(40)]
    prompt = ids_of(on, user("What is shown in this photo?", True), img)
    out, plan, rows, calls = both(probe, on, off, prompt, img)
    assert plan == [(0, None)] * len(views) and out.stats.draft_cached_tokens == 0
    for question in ["Why is that?", "Tell me more about the colors."]:
        prev = rows
        prompt = prompt + out.token_ids + tail_ids(on, question)
        out, plan, rows, calls = both(probe, on, off, prompt, img)
        for k, ((c, src), before, now) in enumerate(zip(plan, prev, rows)):
            assert src == k and len(before) <= c < len(now), (k, plan)      # its own row, no copy
        # the picture lies inside every cached prefix: no vision tower ran, the target's or
        # the draft's (the views' features are computed only for image tokens they prefill)
        assert probe.on_towers == [], probe.on_towers


def test_an_autoregressive_turn_leaves_the_draft_rows(monkeypatch):
    """An AR turn in the slot writes no draft row: the next speculative turn still reuses the
    view rows of the speculative turn before it (and only those)."""
    on, off = pair()
    probe = Probe(monkeypatch, on)
    img = [image(41)]
    prompt = ids_of(on, user("What is shown in this photo?", True), img)
    out, _, rows1, _ = both(probe, on, off, prompt, img)
    prompt = prompt + out.token_ids + tail_ids(on, "Why?")
    ar = on.generate(prompt, images=img, sampling=SP, speculative=False)
    assert ar.token_ids == off.generate(prompt, images=img, sampling=SP, speculative=False).token_ids
    assert ar.stats.draft_cached_tokens == 0
    prompt = prompt + ar.token_ids + tail_ids(on, "And then?")
    _, plan, rows3, _ = both(probe, on, off, prompt, img)
    for (c, _), before, now in zip(plan, rows1, rows3):
        assert len(before) <= c <= len(before) + len(out.token_ids)


def test_a_request_mixing_fewer_views(monkeypatch):
    """A request leaving P out of its mixture has a T row in P's place: it is copied from the
    slot's T row (another view's row), and all stays equal."""
    on, off = pair(("M", "T", "P"))
    probe = Probe(monkeypatch, on)
    img = [image(50)]
    prompt = ids_of(on, user("What is shown in this photo?", True), img)
    out, _, rows, _ = both(probe, on, off, prompt, img)
    turn2 = prompt + out.token_ids + tail_ids(on, "Why?")
    _, plan, rows2, _ = both(probe, on, off, turn2, img, views=("M", "T"))
    assert rows2[2] == rows2[1] and plan[2] == (plan[1][0], 1) and plan[1][0] >= len(rows[1])


def test_chunked_prefill(monkeypatch):
    """A prompt prefilled in chunks of 16 tokens looks its views up after the last chunk."""
    on, off = pair()
    for eng in (on, off):
        monkeypatch.setattr(eng, "prefill_chunk", 16)
    probe = Probe(monkeypatch, on)
    img = [image(49)]
    prompt = ids_of(on, user("What is shown in this photo?", True), img)
    out, _, rows, _ = both(probe, on, off, prompt, img)
    turn2 = prompt + out.token_ids + tail_ids(on, "Why is that? Say it in other words, please.")
    out2, plan, rows2, _ = both(probe, on, off, turn2, img)
    assert out2.stats.prefill_chunks > 1
    assert all(len(a) <= c < len(b) for (c, _), a, b in zip(plan, rows, rows2))


def test_same_image_in_a_new_conversation(monkeypatch):
    """Another question about the same picture: each view reuses up to where the questions
    differ, the M and P rows' image tokens included; the C view (captions) its shared text."""
    views = ("M", "T", "P", "C")
    on, off = pair(views)
    probe = Probe(monkeypatch, on)
    cap = "a small picture"
    both(probe, on, off, user("What is shown in this photo?", True), [image(42)], caption=cap)
    first = probe.keys[-1]
    _, plan, rows, _ = both(probe, on, off, user("How many colors are there?", True), [image(42)], caption=cap)
    tok = on.target.image_token_id
    for k, ((c, _), (before, _), now) in enumerate(zip(plan, first, rows)):
        assert c == shared(before, now) > 0, views[k]
        if views[k] in ("M", "P"):
            assert c >= sum(image_span(now, tok))


def test_another_image_with_the_same_text(monkeypatch):
    """Another picture, the same text: the M and P rows' image tokens have the same ids but
    other features, so their reuse stops where the image starts; the T row (an escape token
    for the image) is the same row and is reused whole but its last token."""
    views = ("M", "T", "P")
    on, off = pair(views)
    probe = Probe(monkeypatch, on)
    msgs = user("What is shown in this photo?", True)
    both(probe, on, off, msgs, [image(43)])
    _, plan, rows, _ = both(probe, on, off, msgs, [image(44)])
    tok = on.target.image_token_id
    for v, (c, _), ids in zip(views, plan, rows):
        assert c == (len(ids) - 1 if v == "T" else image_span(ids, tok)[0]), (v, plan)


def test_eviction_under_a_small_batch(monkeypatch):
    """Two slots: a conversation's draft rows are overwritten when both slots serve other
    requests; its next turn then reuses no image (and stays right)."""
    on, off = pair(max_batch=2)
    probe = Probe(monkeypatch, on)
    img = [image(45)]
    prompt = ids_of(on, user("What is shown in this photo?", True), img)
    out, *_ = both(probe, on, off, prompt, img)
    others = ["Question: how many people stand near the old house?\nAnswer:",
              "Count the windows of the red barn, then the doors:"]
    for a, b in zip(on.generate(others, sampling=[SP, SP]), off.generate(others, sampling=[SP, SP])):
        assert a.token_ids == b.token_ids
    turn2 = prompt + out.token_ids + tail_ids(on, "Why?")
    _, plan, rows, _ = both(probe, on, off, turn2, img)
    assert plan[0][0] <= image_span(rows[0], on.target.image_token_id)[0]
    assert plan[1][0] < len(prompt) // 2


def test_free_view_rows_keep_their_prefix_while_blocks_run(monkeypatch):
    """A request that finishes while another runs leaves a free slot inside the batch: the next
    blocks compute its draft rows as garbage rows written from the length each holds on (paged
    KV), so its view rows survive and the next turn reuses them (beyond the first tokens it
    shares with the other request), with the uncached engine's tokens."""
    on, off = pair()
    probe = Probe(monkeypatch, on)
    img = [image(46)]
    short = ids_of(on, user("What is shown in this photo?", True), img)
    prompts, imgs = [short, "Question: how many people stand near the old house?\nAnswer:"], [img, []]
    sps = [SamplingParams(max_new_tokens=2), SamplingParams(max_new_tokens=14)]
    outs = on.generate(prompts, images=imgs, sampling=sps)
    assert [o.token_ids for o in outs] == [o.token_ids for o in off.generate(prompts, images=imgs, sampling=sps)]
    other = ids_of(on, prompts[1], [])
    turn2 = short + outs[0].token_ids + tail_ids(on, "Why?")
    _, plan, rows, _ = both(probe, on, off, turn2, img)
    assert all(c > max(8, shared(ids, other)) for (c, _), ids in zip(plan, rows))


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    """(engine with the cache, engine without) on a tiny Qwen2.5-VL pair: M, T and P views."""
    from tabed_engine.models.tiny_qwen2_5_vl import build_tiny_qwen2_5_vl
    root = tmp_path_factory.mktemp("qwen_views")
    build_tiny_qwen2_5_vl(str(root / "t"))
    build_tiny_qwen2_5_vl(str(root / "d"), layout="nested", perturb=0.05)
    kw = dict(device="cpu", dtype=torch.float32, views=("M", "T", "P"), gamma=3, policy="kld")
    return (Engine.from_pretrained(str(root / "t"), str(root / "d"), **kw),
            Engine.from_pretrained(str(root / "t"), str(root / "d"), prefix_cache=False, **kw))


def test_a_failed_view_prefill_forgets_the_rows(monkeypatch):
    """A request whose views' prefill fails (its draft rows half written) leaves nothing to
    reuse: the next try prefills its views whole, and right."""
    from tabed_engine.engine import view_cache
    on, off = pair()
    probe = Probe(monkeypatch, on)
    img = [image(51)]
    prompt = ids_of(on, user("What is shown in this photo?", True), img)
    out, *_ = both(probe, on, off, prompt, img)
    turn2 = prompt + out.token_ids + tail_ids(on, "Why?")
    real = view_cache.prefill_rows

    def broken(runner, rows, cache, cached, P):
        # what a failure may leave behind: the rows' own pages (not those shared with other rows) poisoned
        pool = runner.pages.draft
        own = [p for p in cache.block_table.flatten().tolist() if p and pool.refs[p] == 1]
        cache.k[:, own] = float("nan")
        raise RuntimeError("device failure")

    monkeypatch.setattr(view_cache, "prefill_rows", broken)
    with pytest.raises(RuntimeError, match="device failure"):
        on.generate(turn2, images=img, sampling=SP)
    monkeypatch.setattr(view_cache, "prefill_rows", real)
    again, plan, *_ = both(probe, on, off, turn2, img)
    assert plan == [(0, None), (0, None)] and again.stats.draft_cached_tokens == 0


def test_qwen2_5_vl_multi_turn(monkeypatch, qwen):
    """An M-RoPE draft: the reused rows keep their 3-D positions, the rest continues them (a
    second image after the cached prefix included); M, T and P (2x2-pooled merged grids)."""
    from tabed_engine.models.tiny import random_image
    on, off = qwen
    reset(on)
    probe = Probe(monkeypatch, on, off)
    img = [random_image(3, 40)]
    prompt = ids_of(on, user("What is shown?", True), img)
    out, _, rows, _ = both(probe, on, off, prompt, img)
    turn2 = prompt + out.token_ids + tail_ids(on, "Compare:", with_image=True)
    imgs = img + [random_image(4, 56)]
    _, plan, rows2, _ = both(probe, on, off, turn2, imgs)
    assert all(len(a) <= c < len(b) for (c, _), a, b in zip(plan, rows, rows2))
    assert probe.on_towers and probe.on_towers[-1] > 0      # the new image's features: the draft's tower ran


def test_qwen2_5_vl_video(monkeypatch, qwen):
    """Videos: the same frames again reuse the M and P rows past the video; other frames of the
    same size stop them where the video starts (the T row, an escape token, is reused whole)."""
    from tabed_engine.models.tiny_qwen2_5_vl import tiny_video
    on, off = qwen
    reset(on)
    probe = Probe(monkeypatch, on, off)
    content = [{"type": "video"}, {"type": "text", "text": "What happens in the video?"}]
    text = on.processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                            tokenize=False)
    video = tiny_video(5, 4, 28, 44)
    both(probe, on, off, text, None, videos=[video])
    tok = on.target.video_token_id
    _, plan, rows, _ = both(probe, on, off, text, None, videos=[video])
    for v, (c, _), ids in zip(on.views, plan, rows):
        assert c == len(ids) - 1 if v == "T" else c >= sum(image_span(ids, tok)), (v, plan)
    _, plan, rows, _ = both(probe, on, off, text, None, videos=[video[::-1].copy()])
    for v, (c, _), ids in zip(on.views, plan, rows):
        assert c == (len(ids) - 1 if v == "T" else image_span(ids, tok)[0]), (v, plan)


def test_a_draft_with_its_own_processor(monkeypatch):
    """A LLaVA-1.5 draft (its own processor and image-token counts) for a LLaVA-NeXT target."""
    from test_llava_next import loaded as next_loaded
    target, draft, processor, draft_proc = next_loaded("mixed")
    kw = dict(draft=draft, draft_processor=draft_proc, device="cpu", dtype=torch.float32, views=("M", "T", "P"),
              policy="kld", max_len=512, max_batch=2)
    on, off = Engine(target, processor, **kw), Engine(target, processor, prefix_cache=False, **kw)
    probe = Probe(monkeypatch, on)
    img = [image(47, (90, 20))]
    prompt = ids_of(on, user("Describe it.", True), img)
    out, _, rows, _ = both(probe, on, off, prompt, img)
    turn2 = prompt + out.token_ids + tail_ids(on, "Why?")
    _, plan, rows2, _ = both(probe, on, off, turn2, img)
    assert all(len(a) <= c < len(b) for (c, _), a, b in zip(plan, rows, rows2))
    assert len(rows2[0]) != len(turn2)               # the draft's own image-token count


# ---------------------------------------------------------------- the index alone
def test_plan_prefers_its_own_row_and_falls_back_when_nothing_is_saved():
    idx = ViewIndex(2, 2, 64)
    idx.hold(0, [([1, 2, 3, 4], []), ([1, 2, 9], [])])
    # view 0 matches its own row; view 1 ([1, 2, 3, 4, 5]) matches row 0 better than its own
    assert idx.plan([([1, 2, 3, 4, 5], []), ([1, 2, 3, 4, 5], [])], 1) == [(4, 0), (4, 0)]
    assert idx.plan([([1, 2, 3, 4, 5], []), ([1, 2, 9, 9], [])], 0) == [(4, 0), (3, 1)]
    # the last token is never reused; a view that misses makes the forward as long: no reuse
    assert idx.plan([([1, 2, 3, 4], []), ([1, 2, 9], [])], 0) == [(3, 0), (2, 1)]
    assert idx.plan([([1, 2, 3, 4, 5], []), ([7, 7, 7, 7, 7, 7], [])], 0) == [(0, None), (0, None)]
    idx.max_suffix = 1                       # (the GPU's limit: a longer rest prefills whole)
    assert idx.plan([([1, 2, 3, 4, 5], []), ([1, 2, 9, 9], [])], 0) == [(4, 0), (3, 1)]
    assert idx.plan([([1, 2, 3, 4, 5, 6], []), ([1, 2, 9, 9], [])], 0) == [(0, None), (0, None)]
    idx.max_suffix = None
    # media: the same ids with another picture (or the same picture pooled) stop at the run
    idx.hold(1, [([5, 8, 8, 6], [(1, 2, b"a" + b"M")]), ([5, 8, 8, 6], [(1, 2, b"a" + b"P2")])])
    assert idx.plan([([5, 8, 8, 6, 7], [(1, 2, b"a" + b"M")]), ([5, 8, 8, 6, 7], [(1, 2, b"b" + b"M")])], 0) \
        == [(4, 2), (1, 2)]
    idx.forget(1)
    assert idx.entries[2:] == [None, None]
    idx.release(0, [4, 4])
    assert idx.entries[0].ids == [1, 2, 3, 4, 4, 4] and idx.entries[1].ids == [1, 2, 9, 4, 4]
    idx.forget(0)
    assert idx.entries == [None] * 4


def test_view_keys_tag_how_the_draft_embeds_a_picture():
    eng = engine(True, ("M", "T", "P"))
    req = eng._request(user("What is shown in this photo?", True), [image(48)], None, None, True)
    from tabed_engine.speculation.views import build_views
    rows = build_views(eng, req.prep, None, None)
    (m_ids, m), (t_ids, t), (p_ids, p) = view_keys(eng, req.prep, rows)
    assert t == [] and len(m) == len(p) == 1 and m[0][2] != p[0][2]
    assert m[0][:2] == rows[0].spans[0] and p[0][:2] == rows[2].spans[0]
    assert view_keys(eng, req.prep, rows, frozenset("P"))[2][1] == []       # a skipped view is a T row


def test_fit_plan():
    assert fit_plan([(10, 3), (0, None)], [20, 12], 64) == ([(10, 3), (0, None)], 16)
    assert fit_plan([(50, 3), (0, None)], [60, 12], 60) == ([(48, 3), (0, None)], 12)
