"""Qwen2.5-VL's vision side: the vision transformer (transformers' own module, run eagerly once
per request: window attention with its full-attention layers, 2-D rotary, the 2x2 patch
merger), dynamic resolution (`smart_resize` between the processor's min and max pixels) and
the M-RoPE position ids of a prompt's image and video blocks (`rope_index`).

A block of t x h x w merged tokens (h, w: the patch grid over the spatial merge size) starting
at text position c takes the ids (c + i * interval, c + y, c + x) for its token (i, y, x), and
the text after it continues at c + max(h, w): transformers' `get_rope_index` (5.x). After the
prompt every token has three equal ids, its cache slot + `delta` (max id + 1 - prompt length),
so the decoder needs 3-D ids only in the prefill (`decoder.KVCache.pos_offset`).
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """The size the Qwen2-VL image processor resizes an image of (height, width) to: both sides
    multiples of `factor` (patch x merge), the area within [min_pixels, max_pixels], the aspect
    ratio kept as well as that allows (transformers' `smart_resize`, line for line)."""
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"image aspect ratio must be below 200, got {max(height, width) / min(height, width)}")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def rope_index(n: int, blocks: Sequence[tuple[int, int, int, int, float]]) -> torch.Tensor:
    """M-RoPE position ids [3, n] int64 of a prompt of n tokens whose vision blocks are
    `blocks`: (start, t, h, w, interval) in prompt order, t x h x w merged tokens from `start`
    (interval: the temporal id step, 1 for images, tokens_per_second x seconds per temporal
    patch for videos). Text tokens take three equal ids (see the module docstring)."""
    pos = torch.empty(3, n, dtype=torch.long)
    cur, prev = 0, 0
    for start, t, h, w, interval in blocks:
        if start < prev or start + t * h * w > n:
            raise ValueError(f"vision block at {start} of {t}x{h}x{w} tokens overlaps another or ends past "
                             f"the prompt's {n} tokens")
        pos[:, prev:start] = cur + torch.arange(start - prev)
        cur += start - prev
        tt = (torch.arange(t) * interval).long() + cur
        grid = torch.meshgrid(tt, torch.arange(h) + cur, torch.arange(w) + cur, indexing="ij")
        pos[:, start:start + t * h * w] = torch.stack(grid).reshape(3, -1)
        cur += max(h, w)
        prev = start + t * h * w
    pos[:, prev:] = cur + torch.arange(n - prev)
    return pos


def pool_grid(x: torch.Tensor, t: int, h: int, w: int, k: int) -> torch.Tensor:
    """Average-pool merged features x [t*h*w, D] (row-major t, h, w) over k x k spatial windows
    (the last row / column of windows partial when k does not divide h or w: each averages the
    tokens it holds) -> [t * ceil(h/k) * ceil(w/k), D]."""
    D = x.shape[-1]
    g = x.view(t, h, w, D).permute(0, 3, 1, 2).float()
    p = F.avg_pool2d(g, k, stride=k, ceil_mode=True)
    return p.permute(0, 2, 3, 1).reshape(-1, D).to(x.dtype)


# seconds a video's frames are apart: frames are taken as sampled at 2 per second, the
# Qwen2.5-VL processor's default fps (4.x) and qwen-vl-utils' FPS; a temporal patch of 2 frames
# is then 1 s, an integer, so transformers versions that cast seconds per grid to int and those
# that do not give the same temporal ids
VIDEO_FPS = 2.0


def patchify_video(pixels: torch.Tensor, patch: int, merge: int, temporal: int) -> torch.Tensor:
    """A video's frames [F, C, H, W] -> flattened patches [t*gh*gw, C*temporal*patch*patch] as
    transformers' Qwen2-VL video processor lays them out (`pixel_values_videos`): an odd frame
    count padded by repeating the last frame, `temporal` consecutive frames a temporal patch,
    rows ordered (t, gh/merge, gw/merge, merge, merge), columns (C, temporal, patch, patch)."""
    if pad := -pixels.shape[0] % temporal:
        pixels = torch.cat([pixels, pixels[-1:].expand(pad, -1, -1, -1)])
    F_, C, H, W = pixels.shape
    t, gh, gw = F_ // temporal, H // patch, W // patch
    x = pixels.reshape(t, temporal, C, gh // merge, merge, patch, gw // merge, merge, patch)
    x = x.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return x.reshape(t * gh * gw, C * temporal * patch * patch)


class QwenVision(nn.Module):
    """The vision tower of a Qwen2.5-VL checkpoint behind the engine's vision interface
    (`select_images`, `image_features`, `tokens_per_image`, `positions`; videos: `video_tokens`,
    `video_features`, `pool_video`). The merger is part of
    the tower, so there is no separate projector. Image sizes map to patch grids through the
    processor's min / max pixels: `bind_processor` gives them (the engine does, with the
    checkpoint's processor)."""

    def __init__(self, hf_config):
        super().__init__()
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

        vc = hf_config.vision_config
        self.tower = Qwen2_5_VisionTransformerPretrainedModel._from_config(vc)
        self.projector = nn.Module()          # (the merger is in the tower)
        self.image_newline = None
        self.anyres = None
        self.feature_layer = self.strategy = None
        self.patch, self.merge, self.temporal = vc.patch_size, vc.spatial_merge_size, vc.temporal_patch_size
        self.tokens_per_second = vc.tokens_per_second
        self.min_pixels = self.max_pixels = None

    # ------------------------------------------------------------------ engine interface
    fixed_tokens = None          # image-token counts depend on each image's size
    default_pool = 2             # P view: 2x2 average pooling of the merged grid

    def bind_processor(self, image_processor):
        """Take the processor's min / max pixels (how images are resized, hence their grids);
        ValueError when its patch, merge or temporal patch sizes are not the tower's."""
        if image_processor is None:
            raise ValueError("a Qwen2.5-VL model needs its processor's image processor (min / max pixels)")
        size = image_processor.size
        get = size.get if isinstance(size, dict) else (lambda k: getattr(size, k, None))
        lo = get("shortest_edge") or getattr(image_processor, "min_pixels", None)
        hi = get("longest_edge") or getattr(image_processor, "max_pixels", None)
        mine = (self.patch, self.merge, self.temporal)
        theirs = (getattr(image_processor, "patch_size", None), getattr(image_processor, "merge_size", None),
                  getattr(image_processor, "temporal_patch_size", None))
        if lo is None or hi is None or theirs != mine:
            raise ValueError(f"the image processor ({type(image_processor).__name__}: patch, merge, temporal patch "
                             f"{theirs}, min/max pixels {lo}/{hi}) does not fit the Qwen2.5-VL vision tower "
                             f"(patch, merge, temporal patch {mine})")
        self.min_pixels, self.max_pixels = int(lo), int(hi)

    def grid(self, size: tuple[int, int]) -> tuple[int, int]:
        """The patch grid (rows, columns) of an image of size (height, width)."""
        if self.min_pixels is None:
            raise ValueError("the Qwen2.5-VL vision tower has no processor bound (bind_processor)")
        f = self.patch * self.merge
        h, w = smart_resize(size[0], size[1], f, self.min_pixels, self.max_pixels)
        return h // self.patch, w // self.patch

    def merged_grid(self, size, pool: int = 0) -> tuple[int, int]:
        """An image's merged-token grid (rows, columns), pooled by pool x pool windows if pool."""
        gh, gw = self.grid(size)
        h, w = gh // self.merge, gw // self.merge
        return (-(-h // pool), -(-w // pool)) if pool else (h, w)

    def tokens_per_image(self, sizes, pool: int = 0) -> list[int]:
        """Image tokens of each image of sizes [(height, width), ...] (pooled: the P view's)."""
        return [h * w for h, w in (self.merged_grid(s, pool) for s in sizes)]

    def positions(self, ids, spans, sizes, pool: int = 0, videos=()) -> Optional[torch.Tensor]:
        """M-RoPE ids [3, len(ids)] of a prompt whose image i's token run is spans[i] (pooled
        grids with pool) and whose videos are `videos`: (start of its token run, its frames'
        pixels [F, 3, H, W]) each; None for a prompt without either (ids = slots)."""
        if not spans and not videos:
            return None
        blocks = [(start, 1, *self.merged_grid(s, pool), 1) for (start, _), s in zip(spans, sizes)]
        interval = self.tokens_per_second * self.temporal / VIDEO_FPS    # (transformers: tps * second_per_grid_ts)
        blocks += [(start, *self.video_grid(px, pool), interval) for start, px in videos]
        return rope_index(len(ids), sorted(blocks))

    # ------------------------------------------------------------------ videos
    def video_grid(self, pixels: torch.Tensor, pool: int = 0) -> tuple[int, int, int]:
        """A video's merged-token grid (t, rows, columns) from its frames' pixels [F, 3, H, W]
        (`QwenVLProcessor.video_pixels`): t = ceil(F / temporal patch); pooled by pool x pool
        windows per temporal slice if pool."""
        F_, _, H, W = pixels.shape
        f = self.patch * self.merge
        if H % f or W % f:
            raise ValueError(f"video frames of {H}x{W} pixels are not a multiple of {f} (patch x merge): "
                             "preprocess them with the checkpoint's processor (QwenVLProcessor.video_pixels)")
        t, h, w = -(-F_ // self.temporal), H // f, W // f
        return (t, -(-h // pool), -(-w // pool)) if pool else (t, h, w)

    def video_tokens(self, pixels: torch.Tensor, pool: int = 0) -> int:
        """Tokens of one video: grid_t * grid_h * grid_w / merge² (transformers' count), pooled
        per temporal slice with pool (the P view)."""
        t, h, w = self.video_grid(pixels, pool)
        return t * h * w

    @torch.no_grad()
    def video_features(self, pixels: torch.Tensor) -> torch.Tensor:
        """One video's merged features [t*h*w, hidden] from its frames' pixels [F, 3, H, W]: the
        tower over its patches with video_grid_thw [[t, H/patch, W/patch]], as transformers'
        `get_video_features` runs it on `pixel_values_videos`."""
        t, h, w = self.video_grid(pixels)
        patches = patchify_video(pixels, self.patch, self.merge, self.temporal)
        dtype = self.tower.patch_embed.proj.weight.dtype
        grid = torch.tensor([[t, h * self.merge, w * self.merge]], device=pixels.device)
        return self.tower(patches.to(dtype), grid_thw=grid).pooler_output

    def pool_video(self, feats: torch.Tensor, pixels: torch.Tensor, pool: int) -> torch.Tensor:
        """The P view's video features: `video_features` averaged over pool x pool windows of
        each temporal slice's merged grid (as images are)."""
        return pool_grid(feats, *self.video_grid(pixels), pool) if pool else feats

    @torch.no_grad()
    def select_images(self, pixel_values: torch.Tensor, sizes=None) -> torch.Tensor:
        """The processor's flattened patches of a request's images [sum of t*h*w, C*T*p*p] ->
        the merged features [sum of tokens, hidden], image after image."""
        grids = [(1, *self.grid(s)) for s in sizes]
        n = sum(t * h * w for t, h, w in grids)
        if pixel_values.dim() != 2 or pixel_values.shape[0] != n:
            raise ValueError(f"pixel_values {tuple(pixel_values.shape)} do not hold the {n} patches of images of "
                             f"sizes {list(sizes)} (is the processor the checkpoint's Qwen2-VL image processor?)")
        dtype = self.tower.patch_embed.proj.weight.dtype
        grid = torch.tensor(grids, device=pixel_values.device)
        return self.tower(pixel_values.to(dtype), grid_thw=grid).pooler_output

    @torch.no_grad()
    def image_features(self, sel: torch.Tensor, sizes=None, pool: int = 0) -> list[torch.Tensor]:
        """`select_images`' features -> each image's [n_i, hidden]; pool > 0 average-pools each
        image's merged grid over pool x pool windows first (the P view)."""
        grids = [self.merged_grid(s) for s in sizes]
        feats = sel.split([h * w for h, w in grids])
        if not pool:
            return list(feats)
        return [pool_grid(f, 1, h, w, pool) for f, (h, w) in zip(feats, grids)]

    def checkpoint_targets(self) -> dict[str, torch.Tensor]:
        """Canonical vision key (`visual.` stripped) -> the tower's tensor it fills."""
        return dict(self.tower.state_dict())

    def reset_buffers(self):
        """Rebuild the rotary frequencies (non-persistent buffers: not in checkpoints)."""
        rot = self.tower.rotary_pos_emb
        inv, _ = rot.compute_axial_rope_parameters(rot.config, device=rot.inv_freq.device)
        rot.inv_freq.copy_(inv)
        rot.original_inv_freq.copy_(inv)
