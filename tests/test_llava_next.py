"""LLaVA-NeXT (any-resolution) targets and drafts on checkpoints that look published
(tests/next_models.py): per-image token counts, tile features packed as transformers packs
them, and greedy decoding token-identical to transformers `generate(do_sample=False)`
(float32, CPU) for AR and SD, one and two images of different aspect ratios, a LLaVA-1.5-style
draft for a LLaVA-NeXT target, and batched requests."""
import functools
import json
import os
import shutil
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoProcessor, LlavaNextConfig, LlavaNextForConditionalGeneration
from transformers.models.llava_next.modeling_llava_next import LlavaNextModel

from next_models import FIXTURES, checkpoint
from realistic import greedy_new_tokens, image
from tabed_engine import Engine, SamplingParams
from tabed_engine.models.anyres import AnyRes, pack
from tabed_engine.models.loader import load_lvlm, load_processor, lvlm_from_hf
from tabed_engine.engine.prompt import prepare
from tabed_engine.speculation.views import build_views, view_lengths

N_NEW = 16
NEXT = ["vicuna", "mistral", "llama3", "yi", "qwen"]   # LLaVA-NeXT targets with LLaVA-NeXT drafts
WIDE, TALL, SQUARE = (90, 20), (25, 90), (60, 50)          # PIL (width, height)
PROMPTS = {   # name: (prompt, image sizes)
    "wide": ("USER: <image>\nDescribe the picture in detail. ASSISTANT:", [WIDE]),
    "two": ("USER: The first photo: <image>\nThe second photo: <image>\nWhat is different? ASSISTANT:",
            [TALL, SQUARE]),
    "chat": ([{"role": "user", "content": [{"type": "image"}, {"type": "image"},
                                           {"type": "text", "text": "Compare the two photos."}]}], [SQUARE, WIDE]),
}
SD_CONFIGS = [(("M", "T"), "hedge", 5), (("M", "T"), "w-grid", 3), (("M", "T", "P"), "hedge", 3),
              (("M", "T", "P"), "w-grid", 5)]


def images(prompt_name):
    return [image(30 + i, size) for i, size in enumerate(PROMPTS[prompt_name][1])]


@functools.lru_cache(maxsize=None)
def loaded(name):
    target, draft = checkpoint(name)
    draft_proc = load_processor(draft) if FIXTURES[name]["draft"] == "llava" else None
    return (load_lvlm(target, "cpu", torch.float32), load_lvlm(draft, "cpu", torch.float32),
            load_processor(target), draft_proc)


def engine(name, views=("M", "T"), policy="hedge", gamma=5, device_images=None):
    target, draft, processor, draft_proc = loaded(name)
    return Engine(target, processor, draft=draft, draft_processor=draft_proc, device="cpu", dtype=torch.float32,
                  views=views, policy=policy, gamma=gamma, max_len=512, device_images=device_images)


@functools.lru_cache(maxsize=None)
def transformers_model(path):
    return (AutoProcessor.from_pretrained(path, local_files_only=True),
            LlavaNextForConditionalGeneration.from_pretrained(path, local_files_only=True,
                                                              dtype=torch.float32).eval())


def encode(proc, prompt, imgs):
    if isinstance(prompt, list):
        it = iter(imgs)
        msgs = [{**m, "content": [{**c, "image": next(it)} if c["type"] == "image" else c for c in m["content"]]}
                for m in prompt]
        return proc.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=True,
                                        return_tensors="pt")
    return proc(text=prompt, images=imgs, return_tensors="pt")


@functools.lru_cache(maxsize=None)
def reference(name, prompt_name):
    """transformers' greedy new tokens (up to and including EOS) through its own processor."""
    proc, hf = transformers_model(checkpoint(name)[0])
    enc = encode(proc, PROMPTS[prompt_name][0], images(prompt_name))
    return greedy_new_tokens(hf, enc, N_NEW)


def generate(eng, prompt_name, speculative):
    return eng.generate(PROMPTS[prompt_name][0], images=images(prompt_name),
                        sampling=SamplingParams(max_new_tokens=N_NEW), speculative=speculative)


# ---------------------------------------------------------------------------- packing and counts
@pytest.mark.parametrize("tile,patch,pins", [(28, 7, [[28, 56], [56, 28], [56, 56]]),
                                             (30, 6, [[30, 60], [60, 30], [60, 60], [90, 30], [30, 90]]),
                                             (36, 4, [[36, 72], [72, 36], [108, 36], [72, 72]])])
def test_pack_equals_transformers(tile, patch, pins):
    """`anyres.pack` (any grid side) and `AnyRes.num_tokens` against transformers'
    `pack_image_features` and LlavaNextProcessor's count, for sizes that unpad rows, columns
    or nothing, with odd rounding."""
    from transformers import CLIPVisionConfig, LlavaNextProcessor

    cfg = LlavaNextConfig(vision_config=CLIPVisionConfig(image_size=tile, patch_size=patch),
                          image_grid_pinpoints=pins)
    layout = AnyRes.from_config(cfg)
    counter = SimpleNamespace(image_processor=SimpleNamespace(image_grid_pinpoints=pins), patch_size=patch,
                              num_additional_image_tokens=1)
    counter._get_unpadded_features = functools.partial(LlavaNextProcessor._get_unpadded_features, counter)
    g, C = tile // patch, 5
    newline = torch.randn(C)
    for h, w in [(20, 90), (90, 25), (50, 60), (33, 100), (1000, 37), (tile, tile), (7, 9), (301, 299)]:
        n = layout.num_tiles((h, w))
        feats = torch.randn(n, g * g, C)
        ref, lens = LlavaNextModel.pack_image_features(SimpleNamespace(config=cfg), [feats], torch.tensor([[h, w]]),
                                                       "default", newline)
        ours = pack(feats, (h, w), layout, newline)
        assert torch.equal(ours, ref[0]), (h, w)
        assert layout.num_tokens((h, w)) == ours.shape[0] == \
            LlavaNextProcessor._get_number_of_features(counter, h, w, tile, tile) - 1
        small = torch.randn(n, 4, C)                     # a pooled 2x2 grid packs the same way
        assert pack(small, (h, w), layout, newline).shape[0] == layout.num_tokens((h, w), grid=2)
    with pytest.raises(ValueError, match="multiples"):
        AnyRes(((28, 50),), 28, 4)


@pytest.mark.parametrize("name", NEXT)
def test_features_equal_transformers(name):
    """Loaded weights (legacy / current sharded layouts) give transformers' image features,
    image by image; `lvlm_from_hf` maps an in-memory model the same way."""
    path = checkpoint(name)[0]
    proc, hf = transformers_model(path)
    ours = load_lvlm(path, "cpu", torch.float32)
    assert ours.vision.anyres is not None and torch.equal(ours.vision.image_newline, hf.model.image_newline)
    imgs = [image(1, WIDE), image(2, TALL), image(3, SQUARE)]
    enc = proc(text="<image>" * 3, images=imgs, return_tensors="pt")
    with torch.no_grad():
        out = hf.model.get_image_features(enc["pixel_values"], enc["image_sizes"])
        ref = getattr(out, "pooler_output", out)        # transformers 4.x returns the list itself
    sizes = [(im.height, im.width) for im in imgs]
    for model in (ours, lvlm_from_hf(hf)):
        feats = model.vision.image_features(model.vision.select_images(enc["pixel_values"], sizes), sizes)
        assert [f.shape[0] for f in feats] == [r.shape[0] for r in ref] == model.vision.tokens_per_image(sizes)
        for f, r in zip(feats, ref):
            torch.testing.assert_close(f, r, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", NEXT)
def test_token_counts_follow_the_processor(name):
    """Each image's run is the processor's count for its size; the counts differ per image."""
    eng = engine(name)
    proc = transformers_model(checkpoint(name)[0])[0]
    imgs = [image(5, WIDE), image(6, TALL), image(7, SQUARE)]
    prep = prepare(eng.processor, "A<image> b<image><image>", imgs, eng.target.image_token_id, eng.tokens_per_image)
    counts = [n for _, n in prep.image_spans]
    assert len(set(counts)) == 3
    for im, n in zip(imgs, counts):
        assert proc(text="<image>", images=[im])["input_ids"][0].count(eng.target.image_token_id) == n


# ---------------------------------------------------------------------------- greedy equality
@pytest.mark.parametrize("prompt_name", list(PROMPTS))
@pytest.mark.parametrize("name", NEXT)
def test_ar_equals_transformers(name, prompt_name):
    ref = reference(name, prompt_name)
    assert len(set(ref)) >= 4, "the fixture's greedy output is too uniform to compare"
    out = generate(engine(name), prompt_name, speculative=False)
    assert out.token_ids == ref and not out.stats.speculative


@pytest.mark.parametrize("views,policy,gamma", SD_CONFIGS, ids=lambda v: "+".join(v) if isinstance(v, tuple) else v)
@pytest.mark.parametrize("prompt_name", list(PROMPTS))
@pytest.mark.parametrize("name", NEXT + ["mixed"])
def test_sd_equals_transformers(name, prompt_name, views, policy, gamma):
    out = generate(engine(name, views, policy, gamma), prompt_name, speculative=True)
    assert out.token_ids == reference(name, prompt_name)
    s = out.stats
    assert s.speculative and len(s.accepted_lengths) == s.target_forwards >= 1
    assert all(len(w) == len(views) for w in s.weights)


@pytest.mark.parametrize("name,least", [("vicuna", 3), ("mistral", 3), ("llama3", 3), ("yi", 3), ("qwen", 3),
                                              ("mixed", 1)])
def test_drafts_are_accepted(name, least):
    """The LLaVA-NeXT drafts are close enough that blocks accept several tokens (so the equality
    tests cover acceptance and rollback, not only rejection). The LLaVA-1.5 draft sees 16 tokens
    of another preprocessing where the target sees 34-88: with random weights its blocks
    accept 0-1 tokens."""
    acc = [a for p in PROMPTS for a in generate(engine(name, ("M", "T"), "kld"), p, True).stats.accepted_lengths]
    assert max(acc) >= least and min(acc) == 0


def test_views_have_their_own_spans():
    """M rows carry the draft's own image tokens: a LLaVA-NeXT draft packs like the target,
    a LLaVA-1.5 draft has its fixed grid (4x4 = 16) whatever the image; P packs the pooled tiles
    (2x2 grids here); T has one escape token an image."""
    imgs = images("two")
    sizes = [(im.height, im.width) for im in imgs]
    for name, m_counts in (("vicuna", None), ("mixed", [16, 16])):
        eng = engine(name, ("M", "T", "P"))
        req = eng._request(PROMPTS["two"][0], imgs, None, None, True)
        prep = req.prep
        assert [n for _, n in prep.image_spans] == eng.tokens_per_image(imgs)
        assert (prep.draft_pixel_values is None) == (name == "vicuna")
        m, t, p = build_views(eng, prep, None, None)
        assert [n for _, n in m.spans] == (m_counts or eng.tokens_per_image(imgs))
        layout = eng.draft.vision.anyres
        assert [n for _, n in p.spans] == ([4, 4] if layout is None else [layout.num_tokens(s, grid=2) for s in sizes])
        assert t.ids.count(eng.escape_token) >= 2 and eng.target.image_token_id not in t.ids
        assert all(f.shape[0] == n for f, (_, n) in zip(m.features() + p.features(), m.spans + p.spans))


@pytest.mark.parametrize("name", ["vicuna", "mistral", "mixed"])
def test_view_lengths_without_the_tower(name):
    """`view_lengths` (the add-time check of the draft's position limit) counts each view row
    as `build_views` builds it, for every view, a view left out of the mixture, one and two
    images, with and without the escape token."""
    eng = engine(name, ("M", "T", "P", "C"))
    for prompt_name in PROMPTS:
        req = eng._request(PROMPTS[prompt_name][0], images(prompt_name), None, "a red car", True)
        for skip in (frozenset(), frozenset({"M", "C"})):
            rows = build_views(eng, req.prep, None, "a red car", skip)
            assert view_lengths(eng, req.prep, "a red car", skip) == [len(r.ids) for r in rows]
    eng.escape_token = None
    rows = build_views(eng, req.prep, None, "a red car")
    assert view_lengths(eng, req.prep, "a red car") == [len(r.ids) for r in rows]


@pytest.mark.parametrize("speculative", [False, True])
def test_batched_equals_alone(speculative):
    eng = engine("mixed", ("M", "T", "P"), "w-grid", 3)
    a, b, c = image(41, WIDE), image(42, TALL), image(43, SQUARE)
    p1, p2 = "USER: <image>\nWhat is this? ASSISTANT:", "USER: <image> and <image>\nCompare them. ASSISTANT:"
    sp = SamplingParams(max_new_tokens=N_NEW)
    both = eng.generate([p1, p2], images=[[a], [b, c]], sampling=sp, speculative=speculative)
    alone = [eng.generate(p1, images=[a], sampling=sp, speculative=speculative),
             eng.generate(p2, images=[b, c], sampling=sp, speculative=speculative)]
    assert [o.token_ids for o in both] == [o.token_ids for o in alone]
    assert all(len(set(o.token_ids)) >= 3 for o in alone)


def test_token_id_prompt_equals_transformers():
    """One image token per image in a token-id prompt expands to each image's own count."""
    eng = engine("vicuna", ("M", "T"), "kld", 3)
    ids = eng.tokenizer.encode(PROMPTS["two"][0])
    assert ids.count(eng.target.image_token_id) == 2
    out = eng.generate(ids, images=images("two"), sampling=SamplingParams(max_new_tokens=N_NEW))
    assert out.token_ids == reference("vicuna", "two")


# ---------------------------------------------------------------------------- device preprocessing
@pytest.mark.parametrize("name", NEXT + ["mixed"])
def test_device_images_equal_transformers(name):
    """device_images=True forced on the CPU (image_ops computes the any-resolution tiles, and the
    LLaVA-1.5 draft's own CLIP pixels): AR and SD greedy equal transformers' through its processor,
    one and two images of different aspect ratios, alone and batched."""
    eng = engine(name, ("M", "T", "P"), "w-grid", 3, device_images=True)
    assert eng.device_images and eng.draft_device_images == (name == "mixed")
    for prompt_name in PROMPTS:
        for speculative in (False, True):
            out = generate(eng, prompt_name, speculative)
            assert out.token_ids == reference(name, prompt_name), (prompt_name, speculative)
            assert out.stats.speculative == speculative
    names = ["wide", "two"]
    outs = eng.generate([PROMPTS[n][0] for n in names], images=[images(n) for n in names],
                        sampling=SamplingParams(max_new_tokens=N_NEW))
    assert [o.token_ids for o in outs] == [reference(name, n) for n in names]


@pytest.mark.parametrize("name", NEXT + ["mixed"])
def test_device_images_prepare_like_the_processor(name):
    """With device_images the prompt is expanded from the tokenizer alone: the processor's ids and
    spans for every prompt; the pixels computed at prefill (target's, and the draft's own in the
    views) equal the processors' pixel_values."""
    from tabed_engine.models.image_ops import device_inputs

    eng, host = engine(name, device_images=True), engine(name)
    proc = transformers_model(checkpoint(name)[0])[0]
    for prompt_name, (prompt, _) in PROMPTS.items():
        imgs = images(prompt_name)
        a = host._request(prompt, imgs, None, None, True).prep
        b = eng._request(prompt, imgs, None, None, True).prep
        assert (b.ids, b.image_spans) == (a.ids, a.image_spans) and b.pixel_values is None
        assert b.ids == encode(proc, prompt, imgs)["input_ids"][0].tolist()
        ref = encode(proc, prompt, imgs)
        ours = device_inputs(b.images, eng.processor.image_processor, "cpu")
        assert torch.equal(ours["pixel_values"], ref["pixel_values"])
        assert torch.equal(ours["pixel_values"], a.pixel_values)
        assert torch.equal(ours["image_sizes"], ref["image_sizes"])
        b.pixel_values = ours["pixel_values"]
        if name == "mixed":
            assert b.draft_pixel_values is None and a.draft_pixel_values is not None
            rows = build_views(eng, b, None, None)
            assert b.draft_pixel_values is None         # deferred until a row's features are needed
            for r in rows:
                r.features()                            # the draft's own pixels, on the device
            assert torch.equal(b.draft_pixel_values, a.draft_pixel_values)


def test_device_images_refused_where_the_layout_differs():
    """A processor whose pinpoints are not the model's: device_images=True is refused (the token
    counts follow the model's layout), the default leaves the processor in charge."""
    import copy

    target, draft, processor, _ = loaded("vicuna")
    other = copy.deepcopy(processor)
    other.image_processor.image_grid_pinpoints = [[56, 28], [28, 56], [56, 56]]    # ties break otherwise
    with pytest.raises(ValueError, match="device_images=True"):
        Engine(target, other, draft=draft, device="cpu", dtype=torch.float32, device_images=True)
    assert not Engine(target, other, draft=draft, device="cpu", dtype=torch.float32).device_images


def test_full_strategy_refused_as_transformers_cannot_pack_it():
    """vision_feature_select_strategy="full" on a LLaVA-NeXT checkpoint is refused with a ValueError:
    there is no reference to equal, transformers' own get_image_features fails on it (tiles of
    g*g + 1 features viewed as g x g grids)."""
    from tabed_engine.models.vision import VisionEncoder

    proc, hf = transformers_model(checkpoint("vicuna")[0])
    enc = proc(text="<image>", images=images("wide"), return_tensors="pt")
    with pytest.raises(RuntimeError), torch.no_grad():
        hf.model.get_image_features(enc["pixel_values"], enc["image_sizes"], vision_feature_select_strategy="full")
    with pytest.raises(ValueError, match="'default'.*transformers cannot pack 'full'"):
        VisionEncoder(hf.config, -2, "full")


# ---------------------------------------------------------------------------- mixed pairs
def test_from_pretrained_mixed_pair_and_cli(capsys, tmp_path):
    """from_pretrained loads the LLaVA-1.5 draft's own processor; the CLI runs the pair."""
    from tabed_engine.serving.cli import main as cli_main

    target, draft = checkpoint("mixed")
    eng = Engine.from_pretrained(target, draft, device="cpu", dtype=torch.float32, views=("M", "T"))
    assert type(eng.draft_processor.image_processor).__name__.startswith("CLIPImageProcessor")
    assert generate(eng, "wide", True).token_ids == reference("mixed", "wide")
    path = tmp_path / "wide.png"
    images("wide")[0].save(path)
    rc = cli_main(["generate", "--target", target, "--draft", draft, "--image", str(path), "--prompt",
                   "Describe the picture in detail.", "--max-new-tokens", str(N_NEW), "--device", "cpu",
                   "--dtype", "float32", "--json"])
    assert rc == 0
    got = json.loads(capsys.readouterr().out)
    assert got["token_ids"] == reference("mixed", "wide") and got["stats"]["speculative"]


def test_mixed_pair_needs_the_draft_processor():
    target, draft, processor, _ = loaded("mixed")
    with pytest.raises(ValueError, match="draft_processor"):
        Engine(target, processor, draft=draft, device="cpu", dtype=torch.float32)


def test_draft_tokenizer_must_match(tmp_path):
    """A draft whose tokenizer maps two tokens to each other's ids (same size) is refused with
    a ValueError naming the tokenizer, before any weight loads; so is one of another size."""
    target, draft = checkpoint("mixed")
    bad = tmp_path / "draft"
    shutil.copytree(draft, bad)
    tok = json.loads((bad / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = "▁the", "▁a"
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (bad / "tokenizer.json").write_text(json.dumps(tok))
    os.remove(bad / "model.safetensors")              # nothing may load before the check fails
    with pytest.raises(ValueError, match="tokenizer differs"):
        Engine.from_pretrained(target, str(bad), device="cpu", dtype=torch.float32)
    t, d, processor, draft_proc = loaded("mixed")
    other = load_processor(checkpoint("vicuna")[0])
    other.tokenizer.add_tokens(["<extra>"])
    with pytest.raises(ValueError, match="tokenizer differs"):
        Engine(t, processor, draft=d, draft_processor=other, device="cpu", dtype=torch.float32)
    eng = Engine(t, processor, draft=d, draft_processor=draft_proc, device="cpu", dtype=torch.float32)
    assert generate(eng, "wide", True).token_ids == reference("mixed", "wide")


# ---------------------------------------------------------------------------- sampling
SAMPLING = SamplingParams(max_new_tokens=3, temperature=0.7, top_k=3, stop_at_eos=False)
# 4,800 samples: 99.8% power against a 3.5% shift (the likeliest outcome has p = 0.21)
SAMPLES, SHARDS, PER_CALL = 4800, 4, 16


@pytest.fixture(scope="module")
def next_exact_dist():
    """The exact distribution of the first 3 sampled tokens of the vicuna fixture's target for
    the "wide" prompt, enumerated with transformers' model as the oracle (the processed
    distribution: `target_probs`, temperature and top-k)."""
    from tabed_engine.speculation.sampling import target_probs

    proc, hf = transformers_model(checkpoint("vicuna")[0])
    enc = encode(proc, PROMPTS["wide"][0], images("wide"))
    dist = {(): 1.0}
    for _ in range(SAMPLING.max_new_tokens):
        nxt = {}
        for seq, pr in dist.items():
            ids = torch.cat([enc["input_ids"], torch.tensor([seq], dtype=torch.long)], 1) if seq else enc["input_ids"]
            with torch.no_grad():
                logits = hf(**{**enc, "input_ids": ids, "attention_mask": torch.ones_like(ids)}).logits[:, -1]
            p = target_probs(logits, SAMPLING)[0]
            for t in torch.nonzero(p > 0).flatten().tolist():
                nxt[seq + (t,)] = pr * float(p[t])
        dist = nxt
    return dist


@pytest.mark.slow
@pytest.mark.parametrize("shard", range(SHARDS))
def test_sampling_is_lossless_on_llava_next(shard, next_exact_dist, tmp_path_factory):
    """Speculative sampling (M+T+P, kld) on a LLaVA-NeXT target and draft, 16 requests per batch,
    each its own seed: the first 3 tokens follow the exact distribution (and the check rejects a
    3.5% shift of mass; an oracle at temperature 0.8 instead of 0.7 fails it)."""
    from collections import Counter

    from test_speculative import check_when_complete

    eng = engine("vicuna", views=("M", "T", "P"), policy="kld", gamma=2)
    prompt, imgs = PROMPTS["wide"][0], images("wide")
    n = SAMPLES // SHARDS
    counts, accepted = Counter(), 0
    for call in range(n // PER_CALL):
        sps = [SamplingParams(**{**SAMPLING.__dict__, "seed": (shard * 1000 + call) * PER_CALL + i})
               for i in range(PER_CALL)]
        for o in eng.generate([prompt] * PER_CALL, images=[imgs] * PER_CALL, sampling=sps):
            counts[tuple(o.token_ids)] += 1
            accepted += sum(o.stats.accepted_lengths)
    assert accepted > n * 0.15                       # drafts really were accepted
    check_when_complete(tmp_path_factory, "lossless-next", shard, SHARDS, counts, next_exact_dist, SAMPLES, 0.035)


# ---------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("name", ["vicuna", "mixed"])
def test_gpu_graphs_equal_transformers(name):
    """On CUDA (float32): CUDA graphs keyed by tile count, device preprocessing, AR and SD
    alone and batched, equal to transformers' greedy output on the CPU."""
    target, draft = checkpoint(name)
    eng = Engine.from_pretrained(target, draft, device="cuda", dtype=torch.float32, views=("M", "T", "P"),
                                 policy="w-grid", gamma=3, max_len=512)
    sp = SamplingParams(max_new_tokens=N_NEW)
    names = ["wide", "two"]
    for speculative in (False, True):
        outs = eng.generate([PROMPTS[n][0] for n in names], images=[images(n) for n in names], sampling=sp,
                            speculative=speculative)
        for n, o in zip(names, outs):
            alone = generate(eng, n, speculative).token_ids
            assert o.token_ids == alone
            assert o.token_ids == reference(name, n)
    assert len(eng.graphs) > 0


# ---------------------------------------------------------------------------- position limits
@pytest.fixture(scope="module")
def short_draft(tmp_path_factory):
    """The mixed pair with the LLaVA-1.5 draft's max_position_embeddings lowered to what the
    "two" prompt's draft views need (M: the draft's 16 tokens an image) + N_NEW + γ + 2: below
    the target's own prompt (its any-resolution image tokens), as llava-v1.6-vicuna-7b (4096)
    with LLaVA-68M (2048) on a 672x672 image. Returns (engine, the limit)."""
    t, d, processor, draft_proc = loaded("mixed")
    base = engine("mixed")
    req = base._request(PROMPTS["two"][0], images("two"), None, None, True)
    limit = max(view_lengths(base, req.prep, None)) + N_NEW + base.lookahead + 2
    assert len(req.prep.ids) > limit
    path = tmp_path_factory.mktemp("short") / "draft"
    shutil.copytree(checkpoint("mixed")[1], path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["text_config"]["max_position_embeddings"] = limit
    (path / "config.json").write_text(json.dumps(cfg))
    eng = Engine(t, processor, draft=load_lvlm(str(path), "cpu", torch.float32), draft_processor=draft_proc,
                 device="cpu", dtype=torch.float32, views=("M", "T"), policy="hedge", gamma=5, max_len=512)
    return eng, limit


def test_draft_limit_shorter_than_the_target_prompt(short_draft):
    """The target's rows are bounded by the target's limit, the draft's by the draft's: a
    prompt longer than the draft's limit for the target, whose draft views fit, decodes
    speculatively equal to transformers."""
    eng, limit = short_draft
    assert eng.max_len == 512 and eng.draft_len == limit
    out = generate(eng, "two", True)
    assert out.token_ids == reference("mixed", "two") and out.stats.speculative
    assert len(out.stats.accepted_lengths) >= 2
    # "as many tokens as fit": what the draft's views leave
    req = eng._request(PROMPTS["two"][0], images("two"), SamplingParams(max_new_tokens=None), None, True)
    assert req.max_new == N_NEW


def test_draft_views_that_do_not_fit_are_refused(short_draft):
    """One token more than the draft's views hold: a ValueError naming the numbers when the
    request is added; plain decoding is not limited by the draft; the engine serves on."""
    eng, limit = short_draft
    sp = SamplingParams(max_new_tokens=N_NEW + 1)
    for call in (lambda: eng.generate(PROMPTS["two"][0], images=images("two"), sampling=sp),
                 lambda: eng.add_request(PROMPTS["two"][0], images=images("two"), sampling=sp)):
        with pytest.raises(ValueError, match=rf"draft view of \d+ tokens \+ max_new_tokens \({N_NEW + 1}\).*"
                                             rf"max_position_embeddings \({limit}\).*at most {N_NEW}"):
            call()
    assert not eng.has_unfinished()
    ar = eng.generate(PROMPTS["two"][0], images=images("two"), sampling=sp, speculative=False)
    ref = reference("mixed", "two")
    assert ar.token_ids[:len(ref)] == ref and not ar.stats.speculative
    assert generate(eng, "two", True).token_ids == ref


@pytest.mark.parametrize("name,heads,kv,bias", [("yi", 7, 1, False), ("qwen", 4, 4, True)])
def test_large_checkpoint_shapes(name, heads, kv, bias):
    """The yi / qwen fixtures carry llava-v1.6-34b's and llava-next-72b's shapes into our decoder:
    GQA 7 : 1 without bias (a Llama text config); a Qwen2 text config inside
    LlavaNextForConditionalGeneration: q/k/v bias, MHA, RoPE θ 1e6."""
    target = loaded(name)[0]
    cfg = target.lm.cfg
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.qkv_bias) == (heads, kv, bias)
    assert target.family.name == "llava_next" and target.config["text_config"]["model_type"] == \
        ("qwen2" if bias else "llama")
    assert cfg.rope_theta == (1e6 if bias else 10000.0)
    assert cfg.vocab_size % 64 == 0 and cfg.vocab_size > len(loaded(name)[2].tokenizer)   # padded rows
