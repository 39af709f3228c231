"""LLaVA-NeXT any-resolution images: how many tokens an image gets and how its tile features
are packed into them, exactly as transformers' `LlavaNextModel.pack_image_features` and
`LlavaNextProcessor` do it.

An image of H x W pixels is shown to the tower as a base tile (the whole image resized to one
tile) plus the tiles of the best-fitting `image_grid_pinpoints` resolution (rows x cols tiles,
`select_best_resolution`). Its token run is the base tile's g*g features, then the tiles' grid
(rows*g x cols*g features) with the padding rows or columns the processor added to keep the
aspect ratio cut off ("unpadded"), one `image_newline` embedding after each feature row:
g*g + h_u * (w_u + 1) tokens. `pack` works for any grid side g, so the P view packs tiles
pooled to a smaller side the same way (views.py).

LLaVA-OneVision ("anyres_max_N", `vision_aspect_ratio`) adds a budget: when the unpadded grid
holds more than 1.1² · N tiles' features, it is scaled down bilinearly by that ratio (each
side to int(side // ratio)) before the newlines, as transformers' `LlavaOnevisionModel.
pack_image_features` does it and `LlavaOnevisionProcessor` counts it.
"""
from __future__ import annotations

from dataclasses import dataclass

import math
from typing import Optional

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class AnyRes:
    """The any-resolution layout of a checkpoint: `pinpoints` ((height, width) pairs, each a
    multiple of `tile`), the tower's input side `tile` and its grid side `grid` (tile / patch);
    `max_tiles`: OneVision's "anyres_max_N" feature budget (None: no budget, LLaVA-NeXT)."""

    pinpoints: tuple[tuple[int, int], ...]
    tile: int
    grid: int
    max_tiles: Optional[int] = None

    def __post_init__(self):
        if not self.pinpoints:
            raise ValueError("image_grid_pinpoints is empty")
        bad = [p for p in self.pinpoints if len(p) != 2 or p[0] % self.tile or p[1] % self.tile or min(p) <= 0]
        if bad:
            raise ValueError(f"image_grid_pinpoints {bad} are not (height, width) multiples of the vision "
                             f"tower's image_size {self.tile}")

    @classmethod
    def from_config(cls, hf_config) -> "AnyRes":
        vc = hf_config.vision_config
        return cls(tuple(tuple(int(x) for x in p) for p in hf_config.image_grid_pinpoints),
                   vc.image_size, vc.image_size // vc.patch_size,
                   max_tiles_of(getattr(hf_config, "vision_aspect_ratio", None)))

    def tile_grid(self, size: tuple[int, int]) -> tuple[int, int]:
        """(rows, cols) of tiles for an image of size (height, width)."""
        from transformers.image_processing_utils import select_best_resolution

        h, w = select_best_resolution(tuple(int(s) for s in size), [list(p) for p in self.pinpoints])
        return h // self.tile, w // self.tile

    def num_tiles(self, size: tuple[int, int]) -> int:
        """Tiles the processor makes of the image, the base tile included."""
        rows, cols = self.tile_grid(size)
        return rows * cols + 1

    def num_tokens(self, size: tuple[int, int], grid: int | None = None) -> int:
        """Image tokens of an image of size (height, width) at grid side `grid` (default: the
        tower's)."""
        g = self.grid if grid is None else grid
        rows, cols = self.tile_grid(size)
        h, w = self.budget(*unpadded_size(rows * g, cols * g, size), g)
        return g * g + h * (w + 1)

    def budget(self, h: int, w: int, g: int) -> tuple[int, int]:
        """The (height, width) an unpadded h x w grid of tiles of side g is scaled down to under
        the anyres_max budget (unchanged without one, or within 1.1 times it)."""
        ratio = self._ratio(h, w, g)
        return (h, w) if ratio is None else (int(h // ratio), int(w // ratio))

    def _ratio(self, h: int, w: int, g: int) -> Optional[float]:
        if self.max_tiles is None:
            return None
        ratio = math.sqrt(h * w / (self.max_tiles * g ** 2))
        return ratio if ratio > 1.1 else None


def max_tiles_of(aspect_ratio: Optional[str]) -> Optional[int]:
    """N of OneVision's `vision_aspect_ratio` "anyres_max_N"; None for none."""
    if not aspect_ratio:
        return None
    if not aspect_ratio.startswith("anyres_max_") or not aspect_ratio[len("anyres_max_"):].isdigit():
        raise ValueError(f"unsupported vision_aspect_ratio {aspect_ratio!r} (supported: anyres_max_N)")
    return int(aspect_ratio[len("anyres_max_"):])


def unpadded_size(height: int, width: int, size: tuple[int, int]) -> tuple[int, int]:
    """The (height, width) of a height x width feature grid with the processor's padding to
    the original aspect ratio of `size` (height, width) cut off (transformers' `unpad_image`,
    its rounding included)."""
    oh, ow = (int(s) for s in size)
    if ow / oh > width / height:
        new = int(round(oh * (width / ow), 7))
        return height - 2 * ((height - new) // 2), width
    new = int(round(ow * (height / oh), 7))
    return height, width - 2 * ((width - new) // 2)


def pack(feats: torch.Tensor, size: tuple[int, int], layout: AnyRes, newline: torch.Tensor) -> torch.Tensor:
    """One image's token features from its tiles' features.

    feats: [1 + rows*cols, g*g, C] (the base tile first, then the tiles row by row, any
    square grid side g); size: the original (height, width); newline: [C].
    Returns [g*g + h_u * (w_u + 1), C] (h_u, w_u after the anyres_max budget)."""
    n, gg, C = feats.shape
    g = int(round(gg ** 0.5))
    rows, cols = layout.tile_grid(size)
    if g * g != gg or n != rows * cols + 1:
        raise ValueError(f"an image of size {tuple(size)} needs 1 + {rows}x{cols} tiles of a square grid, "
                         f"got features {tuple(feats.shape)}")
    x = feats[1:].view(rows, cols, g, g, C).permute(4, 0, 2, 1, 3).reshape(C, rows * g, cols * g)
    h, w = unpadded_size(rows * g, cols * g, size)
    top, left = (rows * g - h) // 2, (cols * g - w) // 2
    x = x[:, top:top + h, left:left + w]                                   # [C, h, w]
    if layout.budget(h, w, g) != (h, w):                                   # anyres_max: scaled down
        h, w = layout.budget(h, w, g)
        x = F.interpolate(x[None], [h, w], mode="bilinear")[0]
    x = torch.cat([x, newline.to(x)[:, None, None].expand(C, h, 1)], dim=2)  # a newline after each row
    return torch.cat([feats[0], x.reshape(C, h * (w + 1)).t()], dim=0)
