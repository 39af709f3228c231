"""Image preprocessing on the device (tabed_engine/models/image_ops.py) equals the checkpoint's image
processor bit for bit, CLIP (LLaVA-1.5) and LLaVA-NeXT any resolution: the processor installed
here (PIL backend without torchvision), and the torchvision backend's arithmetic through a
reference written out below (torch's uint8 resize, transformers' torchvision center crop, pad
and fused normalisation)."""
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from PIL import Image

from tabed_engine.models.image_ops import (PixelPlan, _fit_size, _resize_crop, device_inputs, device_pixels,
                                    grid_resolution, num_tiles, pixel_plan, supports)
from tabed_engine.engine.prompt import _to_pil

MEAN, STD = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)
# llava-hf/llava-1.5-7b-hf's preprocessor_config.json
LLAVA = dict(size={"shortest_edge": 336}, crop_size={"height": 336, "width": 336}, do_center_crop=True,
             do_convert_rgb=True, do_normalize=True, do_rescale=True, do_resize=True, image_mean=MEAN,
             image_std=STD, resample=3, rescale_factor=1 / 255)


def pil_processor(**kw):
    """A CLIP image processor of the PIL backend (transformers 5: CLIPImageProcessorPil; 4.x:
    CLIPImageProcessor), llava-1.5-7b-hf's preprocessor_config.json overridden by kw."""
    try:
        from transformers import CLIPImageProcessorPil as cls
    except ImportError:
        from transformers import CLIPImageProcessor as cls
    if pixel_plan(cls(**LLAVA)).backend != "pil":   # a transformers 5 without a separate PIL class
        pytest.skip(f"no PIL-backed CLIP image processor in this transformers ({cls.__name__} is not)")
    return cls(**{**LLAVA, **kw})


def image(w, h, channels=3, seed=0):
    a = np.random.default_rng(seed).integers(0, 256, (h, w, channels) if channels else (h, w), dtype=np.uint8)
    return _to_pil(a)      # grey and RGBA become RGB as the engine's prompt path makes them


# odd sizes, both orientations, up- and down-scaling, a tall image shrunk (Pillow 13 resizes it
# vertically first), one already at the target size; grey and RGBA inputs
IMAGES = [image(333, 517), image(640, 480, seed=1), image(37, 1200, seed=2), image(1200, 37, seed=3),
          image(400, 1300, seed=4), image(336, 336, seed=5), image(41, 30, 0, seed=6), image(50, 45, 4, seed=7)]
CONFIGS = {
    "llava-1.5": {},                                                  # as published (336)
    "pad": dict(size={"shortest_edge": 40}, crop_size={"height": 57, "width": 51}),  # crop > resized: zero pad
    "exact-size": dict(size={"height": 100, "width": 77}, do_center_crop=False),
    "no-normalize": dict(size={"shortest_edge": 64}, crop_size={"height": 60, "width": 60}, do_normalize=False),
    "no-rescale": dict(size={"shortest_edge": 64}, crop_size={"height": 60, "width": 61}, do_rescale=False),
    "no-resize": dict(do_resize=False, crop_size={"height": 61, "width": 64}),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_equals_processor(name):
    """Bit-exact (max abs error 0) on every image, one at a time and as one batch."""
    ip = pil_processor(**CONFIGS[name])
    imgs = IMAGES if name != "llava-1.5" else IMAGES[:6]
    for im in imgs:
        ref = ip([im], return_tensors="pt")["pixel_values"]
        ours = device_pixels([im], ip, "cpu")
        assert ours.dtype == torch.float32 and ours.shape == ref.shape
        assert torch.equal(ours, ref), (name, im.size, (ours - ref).abs().max().item())
    batch = imgs[:3]
    assert torch.equal(device_pixels(batch, ip, "cpu"), ip(batch, return_tensors="pt")["pixel_values"])


def test_pass_order_matches_pillow():
    """Random resizes in every direction (the installed Pillow picks which pass goes first)."""
    rng = np.random.default_rng(11)
    for _ in range(40):
        w, h, ow, oh = (int(v) for v in rng.integers(5, 90, 4))
        ip = pil_processor(size={"height": oh, "width": ow}, do_center_crop=False)
        im = image(w, h, seed=int(rng.integers(1 << 30)))
        assert torch.equal(device_pixels([im], ip, "cpu"), ip([im], return_tensors="pt")["pixel_values"]), \
            (w, h, ow, oh)


# ------------------------------------------------------------------ torchvision backend

class BaseImageProcessorFast:
    """transformers 4.x's base class of torchvision-backed processors (stand-in)."""


class CLIPImageProcessorFast(BaseImageProcessorFast):
    """transformers 4.x's name for the torchvision-backed CLIP processor; this stand-in holds its
    settings (torchvision is not installed on the CPU test machines)."""

    def __init__(self, **kw):
        self.__dict__.update({**LLAVA, **kw})


def torchvision_reference(im, ip) -> torch.Tensor:
    """transformers' torchvision backend on the CPU, written out: torch's uint8 antialiased
    bicubic resize (what tvF.resize runs for uint8 on the CPU), its center crop with
    (floor, ceil) zero padding, and the normalisation with the rescale folded into mean/std."""
    x = torch.from_numpy(np.array(im)).permute(2, 0, 1).contiguous()
    h, w = x.shape[1:]
    s = ip.size["shortest_edge"]
    short, long = (w, h) if w <= h else (h, w)
    rh, rw = (int(s * long / short), s) if w <= h else (s, int(s * long / short))
    if (rh, rw) != (h, w):
        x = F.interpolate(x[None], size=(rh, rw), mode="bicubic", antialias=True)[0]
    ch, cw = ip.crop_size["height"], ip.crop_size["width"]
    if cw > rw or ch > rh:
        x = F.pad(x, [(cw - rw) // 2 if cw > rw else 0, (cw - rw + 1) // 2 if cw > rw else 0,
                      (ch - rh) // 2 if ch > rh else 0, (ch - rh + 1) // 2 if ch > rh else 0])
    top, left = int((x.shape[1] - ch) / 2.0), int((x.shape[2] - cw) / 2.0)
    x = x[:, top:top + ch, left:left + cw]
    mean = torch.tensor(ip.image_mean) * (1.0 / ip.rescale_factor)
    std = torch.tensor(ip.image_std) * (1.0 / ip.rescale_factor)
    return (x.float() - mean.view(3, 1, 1)) / std.view(3, 1, 1)


@pytest.mark.parametrize("cfg", [{}, dict(size={"shortest_edge": 40}, crop_size={"height": 57, "width": 51})])
def test_torchvision_backend_equals_reference(cfg):
    ip = CLIPImageProcessorFast(**cfg)
    assert pixel_plan(ip).backend == "torchvision"
    for im in IMAGES[:6] + IMAGES[7:]:
        ref = torchvision_reference(im, ip)
        ours = device_pixels([im], ip, "cpu")[0]
        assert torch.equal(ours, ref), (cfg, im.size, (ours - ref).abs().max().item())


def test_torchvision_resize_matches_torch_uint8():
    """Random resizes in every direction against torch's own uint8 kernel (always horizontal
    first, int16 coefficients)."""
    rng = np.random.default_rng(12)
    for _ in range(40):
        w, h, ow, oh = (int(v) for v in rng.integers(5, 120, 4))
        a = torch.from_numpy(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
        ref = F.interpolate(a.permute(2, 0, 1)[None].contiguous(), size=(oh, ow), mode="bicubic",
                            antialias=True)[0]
        ours = _resize_crop(a, PixelPlan("torchvision", ("exact", oh, ow), None, None, None, None))
        assert torch.equal(ours.to(torch.uint8), ref), (w, h, ow, oh)


# ------------------------------------------------------------------ buffers, refusals, bad input

def check_out_written(imgs, ip, ref):
    """device_pixels into NaN-poisoned out= buffers: float32 is `ref` exactly (the same
    tensor returned), bfloat16 its values rounded once."""
    out = torch.full(ref.shape, float("nan"))
    assert device_pixels(imgs, ip, "cpu", out=out) is out and torch.equal(out, ref)
    half = torch.full(ref.shape, float("nan"), dtype=torch.bfloat16)
    device_pixels(imgs, ip, "cpu", out=half)
    assert torch.equal(half, ref.to(torch.bfloat16))


def test_writes_every_element_of_out():
    ip = pil_processor(size={"shortest_edge": 64}, crop_size={"height": 60, "width": 61})
    imgs = IMAGES[:3]
    check_out_written(imgs, ip, ip(imgs, return_tensors="pt")["pixel_values"])
    with pytest.raises(ValueError, match="out must be"):
        device_pixels(imgs, ip, "cpu", out=torch.empty(2, 3, 60, 61))


@pytest.mark.parametrize("family, kw, why", [
    ("clip", dict(resample=2), "only bicubic"),
    ("clip", dict(size={"shortest_edge": 336, "longest_edge": 500}), "shortest_edge or height and width"),
    ("clip", dict(do_center_crop=False, do_pad=True), "do_pad"),
    ("qwen", dict(resample=2), "only bicubic"),
    ("qwen", dict(do_resize=False), "do_resize off"),
])
def test_unsupported_settings_refused(family, kw, why):
    if family == "qwen":
        ip, imgs = qwen_processor(**kw), QWEN_IMAGES
    else:
        ip, imgs = pil_processor(**kw) if "do_pad" not in kw else CLIPImageProcessorFast(**kw), IMAGES
    assert not supports(ip)
    with pytest.raises(ValueError, match=why):
        pixel_plan(ip)
    with pytest.raises(ValueError, match=why):
        device_pixels(imgs[:1], ip, "cpu")


def test_other_processors_refused():
    class LlavaImageProcessor(CLIPImageProcessorFast):   # pad-to-square: not reproduced
        pass

    assert supports(pil_processor()) and supports(CLIPImageProcessorFast())
    assert not supports(LlavaImageProcessor()) and not supports(object())


def test_bad_images():
    ip = pil_processor(size={"shortest_edge": 64}, crop_size={"height": 60, "width": 60})
    from PIL import Image

    with pytest.raises(TypeError, match="RGB PIL image"):
        device_pixels([Image.new("L", (10, 10))], ip, "cpu")
    with pytest.raises(ValueError, match="uint8"):
        device_pixels([np.zeros((10, 10, 3), np.float32)], ip, "cpu")
    with pytest.raises(ValueError, match="no images"):
        device_pixels([], ip, "cpu")
    free = pil_processor(size={"shortest_edge": 64}, do_center_crop=False)
    with pytest.raises(ValueError, match="different sizes"):
        device_pixels(IMAGES[:2], free, "cpu")
    # uint8 arrays and tensors are the same image as the PIL one
    a = np.array(IMAGES[1])
    ref = device_pixels([IMAGES[1]], ip, "cpu")
    assert torch.equal(device_pixels([a], ip, "cpu"), ref)
    assert torch.equal(device_pixels([torch.from_numpy(a)], ip, "cpu"), ref)


# ------------------------------------------------------------------ GPU

@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["pil", "torchvision"])
def test_cuda_equals_processor(backend):
    """On CUDA, against the processor of each backend installed (the torchvision one is what
    AutoProcessor gives where torchvision is installed), float32 bit-exact and bfloat16 equal to
    the processor's values rounded once."""
    if backend == "pil":
        ip = pil_processor()
    else:
        pytest.importorskip("torchvision")
        import transformers

        name = "CLIPImageProcessor" if int(transformers.__version__.split(".")[0]) >= 5 else "CLIPImageProcessorFast"
        ip = getattr(transformers, name)(**LLAVA)
    assert pixel_plan(ip).backend == backend
    for im in IMAGES:
        ref = ip([im], return_tensors="pt")["pixel_values"]
        ours = device_pixels([im], ip, "cuda")
        assert torch.equal(ours.cpu(), ref), (backend, im.size, (ours.cpu() - ref).abs().max().item())
    out = torch.full((3, 3, 336, 336), float("nan"), dtype=torch.bfloat16, device="cuda")
    device_pixels(IMAGES[:3], ip, "cuda", out=out)
    assert torch.equal(out.cpu(), ip(IMAGES[:3], return_tensors="pt")["pixel_values"].to(torch.bfloat16))


# ------------------------------------------------------------------ any resolution (LLaVA-NeXT)

PINS = [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]]
# llava-hf/llava-v1.6-*-hf's preprocessor_config.json (do_pad: the class default, True)
NEXT = dict(LLAVA, image_grid_pinpoints=PINS, do_pad=True)
NEXT_CONFIGS = {
    "llava-v1.6": {},                                                               # as published
    "fixture": dict(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28},   # test_llava_next
                    image_grid_pinpoints=[[28, 56], [56, 28], [56, 56]]),
    "five-pins": dict(size={"shortest_edge": 30}, crop_size={"height": 30, "width": 30},
                      image_grid_pinpoints=[[30, 60], [60, 30], [60, 60], [90, 30], [30, 90]]),
    # tiles of 36 resized to 40 and cropped back to 36 (the CLIP steps are no no-op here), the
    # base tile a square {height, width}
    "tile-steps": dict(size={"height": 40, "width": 40}, crop_size={"height": 36, "width": 36},
                       image_grid_pinpoints=[[36, 72], [72, 36], [108, 108], [36, 144]]),
    "no-pad-no-normalize": dict(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32},
                                image_grid_pinpoints=[[32, 64], [64, 32], [64, 64]], do_pad=False,
                                do_normalize=False),
}
# smaller and larger than the pinpoints, odd sizes, both orientations, extreme aspect ratios
# (a 3-row fit: transformers 4.x misreads [3, w, 3]; see image_ops), one exactly a pinpoint,
# grey and RGBA inputs
NEXT_IMAGES = [image(90, 20), image(25, 90, seed=1), image(60, 50, seed=2), image(333, 517, seed=3),
               image(640, 480, seed=4), image(1200, 37, seed=5), image(672, 672, seed=6), image(41, 30, 0, seed=7),
               image(50, 45, 4, seed=8), image(7, 300, seed=9)]


def next_processor(**kw):
    """transformers' PIL-backed LLaVA-NeXT image processor (5.x: LlavaNextImageProcessorPil; 4.x:
    LlavaNextImageProcessor), llava-v1.6's settings overridden by kw."""
    try:
        from transformers import LlavaNextImageProcessorPil as cls
    except ImportError:
        from transformers import LlavaNextImageProcessor as cls
    if pixel_plan(cls(**NEXT)).backend != "pil":
        pytest.skip(f"no PIL-backed LLaVA-NeXT image processor in this transformers ({cls.__name__} is not)")
    return cls(**{**NEXT, **kw})


def misread_by_4x(im, ip) -> bool:
    """transformers 4.x takes an image fitted to 3 rows or columns for channels-first."""
    import transformers

    if int(transformers.__version__.split(".")[0]) >= 5:
        return False
    plan = pixel_plan(ip)
    return 3 in _fit_size(im.height, im.width, *grid_resolution((im.height, im.width), plan))


@pytest.mark.parametrize("name", sorted(NEXT_CONFIGS))
def test_anyres_equals_processor(name):
    """Bit-exact pixel_values and equal image_sizes, image by image and as one batch (tile
    counts differ per image: zero tiles pad the batch)."""
    ip = next_processor(**NEXT_CONFIGS[name])
    imgs = [im for im in NEXT_IMAGES if not misread_by_4x(im, ip)]
    if name == "llava-v1.6":
        imgs = imgs[3:7]        # 336-pixel tiles: slow on the CPU
    for im in imgs:
        ref = ip([im], return_tensors="pt")
        ours = device_inputs([im], ip, "cpu")
        assert ours["pixel_values"].shape == ref["pixel_values"].shape, (name, im.size)
        assert torch.equal(ours["pixel_values"], ref["pixel_values"]), \
            (name, im.size, (ours["pixel_values"] - ref["pixel_values"]).abs().max().item())
        assert torch.equal(ours["image_sizes"], ref["image_sizes"])
    counts = [num_tiles((im.height, im.width), pixel_plan(ip)) for im in imgs]
    mixed = [imgs[counts.index(n)] for n in sorted(set(counts), reverse=True)]      # one of each count
    assert len(mixed) > 1
    batch = mixed if ip.do_pad else [im for im, n in zip(imgs, counts) if n == counts[0]][:3]
    ref = ip(batch, return_tensors="pt")
    ours = device_inputs(batch, ip, "cpu")
    assert len(batch) > 1 and ours["pixel_values"].shape == ref["pixel_values"].shape
    assert torch.equal(ours["pixel_values"], ref["pixel_values"])
    assert torch.equal(ours["image_sizes"], ref["image_sizes"])
    if not ip.do_pad:
        with pytest.raises(ValueError, match="do_pad is off"):
            device_pixels(mixed, ip, "cpu")


def test_anyres_writes_every_element_of_out():
    """NaN-poisoned out: every tile written, the zero tiles included; bfloat16 rounds once."""
    ip = next_processor(**NEXT_CONFIGS["five-pins"])
    imgs = [NEXT_IMAGES[0], NEXT_IMAGES[2], NEXT_IMAGES[7]]          # 4, 5 and 3 tiles
    ref = ip(imgs, return_tensors="pt")["pixel_values"]
    assert ref.shape == (3, 5, 3, 30, 30) and not ref[2, 3:].any()
    check_out_written(imgs, ip, ref)
    with pytest.raises(ValueError, match="out must be"):
        device_pixels(imgs, ip, "cpu", out=torch.empty(3, 4, 3, 30, 30))


@pytest.mark.parametrize("mutation", ["last pinpoint", "floor fit", "pad top-left", "pad extra pixel first"])
def test_anyres_mistakes_are_caught(monkeypatch, mutation):
    """The comparison fails for a wrong pinpoint, fit rounding or padding placement."""
    import tabed_engine.models.image_ops as ops

    ip = next_processor(**NEXT_CONFIGS["five-pins"])
    imgs = NEXT_IMAGES[:5]
    good = ip(imgs, return_tensors="pt")["pixel_values"]
    assert torch.equal(device_pixels(imgs, ip, "cpu"), good)
    if mutation == "last pinpoint":
        monkeypatch.setattr(ops, "grid_resolution", lambda size, plan: plan.anyres.pinpoints[-1])
    elif mutation == "floor fit":
        monkeypatch.setattr(ops, "_fit_size", lambda h, w, th, tw: (th, min(int(w * th / h), tw)) if tw / w >= th / h
                            else (min(int(h * tw / w), th), tw))
    elif mutation == "pad top-left":
        monkeypatch.setattr(ops, "_pad_offsets", lambda fh, fw, gh, gw: (0, 0))
    else:
        monkeypatch.setattr(ops, "_pad_offsets", lambda fh, fw, gh, gw: ((gh - fh + 1) // 2, (gw - fw + 1) // 2))
    bad = device_pixels(imgs, ip, "cpu")
    assert bad.shape != good.shape or not torch.equal(bad, good)


class LlavaNextImageProcessorFast(BaseImageProcessorFast):
    """transformers 4.x's torchvision-backed LLaVA-NeXT processor (stand-in holding its settings)."""

    def __init__(self, **kw):
        self.__dict__.update({**NEXT, **kw})


def torchvision_anyres_reference(im, ip) -> torch.Tensor:
    """transformers' torchvision LLaVA-NeXT backend on the CPU, written out for one image: torch's
    uint8 resize into the best pinpoint keeping the aspect ratio, tvF.pad's centred zero padding
    ([left, top, right, bottom] with the odd pixel after), divide_to_patches, the base tile,
    then each tile through the CLIP steps (torchvision_reference: resize, crop, fused
    normalisation)."""
    from transformers.image_processing_utils import select_best_resolution

    x = torch.from_numpy(np.array(im)).permute(2, 0, 1).contiguous()
    h, w = x.shape[1:]
    gh, gw = select_best_resolution((h, w), ip.image_grid_pinpoints)
    sw, sh = gw / w, gh / h
    fh, fw = (min(math.ceil(h * sw), gh), gw) if sw < sh else (gh, min(math.ceil(w * sh), gw))
    fit = x if (fh, fw) == (h, w) else \
        F.interpolate(x[None], size=(fh, fw), mode="bicubic", antialias=True)[0]
    px, rx = divmod(gw - fw, 2)
    py, ry = divmod(gh - fh, 2)
    padded = F.pad(fit, [px, px + rx, py, py + ry])
    t = ip.crop_size["height"]
    tiles = [padded[:, i:i + t, j:j + t] for i in range(0, gh, t) for j in range(0, gw, t)]
    s = ip.size["shortest_edge"]
    base = F.interpolate(x[None], size=(s, s), mode="bicubic", antialias=True)[0]
    clip = CLIPImageProcessorFast(**{k: v for k, v in ip.__dict__.items() if k != "image_grid_pinpoints"})
    return torch.stack([torchvision_reference(Image.fromarray(p.permute(1, 2, 0).numpy()), clip)
                        for p in [base] + tiles])


@pytest.mark.parametrize("cfg", [{}, NEXT_CONFIGS["five-pins"],
                                 dict(size={"shortest_edge": 40}, crop_size={"height": 36, "width": 36},
                                      image_grid_pinpoints=[[36, 72], [72, 36], [108, 108], [36, 144]])])
def test_anyres_torchvision_backend_equals_reference(cfg):
    ip = LlavaNextImageProcessorFast(**cfg)
    plan = pixel_plan(ip)
    assert plan.backend == "torchvision" and plan.anyres is not None
    imgs = NEXT_IMAGES[:4] if not cfg else NEXT_IMAGES
    for im in imgs:
        ref = torchvision_anyres_reference(im, ip)
        ours = device_pixels([im], ip, "cpu")[0]
        assert ours.shape == ref.shape and torch.equal(ours, ref), (cfg, im.size)


@pytest.mark.parametrize("kw, why", [
    (dict(resample=2, do_resize=False), "only bicubic"),
    (dict(size={"height": 336, "width": 300}), "square height and width"),
    (dict(image_grid_pinpoints=[[336, 600]]), "multiples of the tile"),
    (dict(image_grid_pinpoints=[]), "multiples of the tile"),
    (dict(crop_size={"height": 112, "width": 112}, do_resize=False, do_center_crop=False), "different sizes"),
])
def test_anyres_unsupported_settings_refused(kw, why):
    ip = next_processor(**kw)
    assert not supports(ip)
    with pytest.raises(ValueError, match=why):
        pixel_plan(ip)


def test_anyres_layout_must_match_the_model():
    """supports(ip, layout): the model's pinpoints and tile side, which its token counts follow."""
    from tabed_engine.models.anyres import AnyRes

    ip = next_processor()
    pins = tuple(tuple(p) for p in PINS)
    assert supports(ip) and supports(ip, AnyRes(pins, 336, 24))
    assert not supports(ip, AnyRes(pins[:3], 336, 24))
    assert not supports(ip, AnyRes(pins[::-1], 336, 24))    # ties go to the first pinpoint
    assert not supports(ip, AnyRes(((672, 672),), 224, 16))
    assert not supports(pil_processor(), AnyRes(pins, 336, 24))


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["pil", "torchvision"])
def test_cuda_anyres_equals_processor(backend):
    """LLaVA-NeXT (llava-v1.6's settings) on CUDA against the processor of each backend installed,
    one image at a time and as a padded batch; bfloat16 equal to the processor's values rounded once."""
    if backend == "pil":
        ip = next_processor()
    else:
        pytest.importorskip("torchvision")
        import transformers

        name = ("LlavaNextImageProcessor" if int(transformers.__version__.split(".")[0]) >= 5
                else "LlavaNextImageProcessorFast")
        ip = getattr(transformers, name)(**NEXT)
    assert pixel_plan(ip).backend == backend
    imgs = [im for im in NEXT_IMAGES if not misread_by_4x(im, ip)]
    for im in imgs:
        ref = ip([im], return_tensors="pt")["pixel_values"]
        ours = device_pixels([im], ip, "cuda")
        assert ours.shape == ref.shape and torch.equal(ours.cpu(), ref), (backend, im.size)
    ref = ip(imgs[3:6], return_tensors="pt")["pixel_values"]
    out = torch.full(ref.shape, float("nan"), dtype=torch.bfloat16, device="cuda")
    device_pixels(imgs[3:6], ip, "cuda", out=out)
    assert torch.equal(out.cpu(), ref.to(torch.bfloat16))


# ------------------------------------------------------------------ LLaVA-OneVision

# llava-hf/llava-onevision-qwen2-*-ov-hf's preprocessor_config.json (SigLIP normalisation, no crop)
ONEVISION = dict(do_convert_rgb=True, do_normalize=True, do_pad=True, do_rescale=True, do_resize=True,
                 image_grid_pinpoints=[[384 * i, 384 * j] for i in range(1, 7) for j in range(1, 7)],
                 image_mean=[0.5] * 3, image_std=[0.5] * 3, resample=3, rescale_factor=1 / 255,
                 size={"height": 384, "width": 384})
# the published layout at a 30-pixel tile (test_onevision's fixture is 35), and one with fewer pinpoints
OV_CONFIGS = {
    "tile-30": dict(size={"height": 30, "width": 30},
                    image_grid_pinpoints=[[30 * i, 30 * j] for i in range(1, 7) for j in range(1, 7)]),
    "five-pins": dict(size={"height": 30, "width": 30},
                      image_grid_pinpoints=[[30, 60], [60, 30], [60, 60], [90, 30], [30, 90]]),
    "shortest-edge-no-normalize": dict(size={"shortest_edge": 32}, do_normalize=False,
                                       image_grid_pinpoints=[[32, 32], [32, 64], [64, 32], [64, 64]]),
}
# tall, wide, tiny, exactly a tile, extreme aspect ratios, odd sizes that need padding in their
# pinpoint, larger than every pinpoint (shrunk), grey and RGBA inputs
OV_IMAGES = [image(17, 300, seed=20), image(300, 17, seed=21), image(5, 4, seed=22), image(30, 30, seed=23),
             image(91, 44, seed=24), image(333, 517, seed=25), image(640, 480, seed=26), image(41, 30, 0, seed=27),
             image(50, 45, 4, seed=28), image(7, 300, seed=29)]


def onevision_processor(**kw):
    """transformers' PIL-backed LLaVA-OneVision image processor (5.x: LlavaOnevisionImageProcessorPil;
    4.x: LlavaOnevisionImageProcessor), the published settings overridden by kw."""
    try:
        from transformers import LlavaOnevisionImageProcessorPil as cls
    except ImportError:
        from transformers import LlavaOnevisionImageProcessor as cls
    if pixel_plan(cls(**ONEVISION)).backend != "pil":
        pytest.skip(f"no PIL-backed LLaVA-OneVision image processor in this transformers ({cls.__name__} is not)")
    return cls(**{**ONEVISION, **kw})


@pytest.mark.parametrize("name", sorted(OV_CONFIGS))
def test_onevision_equals_processor(name):
    """Bit-exact pixel_values and equal image_sizes, image by image and as one padded batch of
    images with different tile counts (the processor's flat image list: every image tiled)."""
    ip = onevision_processor(**OV_CONFIGS[name])
    plan = pixel_plan(ip)
    assert plan.anyres is not None and plan.crop is None and plan.anyres.tile == plan.anyres.base[0]
    imgs = [im for im in OV_IMAGES if not misread_by_4x(im, ip)]
    for im in imgs:
        ref = ip([im], return_tensors="pt")
        ours = device_inputs([im], ip, "cpu")
        assert ours["pixel_values"].shape == ref["pixel_values"].shape, (name, im.size)
        assert torch.equal(ours["pixel_values"], ref["pixel_values"]), \
            (name, im.size, (ours["pixel_values"] - ref["pixel_values"]).abs().max().item())
        assert torch.equal(ours["image_sizes"], ref["image_sizes"])
    counts = [num_tiles((im.height, im.width), plan) for im in imgs]
    mixed = [imgs[counts.index(n)] for n in sorted(set(counts), reverse=True)]      # one of each count
    assert len(mixed) > 2
    ref = ip(mixed, return_tensors="pt")
    ours = device_inputs(mixed, ip, "cpu")
    assert ours["pixel_values"].shape == ref["pixel_values"].shape
    assert torch.equal(ours["pixel_values"], ref["pixel_values"])
    assert torch.equal(ours["image_sizes"], ref["image_sizes"])


def test_onevision_published_settings_equal_processor():
    """llava-hf's settings (384-pixel tiles, 36 pinpoints): the benchmark's 384 x 384 image, a
    portrait photo size that is shrunk and padded, and both as one batch."""
    ip = onevision_processor()
    imgs = [image(384, 384, seed=30), image(333, 517, seed=31)]
    for im in imgs:
        ref = ip([im], return_tensors="pt")["pixel_values"]
        assert torch.equal(device_pixels([im], ip, "cpu"), ref), im.size
    assert torch.equal(device_pixels(imgs, ip, "cpu"), ip(imgs, return_tensors="pt")["pixel_values"])


@pytest.mark.parametrize("mutation", ["bilinear processor", "last pinpoint", "pad top-left", "base as a tile"])
def test_onevision_mistakes_are_caught(monkeypatch, mutation):
    """The comparison fails for another resample filter, a wrong pinpoint, padding placement or
    base-tile resize."""
    import tabed_engine.models.image_ops as ops

    ip = onevision_processor(**OV_CONFIGS["five-pins"])
    imgs = OV_IMAGES[4:7]
    good = ip(imgs, return_tensors="pt")["pixel_values"]
    assert torch.equal(device_pixels(imgs, ip, "cpu"), good)
    if mutation == "bilinear processor":        # what a processor resampling bilinearly gives
        good = onevision_processor(**OV_CONFIGS["five-pins"], resample=2)(imgs, return_tensors="pt")["pixel_values"]
    elif mutation == "last pinpoint":
        monkeypatch.setattr(ops, "grid_resolution", lambda size, plan: plan.anyres.pinpoints[-1])
    elif mutation == "pad top-left":
        monkeypatch.setattr(ops, "_pad_offsets", lambda fh, fw, gh, gw: (0, 0))
    else:                                       # the base tile cut from the image instead of resized
        real = ops._anyres_tiles
        monkeypatch.setattr(ops, "_anyres_tiles", lambda img, plan: (real(img, plan)[1][0], real(img, plan)[1]))
    bad = device_pixels(imgs, ip, "cpu")
    assert bad.shape != good.shape or not torch.equal(bad, good)


class LlavaOnevisionImageProcessorFast(BaseImageProcessorFast):
    """transformers 4.x's torchvision-backed LLaVA-OneVision processor (stand-in holding its settings)."""

    def __init__(self, **kw):
        self.__dict__.update({**ONEVISION, "crop_size": None, "do_center_crop": None, **kw})


@pytest.mark.parametrize("kw, why", [
    (dict(resample=2), "only bicubic"),
    (dict(size={"height": 384, "width": 320}), "square height and width"),
    (dict(image_grid_pinpoints=[[384, 500]]), "multiples of the tile"),
    (dict(crop_size={"height": 384, "width": 384}), "tiles at `size`"),
    (dict(do_center_crop=True, crop_size={"height": 384, "width": 384}), "do_center_crop"),
])
def test_onevision_unsupported_settings_refused(kw, why):
    ip = onevision_processor(**kw)
    assert not supports(ip)
    with pytest.raises(ValueError, match=why):
        pixel_plan(ip)


def test_onevision_torchvision_backend_refused():
    with pytest.raises(ValueError, match="only LLaVA-OneVision's PIL backend"):
        pixel_plan(LlavaOnevisionImageProcessorFast())
    assert not supports(LlavaOnevisionImageProcessorFast())


def test_onevision_layout_must_match_the_model():
    """supports(ip, layout) against the OneVision model's layout (anyres_max budget included)."""
    from tabed_engine.models.anyres import AnyRes

    ip = onevision_processor()
    pins = tuple(tuple(p) for p in ONEVISION["image_grid_pinpoints"])
    assert supports(ip, AnyRes(pins, 384, 27, max_tiles=9))
    assert not supports(ip, AnyRes(pins[:-1], 384, 27, max_tiles=9))
    assert not supports(ip, AnyRes(tuple((h // 384 * 336, w // 384 * 336) for h, w in pins), 336, 24))


@pytest.mark.gpu
def test_cuda_onevision_equals_processor():
    """LLaVA-OneVision's published settings on CUDA, image by image and as a padded batch; bfloat16
    equal to the processor's values rounded once."""
    ip = onevision_processor()
    imgs = [im for im in OV_IMAGES if not misread_by_4x(im, ip)]
    for im in imgs:
        ref = ip([im], return_tensors="pt")["pixel_values"]
        ours = device_pixels([im], ip, "cuda")
        assert ours.shape == ref.shape and torch.equal(ours.cpu(), ref), im.size
    ref = ip(imgs[4:7], return_tensors="pt")["pixel_values"]
    out = torch.full(ref.shape, float("nan"), dtype=torch.bfloat16, device="cuda")
    device_pixels(imgs[4:7], ip, "cuda", out=out)
    assert torch.equal(out.cpu(), ref.to(torch.bfloat16))


# ------------------------------------------------------------------ Qwen2-VL / Qwen2.5-VL

# Qwen/Qwen2.5-VL-*-Instruct's preprocessor_config.json
QWEN = dict(min_pixels=3136, max_pixels=12845056, patch_size=14, temporal_patch_size=2, merge_size=2,
            image_mean=list(MEAN), image_std=list(STD))
QWEN_CONFIGS = {
    "published": {},
    "tiny": dict(min_pixels=256, max_pixels=2304, patch_size=4),          # tiny_qwen2_5_vl's fixture
    "1280-tokens": dict(max_pixels=1280 * 28 * 28),                       # the common max_pixels: shrinks more
    # every axis of the layout a different size (a merge / temporal / channel mix-up shows)
    "odd-layout": dict(min_pixels=400, max_pixels=40000, patch_size=5, merge_size=3, temporal_patch_size=3),
    "no-normalize": dict(min_pixels=256, max_pixels=2304, patch_size=4, do_normalize=False),
    "no-rescale": dict(min_pixels=256, max_pixels=2304, patch_size=4, do_rescale=False),
}
# odd sizes; tiny ones scaled up to min_pixels; 672 x 672 (already a multiple of 28: no resize); a tall
# one shrunk (Pillow 13 resizes it vertically first); one larger than 1280 tokens; extreme aspect
# ratios; grey and RGBA inputs
QWEN_IMAGES = [image(41, 67, seed=40), image(200, 113, seed=41), image(672, 672, seed=42), image(5, 7, seed=43),
               image(113, 2000, seed=44), image(1500, 1100, seed=45), image(400, 3, seed=46), image(2, 300, seed=47),
               image(37, 29, 0, seed=48), image(50, 45, 4, seed=49)]


def qwen_processor(**kw):
    """transformers' PIL-backed Qwen2-VL image processor (5.x: Qwen2VLImageProcessorPil; 4.x:
    Qwen2VLImageProcessor), Qwen2.5-VL's published settings overridden by kw."""
    try:
        from transformers import Qwen2VLImageProcessorPil as cls
    except ImportError:
        from transformers import Qwen2VLImageProcessor as cls
    if pixel_plan(cls(**QWEN)).backend != "pil":
        pytest.skip(f"no PIL-backed Qwen2-VL image processor in this transformers ({cls.__name__} is not)")
    return cls(**{**QWEN, **kw})


def qwen_misread_by_4x(im) -> bool:
    """transformers 4.x takes an image 3 pixels high for channels-first."""
    import transformers

    return int(transformers.__version__.split(".")[0]) < 5 and im.height == 3


@pytest.mark.parametrize("name", sorted(QWEN_CONFIGS))
def test_qwen_equals_processor(name):
    """Bit-exact pixel_values and equal image_grid_thw, image by image and as one batch (the
    images' patch rows one after another)."""
    ip = qwen_processor(**QWEN_CONFIGS[name])
    imgs = [im for im in QWEN_IMAGES if not qwen_misread_by_4x(im)]
    resized = 0
    for im in imgs:
        ref = ip([im], return_tensors="pt")
        ours = device_inputs([im], ip, "cpu")
        assert ours["pixel_values"].dtype == torch.float32
        assert ours["pixel_values"].shape == ref["pixel_values"].shape, (name, im.size)
        assert torch.equal(ours["pixel_values"], ref["pixel_values"]), \
            (name, im.size, (ours["pixel_values"] - ref["pixel_values"]).abs().max().item())
        assert torch.equal(ours["image_grid_thw"], ref["image_grid_thw"])
        t, gh, gw = ref["image_grid_thw"][0].tolist()
        resized += (gh * ip.patch_size, gw * ip.patch_size) != (im.height, im.width)
    assert resized >= len(imgs) - 1       # (the resampling ran, not only the layout)
    batch = imgs[:4]
    ref = ip(batch, return_tensors="pt")
    ours = device_inputs(batch, ip, "cpu")
    assert torch.equal(ours["pixel_values"], ref["pixel_values"])
    assert torch.equal(ours["image_grid_thw"], ref["image_grid_thw"])


@pytest.mark.slow
def test_qwen_huge_image_equals_processor():
    """An image past the published max_pixels (12845056): shrunk a little, in both pass orders
    (a wide one, horizontal first; a tall one, vertical first under Pillow 13)."""
    ip = qwen_processor()
    for im in (image(3700, 3500, seed=50), image(1200, 11000, seed=51)):
        ref = ip([im], return_tensors="pt")
        t, gh, gw = ref["image_grid_thw"][0].tolist()
        assert gh * gw * 14 * 14 <= QWEN["max_pixels"] < im.height * im.width
        assert torch.equal(device_pixels([im], ip, "cpu"), ref["pixel_values"]), im.size


def test_qwen_writes_every_element_of_out():
    """out= (poisoned with NaN) is written whole: float32 equal to the processor, bfloat16 its
    values rounded once; a wrong shape or a non-contiguous out is refused."""
    ip = qwen_processor(**QWEN_CONFIGS["tiny"])
    imgs = QWEN_IMAGES[:3]
    ref = ip(imgs, return_tensors="pt")["pixel_values"]
    check_out_written(imgs, ip, ref)
    with pytest.raises(ValueError, match="out must be"):
        device_pixels(imgs, ip, "cpu", out=torch.empty(ref.shape[0] - 1, ref.shape[1]))
    with pytest.raises(ValueError, match="contiguous"):
        device_pixels(imgs, ip, "cpu", out=torch.empty(ref.shape[1], ref.shape[0]).t())


@pytest.mark.parametrize("mutation", ["bilinear processor", "temporal before channel", "rows without merge",
                                      "floor sizes"])
def test_qwen_mistakes_are_caught(monkeypatch, mutation):
    """The comparison fails for another resample filter, a wrong column or row order, or a
    resize that rounds the sides down."""
    import tabed_engine.models.image_ops as ops

    ip = qwen_processor(**QWEN_CONFIGS["odd-layout"])
    imgs = QWEN_IMAGES[:2]
    good = ip(imgs, return_tensors="pt")["pixel_values"]
    assert torch.equal(device_pixels(imgs, ip, "cpu"), good)
    if mutation == "bilinear processor":
        good = qwen_processor(**QWEN_CONFIGS["odd-layout"], resample=2)(imgs, return_tensors="pt")["pixel_values"]
    elif mutation == "temporal before channel":
        def patchify(x, p, out):
            C, H, W = x.shape
            gh, gw, m = H // p.patch, W // p.patch, p.merge
            x = x.view(C, gh // m, m, p.patch, gw // m, m, p.patch).permute(1, 4, 2, 5, 0, 3, 6)
            out.view(gh // m, gw // m, m, m, p.temporal, C, p.patch, p.patch).copy_(
                x.unsqueeze(4).expand(-1, -1, -1, -1, p.temporal, -1, -1, -1))
        monkeypatch.setattr(ops, "_patchify", patchify)
    elif mutation == "rows without merge":          # plain row-major patch rows
        def patchify(x, p, out):
            C, H, W = x.shape
            gh, gw = H // p.patch, W // p.patch
            x = x.view(C, gh, p.patch, gw, p.patch).permute(1, 3, 0, 2, 4)
            out.view(gh, gw, C, p.temporal, p.patch, p.patch).copy_(x.unsqueeze(3).expand(-1, -1, -1, p.temporal,
                                                                                          -1, -1))
        monkeypatch.setattr(ops, "_patchify", patchify)
    else:
        def smart(h, w, factor, lo, hi):
            return max(factor, h // factor * factor), max(factor, w // factor * factor)
        from tabed_engine.models import image_plan

        monkeypatch.setattr(image_plan, "smart_resize", smart)
    bad = device_pixels(imgs, ip, "cpu")
    assert bad.shape != good.shape or not torch.equal(bad, good)


class Qwen2VLImageProcessorFast(BaseImageProcessorFast):
    """transformers 4.x's torchvision-backed Qwen2-VL processor (stand-in holding its settings)."""

    def __init__(self, **kw):
        self.__dict__.update({**QWEN, "do_resize": True, "resample": 3, "do_rescale": True, "rescale_factor": 1 / 255,
                              "do_normalize": True, "size": {"shortest_edge": 3136, "longest_edge": 12845056}, **kw})


def test_qwen_supported_and_refused_processors():
    """The published settings and the tiny fixture's are supported (and need no layout: the
    model's grids follow the processor it is bound to); the torchvision backend, a processor
    without min / max pixels and an any-resolution layout are not."""
    from tabed_engine.models.anyres import AnyRes

    assert supports(qwen_processor()) and supports(qwen_processor(**QWEN_CONFIGS["tiny"]))
    assert not supports(qwen_processor(), AnyRes(((672, 672),), 336, 24))
    with pytest.raises(ValueError, match="only Qwen2-VL's PIL backend"):
        pixel_plan(Qwen2VLImageProcessorFast())
    assert not supports(Qwen2VLImageProcessorFast())
    ip = qwen_processor()
    ip.size = {}
    for attr in ("min_pixels", "max_pixels"):     # (4.x keeps them as attributes too)
        if hasattr(ip, attr):
            setattr(ip, attr, None)
    with pytest.raises(ValueError, match="shortest_edge and longest_edge"):
        pixel_plan(ip)
    with pytest.raises(ValueError, match="aspect ratio"):       # as smart_resize refuses it in the processor
        device_pixels([image(1000, 4, seed=52)], qwen_processor(), "cpu")



@pytest.mark.gpu
def test_cuda_qwen_equals_processor():
    """Qwen2.5-VL's published settings on CUDA (float64 matmuls there: still exact), image by
    image and as one batch; bfloat16 out= equal to the processor's values rounded once."""
    ip = qwen_processor()
    imgs = [im for im in QWEN_IMAGES if not qwen_misread_by_4x(im)] + [image(3700, 3500, seed=50)]
    for im in imgs:
        ref = ip([im], return_tensors="pt")
        ours = device_inputs([im], ip, "cuda")
        assert ours["pixel_values"].is_cuda and torch.equal(ours["pixel_values"].cpu(), ref["pixel_values"]), im.size
        assert torch.equal(ours["image_grid_thw"].cpu(), ref["image_grid_thw"])
    ref = ip(imgs[:4], return_tensors="pt")["pixel_values"]
    out = torch.full(ref.shape, float("nan"), dtype=torch.bfloat16, device="cuda")
    device_pixels(imgs[:4], ip, "cuda", out=out)
    assert torch.equal(out.cpu(), ref.to(torch.bfloat16))

def test_long_axes_in_blocks_equal_processor(monkeypatch):
    """The blocked resampling of long axes (resample.resample_axis past DENSE_BYTES), forced on
    small images with blocks of 7 output pixels: still bit-exact for CLIP (crop and zero pad), the
    any-resolution tiles and Qwen2-VL's patches, shrunk and enlarged, in both pass orders."""
    from tabed_engine.models import resample

    monkeypatch.setattr(resample, "DENSE_BYTES", 0)
    monkeypatch.setattr(resample, "BLOCK", 7)
    cases = [(pil_processor(**CONFIGS["pad"]), IMAGES[:5]), (pil_processor(), IMAGES[:3]),
             (qwen_processor(**QWEN_CONFIGS["odd-layout"]), QWEN_IMAGES[:6]),
             (qwen_processor(), [image(113, 2000, seed=53), image(700, 150, seed=54)])]
    for ip, imgs in cases:
        for im in imgs:
            assert torch.equal(device_pixels([im], ip, "cpu"), ip([im], return_tensors="pt")["pixel_values"]), \
                (type(ip).__name__, im.size)
    ip = next_processor(**NEXT_CONFIGS[sorted(NEXT_CONFIGS)[0]])
    imgs = [im for im in IMAGES[:4] if not misread_by_4x(im, ip)]
    assert torch.equal(device_pixels(imgs, ip, "cpu"), ip(imgs, return_tensors="pt")["pixel_values"])
    assert any(k[-1] == 7 for k in resample.matrices.items)      # (the blocks ran)
