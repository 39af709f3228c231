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
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AnyRes:
    """The any-resolution layout of a checkpoint: `pinpoints` ((height, width) pairs, each a
    multiple of `tile`), the tower's input side `tile` and its grid side `grid` (tile / patch)."""

    pinpoints: tuple[tuple[int, int], ...]
    tile: int
    grid: int

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
                   vc.image_size, vc.image_size // vc.patch_size)

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
        h, w = unpadded_size(rows * g, cols * g, size)
        return g * g + h * (w + 1)


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
    Returns [g*g + h_u * (w_u + 1), C]."""
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
    x = torch.cat([x, newline.to(x)[:, None, None].expand(C, h, 1)], dim=2)  # a newline after each row
    return torch.cat([feats[0], x.reshape(C, h * (w + 1)).t()], dim=0)
