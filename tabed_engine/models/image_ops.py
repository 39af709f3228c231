"""Image preprocessing on the device, equal to the checkpoint's CLIP, LLaVA-NeXT, LLaVA-OneVision or
Qwen2-VL (Qwen2.5-VL) image processor.

`device_pixels(images, image_processor, device, dtype)` returns the processor's
`pixel_values` computed on `device`; the host only uploads each image's uint8 pixels.
`supports(image_processor)` says whether it can (`pixel_plan` raises a ValueError naming
what it cannot do); where it cannot, the processor (the CPU path) stays the way in.

Bit-exact, not approximately equal: both processor backends resize uint8 pixels in fixed
point, so a float resize (torch's `interpolate(mode="bicubic", antialias=True)` on float
input) differs from them by whole levels (22 of 255 on the benchmark's photos, more on
upsampled noise: results/ttft_vision_h200.json, float_resize_vs_processor_max_abs).
Here each axis is one matmul with the integer fixed-point coefficients in float64 (pixels
< 2^8 times coefficients < 2^23, sums < 2^31: exact in any summation order; a long axis resized
to a long one, in blocks of output pixels: resample.py), then the same
rounding and clipping to uint8 as the processor, the two passes in the processor's order:

* PIL backend (`CLIPImageProcessor` in transformers 4.x, `CLIPImageProcessorPil` in 5.x):
  Pillow's `ImagingResample` (bicubic a = -0.5, support scaled by the downscale factor,
  coefficients rounded to 22 fractional bits). Pillow <= 12 always resamples horizontally
  first; Pillow 13 vertically first when the height loses more than twice the pixels the
  width loses (a tall image shrunk): the installed Pillow's order is probed once.
* torchvision backend (`CLIPImageProcessorFast` in 4.x, `CLIPImageProcessor` in 5.x with
  torchvision installed; it resizes on the CPU): torch's uint8 antialiased bicubic kernel,
  int16 coefficients with the precision chosen from the largest weight, horizontal first.

Then center crop (zero padding where the crop is larger, offset rounded as each backend
rounds it), rescale and normalise in float32 with the backend's own operation order (the
torchvision backend folds the rescale into mean and std). Only the resized rows and columns
the crop keeps are computed.

Any resolution (LLaVA-NeXT: `LlavaNextImageProcessor` / `...Fast` in 4.x, `...` / `...Pil` in
5.x): per image, the whole image resized to the base tile (`size`), and the image resized into
its best `image_grid_pinpoints` resolution keeping its aspect ratio (the same two resamplings as
above), zero-padded there centred (an odd padding's extra pixel after) and cut into tiles of
crop_size's height, row by row; then every tile through the CLIP steps above (a no-op resize
and crop as published); `do_pad` pads each image's tiles with zero tiles to the batch's most.
The result is `[n, max_tiles, 3, h, w]`; `device_inputs` adds `image_sizes`. transformers 4.57's
PIL processor misreads the channel axis of an image fitted to a 3-pixel side ([3, w, 3] is
taken for channels-first) and tiles it wrongly; here it is tiled as 5.x tiles it.

LLaVA-OneVision (`LlavaOnevisionImageProcessor` in 4.x, `...Pil` in 5.x: the PIL backend only) tiles
the same way with no crop: tiles and base tile of the square `size` (4.x tiles at `size`, 5.x at a
crop_size height when one is set: refused), each tile then resized to `size` (a no-op) and
normalised. As the engine calls it, with a flat image list: every image is tiled (a nested list,
several images of one prompt, would pad them to squares instead; not reproduced).

Qwen2-VL / Qwen2.5-VL (`Qwen2VLImageProcessorPil` in 5.x, `Qwen2VLImageProcessor` in 4.x: the PIL
backend only): each image resized to `smart_resize` of its size (sides multiples of patch x merge,
area within the size's shortest_edge / longest_edge, 4.x's min_pixels / max_pixels) with the PIL
resampling above (no resize where the size is already that), rescaled and normalised as above, then
laid out as the processor's flattened patches: repeated temporal_patch_size times, rows ordered
(grid_h / merge, grid_w / merge, merge, merge), columns (channel, temporal, patch, patch); the
images' rows concatenated: `pixel_values` [sum of grid_h * grid_w, 3 * temporal * patch²], and
`device_inputs` adds `image_grid_thw` [[1, grid_h, grid_w], ...]. Checked bit-exact against 5.24 and
4.57.6 (Pillow 13); 4.57 reads an image 3 pixels high as channels-first (a wrong picture, with a
warning); here it is read as 5.x reads it. Videos stay on the host
(`qwen2_5_vl.QwenVLProcessor.video_pixels`).

Supported: `CLIPImageProcessor` / `CLIPImageProcessorFast` / `CLIPImageProcessorPil` with
bicubic resampling, `size` {shortest_edge} or {height, width}, any crop, rescale and
normalisation; `do_pad` only where it is a no-op (all images cropped to one size). Qwen2-VL's PIL
processor with bicubic resampling, do_resize on, any rescale and normalisation. LLaVA-NeXT
processors with those CLIP steps, crop_size with a height, `size` {shortest_edge} or a square
{height, width} (where 4.57 and 5.x agree); LLaVA-OneVision's PIL processor with bicubic
resampling, a square `size`, no crop_size and no center crop. Not supported, so the processor runs: other
processor classes (LLaVA's pad-to-square `LlavaImageProcessor`, SigLIP, Qwen2-VL's torchvision
backend, ...), other filters
(bilinear: torchvision's CPU rounding depends on the CPU's instruction set), `longest_edge` /
`max_height` sizes. Images: RGB PIL
images (what `prompt._to_pil` returns) or uint8 HWC RGB arrays / tensors (on any device);
`do_convert_rgb` is then a no-op.
"""
from __future__ import annotations

import functools
import math
from dataclasses import replace
from typing import Optional, Sequence

import numpy as np
import torch

# (the plans are read in image_plan; PixelPlan and pixel_plan are re-exported)
from tabed_engine.models.image_plan import PatchPlan, PixelPlan, _crop_axis, _output_size, _resized_size, pixel_plan
from tabed_engine.models.resample import fixed_point as _fixed_point, resample_axis as _resample_axis

def supports(image_processor, layout=None) -> bool:
    """Whether `device_pixels` reproduces this processor (else use the processor). layout: the
    model's `anyres.AnyRes`, when given, must tile as the processor does (same pinpoints and tile
    side: the image-token counts follow the model's, the pixels the processor's); a Qwen2-VL
    model has none (its grids follow the processor it is bound to, `QwenVision.bind_processor`)."""
    try:
        plan = pixel_plan(image_processor)
    except (ValueError, AttributeError, TypeError):
        return False
    if layout is None:
        return True
    return (plan.anyres is not None and plan.anyres.pinpoints == tuple(layout.pinpoints)
            and plan.anyres.tile == layout.tile
            and _output_size(layout.tile, layout.tile, plan) == (layout.tile, layout.tile))


# ---------------------------------------------------------------- one image

def _resize_crop(img: torch.Tensor, plan: PixelPlan, vertical_first: Optional[bool] = None) -> torch.Tensor:
    """uint8 [H, W, 3] on the device -> resized, cropped pixel values [3, h, w] (float64 ints).
    vertical_first: the pass order (None: the order the backend uses for these sizes)."""
    return _resample(img.permute(2, 0, 1).to(torch.float64, memory_format=torch.contiguous_format), plan,
                     vertical_first)


def _resample(x: torch.Tensor, plan: PixelPlan, vertical_first: Optional[bool] = None) -> torch.Tensor:
    """`_resize_crop` of uint8 values held in float64 [..., 3, H, W] (a batch of tiles at once)."""
    h, w = x.shape[-2:]
    rh, rw = _resized_size(h, w, plan.resize)
    crop = plan.crop or (None, None)
    y0, ny, dy, oh = _crop_axis(rh, crop[0], plan.backend)
    x0, nx, dx, ow = _crop_axis(rw, crop[1], plan.backend)
    if vertical_first is None:
        vertical_first = plan.backend == "pil" and _pillow_vertical_first(w, h, rw, rh)
    for axis in ("v", "h") if vertical_first else ("h", "v"):
        if axis == "h" and rw != w:
            x = _fixed_point(_resample_axis(x, -1, w, rw, x0, nx, plan.backend))   # [..., *, nx]
        elif axis == "h":
            x = x[..., x0:x0 + nx]
        elif rh != h:
            x = _fixed_point(_resample_axis(x, -2, h, rh, y0, ny, plan.backend))   # [..., ny, *]
        else:
            x = x[..., y0:y0 + ny, :]
    if (ny, nx) == (oh, ow):
        return x
    canvas = x.new_zeros(*x.shape[:-2], oh, ow)
    canvas[..., dy:dy + ny, dx:dx + nx] = x
    return canvas


def _pillow_vertical_first(w: int, h: int, ow: int, oh: int) -> bool:
    """Whether the installed Pillow resamples vertically first for these sizes."""
    return _pillow_order() == "height" and oh < h and h - oh > 2 * (w - ow)


@functools.lru_cache(maxsize=None)
def _pillow_order() -> str:
    """The installed Pillow's pass order, probed once on a small random image: "horizontal"
    (Pillow <= 12: always the horizontal pass first) or "height" (Pillow 13: vertically first
    when the height loses more than twice the pixels the width loses). ValueError if neither."""
    from PIL import Image

    a = np.random.default_rng(0).integers(0, 256, (90, 40, 3), dtype=np.uint8)
    ref = torch.from_numpy(np.array(Image.fromarray(a).resize((30, 40), Image.BICUBIC))).permute(2, 0, 1)
    plan = PixelPlan("pil", ("exact", 40, 30), None, None, None, None)
    for order, vertical in (("height", True), ("horizontal", False)):
        if torch.equal(_resize_crop(torch.from_numpy(a), plan, vertical).to(torch.uint8), ref):
            return order
    raise ValueError("the installed Pillow resamples in an order this module does not reproduce")


@functools.lru_cache(maxsize=16)
def _affine(plan: PixelPlan, device: torch.device):
    """(subtract, divide) float32 [3, 1, 1] constants of the backend's normalisation."""
    if plan.mean is None:
        return None
    mean = torch.tensor(plan.mean, dtype=torch.float32)
    std = torch.tensor(plan.std, dtype=torch.float32)
    if plan.backend == "torchvision" and plan.rescale is not None:   # torchvision folds the rescale in
        mean, std = mean * (1.0 / plan.rescale), std * (1.0 / plan.rescale)
    return mean.view(3, 1, 1).to(device), std.view(3, 1, 1).to(device)


def _normalize(x: torch.Tensor, plan: PixelPlan, out: torch.Tensor) -> torch.Tensor:
    """Resized uint8 values (float64) -> pixel values in float32, in the backend's arithmetic,
    written into `out` (its dtype: the float32 result rounded once)."""
    affine = _affine(plan, out.device)
    if plan.backend == "pil":       # numpy: astype(float64) * scale -> float32, then (x - mean) / std
        x = (x * plan.rescale).float() if plan.rescale is not None else x.float()
    else:                           # torchvision: (x - mean / scale) / (std / scale), or x * scale
        x = x.float()
        if affine is None and plan.rescale is not None:
            return torch.mul(x, plan.rescale, out=out)
    if affine is None:
        return out.copy_(x)
    return torch.div(x.sub_(affine[0]), affine[1], out=out)


def _upload(image, index: int, device) -> torch.Tensor:
    """One image as uint8 [H, W, 3] on the device: the only host work. From pageable memory:
    on an H200 host, PIL -> numpy 0.26 ms + upload 0.10 ms for 640x480, where staging it
    in pinned memory first cost 0.47 ms (benchmarks/results/README.md, 2026-11-28)."""
    if isinstance(image, torch.Tensor):
        a = image
    elif isinstance(image, np.ndarray):
        a = image
    elif getattr(image, "mode", None) == "RGB":            # PIL
        a = np.array(image)
    else:
        raise TypeError(f"image {index}: expected an RGB PIL image or a uint8 HWC RGB array/tensor "
                        f"(prompt._to_pil's output), got {type(image).__name__} "
                        f"{getattr(image, 'mode', '')}".rstrip())
    if a.dtype not in (np.uint8, torch.uint8) or a.ndim != 3 or a.shape[-1] != 3 or 0 in a.shape:
        raise ValueError(f"image {index}: expected uint8 [H, W, 3], got {a.dtype} {list(a.shape)}")
    if isinstance(a, np.ndarray):
        a = torch.from_numpy(a if a.flags.writeable else a.copy())
    return a.to(device, non_blocking=True)


# ---------------------------------------------------------------- any resolution (LLaVA-NeXT)

def _fit_size(h: int, w: int, th: int, tw: int) -> tuple[int, int]:
    """The size an h x w image is resized to inside a th x tw grid resolution, keeping its aspect
    ratio (transformers' `get_patch_output_size`)."""
    if tw / w < th / h:
        return min(math.ceil(h * (tw / w)), th), tw
    return th, min(math.ceil(w * (th / h)), tw)


def _pad_offsets(fh: int, fw: int, gh: int, gw: int) -> tuple[int, int]:
    """(top, left) of the resized image in its zero-padded pinpoint: centred, an odd padding's
    extra pixel after (bottom / right), as both backends pad."""
    return (gh - fh) // 2, (gw - fw) // 2


def grid_resolution(size: tuple[int, int], plan: PixelPlan) -> tuple[int, int]:
    """The (height, width) pinpoint the processor tiles an image of `size` (height, width) at."""
    from transformers.image_processing_utils import select_best_resolution

    return tuple(select_best_resolution(tuple(size), [list(p) for p in plan.anyres.pinpoints]))


def num_tiles(size: tuple[int, int], plan: PixelPlan) -> int:
    """Tiles the processor makes of an image of `size`, the base tile included."""
    gh, gw = grid_resolution(size, plan)
    return 1 + (gh // plan.anyres.tile) * (gw // plan.anyres.tile)


def _anyres_tiles(img: torch.Tensor, plan: PixelPlan) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 [H, W, 3] -> the processor's tiles before their CLIP steps, float64 uint8 values:
    base [3, bh, bw] (the whole image resized to the base size) and tiles [rows*cols, 3, t, t]
    (the image resized into its pinpoint keeping its aspect ratio, zero-padded to it centred,
    cut into tiles row by row)."""
    a, clip = plan.anyres, replace(plan, crop=None, anyres=None)
    h, w = img.shape[:2]
    gh, gw = grid_resolution((h, w), plan)
    fh, fw = _fit_size(h, w, gh, gw)
    x = img.permute(2, 0, 1).to(torch.float64, memory_format=torch.contiguous_format)    # [3, H, W]
    fit = _resample(x, replace(clip, resize=("exact", fh, fw)))
    t = a.tile
    padded = x.new_zeros(3, gh, gw)
    top, left = _pad_offsets(fh, fw, gh, gw)
    padded[:, top:top + fh, left:left + fw] = fit
    tiles = padded.view(3, gh // t, t, gw // t, t).permute(1, 3, 0, 2, 4).reshape(-1, 3, t, t)
    base = _resample(x, replace(clip, resize=("exact",) + a.base))                         # [3, bh, bw]
    return base, tiles


def device_pixels(images: Sequence, image_processor, device, dtype: torch.dtype = torch.float32,
                  out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The processor's `pixel_values` for `images`, computed on `device`.

    Parameters
    ----------
    images : sequence of RGB PIL images or uint8 [H, W, 3] arrays / tensors
    image_processor : the checkpoint's image processor (`supports` must hold)
    device, dtype : where and in which dtype the result lives (float32: bit-exact with the
        processor; other dtypes are the processor's values rounded once)
    out : optional tensor of the result's shape to write into (a graph's static input, say)

    Returns
    -------
    Tensor: `image_processor(images, return_tensors="pt").pixel_values`: [n, 3, h, w]; for an
    any-resolution (LLaVA-NeXT, OneVision) processor [n, max_tiles, 3, h, w], each image's tiles (its base
    tile first) then zero tiles up to the most any image has (do_pad); for Qwen2-VL's processor
    the flattened patches of all images [sum of grid_h * grid_w, 3 * temporal * patch²], image
    after image.
    """
    plan = pixel_plan(image_processor)
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if len(images) == 0:
        raise ValueError("no images")
    pixels = [_upload(im, i, device) for i, im in enumerate(images)]
    if plan.anyres is not None:
        return _anyres_pixels(pixels, plan, device, dtype, out)
    if plan.patches is not None:
        return _patch_pixels(pixels, plan, device, dtype, out)
    sizes = {_output_size(p.shape[0], p.shape[1], plan) for p in pixels}
    if len(sizes) > 1:
        raise ValueError(f"the images preprocess to different sizes {sorted(sizes)} (no resize to a fixed "
                         "size and no crop); they cannot form one batch")
    h, w = sizes.pop()
    out = _check_out(out, (len(pixels), 3, h, w), device, dtype)
    for i, p in enumerate(pixels):
        _normalize(_resize_crop(p, plan), plan, out[i])
    return out


def _check_out(out: Optional[torch.Tensor], shape: tuple, device, dtype) -> torch.Tensor:
    if out is None:
        return torch.empty(shape, dtype=dtype, device=device)
    if tuple(out.shape) != shape or out.device != device:
        raise ValueError(f"out must be {list(shape)} on {device}, got {list(out.shape)} on {out.device}")
    return out


def _anyres_pixels(pixels: list, plan: PixelPlan, device, dtype, out) -> torch.Tensor:
    counts = [num_tiles(p.shape[:2], plan) for p in pixels]
    if not plan.anyres.pad and len(set(counts)) > 1:
        raise ValueError(f"the images make different numbers of tiles {counts} and do_pad is off; they "
                         "cannot form one batch")
    h, w = _output_size(plan.anyres.tile, plan.anyres.tile, plan)
    out = _check_out(out, (len(pixels), max(counts), 3, h, w), device, dtype)
    for i, (p, n) in enumerate(zip(pixels, counts)):
        base, tiles = _anyres_tiles(p, plan)
        _normalize(_resample(base, plan), plan, out[i, 0])
        _normalize(_resample(tiles, plan), plan, out[i, 1:n])
        out[i, n:].zero_()                               # do_pad's zero tiles
    return out


# ---------------------------------------------------------------- flattened patches (Qwen2-VL)

def patch_grid(size: tuple[int, int], plan: PixelPlan) -> tuple[int, int, int]:
    """(grid_t, grid_h, grid_w) the processor gives an image of `size` (height, width): its
    `image_grid_thw` row (grid_t 1: an image is one temporal patch)."""
    h, w = _resized_size(*size, plan.resize)
    return 1, h // plan.patches.patch, w // plan.patches.patch


def _patchify(x: torch.Tensor, p: PatchPlan, out: torch.Tensor):
    """Pixel values [C, H, W] -> the processor's patch rows in `out` [grid_h * grid_w, C * T * p * p]:
    rows (grid_h / m, grid_w / m, m, m), columns (C, T, p, p), the image repeated over T."""
    C, H, W = x.shape
    gh, gw, m = H // p.patch, W // p.patch, p.merge
    x = x.view(C, gh // m, m, p.patch, gw // m, m, p.patch).permute(1, 4, 2, 5, 0, 3, 6)  # [gh/m, gw/m, m, m, C, p, p]
    out.view(gh // m, gw // m, m, m, C, p.temporal, p.patch, p.patch).copy_(
        x.unsqueeze(5).expand(-1, -1, -1, -1, -1, p.temporal, -1, -1))


def _patch_pixels(pixels: list, plan: PixelPlan, device, dtype, out) -> torch.Tensor:
    grids = [patch_grid(tuple(px.shape[:2]), plan) for px in pixels]
    rows = [t * h * w for t, h, w in grids]
    out = _check_out(out, (sum(rows), 3 * plan.patches.temporal * plan.patches.patch ** 2), device, dtype)
    if not out.is_contiguous():
        raise ValueError("out must be contiguous (the patch rows are written through a view of it)")
    start = 0
    for px, (_, gh, gw), n in zip(pixels, grids, rows):
        x = torch.empty(3, gh * plan.patches.patch, gw * plan.patches.patch, dtype=torch.float32, device=device)
        _normalize(_resize_crop(px, plan), plan, x)      # (float32 as the processor; `out` rounds once)
        _patchify(x, plan.patches, out[start:start + n])
        start += n
    return out


def device_inputs(images: Sequence, image_processor, device, dtype: torch.dtype = torch.float32) -> dict:
    """The processor's image outputs computed on `device`: {"pixel_values"} (`device_pixels`), and
    for an any-resolution processor "image_sizes" too: int64 [n, 2] (height, width) as given; for
    Qwen2-VL's processor "image_grid_thw": int64 [n, 3] (grid_t, grid_h, grid_w)."""
    pv = device_pixels(images, image_processor, device, dtype)
    plan = pixel_plan(image_processor)
    sizes = [tuple(im.shape[:2]) if hasattr(im, "shape") else (im.height, im.width) for im in images]
    if plan.patches is not None:
        grids = [patch_grid(s, plan) for s in sizes]
        return {"pixel_values": pv, "image_grid_thw": torch.tensor(grids, dtype=torch.int64, device=pv.device)}
    if plan.anyres is None:
        return {"pixel_values": pv}
    return {"pixel_values": pv, "image_sizes": torch.tensor(sizes, dtype=torch.int64, device=pv.device)}
