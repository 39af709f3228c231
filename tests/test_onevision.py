"""LLaVA-OneVision targets and drafts on tiny checkpoints laid out as published
(models/tiny_onevision.py): anyres_max_9 counts and packing equal to transformers', and greedy
AR and SD (chains and a tree) token-identical to transformers `generate(do_sample=False)` in
float32 for one image, several images of different sizes (one past the anyres_max budget, so the
bilinear downscale runs), a video (frames pooled 2x2, one newline), a video beside an image, text
only and a multi-turn chat; the draft has the 0.5B's shape of
difference (fewer padded embedding rows, its own tower, legacy key names)."""
import functools
import hashlib
import json
import os
import shutil
import tempfile
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

from tabed_engine import Engine, SamplingParams
from tabed_engine.models.anyres import AnyRes, pack
from tabed_engine.models.llava_onevision import load_processor
from tabed_engine.speculation.tree import TreeConfig

N_NEW = 16
TILE, PATCH = 35, 7                  # 5 x 5 features a tile (the published 27 x 27 at 384 px)
TARGET = dict(model_vocab=448, seed=31)
DRAFT = dict(model_vocab=416, seed=31, perturb=0.03, vision_perturb=0.05, layout="legacy")   # 0.5B: fewer rows
_ROOT = os.path.join(os.environ.get("TABED_TEST_MODELS") or tempfile.mkdtemp(prefix="tabed_models_"), "onevision")


@functools.lru_cache(maxsize=None)
def checkpoints() -> tuple[str, str]:
    """(target dir, draft dir), built once per session (renamed into place: workers share it)."""
    from tabed_engine.models.tiny_onevision import build_tiny_onevision

    key = hashlib.sha1(json.dumps([TARGET, DRAFT, TILE, PATCH]).encode()).hexdigest()[:10]
    path = os.path.join(_ROOT, key)
    if not os.path.isfile(os.path.join(path, "draft", "config.json")):
        os.makedirs(_ROOT, exist_ok=True)
        tmp = tempfile.mkdtemp(dir=_ROOT)
        target = build_tiny_onevision(os.path.join(tmp, "target"), tile=TILE, patch=PATCH, **TARGET)
        build_tiny_onevision(os.path.join(tmp, "draft"), tile=TILE, patch=PATCH, like=target, **DRAFT)
        try:
            os.rename(tmp, path)
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
    return os.path.join(path, "target"), os.path.join(path, "draft")


def image(seed, size):
    """A smooth random picture of PIL size (width, height) (noise upsampled: tiles differ)."""
    rng = np.random.default_rng(seed)
    small = Image.fromarray(rng.integers(0, 256, (6, 7, 3), dtype=np.uint8))
    return small.resize(size, Image.BILINEAR)


WIDE, BIG, SMALL = (90, 40), (160, 150), (30, 36)        # PIL (width, height); BIG exceeds the budget
PROMPTS = {   # name: (messages, image sizes)
    "one": ([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe the picture."}]}],
            [WIDE]),
    "several": ([{"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "image"},
                                              {"type": "text", "text": "Compare the three photos."}]}],
                [SMALL, BIG, WIDE]),
    "text": ([{"role": "user", "content": [{"type": "text", "text": "What is a red square?"}]}], []),
    "chat": ([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is shown?"}]},
              {"role": "assistant", "content": [{"type": "text", "text": "A red square and two blue circles."}]},
              {"role": "user", "content": [{"type": "text", "text": "How many circles are there?"}]}], [BIG]),
    "video": ([{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "What happens?"}]}], []),
    "video-image": ([{"role": "user", "content": [{"type": "image"}, {"type": "video"},
                                                  {"type": "text", "text": "Is the picture in the video?"}]}],
                    [WIDE]),
}
FRAMES = {"video": 3, "video-image": 2}          # frames of each prompt's one video


def videos(name):
    return [[image(60 + i, (50, 40)) for i in range(FRAMES[name])]] if name in FRAMES else None


def images(name):
    return [image(40 + i, size) for i, size in enumerate(PROMPTS[name][1])]


@functools.lru_cache(maxsize=None)
def transformers_model():
    from transformers import LlavaOnevisionForConditionalGeneration

    target = checkpoints()[0]
    return load_processor(target), LlavaOnevisionForConditionalGeneration.from_pretrained(
        target, local_files_only=True, dtype=torch.float32).eval()


@functools.lru_cache(maxsize=None)
def reference(name):
    """transformers' greedy new tokens (up to and including EOS) through its own processor."""
    from realistic import greedy_new_tokens

    proc, hf = transformers_model()
    text = proc.apply_chat_template(PROMPTS[name][0], add_generation_prompt=True)
    if name not in FRAMES:
        enc = proc(text=text, images=images(name) or None, return_tensors="pt")
        return greedy_new_tokens(hf, enc, N_NEW)
    # a video: its pixels and placeholder built by hand (the video processor needs torchvision),
    # the images' by the processor's own image step, the text by the tokenizer
    from transformers.models.llava_onevision.processing_llava_onevision import LlavaOnevisionProcessor

    from tabed_engine.engine.prompt import video_pixels

    pv = video_pixels(proc.image_processor, videos(name)[0])
    text = text.replace("<video>", LlavaOnevisionProcessor.replace_video_token(proc, {"pixel_values_videos": [pv]}, 0))
    enc = {}
    if images(name):
        processed, reps = proc._process_images(images(name), return_tensors="pt")
        pieces = text.split("<image>")            # each placeholder by its image's expansion, in order
        text = pieces[0] + "".join(r + rest for r, rest in zip(reps, pieces[1:]))
        enc.update(processed)
    enc.update(proc.tokenizer(text, return_tensors="pt"), pixel_values_videos=pv[None])
    return greedy_new_tokens(hf, enc, N_NEW)


@functools.lru_cache(maxsize=None)
def engine(spec=()):
    target, draft = checkpoints()
    return Engine.from_pretrained(target, draft, device="cpu", dtype=torch.float32, max_len=1024, **dict(spec))


# ---------------------------------------------------------------------------- counts and packing
def test_counts_and_packing_equal_transformers():
    """AnyRes with the anyres_max_9 budget against transformers' `pack_image_features` and
    `LlavaOnevisionProcessor`'s count (the published 27-px grid and pinpoints, and the tiny
    fixture's), for sizes within the budget, past it, and of every aspect."""
    from transformers import LlavaOnevisionConfig, SiglipVisionConfig
    from transformers.models.llava_onevision.modeling_llava_onevision import LlavaOnevisionModel
    from transformers.models.llava_onevision.processing_llava_onevision import LlavaOnevisionProcessor

    from tabed_engine.models.tiny_onevision import pinpoints

    for tile, patch in ((384, 14), (TILE, PATCH)):
        cfg = LlavaOnevisionConfig(vision_config=SiglipVisionConfig(image_size=tile, patch_size=patch),
                                   image_grid_pinpoints=pinpoints(tile))
        layout = AnyRes.from_config(cfg)
        assert layout.max_tiles == 9 and len(layout.pinpoints) == 36
        g, C = tile // patch, 3
        counter = SimpleNamespace(image_processor=SimpleNamespace(image_grid_pinpoints=pinpoints(tile)),
                                  num_image_tokens=g * g, vision_aspect_ratio="anyres_max_9")
        counter._get_unpadded_features = functools.partial(LlavaOnevisionProcessor._get_unpadded_features, counter)
        newline = torch.randn(C)
        scale = tile / TILE
        downscaled = 0
        for h, w in [(40, 90), (150, 160), (36, 30), (35, 35), (200, 20), (20, 210), (77, 133), (210, 210)]:
            h, w = int(h * scale), int(w * scale)
            n = layout.num_tiles((h, w))
            feats = torch.randn(n, g * g, C)
            ref, _ = LlavaOnevisionModel.pack_image_features(SimpleNamespace(config=cfg), [feats], torch.tensor([[h, w]]),
                                                             newline, "anyres_max_9")
            ours = pack(feats, (h, w), layout, newline)
            assert torch.equal(ours, ref[0]), (tile, h, w)
            assert layout.num_tokens((h, w)) == ours.shape[0] == \
                LlavaOnevisionProcessor._get_number_of_features(counter, h, w, tile, tile)
            full = _unpadded(layout, (h, w), g)
            downscaled += layout.budget(*full, g) != full
        assert downscaled >= 2          # the bilinear downscale ran


def _unpadded(layout, size, g):
    from tabed_engine.models.anyres import unpadded_size

    rows, cols = layout.tile_grid(size)
    return unpadded_size(rows * g, cols * g, size)


def test_processor_counts_each_image_by_its_own_tiles():
    """The published processor with a flat image list (the engine's call) expands every
    `<image>` by its own anyres count: the engine's per-image counts equal its runs."""
    eng = engine()
    proc = eng.processor
    imgs = images("several")
    text = proc.apply_chat_template(PROMPTS["several"][0], add_generation_prompt=True)
    ids = proc(text=text, images=imgs, return_tensors="pt")["input_ids"][0].tolist()
    counts = eng.tokens_per_image(imgs)
    assert sum(counts) == ids.count(eng.target.image_token_id) and len(set(counts)) == 3
    assert counts[1] < (TILE // PATCH) ** 2 * (1 + 9 * 1.21)      # BIG is cut to the budget


# ---------------------------------------------------------------------------- greedy == transformers
@pytest.mark.parametrize("name", list(PROMPTS))
def test_greedy_ar_equals_transformers(name):
    out = engine().generate(PROMPTS[name][0], images=images(name), videos=videos(name),
                            sampling=SamplingParams(max_new_tokens=N_NEW), speculative=False)
    assert out.token_ids == reference(name)


SPECS = {"chain-MT": (("views", ("M", "T")), ("policy", "hedge"), ("gamma", 4)),
         "chain-MTP-wgrid": (("views", ("M", "T", "P")), ("policy", "w-grid"), ("gamma", 3)),
         "tree": (("views", ("M", "T")), ("tree", TreeConfig(depth=4, width=3, branch=2)))}


@pytest.mark.parametrize("spec", list(SPECS))
@pytest.mark.parametrize("name", list(PROMPTS))
def test_greedy_sd_equals_transformers(name, spec):
    eng = engine(SPECS[spec])
    assert eng.draft.lm.cfg.vocab_size == TARGET["model_vocab"]       # the draft's padding fitted
    out = eng.generate(PROMPTS[name][0], images=images(name), videos=videos(name),
                       sampling=SamplingParams(max_new_tokens=N_NEW))
    assert out.token_ids == reference(name)
    assert sum(out.stats.accepted_lengths) > 0


def test_views_of_a_onevision_draft():
    """M rows hold the draft's own anyres counts, P rows the pooled grids packed the same way,
    T rows one escape newline an image."""
    from tabed_engine.engine.prompt import prepare
    from tabed_engine.speculation.views import build_views, view_lengths

    eng = engine(SPECS["chain-MTP-wgrid"])
    assert eng.draft.vision_sd_hash != eng.target.vision_sd_hash       # the draft encodes with its own tower
    imgs = images("several")
    prep = prepare(eng.processor, PROMPTS["several"][0], imgs, eng.target.image_token_id, eng.tokens_per_image)
    rows = build_views(eng, prep, None, None)
    assert [len(r.ids) for r in rows] == view_lengths(eng, prep, None)
    m, t, p = rows
    assert m.ids == prep.ids
    assert len(t.ids) == len(prep.ids) - sum(n for _, n in prep.image_spans) + 3
    pooled = [eng.draft.vision.anyres.num_tokens((im.height, im.width), grid=2) for im in imgs]
    assert [n for _, n in p.spans] == pooled


def test_video_features_and_views():
    """A video's token run is transformers' count (frames x ceil(g/2)^2 + 1) and its features
    transformers' `get_video_features`; the draft's M and P rows carry its own frames' features,
    T and C rows one escape token for it."""
    from transformers.models.llava_onevision.processing_llava_onevision import LlavaOnevisionProcessor

    from tabed_engine.engine.prompt import prepare, video_pixels
    from tabed_engine.speculation.views import build_views, view_lengths

    eng = engine(SPECS["chain-MTP-wgrid"])
    proc, hf = transformers_model()
    frames = videos("video-image")[0]
    pv = video_pixels(proc.image_processor, frames)
    assert tuple(pv.shape) == (2, 3, TILE, TILE)
    n = LlavaOnevisionProcessor.replace_video_token(proc, {"pixel_values_videos": [pv]}, 0).count("<video>")
    assert n == eng.target.vision.video_tokens(2) == 2 * 3 * 3 + 1
    with torch.no_grad():
        out = hf.model.get_video_features(pv[None])
        ref = getattr(out, "pooler_output", out)[0]
    torch.testing.assert_close(eng.target.vision.video_features(pv), ref, atol=1e-5, rtol=1e-5)
    prep = prepare(eng.processor, PROMPTS["video-image"][0], images("video-image"), eng.target.image_token_id,
                   eng.tokens_per_image, videos=[frames], video_token_id=eng.target.video_token_id,
                   video_tokens=eng.target.vision.video_tokens)
    assert [n for _, n in prep.video_spans] == [19] and prep.num_images == 1
    rows = build_views(eng, prep, None, None)
    assert [len(r.ids) for r in rows] == view_lengths(eng, prep, None)
    m, t, p = rows
    assert m.ids == prep.ids and len(m.features()) == 2 and m.spans[1] == prep.video_spans[0]
    assert eng.target.video_token_id not in t.ids and eng.target.image_token_id not in t.ids
    assert p.ids.count(eng.target.video_token_id) == 19
    with pytest.raises(ValueError, match="video placeholder"):
        eng.generate(PROMPTS["video"][0], videos=[frames, frames])


# ---------------------------------------------------------------------------- images on the device
@pytest.mark.parametrize("name", ["one", "several", "chat", "video-image"])
def test_device_images_equal_processor_path(name, monkeypatch):
    """device_images=True (image_ops' OneVision preprocessing; runs on CPU tensors too): the
    prompt is tokenized without the image processor and the pixels computed in prefill, and the
    greedy tokens, AR and SD, equal the processor path's (transformers' reference)."""
    import tabed_engine.models.image_ops as ops

    from tabed_engine.models.image_ops import supports

    eng = engine((("device_images", True),) + SPECS["chain-MT"])
    assert eng.device_images and not engine(SPECS["chain-MT"]).device_images      # (the CPU's default: off)
    assert supports(eng.processor.image_processor, eng.target.vision.anyres)
    calls = []
    real = ops.device_pixels
    monkeypatch.setattr(ops, "device_pixels", lambda *a, **k: calls.append(len(a[0])) or real(*a, **k))
    for speculative in (False, True):
        out = eng.generate(PROMPTS[name][0], images=images(name), videos=videos(name),
                           sampling=SamplingParams(max_new_tokens=N_NEW), speculative=speculative)
        assert out.token_ids == reference(name), speculative
    assert calls == [len(images(name))] * 2                # the device path ran, once a request
