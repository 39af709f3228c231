"""Qwen2.5-VL: loading (both key layouts, flat and nested configs), M-RoPE and dynamic
resolution, greedy AR and speculative decoding (chains and trees, every view) token-identical
to transformers' `generate` in float32, and sampling through a Qwen2.5-VL pair lossless."""
import dataclasses
import functools
from collections import Counter

import pytest
import torch
from transformers import Qwen2_5_VLForConditionalGeneration

from tabed_engine import Engine, SamplingParams, TreeConfig
from tabed_engine.models import qwen2_5_vl
from tabed_engine.models.qwen2_5_vl_vision import QwenVision, rope_index
from tabed_engine.models.tiny import random_image
from tabed_engine.models.tiny_qwen2_5_vl import build_tiny_qwen2_5_vl
from tabed_engine.speculation import chain

SP = SamplingParams(max_new_tokens=16)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """target: the published layout; same: its weights in the nested layout; draft: a close
    perturbation of it (nested layout)."""
    root = tmp_path_factory.mktemp("qwen2_5_vl")
    out = {"target": root / "target", "same": root / "same", "draft": root / "draft"}
    build_tiny_qwen2_5_vl(str(out["target"]))
    build_tiny_qwen2_5_vl(str(out["same"]), layout="nested")
    build_tiny_qwen2_5_vl(str(out["draft"]), layout="nested", perturb=0.05)
    return {k: str(v) for k, v in out.items()}


@pytest.fixture(scope="module")
def hf(dirs):
    return Qwen2_5_VLForConditionalGeneration.from_pretrained(dirs["target"], dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def target(dirs):
    return Engine.from_pretrained(dirs["target"], device="cpu", dtype=torch.float32)


def reference(hf, processor, text, images, n=SP.max_new_tokens):
    """transformers' greedy tokens, its inputs built from the image processor and tokenizer."""
    enc = processor(text=text, images=images)
    ids = enc["input_ids"]
    kw = {}
    if images:
        kw = dict(pixel_values=enc["pixel_values"], image_grid_thw=enc["image_grid_thw"],
                  mm_token_type_ids=(ids == hf.config.image_token_id).int())
    with torch.no_grad():
        out = hf.generate(input_ids=ids, attention_mask=enc["attention_mask"], max_new_tokens=n, do_sample=False,
                          **kw)
    new = out[0, ids.shape[1]:].tolist()
    eos = hf.config.text_config.eos_token_id
    return new[:new.index(eos) + 1] if eos in new else new


def chat(eng, kind):
    """(prompt text, images) of a test case."""
    image = {"type": "image"}
    turns = {
        "one image": [{"role": "user", "content": [image, {"type": "text", "text": "What is shown?"}]}],
        "two images": [{"role": "user", "content": [image, {"type": "text", "text": "left"}, image,
                                                    {"type": "text", "text": "Describe the image in detail."}]}],
        "text only": [{"role": "user", "content": "How many cats and dogs are there?"}],
        "multi-turn": [{"role": "user", "content": [image, {"type": "text", "text": "What is shown?"}]},
                       {"role": "assistant", "content": "A red square."},
                       {"role": "user", "content": [image, {"type": "text", "text": "And here? count"}]}],
    }[kind]
    n_images = sum(1 for t in turns if isinstance(t["content"], list) for c in t["content"] if c["type"] == "image")
    images = [random_image(i, size) for i, size in zip(range(n_images), (40, 56))]
    if kind == "two images":     # different sizes and aspect ratios: different grids
        images[1] = images[1].resize((24, 56))
    return eng.processor.apply_chat_template(turns, add_generation_prompt=True, tokenize=False), images


# ---------------------------------------------------------------- config, keys, positions
def test_config_styles_and_key_layouts(dirs):
    import json

    flat = json.load(open(f"{dirs['target']}/config.json"))
    nested = json.load(open(f"{dirs['same']}/config.json"))
    assert "text_config" not in flat and "text_config" in nested
    a, b = qwen2_5_vl.lm_config(flat), qwen2_5_vl.lm_config(nested)
    assert a == b and a.mrope_section == (2, 3, 3) and a.qkv_bias and a.rope_theta == 100.0
    assert qwen2_5_vl.canonical_key("model.layers.0.mlp.up_proj.weight") == ("lm", "layers.0.mlp.up_proj.weight")
    assert qwen2_5_vl.canonical_key("model.language_model.norm.weight") == ("lm", "norm.weight")
    assert qwen2_5_vl.canonical_key("visual.merger.mlp.0.bias") == ("vision", "merger.mlp.0.bias")
    assert qwen2_5_vl.canonical_key("model.visual.blocks.0.attn.qkv.weight") == ("vision", "blocks.0.attn.qkv.weight")
    assert qwen2_5_vl.canonical_key("lm_head.weight") == ("lm", "lm_head.weight")
    bad = dict(flat, rope_scaling={"type": "yarn", "factor": 4.0})
    with pytest.raises(ValueError, match="RoPE type"):
        qwen2_5_vl.lm_config(bad)
    with pytest.raises(ValueError, match="mrope_section"):
        qwen2_5_vl.lm_config(dict(flat, rope_scaling={"type": "mrope", "mrope_section": [2, 2, 2]}))


def test_rope_index_matches_transformers(hf):
    """Images and a video (temporal interval tokens_per_second * seconds per patch) against
    transformers' get_rope_index, and the decode-time delta."""
    img, vid = hf.config.image_token_id, hf.config.video_token_id
    grids = {"image": [[1, 4, 6], [1, 8, 2]], "video": [[3, 4, 4]]}
    ids = [5, 6] + [img] * 6 + [7] + [vid] * 12 + [8, 9, 10] + [img] * 4 + [11]
    second = torch.tensor([0.75])
    t = torch.tensor([ids])
    mm = (t == img).int() + 2 * (t == vid).int()
    want, delta = hf.model.get_rope_index(t, mm, torch.tensor(grids["image"]), torch.tensor(grids["video"]),
                                          second_per_grid_ts=second)
    interval = hf.config.vision_config.tokens_per_second * 0.75
    got = rope_index(len(ids), [(2, 1, 2, 3, 1), (9, 3, 2, 2, interval), (24, 1, 4, 1, 1)])
    assert torch.equal(got, want[:, 0])
    assert int(got.max()) + 1 - len(ids) == int(delta)


@pytest.mark.parametrize("grids", [[(1, 8, 12)], [(1, 14, 10), (1, 4, 6)], [(2, 10, 18)], [(1, 16, 16)],
                                   [(1, 2, 2), (3, 6, 4), (1, 12, 20)]])
def test_tower_forward_matches_transformers(hf, grids):
    """The engine's run of the vision transformer (one attention call per chunk length, the
    window layout and rotary from a plan) gives transformers' features: windows whole and
    partial (grids that are not multiples of the window, one smaller than a window), several
    images, video frames (t > 1)."""
    from tabed_engine.models.qwen2_5_vl_vision import TowerPlan, tower_forward

    tower = hf.model.visual
    vc = hf.config.vision_config
    g = torch.Generator().manual_seed(sum(t * h * w for t, h, w in grids))
    n = sum(t * h * w for t, h, w in grids)
    patches = torch.randn(n, 3 * vc.temporal_patch_size * vc.patch_size ** 2, generator=g)
    want = tower(patches, grid_thw=torch.tensor(grids)).pooler_output
    plan = TowerPlan(grids, vc.spatial_merge_size, vc.window_size, vc.patch_size, tower.rotary_pos_emb.inv_freq, "cpu")
    assert plan.window_groups and plan.frame_groups
    got = tower_forward(tower, patches, plan)
    assert torch.equal(got, want)          # (the same operations per chunk: the same bits in float32)
    # the windows this grid list has: as many chunk lengths as transformers' cu_window_seqlens shows
    lens = [L for L, _, k in plan.window_groups for _ in range(k)]
    assert sum(lens) == n


def test_tower_plans_are_kept_per_grid(target):
    """One plan per grid list, the latest PLANS_KEPT kept: a grid seen again reuses its plan
    (same features), an evicted one is rebuilt alike; too few patches for the grids: ValueError."""
    vis = target.target.vision
    vis._plans.clear()
    dim = 3 * vis.temporal * vis.patch ** 2
    x = torch.randn(8 * 12, dim, generator=torch.Generator().manual_seed(0))
    first = vis.features(x, [(1, 8, 12)])
    plan = vis._plans[((1, 8, 12),), "cpu"]
    assert torch.equal(vis.features(x, [(1, 8, 12)]), first) and vis._plans[((1, 8, 12),), "cpu"] is plan
    for i in range(vis.PLANS_KEPT):
        vis.features(torch.zeros(4 * (i + 1) * 2, dim), [(1, 4, 2 * (i + 1))])
    assert len(vis._plans) == vis.PLANS_KEPT and ((1, 8, 12),) not in [k for k, _ in vis._plans]
    assert torch.equal(vis.features(x, [(1, 8, 12)]), first)
    with pytest.raises(ValueError, match="patches"):
        vis.features(x[:-4], [(1, 8, 12)])


def test_dynamic_resolution_counts_match_the_processor(target):
    """Token counts, grids and pixel patches of images of several sizes as the processor's."""
    vision, ip = target.target.vision, target.processor.image_processor
    sizes = [(40, 40), (56, 24), (13, 64), (64, 9), (300, 200)]
    for h, w in sizes:
        enc = ip([random_image(0, 8).resize((w, h))], return_tensors="pt")
        assert list(enc["image_grid_thw"][0]) == [1, *vision.grid((h, w))]
        assert vision.tokens_per_image([(h, w)]) == [int(enc["image_grid_thw"][0].prod()) // 4]
    h, w = vision.merged_grid((56, 24))
    assert vision.tokens_per_image([(56, 24)], pool=2) == [-(-h // 2) * -(-w // 2)]


# ---------------------------------------------------------------- greedy against transformers
@pytest.mark.parametrize("kind", ["one image", "two images", "text only", "multi-turn"])
def test_greedy_ar_matches_transformers(target, hf, kind):
    text, images = chat(target, kind)
    want = reference(hf, target.processor, text, images)
    out = target.generate(text, images=images, sampling=SP, speculative=False)
    assert out.token_ids == want


def test_m_rope_is_what_makes_it_match(target, hf, monkeypatch):
    """The broken variant: 1-D positions for the image blocks (no M-RoPE) change the tokens."""
    text, images = chat(target, "two images")
    want = reference(hf, target.processor, text, images)
    monkeypatch.setattr(QwenVision, "positions", lambda self, *a, **k: None)
    assert target.generate(text, images=images, sampling=SP, speculative=False).token_ids != want


def test_both_key_layouts_load_alike(dirs, target):
    text, images = chat(target, "one image")
    same = Engine.from_pretrained(dirs["same"], device="cpu", dtype=torch.float32)
    assert same.generate(text, images=images, sampling=SP, speculative=False).token_ids == \
        target.generate(text, images=images, sampling=SP, speculative=False).token_ids


@functools.lru_cache(maxsize=None)
def sd_engine(target_dir, draft_dir, views, tree, policy="kld", gamma=3, **kw):
    return Engine.from_pretrained(target_dir, draft_dir, device="cpu", dtype=torch.float32, views=views,
                                  policy=policy, gamma=gamma, tree=tree, adaptive=False, **kw)


@pytest.mark.parametrize("tree", [None, TreeConfig(3, 2, 2)], ids=["chain", "tree"])
@pytest.mark.parametrize("kind", ["two images", "text only"])
def test_speculative_matches_transformers(dirs, hf, tree, kind):
    eng = sd_engine(dirs["target"], dirs["draft"], ("M", "T", "P", "C"), tree)
    text, images = chat(eng, kind)
    want = reference(hf, eng.processor, text, images)
    out = eng.generate(text, images=images, sampling=SP, caption="a red square")
    assert out.token_ids == want
    assert sum(out.stats.accepted_lengths) > 0


# a tree whose frontier always holds the greedy path (branch 1: every frontier node's one child)
@pytest.mark.parametrize("tree", [None, TreeConfig(3, 2, 1)], ids=["chain", "tree"])
def test_identical_draft_accepts_every_token(dirs, tree, monkeypatch):
    """A draft with the target's weights (M view) drafts exactly the target's tokens only with
    the right M-RoPE positions in its prefill and in every drafted and verified position after
    it; the broken variant (the draft rows' position offsets left at 0) loses acceptance."""
    # no prefix cache: the second run must prefill its draft rows again, not reuse the first's
    eng = sd_engine(dirs["target"], dirs["same"], ("M",), tree, policy="uniform", prefix_cache=False)
    text, images = chat(eng, "two images")
    out = eng.generate(text, images=images, sampling=SP)
    assert all(n == 3 for n in out.stats.accepted_lengths[:-1]), out.stats.accepted_lengths
    right = out.token_ids
    real = chain.prompt_positions
    monkeypatch.setattr(chain, "prompt_positions", lambda *a: (real(*a)[0], [0] * len(a[1])))
    out = eng.generate(text, images=images, sampling=SP)
    assert out.token_ids == right              # lossless all the same
    assert any(n < 3 for n in out.stats.accepted_lengths[:-1])


def test_pooled_view_rows(dirs):
    """The P row: 2x2-pooled grids, token counts as `view_lengths` counts them, M-RoPE ids over
    the pooled grid; the T row has no image tokens and 1-D positions."""
    from tabed_engine.speculation.views import build_views, view_lengths

    eng = sd_engine(dirs["target"], dirs["draft"], ("M", "T", "P", "C"), None)
    text, images = chat(eng, "two images")
    from tabed_engine.engine.prompt import prepare
    prep = prepare(eng.processor, text, images, eng.target.image_token_id, eng.tokens_per_image)
    rows = build_views(eng, prep, None, "a red square")
    assert [len(r.ids) for r in rows] == view_lengths(eng, prep, "a red square")
    m, t, p, c = rows
    vision = eng.draft.vision
    sizes = prep.image_sizes
    assert [n for _, n in p.spans] == vision.tokens_per_image(sizes, pool=2) != vision.tokens_per_image(sizes)
    h, w = vision.merged_grid(sizes[0], pool=2)
    start = p.spans[0][0]
    assert p.positions[1, start:start + h * w].tolist() == [start + i for i in range(h) for _ in range(w)]
    assert p.positions[2, start:start + h * w].tolist() == [start + j for _ in range(h) for j in range(w)]
    assert t.positions is None and c.positions is None and eng.target.image_token_id not in t.ids
    assert torch.allclose(p.features()[0][0], m.features()[0].view(*vision.merged_grid(sizes[0]), -1)[:2, :2].mean((0, 1)),
                          atol=1e-6)


KINDS = ["two images", "one image", "text only", "multi-turn"]


@pytest.mark.parametrize("speculative", [False, True], ids=["ar", "sd"])
def test_batched_padded_prefill_matches_transformers(dirs, hf, speculative):
    """Four requests through two slots (rows of one batch with different position offsets; a
    text-only request takes a slot an image request left), the target's prefill padded to its
    bucket with the M-RoPE ids as a graph input (the GPU graphs' inputs, run eagerly here)."""
    eng = Engine.from_pretrained(dirs["target"], dirs["draft"], device="cpu", dtype=torch.float32,
                                 views=("M", "T"), gamma=3, max_batch=2, adaptive=False)
    eng.runner.prefill_graphs = True
    cases = [chat(eng, k) for k in KINDS]
    outs = eng.generate([t for t, _ in cases], images=[im for _, im in cases], sampling=SP, speculative=speculative)
    for kind, (text, images), out in zip(KINDS, cases, outs):
        assert out.token_ids == reference(hf, eng.processor, text, images), kind
    assert eng.runner._prefill_pos is not None


@pytest.mark.gpu
def test_gpu_float32_matches_transformers(dirs, hf):
    """CUDA: the fused rope / KV-write kernels fed offset positions, the prefill and block
    graphs, AR and SD (chains and a tree) equal to transformers on the CPU."""
    for tree in (None, TreeConfig(3, 2, 2)):
        eng = Engine.from_pretrained(dirs["target"], dirs["draft"], device="cuda", dtype=torch.float32,
                                     views=("M", "T", "P"), gamma=3, tree=tree)
        for kind in KINDS:
            text, images = chat(eng, kind)
            want = reference(hf, eng.processor, text, images)
            for speculative in (False, True):
                assert eng.generate(text, images=images, sampling=SP, speculative=speculative).token_ids == want


# ---------------------------------------------------------------- images preprocessed on the device
def test_device_images_equal_processor_path(dirs, hf, monkeypatch):
    """device_images=True (image_ops' Qwen2-VL preprocessing, the CUDA default; forced here on the
    CPU): the prompt is tokenized without the image processor (the processor path's ids and spans),
    the pixels and grids equal the processor's bit for bit, and the greedy tokens, AR then SD (the
    SD turn's images lie in the cached prefix: the draft's views preprocess them), equal the
    processor path's and transformers'."""
    import tabed_engine.models.image_ops as ops

    eng = sd_engine(dirs["target"], dirs["draft"], ("M", "T", "P"), None, device_images=True)
    host = sd_engine(dirs["target"], dirs["draft"], ("M", "T", "P"), None)
    assert eng.device_images and not host.device_images          # (the CPU's default: the processor)
    assert ops.supports(eng.processor.image_processor, eng.target.vision.anyres)
    calls = []
    real = ops.device_pixels
    monkeypatch.setattr(ops, "device_pixels", lambda *a, **k: calls.append(len(a[0])) or real(*a, **k))
    for kind in ("two images", "multi-turn"):
        text, images = chat(eng, kind)
        a = host._request(text, images, None, None, True).prep
        b = eng._request(text, images, None, None, True).prep
        assert (b.ids, b.image_spans) == (a.ids, a.image_spans) and b.pixel_values is None
        ours = ops.device_inputs(b.images, eng.processor.image_processor, "cpu")
        assert torch.equal(ours["pixel_values"], a.pixel_values)
        assert torch.equal(ours["image_grid_thw"], eng.processor(text, images)["image_grid_thw"])
        want = reference(hf, eng.processor, text, images)
        calls.clear()
        for speculative in (False, True):
            for e in (eng, host):
                out = e.generate(text, images=images, sampling=SP, speculative=speculative)
                assert out.token_ids == want, (kind, speculative, e.device_images)
        assert calls == [len(images)] * 2, calls     # the prefill's, then the draft views'


# ---------------------------------------------------------------- sampling is lossless
SAMPLING = SamplingParams(max_new_tokens=2, temperature=0.8, top_k=3, stop_at_eos=False)


def exact_distribution(hf, processor, text, images, sp, n_tok):
    """transformers' exact distribution of the first n_tok sampled tokens (top-k support)."""
    enc = processor(text=text, images=images)
    base = enc["input_ids"]
    dist = {(): 1.0}
    for _ in range(n_tok):
        nxt = {}
        for seq, pr in dist.items():
            ids = torch.cat([base, torch.tensor([seq], dtype=torch.long)], 1)
            with torch.no_grad():
                logits = hf(input_ids=ids, pixel_values=enc["pixel_values"], image_grid_thw=enc["image_grid_thw"],
                            mm_token_type_ids=(ids == hf.config.image_token_id).int()).logits[0, -1]
            top = (logits / sp.temperature).topk(sp.top_k)
            p = top.values.softmax(-1)
            for t, q in zip(top.indices.tolist(), p.tolist()):
                nxt[seq + (t,)] = pr * q
        dist = nxt
    return dist


@pytest.mark.slow
def test_sampling_is_lossless(dirs, hf):
    """Sampled 2-token continuations through a Qwen2.5-VL pair (M and T views, chains of 2)
    against transformers' exact distribution; the same check rejects a 4% shift of mass."""
    from test_speculative import check_lossless

    eng = sd_engine(dirs["target"], dirs["draft"], ("M", "T"), None, gamma=2)
    text, images = chat(eng, "one image")
    dist = exact_distribution(hf, eng.processor, text, images, SAMPLING, 2)
    n, batch = 3200, 16
    counts, accepted = Counter(), 0
    for start in range(0, n, batch):
        sps = [dataclasses.replace(SAMPLING, seed=s) for s in range(start, start + batch)]
        for out in eng.generate([text] * batch, images=[images] * batch, sampling=sps):
            counts[tuple(out.token_ids)] += 1
            accepted += sum(out.stats.accepted_lengths)
    assert accepted > n * 0.15
    check_lossless(counts, dist, n, shift=0.04, power=0.95)    # (96%: the likeliest outcome has p = 0.47)


def test_padded_vocabularies_pair(dirs, tmp_path):
    """A target whose embedding rows are padded past the draft's (as the published 7B's 152064
    rows over the 3B's 151936): the draft is fitted to the target's vocabulary, SD == transformers."""
    import shutil

    padded = str(tmp_path / "padded")          # the target with 10 padding rows (head and embedding)
    hf_padded = Qwen2_5_VLForConditionalGeneration.from_pretrained(dirs["target"], dtype=torch.float32).eval()
    hf_padded.resize_token_embeddings(hf_padded.config.text_config.vocab_size + 10, mean_resizing=False)
    hf_padded.save_pretrained(padded)
    for name in ("tokenizer.json", "tokenizer_config.json", "preprocessor_config.json", "chat_template.json"):
        shutil.copy(f"{dirs['target']}/{name}", padded)
    eng = Engine.from_pretrained(padded, dirs["draft"], device="cpu", dtype=torch.float32, views=("M", "T"),
                                 gamma=3, adaptive=False)
    assert eng.draft.lm.cfg.vocab_size == eng.target.lm.cfg.vocab_size == len(eng.tokenizer) + 10
    text, images = chat(eng, "two images")
    out = eng.generate(text, images=images, sampling=SP)
    assert out.token_ids == reference(hf_padded, eng.processor, text, images)
    assert sum(out.stats.accepted_lengths) > 0


def test_views_of_different_buckets_prefill_packed(dirs, monkeypatch):
    """The M, T and P rows (M-RoPE ids, each row its own offset) of different prompt buckets
    prefilled as one packed stream, each at its own bucket: the same tokens, accepted lengths
    and view weights as one batch padded to the longest row."""
    from test_batch import pack_views

    pack, packed = pack_views(monkeypatch)
    outs = []
    for on in (False, True):
        pack(on)
        eng = sd_engine(dirs["target"], dirs["draft"], ("M", "T", "P"), None, prefix_cache=False)
        text, images = chat(eng, "two images")
        outs.append(eng.generate(text, images=images, sampling=SP))
    assert packed and len(set(packed[0])) > 1, packed
    a, b = outs
    assert b.token_ids == a.token_ids
    assert b.stats.accepted_lengths == a.stats.accepted_lengths and sum(a.stats.accepted_lengths) > 0
    assert b.stats.weights == a.stats.weights
