"""Procedural scenes: coloured shapes on a 4x4 grid, rendered into small RGB images.

A scene is pure data (`Scene`); `render(scene)` is a deterministic function of it
(its `seed` drives the pixel jitter), so the same seed always gives the same image.
Each grid cell is exactly one 16x16 vision patch at the default 64x64 size, which
keeps the vision task learnable by a tiny CLIP tower in a few minutes of CPU
training; the 4x4 patch grid is even, so the pooled view (P) averages 2x2 cells.

Styles: "normal" is the training distribution of the draft. The out-of-distribution
styles ("inverted", "outline", "dark", "noise") are seen only by the target in
training, so the draft's vision path is unreliable on them (scenario S5).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from PIL import Image

GRID = 4  # cells per side
IMAGE_SIZE = 64  # pixels per side
CELL = IMAGE_SIZE // GRID

COLORS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (40, 70, 225),
    "yellow": (235, 205, 30),
    "purple": (150, 55, 190),
    "orange": (245, 135, 25),
}
SHAPES = ("circle", "square", "triangle", "cross")
STYLES = ("normal",)
OOD_STYLES = ("inverted", "outline", "dark", "noise")
MAX_OBJECTS = 4

_BACKGROUND = {"normal": (232, 232, 228), "dark": (28, 30, 40)}


@dataclass(frozen=True)
class Obj:
    shape: str
    color: str
    row: int  # 0..GRID-1, top to bottom
    col: int  # 0..GRID-1, left to right


@dataclass(frozen=True)
class Scene:
    objects: tuple[Obj, ...]  # in reading order (row-major)
    style: str = "normal"
    seed: int = 0  # drives the rendering jitter only

    def __post_init__(self):
        if self.style not in STYLES + OOD_STYLES:
            raise ValueError(f"unknown style {self.style!r}")
        cells = [(o.row, o.col) for o in self.objects]
        if len(set(cells)) != len(cells):
            raise ValueError("two objects in one cell")
        if list(self.objects) != sorted(self.objects, key=lambda o: (o.row, o.col)):
            raise ValueError("objects must be in reading order")


def random_scene(rng: np.random.Generator, style: str = "normal",
                 n_min: int = 1, n_max: int = MAX_OBJECTS) -> Scene:
    """Draw a scene: n_min..n_max objects in distinct cells, random shape and colour.

    Fewer objects are likelier (weights 4:3:2:1.5...): one-object scenes make the
    image-to-answer attention easy to find early in training."""
    w = np.array([4.0, 3.0, 2.0, 1.5, 1.0, 1.0][: n_max - n_min + 1])
    n = n_min + int(rng.choice(len(w), p=w / w.sum()))
    cells = sorted(rng.choice(GRID * GRID, size=n, replace=False).tolist())
    names = list(COLORS)
    objs = tuple(
        Obj(SHAPES[int(rng.integers(len(SHAPES)))], names[int(rng.integers(len(names)))],
            c // GRID, c % GRID)
        for c in cells
    )
    return Scene(objs, style, int(rng.integers(2**31)))


def _mask(shape: str, cx: float, cy: float, r: float, size: int) -> np.ndarray:
    y, x = np.mgrid[0:size, 0:size].astype(np.float32) + 0.5
    dx, dy = x - cx, y - cy
    if shape == "circle":
        return dx * dx + dy * dy <= r * r
    if shape == "square":
        return (np.abs(dx) <= 0.82 * r) & (np.abs(dy) <= 0.82 * r)
    if shape == "triangle":  # apex up
        t = (dy + r) / (2 * r)  # 0 at apex, 1 at base
        return (t >= 0) & (t <= 1) & (np.abs(dx) <= t * r)
    if shape == "cross":
        w = r / 3
        return ((np.abs(dx) <= w) & (np.abs(dy) <= r)) | ((np.abs(dy) <= w) & (np.abs(dx) <= r))
    raise ValueError(f"unknown shape {shape!r}")


def _outline(mask: np.ndarray) -> np.ndarray:
    inner = mask.copy()
    inner[1:, :] &= mask[:-1, :]
    inner[:-1, :] &= mask[1:, :]
    inner[:, 1:] &= mask[:, :-1]
    inner[:, :-1] &= mask[:, 1:]
    inner2 = inner.copy()  # two pixels thick
    inner2[1:, :] &= inner[:-1, :]
    inner2[:-1, :] &= inner[1:, :]
    inner2[:, 1:] &= inner[:, :-1]
    inner2[:, :-1] &= inner[:, 1:]
    return mask & ~inner2


def render(scene: Scene, size: int = IMAGE_SIZE) -> Image.Image:
    """Render `scene` into a `size`x`size` RGB PIL image (deterministic given the scene)."""
    rng = np.random.default_rng(scene.seed)
    cell = size / GRID
    bg = np.array(_BACKGROUND.get(scene.style, _BACKGROUND["normal"]), np.float32)
    bg = bg + rng.uniform(-8, 8, size=3)
    img = np.empty((size, size, 3), np.float32)
    img[:] = bg
    for o in scene.objects:
        r = cell * rng.uniform(0.30, 0.43)
        cx = (o.col + 0.5) * cell + rng.uniform(-0.06, 0.06) * cell
        cy = (o.row + 0.5) * cell + rng.uniform(-0.06, 0.06) * cell
        m = _mask(o.shape, cx, cy, r, size)
        if scene.style == "outline":
            m = _outline(m)
        rgb = np.array(COLORS[o.color], np.float32) + rng.uniform(-15, 15, size=3)
        img[m] = rgb
    if scene.style == "inverted":
        img = 255.0 - img
    elif scene.style == "noise":
        img = img + rng.normal(0.0, 45.0, size=img.shape)
    return Image.fromarray(np.clip(img, 0, 255).round().astype(np.uint8), "RGB")
