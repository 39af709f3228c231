"""LLaVA-NeXT / LLaVA-1.6 (`LlavaNextForConditionalGeneration`): LLaVA-1.5's pieces plus
any-resolution images (tiles chosen from `image_grid_pinpoints`, packed with a learned
`image_newline` after each feature row: anyres.py). Weight names as LLaVA's, plus
`image_newline`."""
from __future__ import annotations

import dataclasses

from tabed_engine.models import llava
from tabed_engine.models.registry import register


def image_layout(config: dict) -> tuple:
    """The tower's input size and patch, and the grid pinpoints the tiles are chosen from."""
    size, patch, _ = llava.image_layout(config)
    pins = config.get("image_grid_pinpoints")
    return size, patch, None if pins is None else tuple(tuple(p) for p in pins)


FAMILY = register(dataclasses.replace(
    llava.FAMILY, name="llava_next", architectures=("LlavaNextForConditionalGeneration",),
    model_types=("llava_next",), image_layout=image_layout))
