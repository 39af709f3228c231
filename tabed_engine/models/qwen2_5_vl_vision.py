"""Qwen2.5-VL's vision side: the vision transformer (transformers' own modules and weights, run
by `tower_forward` without host syncs: window attention as one batched call per window length,
its full-attention layers, 2-D rotary, the 2x2 patch merger), dynamic resolution (`smart_resize` between the processor's min and max pixels) and
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


class TowerPlan:
    """What the vision transformer needs for one list of patch grids, built once on the host and
    kept on the device: the window permutation of the merge units (transformers'
    `get_window_index`: windows of `window` pixels, aligned at the grid's origin, the last row
    and column of windows partial), the 2-D rotary cos / sin in that order, and the attention
    chunks (windows; whole frames in the full-attention layers) grouped by length, so that each
    layer runs one batched attention per distinct chunk length instead of one per chunk."""

    def __init__(self, grids: Sequence[tuple[int, int, int]], merge: int, window: int, patch: int,
                 inv_freq: torch.Tensor, device):
        vw = window // merge // patch            # merge units along a window's side
        unit = merge * merge
        order, windows, frames, hpos, wpos = [], [], [], [], []
        base = 0
        for t, gh, gw in grids:
            lh, lw = gh // merge, gw // merge
            # processor order: units (t, lh, lw), patches (merge, merge) inside a unit
            bh = torch.arange(lh).view(lh, 1, 1, 1).expand(lh, lw, merge, merge)
            bw = torch.arange(lw).view(1, lw, 1, 1).expand(lh, lw, merge, merge)
            i = torch.arange(merge).view(1, 1, merge, 1).expand(lh, lw, merge, merge)
            j = torch.arange(merge).view(1, 1, 1, merge).expand(lh, lw, merge, merge)
            hpos.append((bh * merge + i).reshape(-1).repeat(t))
            wpos.append((bw * merge + j).reshape(-1).repeat(t))
            units = torch.arange(t * lh * lw).view(t, lh, lw)
            for f in range(t):
                frames.append(lh * lw * unit)
                for y in range(0, lh, vw):
                    for x in range(0, lw, vw):
                        win = units[f, y:y + vw, x:x + vw].reshape(-1)
                        order.append(win + base)
                        windows.append(win.numel() * unit)
            base += t * lh * lw
        self.n = base * unit                      # patches
        self.window_index = torch.cat(order).to(device)                       # [units]
        self.reverse = torch.argsort(self.window_index)
        pos = torch.stack([torch.cat(hpos), torch.cat(wpos)])                  # [2, patches]
        freqs = pos[..., None].to(inv_freq.device).float() * inv_freq.float()  # [2, patches, hd/4]
        emb = torch.cat([freqs[0], freqs[1]], -1)
        emb = torch.cat([emb, emb], -1).to(device)
        emb = self.permute(emb)
        self.cos, self.sin = emb.cos(), emb.sin()                              # [patches, hd] float32
        self.window_groups = self._groups(windows, device)
        self.frame_groups = self._groups(frames, device)

    def permute(self, x: torch.Tensor) -> torch.Tensor:
        """Patches [n, ...] in the processor's order -> in window order (whole merge units)."""
        unit = self.n // self.window_index.numel()
        return x.reshape(-1, unit, *x.shape[1:])[self.window_index].reshape(self.n, *x.shape[1:])

    @staticmethod
    def _groups(lengths: list[int], device) -> list[tuple[int, Optional[torch.Tensor], int]]:
        """Chunks of `lengths` (consecutive in window order) by length: (L, index [n, L] of
        their patches, or None when they are all the patches in order, n)."""
        starts = [0]
        for n in lengths[:-1]:
            starts.append(starts[-1] + n)
        by_len: dict[int, list[int]] = {}
        for s, n in zip(starts, lengths):
            if n:
                by_len.setdefault(n, []).append(s)
        total = sum(lengths)
        out = []
        for L, ss in by_len.items():
            if len(ss) * L == total:              # every chunk one length: a reshape, no gather
                out.append((L, None, len(ss)))
            else:
                idx = (torch.tensor(ss)[:, None] + torch.arange(L)).to(device)
                out.append((L, idx, len(ss)))
        return out


def _chunked_attention(q, k, v, groups, scale: float) -> torch.Tensor:
    """Attention inside each chunk (no mask): q, k, v [n, H, hd] in window order -> [n, H, hd];
    one scaled-dot-product call per chunk length."""
    out = None
    for L, idx, n in groups:
        if idx is None:
            qs, ks, vs = (t.view(n, L, *t.shape[1:]).transpose(1, 2) for t in (q, k, v))
            return F.scaled_dot_product_attention(qs, ks, vs, scale=scale).transpose(1, 2).reshape(q.shape)
        if out is None:
            out = torch.empty_like(q)
        flat = idx.reshape(-1)
        qs, ks, vs = (t.index_select(0, flat).view(n, L, *t.shape[1:]).transpose(1, 2) for t in (q, k, v))
        res = F.scaled_dot_product_attention(qs, ks, vs, scale=scale).transpose(1, 2)
        out.index_copy_(0, flat, res.reshape(-1, *q.shape[1:]))
    return out


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """2-D rotary in float32 (transformers' `apply_rotary_pos_emb_vision`): x [n, H, hd]."""
    xf = x.float()
    half = xf.shape[-1] // 2
    rot = torch.cat((-xf[..., half:], xf[..., :half]), dim=-1)
    return (xf * cos[:, None] + rot * sin[:, None]).to(x.dtype)


@torch.no_grad()
def tower_forward(tower, pixel_values: torch.Tensor, plan: TowerPlan) -> torch.Tensor:
    """transformers' Qwen2.5-VL vision transformer (its modules and weights) over flattened
    patches [n, C*T*p*p] -> merged features [n / merge², out_hidden], without a host sync: the
    attention runs per chunk length (`TowerPlan`) rather than per window, the window layout
    and rotary come from the plan."""
    x = tower.patch_embed(pixel_values)
    x = plan.permute(x)
    full = set(tower.fullatt_block_indexes)
    for i, blk in enumerate(tower.blocks):
        attn = blk.attn
        h = blk.norm1(x)
        qkv = attn.qkv(h).view(plan.n, 3, attn.num_heads, -1)
        q = _rotate(qkv[:, 0], plan.cos, plan.sin)
        k = _rotate(qkv[:, 1], plan.cos, plan.sin)
        scale = getattr(attn, "scaling", None) or q.shape[-1] ** -0.5
        o = _chunked_attention(q, k, qkv[:, 2], plan.frame_groups if i in full else plan.window_groups, scale)
        x = x + attn.proj(o.reshape(plan.n, -1))
        x = x + blk.mlp(blk.norm2(x))
    return tower.merger(x)[plan.reverse]


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
        self._plans: dict = {}                # (grids, device) -> TowerPlan, the latest PLANS_KEPT

    PLANS_KEPT = 16

    def features(self, patches: torch.Tensor, grids: Sequence[tuple[int, int, int]]) -> torch.Tensor:
        """The tower over flattened patches [n, C*T*p*p] of images / videos of patch grids
        [(t, h, w), ...] -> merged features [n / merge², hidden] (`tower_forward`, its plan for
        these grids built on first use and kept)."""
        key = (tuple(tuple(int(v) for v in g) for g in grids), str(patches.device))
        plan = self._plans.pop(key, None)
        if plan is None:
            tw = self.tower
            plan = TowerPlan(key[0], self.merge, tw.window_size, self.patch, tw.rotary_pos_emb.inv_freq,
                             patches.device)
            if len(self._plans) >= self.PLANS_KEPT:
                old = self._plans.pop(next(iter(self._plans)))
                if old.window_index.is_cuda:
                    # (the tower may run on the draft's view stream and on the main one: no
                    # stream may still read the plan's tensors when their memory is handed out)
                    torch.cuda.synchronize(old.window_index.device)
        self._plans[key] = plan                   # (most recently used last)
        if patches.shape[0] != plan.n:
            raise ValueError(f"{patches.shape[0]} patches for grids {list(key[0])} of {plan.n}")
        return tower_forward(self.tower, patches.to(self.tower.patch_embed.proj.weight.dtype), plan)

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
        return self.features(patches, [(t, h * self.merge, w * self.merge)])

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
        return self.features(pixel_values, grids)

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
        """Rebuild the rotary frequencies (non-persistent buffers: not in checkpoints); the
        plans built from the old ones are dropped."""
        self._plans.clear()
        rot = self.tower.rotary_pos_emb
        # head_dim / 4 frequencies over head_dim / 2 (rows and columns each rotate half of a
        # head), theta from the config where transformers 5.x keeps it (4.x: its fixed 10000)
        params = getattr(self.tower.config, "rope_parameters", None) or {}
        theta = float(params.get("rope_theta", 10000.0))
        dim = 2 * rot.inv_freq.numel()
        inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float, device=rot.inv_freq.device) / dim))
        for name in ("inv_freq", "original_inv_freq"):
            if hasattr(rot, name):
                getattr(rot, name).copy_(inv)
