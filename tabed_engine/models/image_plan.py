"""What an image processor does to each image, read from its configuration: the `PixelPlan`
that `image_ops.device_pixels` follows (resize, crop, rescale, normalisation, and the layout
after them: LLaVA-NeXT / OneVision tiles or Qwen2-VL's flattened patches). `pixel_plan` raises
a ValueError naming what it cannot reproduce (see `image_ops` for what is supported)."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

from tabed_engine.models.qwen2_5_vl_vision import smart_resize

_CLASSES = ("CLIPImageProcessor", "CLIPImageProcessorFast", "CLIPImageProcessorPil")
# any-resolution (LLaVA-NeXT): 4.x LlavaNextImageProcessor (PIL) / ...Fast (torchvision); 5.x
# LlavaNextImageProcessor (torchvision) / ...Pil
_ANYRES_CLASSES = ("LlavaNextImageProcessor", "LlavaNextImageProcessorFast", "LlavaNextImageProcessorPil")
# LLaVA-OneVision: 4.x LlavaOnevisionImageProcessor (PIL) / ...Fast (torchvision); 5.x
# LlavaOnevisionImageProcessor (torchvision) / ...Pil. Only the PIL backend is reproduced.
_ONEVISION_CLASSES = ("LlavaOnevisionImageProcessor", "LlavaOnevisionImageProcessorFast",
                      "LlavaOnevisionImageProcessorPil")
# Qwen2-VL (Qwen2.5-VL): 4.x Qwen2VLImageProcessor (PIL) / ...Fast (torchvision); 5.x
# Qwen2VLImageProcessor (torchvision) / ...Pil. Only the PIL backend is reproduced.
_PATCH_CLASSES = ("Qwen2VLImageProcessor", "Qwen2VLImageProcessorFast", "Qwen2VLImageProcessorPil")
_SIZE_KEYS = ("height", "width", "shortest_edge", "longest_edge", "max_height", "max_width",
              "min_pixels", "max_pixels")


@dataclass(frozen=True)
class AnyResPlan:
    """LLaVA-NeXT's any-resolution tiling, before each tile goes through the CLIP steps."""

    pinpoints: tuple[tuple[int, int], ...]   # (height, width) grid resolutions, multiples of `tile`
    tile: int                                # side of the tiles cut from the padded image
    base: tuple[int, int]                    # (height, width) the whole image is resized to
    pad: bool                                # do_pad: zero tiles up to the batch's most


@dataclass(frozen=True)
class PatchPlan:
    """Qwen2-VL's flattened-patch layout, after the image is resized to its `smart_resize` size."""

    patch: int          # patch side (pixels)
    merge: int          # spatial merge size: rows are ordered by merge x merge groups
    temporal: int       # temporal patch size: an image is repeated this many times

    def __post_init__(self):
        if min(self.patch, self.merge, self.temporal) < 1:
            raise ValueError(f"patch, merge and temporal patch sizes must be positive, got {self}")


@dataclass(frozen=True)
class PixelPlan:
    """What the processor does to each image, read from its configuration."""

    backend: str                              # "pil" | "torchvision": whose rounding to follow
    resize: Optional[tuple]                   # ("shortest_edge", s) | ("exact", h, w) | ("smart", factor,
                                              # min_pixels, max_pixels) | None
    crop: Optional[tuple[int, int]]           # (h, w) | None
    rescale: Optional[float]
    mean: Optional[tuple[float, ...]]         # normalisation, None: off
    std: Optional[tuple[float, ...]]
    anyres: Optional[AnyResPlan] = None      # any-resolution tiling first (LLaVA-NeXT), else None
    patches: Optional[PatchPlan] = None      # Qwen2-VL's flattened patches last, else None

    def __post_init__(self):
        if self.backend not in ("pil", "torchvision"):
            raise ValueError(f"unknown image processor backend {self.backend!r}")


def _size(s) -> dict:
    """A size setting (dict in transformers 4.x, SizeDict in 5.x) as a dict of its set keys."""
    if s is None:
        return {}
    get = s.get if isinstance(s, dict) else (lambda k: getattr(s, k, None))
    return {k: get(k) for k in _SIZE_KEYS if get(k) is not None}


def pixel_plan(image_processor) -> PixelPlan:
    """The processor's preprocessing as a `PixelPlan`; ValueError naming what is unsupported."""
    ip = image_processor
    name = type(ip).__name__
    if name not in _CLASSES + _ANYRES_CLASSES + _ONEVISION_CLASSES + _PATCH_CLASSES:
        raise ValueError(f"{name} is not a CLIP, LLaVA-NeXT, LLaVA-OneVision or Qwen2-VL image processor")
    bases = {c.__name__ for c in type(ip).__mro__}   # 4.x: BaseImageProcessor(Fast); 5.x: the backends
    if bases & {"TorchvisionBackend", "BaseImageProcessorFast"}:
        backend = "torchvision"
    elif bases & {"PilBackend", "BaseImageProcessor"}:
        backend = "pil"
    else:
        raise ValueError(f"{name} derives from no transformers image processor base class")
    if getattr(ip, "backend", backend) != backend:
        raise ValueError(f"{name} says its backend is {ip.backend!r}, its base class says {backend!r}")
    onevision = name in _ONEVISION_CLASSES
    if onevision and backend != "pil":
        # (its tiles go through a torchvision resize to `size` this module has not been checked against)
        raise ValueError(f"{name}: only LLaVA-OneVision's PIL backend is reproduced, not {backend!r}")
    if name in _PATCH_CLASSES and backend != "pil":
        raise ValueError(f"{name}: only Qwen2-VL's PIL backend is reproduced, not {backend!r}")
    if backend == "pil":
        from tabed_engine.models.image_ops import _pillow_order   # (a probe of the installed Pillow)

        _pillow_order()
    if name in _PATCH_CLASSES:
        return _patch_plan(ip)
    resize = None
    anyres = name in _ANYRES_CLASSES or onevision
    if ip.do_resize or anyres:      # LLaVA-NeXT resizes to the grid and the base tile whatever do_resize
        resample = getattr(ip.resample, "value", ip.resample)
        if resample not in (3, "bicubic"):
            raise ValueError(f"resample {ip.resample!r}: only bicubic is reproduced")
    if ip.do_resize:
        size = _size(ip.size)
        if set(size) == {"shortest_edge"}:
            resize = ("shortest_edge", int(size["shortest_edge"]))
        elif set(size) == {"height", "width"}:
            resize = ("exact", int(size["height"]), int(size["width"]))
        else:
            raise ValueError(f"size {size}: only shortest_edge or height and width are reproduced")
    crop = None
    if onevision and ip.do_center_crop:      # (5.x would crop every tile, 4.x never does)
        raise ValueError("do_center_crop: LLaVA-OneVision's processors do not crop alike across versions")
    if ip.do_center_crop:
        cs = _size(ip.crop_size)
        if set(cs) != {"height", "width"}:
            raise ValueError(f"crop_size {cs}: expected height and width")
        crop = (int(cs["height"]), int(cs["width"]))
    if not anyres and getattr(ip, "do_pad", None) and crop is None and (resize is None or resize[0] != "exact"):
        raise ValueError("do_pad pads images of different sizes to one; not reproduced")
    plan = PixelPlan(backend, resize, crop, float(ip.rescale_factor) if ip.do_rescale else None, *_mean_std(ip))
    return replace(plan, anyres=_anyres_plan(ip, plan, onevision)) if anyres else plan


def _mean_std(ip) -> tuple[Optional[tuple[float, ...]], Optional[tuple[float, ...]]]:
    """The processor's normalisation (mean, std) per channel; (None, None) when it is off."""
    if not ip.do_normalize:
        return None, None
    mean, std = (tuple(float(v) for v in (x if isinstance(x, (list, tuple)) else [x] * 3))
                 for x in (ip.image_mean, ip.image_std))
    if len(mean) != 3 or len(std) != 3:
        raise ValueError(f"image_mean {mean} / image_std {std}: expected 3 channels")
    return mean, std


def _patch_plan(ip) -> PixelPlan:
    """Qwen2-VL's PIL processor: the `smart_resize` bounds (size's shortest_edge / longest_edge,
    else the min_pixels / max_pixels attributes, as `QwenVision.bind_processor` reads them, so the
    pixels and the model's token counts agree), bicubic resampling, then rescale, normalisation
    and the patch layout."""
    name = type(ip).__name__
    if not ip.do_resize:
        raise ValueError(f"{name} with do_resize off: only its smart_resize to multiples of the patch is reproduced")
    resample = getattr(ip.resample, "value", ip.resample)
    if resample not in (3, "bicubic"):
        raise ValueError(f"resample {ip.resample!r}: only bicubic is reproduced")
    if getattr(ip, "do_center_crop", None) or getattr(ip, "do_pad", None):
        raise ValueError(f"{name} with do_center_crop / do_pad: not steps of Qwen2-VL's processor, not reproduced")
    size = _size(ip.size)
    lo = size.get("shortest_edge") or getattr(ip, "min_pixels", None)
    hi = size.get("longest_edge") or getattr(ip, "max_pixels", None)
    if not lo or not hi:
        raise ValueError(f"size {size}: Qwen2-VL's processor needs shortest_edge and longest_edge (min / max pixels)")
    layout = PatchPlan(int(ip.patch_size), int(ip.merge_size), int(ip.temporal_patch_size))
    resize = ("smart", layout.patch * layout.merge, int(lo), int(hi))
    return PixelPlan("pil", resize, None, float(ip.rescale_factor) if ip.do_rescale else None, *_mean_std(ip),
                     patches=layout)


def _anyres_plan(ip, plan: PixelPlan, onevision: bool = False) -> AnyResPlan:
    """The any-resolution tiling settings, where transformers 4.57 and 5.x read them alike. LLaVA-NeXT:
    tiles of crop_size's height, the base tile of a square `size` (4.57 squares a {height, width}
    size to its smaller side, 5.x does not). LLaVA-OneVision: tiles and base tile of the square
    `size` (5.x would tile at a crop_size height, 4.x ignores crop_size: refused when set)."""
    cs, size = _size(ip.crop_size), _size(ip.size)
    if onevision and "height" in cs:
        raise ValueError(f"crop_size {cs}: LLaVA-OneVision tiles at `size` in transformers 4.x, at crop_size "
                         "in 5.x")
    if not onevision and "height" not in cs:
        raise ValueError(f"crop_size {cs}: any-resolution tiles need crop_size height")
    tile = None if onevision else int(cs["height"])
    if set(size) == {"shortest_edge"}:
        base = (int(size["shortest_edge"]),) * 2
    elif set(size) == {"height", "width"} and size["height"] == size["width"]:
        base = (int(size["height"]),) * 2
    else:
        raise ValueError(f"size {size}: any-resolution needs shortest_edge or a square height and width")
    tile = base[0] if tile is None else tile
    pins = tuple(tuple(int(v) for v in p) for p in (ip.image_grid_pinpoints or ()))
    bad = [p for p in pins if len(p) != 2 or min(p) <= 0 or p[0] % tile or p[1] % tile]
    if not pins or bad:
        raise ValueError(f"image_grid_pinpoints {list(pins)}: expected (height, width) multiples of the tile "
                         f"side {tile}")
    sizes = {_output_size(tile, tile, plan), _output_size(*base, plan)}
    if len(sizes) > 1:
        raise ValueError(f"the tiles and the base tile preprocess to different sizes {sorted(sizes)}")
    return AnyResPlan(pins, tile, base, bool(getattr(ip, "do_pad", True)))


# ---------------------------------------------------------------- sizes

def _resized_size(h: int, w: int, resize) -> tuple[int, int]:
    if resize is None:
        return h, w
    if resize[0] == "exact":
        return resize[1], resize[2]
    if resize[0] == "smart":        # Qwen2-VL: (factor, min_pixels, max_pixels)
        return smart_resize(h, w, *resize[1:])
    s = resize[1]   # transformers' get_resize_output_image_size(default_to_square=False)
    short, long = (w, h) if w <= h else (h, w)
    new_long = int(s * long / short)
    return (new_long, s) if w <= h else (s, new_long)


def _crop_axis(size: int, crop: Optional[int], backend: str) -> tuple[int, int, int, int]:
    """(first kept pixel, kept count, offset in the output, output size) along one axis."""
    if crop is None:
        return 0, size, 0, size
    if crop <= size:
        return (size - crop) // 2, crop, 0, crop
    pad = crop - size   # zero padding: numpy's center_crop rounds the offset up, torchvision's down
    return 0, size, (pad + 1) // 2 if backend == "pil" else pad // 2, crop


def _output_size(h: int, w: int, plan: PixelPlan) -> tuple[int, int]:
    rh, rw = _resized_size(h, w, plan.resize)
    crop = plan.crop or (None, None)
    return _crop_axis(rh, crop[0], plan.backend)[3], _crop_axis(rw, crop[1], plan.backend)[3]
