"""Turn user prompts (text with `<image>`, chat messages, or token ids) plus images into
token ids with one run of image tokens per image, and pixel values from the processor."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import numpy as np
import torch


@dataclass
class Prepared:
    """A request after the processor: `ids` holds one run of `image_token_id` per image."""

    ids: list[int]
    pixel_values: Optional[torch.Tensor]   # [n_images, 3, H, W] or None
    image_spans: list[tuple[int, int]]     # (start, length) of each image's token run
    images: list = None                    # the PIL images (for a captioner)

    @property
    def num_images(self) -> int:
        return len(self.image_spans)


def _to_pil(img):
    from PIL import Image

    if isinstance(img, Image.Image):
        return img.convert("RGB")
    if isinstance(img, torch.Tensor):
        t = img.detach().cpu()
        if t.dim() != 3:
            raise ValueError(f"image tensor must be 3-D (CHW or HWC), got shape {tuple(t.shape)}")
        if t.shape[0] in (1, 3) and t.shape[-1] not in (1, 3):
            t = t.permute(1, 2, 0)
        if t.is_floating_point():
            t = (t.clamp(0, 1) * 255).round()
        img = t.to(torch.uint8).numpy()
    if isinstance(img, np.ndarray):
        if img.ndim != 3 or img.shape[-1] not in (1, 3) or img.dtype != np.uint8:
            raise ValueError(f"numpy images must be HWC uint8 with 1 or 3 channels, got "
                             f"shape {img.shape} dtype {img.dtype}")
        return Image.fromarray(img if img.shape[-1] == 3 else img[..., 0]).convert("RGB")
    raise TypeError(f"unsupported image type {type(img).__name__}; use a PIL image, an HWC uint8 "
                    "numpy array or a tensor")


def image_runs(ids: Sequence[int], image_token_id: int) -> list[tuple[int, int]]:
    """(start, length) of each maximal run of image tokens."""
    runs, i = [], 0
    while i < len(ids):
        if ids[i] == image_token_id:
            j = i
            while j < len(ids) and ids[j] == image_token_id:
                j += 1
            runs.append((i, j - i))
            i = j
        else:
            i += 1
    return runs


def split_runs(runs: Sequence[tuple[int, int]], counts: Sequence[int]) -> list[tuple[int, int]]:
    """One (start, length) span per image from maximal image-token runs: a run holding the
    tokens of several adjacent images (`<image><image>`) is cut by the images' token counts
    `counts` (in prompt order; counts may differ per image). Raises ValueError when the runs
    do not add up to the images."""
    spans, i = [], 0
    for start, length in runs:
        pos, end = start, start + length
        while pos < end and i < len(counts):
            spans.append((pos, counts[i]))
            pos += counts[i]
            i += 1
        if pos != end:      # a run the images' counts do not tile exactly
            i = -1
            break
    if i != len(counts):
        raise ValueError(f"the prompt's image-token runs {[n for _, n in runs]} do not hold {len(counts)} "
                         f"image(s) of {list(counts)} tokens (is the processor's patch_size right?)")
    return spans


def prepare(processor, prompt: Any, images: Optional[Sequence], image_token_id: int,
            tokens_per_image: int | Sequence[int]) -> Prepared:
    """Validate and tokenize one request. Raises ValueError/TypeError on bad input.

    tokens_per_image: the image-token count of every image, or one count per image."""
    if images is not None and not isinstance(images, (list, tuple)):
        images = [images]
    images = list(images or [])
    pil = [_to_pil(im) for im in images]
    counts = [tokens_per_image] * len(pil) if isinstance(tokens_per_image, int) else list(tokens_per_image)
    if isinstance(prompt, str):
        text = prompt
    elif isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, dict) for m in prompt):
        if not all("role" in m and "content" in m for m in prompt):
            raise ValueError("chat messages must be dicts with 'role' and 'content'")
        text = processor.apply_chat_template(list(prompt), add_generation_prompt=True, tokenize=False)
    elif isinstance(prompt, (list, tuple, torch.Tensor)) and len(prompt) > 0:
        ids = [int(t) for t in (prompt.tolist() if isinstance(prompt, torch.Tensor) else prompt)]
        vocab = len(processor.tokenizer)
        if any(t < 0 or t >= vocab for t in ids):
            raise ValueError(f"token ids must be in [0, {vocab})")
        ids = _expand_placeholders(ids, image_token_id, counts)
        pv = _pixels(processor, pil)
        return Prepared(ids, pv, split_runs(image_runs(ids, image_token_id), counts), pil)
    else:
        raise TypeError("prompt must be a non-empty string, a list of chat messages, or a list of "
                        f"token ids; got {type(prompt).__name__}")
    n_placeholders = text.count(getattr(processor, "image_token", "<image>"))
    _check_count(n_placeholders, len(pil))
    if not text.strip():
        raise ValueError("prompt is empty")
    enc = processor(text=text, images=pil or None, return_tensors="pt")
    ids = enc["input_ids"][0].tolist()
    spans = split_runs(image_runs(ids, image_token_id), counts)
    return Prepared(ids, enc.get("pixel_values") if pil else None, spans, pil)


def _expand_placeholders(ids: list[int], image_token_id: int, counts: list[int]) -> list[int]:
    """Token-id prompts: each image is one image token (expanded here to its count) or its
    full run already expanded; adjacent images may mix both forms."""
    out: list[int] = []
    prev, i = 0, 0
    for start, length in image_runs(ids, image_token_id):
        out += ids[prev:start]
        left = length
        while left > 0:
            if i == len(counts):
                raise ValueError(f"the token ids hold more image tokens than the {len(counts)} image(s) "
                                 "given need")
            take = counts[i] if left >= counts[i] and counts[i] > 1 else 1
            out += [image_token_id] * counts[i]
            left -= take
            i += 1
        prev = start + length
    _check_count(i, len(counts))
    return out + ids[prev:]


def _check_count(n_placeholders: int, n_images: int):
    if n_placeholders != n_images:
        raise ValueError(f"the prompt has {n_placeholders} image placeholder(s) but {n_images} "
                         "image(s) were given")


def _pixels(processor, pil):
    if not pil:
        return None
    return processor.image_processor(pil, return_tensors="pt")["pixel_values"]
