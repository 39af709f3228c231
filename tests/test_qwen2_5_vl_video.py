"""Qwen2.5-VL videos: `<|video_pad|>` runs of grid_t * grid_h * grid_w / merge² tokens, frames
preprocessed as transformers' Qwen2-VL video processor does (reproduced without torchvision: the
checkpoint's PIL image processor per frame, temporal patches of 2 frames, an odd count padded with
the last frame), the vision tower over the video's patches, M-RoPE ids with the temporal interval;
greedy AR and SD (chain, tree) token-identical to transformers' `generate` in float32 for a video
alone, beside an image, and with an odd frame count; the T and P rows; broken variants caught."""
import functools
import math

import pytest
import torch
from transformers import Qwen2_5_VLForConditionalGeneration
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

from tabed_engine import Engine, SamplingParams, TreeConfig
from tabed_engine.engine.prompt import _videos, prepare
from tabed_engine.models import qwen2_5_vl_vision
from tabed_engine.models.tiny import random_image
from tabed_engine.models.tiny_qwen2_5_vl import build_tiny_qwen2_5_vl, tiny_video

SP = SamplingParams(max_new_tokens=16)
# frames: (count, height, width); "odd": 5 frames (the last one repeated into the third temporal patch)
CASES = {"video": (4, 28, 44), "video-image": (4, 40, 28), "odd": (5, 56, 36)}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen2_5_vl_video")
    out = {"target": root / "target", "draft": root / "draft"}
    build_tiny_qwen2_5_vl(str(out["target"]))
    build_tiny_qwen2_5_vl(str(out["draft"]), layout="nested", perturb=0.05)
    return {k: str(v) for k, v in out.items()}


@pytest.fixture(scope="module")
def hf(dirs):
    return Qwen2_5_VLForConditionalGeneration.from_pretrained(dirs["target"], dtype=torch.float32).eval()


@functools.lru_cache(maxsize=None)
def engine(target_dir, draft_dir=None, tree=None, views=("M", "T", "P")):
    return Engine.from_pretrained(target_dir, draft_dir, device="cpu", dtype=torch.float32, views=views,
                                  policy="kld", gamma=3, tree=tree, adaptive=False)


def case(eng, name):
    """(prompt text, images, videos) of a test case, the text from the chat template."""
    frames, h, w = CASES[name]
    content = [{"type": "video"}, {"type": "text", "text": "What happens in the video?"}]
    images = []
    if name == "video-image":
        content = [{"type": "image"}] + content
        images = [random_image(3, 40).resize((24, 56))]
    text = eng.processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                             tokenize=False)
    return text, images, [tiny_video(len(name), frames, h, w)]


def reference_patches(frames: torch.Tensor, patch: int, merge: int, temporal: int):
    """pixel_values_videos and video_grid_thw of one video's preprocessed frames [F, C, H, W],
    written after transformers' `Qwen2VLVideoProcessor.patchify` (batch of one)."""
    videos = frames[None]
    if pad := -videos.shape[1] % temporal:
        videos = torch.cat((videos, videos[:, -1:].expand(-1, pad, -1, -1, -1)), dim=1)
    b, f, c, h, w = videos.shape
    gt, gh, gw = f // temporal, h // patch, w // patch
    p = videos.view(b, gt, temporal, c, gh // merge, merge, patch, gw // merge, merge, patch)
    p = p.permute(0, 1, 4, 7, 5, 8, 3, 2, 6, 9).reshape(b, gt * gh * gw, c * temporal * patch * patch)
    return p[0], torch.tensor([[gt, gh, gw]])


def reference_inputs(hf, proc, text, images, videos):
    """transformers' inputs built by hand: the image processor's pixels, the video's patches from
    the engine's preprocessed frames, each placeholder expanded as Qwen2_5_VLProcessor does."""
    kw = {}
    if images:
        enc = proc.image_processor(images, return_tensors="pt")
        kw.update(pixel_values=enc["pixel_values"], image_grid_thw=enc["image_grid_thw"])
        n = int(enc["image_grid_thw"][0].prod()) // 4
        text = text.replace("<|image_pad|>", "<|image_pad|>" * n)
    ip = proc.image_processor
    pv, grid = reference_patches(proc.video_pixels(_videos(videos, proc, 0)[0]), ip.patch_size, ip.merge_size,
                                 ip.temporal_patch_size)
    text = text.replace("<|video_pad|>", "<|video_pad|>" * (int(grid.prod()) // 4))
    ids = proc.tokenizer(text, return_tensors="pt")["input_ids"]
    mm = (ids == hf.config.image_token_id).int() + 2 * (ids == hf.config.video_token_id).int()
    # frames taken 2 a second (the engine's VIDEO_FPS): 1 s a temporal patch of 2 frames
    return ids, dict(kw, pixel_values_videos=pv, video_grid_thw=grid, second_per_grid_ts=torch.tensor([1.0]),
                     mm_token_type_ids=mm)


def reference(hf, proc, text, images, videos, n=SP.max_new_tokens):
    ids, kw = reference_inputs(hf, proc, text, images, videos)
    with torch.no_grad():
        out = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                          **kw)
    new = out[0, ids.shape[1]:].tolist()
    eos = hf.config.text_config.eos_token_id
    return new[:new.index(eos) + 1] if eos in new else new


def prep_of(eng, text, images, videos):
    return prepare(eng.processor, text, images, eng.target.image_token_id, eng.tokens_per_image, videos=videos,
                   video_token_id=eng.target.video_token_id, video_tokens=eng.target.vision.video_tokens)


# ---------------------------------------------------------------- preprocessing, counts, features
@pytest.mark.parametrize("name", list(CASES))
def test_video_tokens_patches_and_features(dirs, hf, name):
    """Each frame is what the image processor makes of it at the video's size, the token count
    transformers' (smart_resize of the frame, grid_t = ceil(F / 2), / merge²), the features
    transformers' `get_video_features` of the reference patches."""
    eng = engine(dirs["target"])
    text, images, videos = case(eng, name)
    frames = _videos(videos, eng.processor, 0)[0]
    px = eng.processor.video_pixels(frames)
    F_, h, w = CASES[name]
    rh, rw = smart_resize(h, w, 8, 256, 2304)
    assert px.shape == (F_, 3, rh, rw)
    one = eng.processor.image_processor([frames[-1]], return_tensors="pt")["pixel_values"]
    assert torch.equal(reference_patches(px[-1:], 4, 2, 2)[0], one)      # a frame = an image's pixels
    prep = prep_of(eng, text, images, videos)
    pv, grid = reference_patches(px, 4, 2, 2)
    assert grid.tolist() == [[math.ceil(F_ / 2), rh // 4, rw // 4]]
    assert [n for _, n in prep.video_spans] == [int(grid.prod()) // 4]
    ids, _ = reference_inputs(hf, eng.processor, text, images, videos)
    assert prep.ids == ids[0].tolist()
    with torch.no_grad():
        want = hf.model.get_video_features(pv, grid).pooler_output[0]
    torch.testing.assert_close(eng.target.vision.video_features(prep.video_pixels[0]), want, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- greedy against transformers
@pytest.mark.parametrize("name", list(CASES))
def test_greedy_ar_matches_transformers(dirs, hf, name):
    eng = engine(dirs["target"])
    text, images, videos = case(eng, name)
    out = eng.generate(text, images=images, videos=videos, sampling=SP, speculative=False)
    assert out.token_ids == reference(hf, eng.processor, text, images, videos)


@pytest.mark.parametrize("tree", [None, TreeConfig(3, 2, 2)], ids=["chain", "tree"])
@pytest.mark.parametrize("name", list(CASES))
def test_speculative_matches_transformers(dirs, hf, name, tree):
    eng = engine(dirs["target"], dirs["draft"], tree)
    text, images, videos = case(eng, name)
    out = eng.generate(text, images=images, videos=videos, sampling=SP)
    assert out.token_ids == reference(hf, eng.processor, text, images, videos)
    assert sum(out.stats.accepted_lengths) > 0


def test_wrong_temporal_grouping_is_caught(dirs, hf, monkeypatch):
    """Broken variants: frames paired across temporal patches (0+2, 1+3 instead of 0+1, 2+3), and
    the temporal ids spaced for frames 1 s apart instead of 0.5 s, each change the tokens."""
    eng = engine(dirs["target"])
    text, images, videos = case(eng, "video")
    want = reference(hf, eng.processor, text, images, videos)
    real = qwen2_5_vl_vision.patchify_video
    monkeypatch.setattr(qwen2_5_vl_vision, "patchify_video",
                        lambda px, *a: real(px[[0, 2, 1, 3]], *a))
    assert eng.generate(text, images=images, videos=videos, sampling=SP, speculative=False).token_ids != want
    monkeypatch.setattr(qwen2_5_vl_vision, "patchify_video", real)
    monkeypatch.setattr(qwen2_5_vl_vision, "VIDEO_FPS", 1.0)
    assert eng.generate(text, images=images, videos=videos, sampling=SP, speculative=False).token_ids != want


# ---------------------------------------------------------------- views
def test_view_rows(dirs):
    """T: the video's run replaced by one newline token, 1-D positions; P: each temporal slice's
    merged grid pooled 2x2 with M-RoPE ids over the pooled grid (temporal step tokens_per_second
    x 1 s); every row as long as `view_lengths` says."""
    from tabed_engine.speculation.views import build_views, view_lengths

    eng = engine(dirs["target"], dirs["draft"], None, ("M", "T", "P"))
    text, images, videos = case(eng, "odd")
    prep = prep_of(eng, text, images, videos)
    m, t, p = build_views(eng, prep, None, None)
    assert [len(r.ids) for r in (m, t, p)] == view_lengths(eng, prep, None)
    (s, n), = prep.video_spans
    assert t.ids == prep.ids[:s] + [eng.escape_token] + prep.ids[s + n:] and t.positions is None and not t.features()
    assert eng.tokenizer.decode([eng.escape_token]) == "\n"
    vision = eng.draft.vision
    gt, gh, gw = vision.video_grid(prep.video_pixels[0])
    assert (gt, gh, gw) == (3, 7, 4) and m.ids == prep.ids and m.spans == prep.video_spans
    ph, pw = -(-gh // 2), -(-gw // 2)
    assert p.spans == [(s, gt * ph * pw)] and p.features()[0].shape[0] == gt * ph * pw
    grid = m.features()[0].view(gt, gh, gw, -1)
    torch.testing.assert_close(p.features()[0][ph * pw + 1], grid[1, :2, 2:4].mean((0, 1)))      # slice 1, window (0, 1)
    torch.testing.assert_close(p.features()[0][ph * pw - 1], grid[0, 6:, 2:].mean((0, 1)))       # a partial last-row window
    ids = p.positions[:, s:s + gt * ph * pw].view(3, gt, ph, pw)
    assert ids[0, :, 0, 0].tolist() == [s, s + 2, s + 4]
    assert ids[1, 0, :, 0].tolist() == list(range(s, s + ph)) and ids[2, 0, 0].tolist() == list(range(s, s + pw))
    assert p.positions[0, s + gt * ph * pw] == s + max(ph, pw)          # the text after the video


# ---------------------------------------------------------------- bad input, prefix cache
def test_bad_videos_are_refused(dirs):
    eng = engine(dirs["target"])
    text, images, videos = case(eng, "video")
    with pytest.raises(ValueError, match="non-empty list of frames"):
        eng.generate(text, videos=[[]], sampling=SP)
    with pytest.raises(ValueError, match="differ in size"):
        eng.generate(text, videos=[[videos[0][0], videos[0][1, :20]]], sampling=SP)
    with pytest.raises(ValueError, match="1 video placeholder"):
        eng.generate(text, videos=videos * 2, sampling=SP)
    assert eng.generate(text, videos=videos, sampling=SP, speculative=False).token_ids   # still usable


def test_prefix_cache_keys_the_video(dirs, hf):
    """The same prompt with the same video reuses the KV past the video; with other frames of the
    same size, only the text before the video, and the tokens are that video's."""
    eng = engine(dirs["target"])
    text, images, videos = case(eng, "video")
    prep = prep_of(eng, text, images, videos)
    (start, n), = prep.video_spans
    first = eng.generate(text, videos=videos, sampling=SP, speculative=False)
    again = eng.generate(text, videos=videos, sampling=SP, speculative=False)
    assert again.stats.cached_tokens > start + n and again.token_ids == first.token_ids
    other = [videos[0][::-1].copy()]
    out = eng.generate(text, videos=other, sampling=SP, speculative=False)
    assert out.stats.cached_tokens <= start
    assert out.token_ids == reference(hf, eng.processor, text, images, other)


def test_video_settings_read_as_transformers_reads_them(dirs, tmp_path):
    """processor_config.json's "video_processor" over video_preprocessor_config.json over
    preprocessor_config.json (the published repositories' only file: the images' min / max pixels);
    the video's own min / max pixels decide its frames' size; settings the engine does not
    reproduce are refused."""
    import json
    import shutil

    from tabed_engine.models.qwen2_5_vl import load_processor, video_settings

    d = tmp_path / "ckpt"
    shutil.copytree(dirs["target"], d)
    assert (video_settings(str(d))["min_pixels"], video_settings(str(d))["max_pixels"]) == (256, 2304)
    json.dump({"size": {"shortest_edge": 64, "longest_edge": 1024}, "patch_size": 4},
              open(d / "video_preprocessor_config.json", "w"))
    assert (video_settings(str(d))["min_pixels"], video_settings(str(d))["max_pixels"]) == (64, 1024)
    json.dump({"video_processor": {"max_pixels": 512, "min_pixels": 64, "patch_size": 4}},
              open(d / "processor_config.json", "w"))
    assert video_settings(str(d))["max_pixels"] == 512
    proc = load_processor(str(d))
    px = proc.video_pixels(_videos([tiny_video(0, 2, 56, 56)], proc, 0)[0])
    assert px.shape[-2:] == smart_resize(56, 56, 8, 64, 512) == (16, 16)
    json.dump({"video_processor": {"min_pixels": 64, "max_pixels": 512, "cap_pixels_per_frame": True}},
              open(d / "processor_config.json", "w"))
    with pytest.raises(ValueError, match="cap_pixels_per_frame"):
        video_settings(str(d))
