"""Turn user prompts (text with `<image>`, chat messages, or token ids) plus images into
token ids with one run of image tokens per image, and pixel values from the processor."""
from __future__ import annotations

import numbers
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence, Union

import numpy as np
import torch


@dataclass
class Prepared:
    """A request after the processor: `ids` holds one run of `image_token_id` per image."""

    ids: list[int]
    pixel_values: Optional[torch.Tensor]   # [n_images, 3, H, W] or None; any-res: [n_images, tiles, 3, H, W]
    image_spans: list[tuple[int, int]]     # (start, length) of each image's token run
    images: list = None                    # the PIL images (for a captioner)
    draft_pixel_values: Optional[torch.Tensor] = None   # the draft processor's, when it has its own
    video_pixels: Optional[list] = None    # per video: its frames' preprocessed pixels [frames, 3, H, W]
    video_spans: Optional[list] = None     # (start, length) of each video's token run
    _arrays: Optional[list] = field(default=None, repr=False, compare=False)

    def host_pixels(self) -> list:
        """The images as uint8 [H, W, 3] arrays, converted from PIL once and kept: the prefix
        cache's keys and every upload to the device (the target's preprocessing, a draft's own)
        read these same bytes."""
        if self._arrays is None:
            self._arrays = [np.array(im) for im in self.images or []]
        return self._arrays

    def release_host_pixels(self):
        """Drop the arrays of `host_pixels` (every upload that reads them is done)."""
        self._arrays = None

    def __getstate__(self):          # (a tensor-parallel worker gets the images, not these copies)
        return {**self.__dict__, "_arrays": None}

    @property
    def num_videos(self) -> int:
        return len(self.video_spans or [])

    @property
    def media_spans(self) -> list[tuple[int, int]]:
        """The images' token runs, then the videos' (the order of `encode`'s features)."""
        return list(self.image_spans) + list(self.video_spans or [])

    @property
    def image_sizes(self) -> list[tuple[int, int]]:
        """(height, width) of each image as given (any-resolution tiling depends on it)."""
        return [(im.height, im.width) for im in self.images or []]

    @property
    def num_images(self) -> int:
        return len(self.image_spans)


def _to_pil(img, index: int = 0):
    """One image as RGB PIL. Arrays and tensors mean the same thing whatever their library:
    HWC or CHW with 1, 3 or 4 channels (or HW grey); integer values are 0..255 as they are,
    float values must lie in [0, 1] (a float image in 0..255 is refused, not clamped white)."""
    from PIL import Image

    if isinstance(img, Image.Image):
        return img.convert("RGB")
    if isinstance(img, torch.Tensor):
        img = img.detach().cpu()
        if img.dtype == torch.bfloat16 or img.dtype == torch.float16:
            img = img.float()
        img = img.numpy()
    if not isinstance(img, np.ndarray):
        raise TypeError(f"image {index}: unsupported image type {type(img).__name__}; use a PIL image, "
                        "a numpy array or a tensor (HWC or CHW)")
    a = img
    if a.ndim == 3 and a.shape[-1] not in (1, 3, 4) and a.shape[0] in (1, 3, 4):
        a = a.transpose(1, 2, 0)                                   # CHW -> HWC
    if not (a.ndim == 2 or (a.ndim == 3 and a.shape[-1] in (1, 3, 4))) or 0 in a.shape:
        raise ValueError(f"image {index}: an array or tensor image must be HW, HWC or CHW with 1, 3 or 4 "
                         f"channels, got shape {tuple(img.shape)} (pass a batch as a list of images)")
    if a.dtype == np.bool_ or not (np.issubdtype(a.dtype, np.integer) or np.issubdtype(a.dtype, np.floating)):
        raise TypeError(f"image {index}: pixel values must be uint8 (0..255) or float (0..1), got {a.dtype}")
    lo, hi = a.min(), a.max()
    if np.issubdtype(a.dtype, np.floating):
        if not (np.isfinite(lo) and np.isfinite(hi) and 0.0 <= lo and hi <= 1.0):
            raise ValueError(f"image {index}: float pixel values must lie in [0, 1], got [{lo:.4g}, {hi:.4g}]; "
                             "pass uint8 values 0..255, or divide by 255")
        a = np.rint(a.astype(np.float32) * 255.0)
    elif lo < 0 or hi > 255:
        raise ValueError(f"image {index}: integer pixel values must lie in 0..255, got [{lo}, {hi}]")
    a = a.astype(np.uint8)
    if a.ndim == 3 and a.shape[-1] == 1:
        a = a[..., 0]
    return Image.fromarray(a).convert("RGB")


def _token_ids(prompt) -> list[int]:
    """A token-id prompt as a list of ints: a sequence of ints, or a tensor/array [n] or [1, n]
    (an HF `input_ids`). Several prompts ([2, n], a list of lists) are refused: one request."""
    if isinstance(prompt, (torch.Tensor, np.ndarray)):
        t = torch.as_tensor(prompt)
        if t.dim() == 2 and t.shape[0] == 1:
            t = t[0]
        if t.dim() == 2:
            raise ValueError(f"a token-id prompt must have shape [n] or [1, n], got {list(t.shape)} (several "
                             "prompts go to generate() as a list)")
        if t.dim() != 1:
            raise ValueError(f"a token-id prompt must have shape [n] or [1, n], got {list(t.shape)}")
        if t.dtype == torch.bool or t.is_floating_point() or t.is_complex():
            raise TypeError(f"token ids must be integers, got a {t.dtype} tensor")
        prompt = t.tolist()
    if not prompt:
        raise ValueError("prompt is empty")
    if all(type(t) is int for t in prompt):        # plain ints (the common case): no checks left
        return list(prompt)
    if any(isinstance(t, (list, tuple, str, torch.Tensor, np.ndarray)) for t in prompt):
        raise ValueError("a prompt must be a string, chat messages or token ids, not a list of prompts "
                         "(several prompts go to generate() as one list of prompts)")
    bad = next((t for t in prompt if isinstance(t, bool) or not isinstance(t, numbers.Integral)), None)
    if bad is not None:
        raise TypeError(f"token ids must be ints, got {type(bad).__name__} {bad!r}")
    return [int(t) for t in prompt]


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


TokenCounts = Union[int, Sequence[int], Callable[[list], Sequence[int]]]


def prepare(processor, prompt: Any, images: Optional[Sequence], image_token_id: int,
            tokens_per_image: TokenCounts, with_pixels: bool = True, videos: Optional[Sequence] = None,
            video_token_id: Optional[int] = None, video_tokens: Optional[Callable[[int], int]] = None) -> Prepared:
    """Validate and tokenize one request. Raises ValueError/TypeError on bad input.

    tokens_per_image: the image-token count of every image, one count per image, or a
    function of the request's PIL images returning one count per image (LLaVA-NeXT: the
    count depends on the image's size).
    with_pixels=False: leave `pixel_values` None (the engine computes them on the device,
    `image_ops.device_pixels`); the text is tokenized without the image processor and each
    placeholder expanded to its image's count, as the processor does.
    videos: one video per video placeholder (LLaVA-OneVision's `<video>`, Qwen2.5-VL's
    `<|video_pad|>`), each a list of frames of one size or an array / tensor [frames, H, W, C]
    (or [frames, C, H, W]); video_token_id and video_tokens(pixels) (the token count of a
    video's preprocessed frames) come with them. The frames are preprocessed here
    (`processor.video_pixels(frames)` where the processor has it, else `video_pixels`) and each
    placeholder expanded to its video's count."""
    vids = _videos(videos, processor, video_token_id)
    if vids:
        prep = prepare(processor, prompt, images, image_token_id, tokens_per_image, with_pixels=False)
        ids = prep.ids
        if isinstance(prompt, str) or (isinstance(prompt, (list, tuple)) and prompt
                                       and all(isinstance(m, dict) for m in prompt)):
            _check_count(ids.count(video_token_id), len(vids), "video")
        own = getattr(processor, "video_pixels", None)
        vpix = [own(v) if own is not None else video_pixels(processor.image_processor, v) for v in vids]
        vcounts = [video_tokens(p) for p in vpix]
        ids = _expand_placeholders(ids, video_token_id, vcounts)
        counts = [n for _, n in prep.image_spans]
        return Prepared(ids, pixels(processor, prep.images) if with_pixels else None,
                        split_runs(image_runs(ids, image_token_id), counts), prep.images,
                        video_pixels=vpix, video_spans=split_runs(image_runs(ids, video_token_id), vcounts))
    if images is not None and not isinstance(images, (list, tuple)):
        images = [images]
    images = list(images or [])
    if any(isinstance(im, (list, tuple)) for im in images):
        raise ValueError("images must be one list of images for one prompt (a list of image lists goes "
                         "with a list of prompts)")
    pil = [_to_pil(im, i) for i, im in enumerate(images)]
    if callable(tokens_per_image):
        tokens_per_image = tokens_per_image(pil)
    counts = [tokens_per_image] * len(pil) if isinstance(tokens_per_image, int) else list(tokens_per_image)
    if isinstance(prompt, (list, tuple)) and not prompt:
        raise ValueError("prompt is empty")
    if isinstance(prompt, str):
        text = prompt
    elif isinstance(prompt, (list, tuple)) and all(isinstance(m, dict) for m in prompt):
        if not all("role" in m and "content" in m for m in prompt):
            raise ValueError("chat messages must be dicts with 'role' and 'content'")
        text = processor.apply_chat_template(list(prompt), add_generation_prompt=True, tokenize=False)
    elif isinstance(prompt, (list, tuple, torch.Tensor, np.ndarray)):
        ids = _token_ids(prompt)
        vocab = len(processor.tokenizer)
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids must be in [0, {vocab}) (the tokenizer's vocabulary), "
                             f"got {bad[:5]}")
        ids = _expand_placeholders(ids, image_token_id, counts)
        pv = pixels(processor, pil) if with_pixels else None
        return Prepared(ids, pv, split_runs(image_runs(ids, image_token_id), counts), pil)
    else:
        raise TypeError("prompt must be a string, a list of chat messages, or token ids (a list of "
                        f"ints or an integer tensor [n] / [1, n]); got {type(prompt).__name__}")
    n_placeholders = text.count(getattr(processor, "image_token", "<image>"))
    _check_count(n_placeholders, len(pil))
    if not text.strip():
        raise ValueError("prompt is empty")
    if not with_pixels:          # (the tokenizer alone: the processor would refuse a <video> it has no video for)
        ids = _expand_placeholders(processor.tokenizer(text)["input_ids"], image_token_id, counts)
        return Prepared(ids, None, split_runs(image_runs(ids, image_token_id), counts), pil)
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


def _check_count(n_placeholders: int, n_images: int, what: str = "image"):
    if n_placeholders != n_images:
        raise ValueError(f"the prompt has {n_placeholders} {what} placeholder(s) but {n_images} "
                         f"{what}(s) were given")


def _videos(videos, processor, video_token_id) -> list[list]:
    """Each video as a list of RGB PIL frames; [] for none. Raises for a model without videos."""
    if videos is None or (isinstance(videos, (list, tuple)) and not videos):
        return []
    if video_token_id is None:
        raise ValueError("this model takes no videos (its family has no video token)")
    if isinstance(videos, (np.ndarray, torch.Tensor)) and videos.ndim == 4:
        videos = [videos]
    if not isinstance(videos, (list, tuple)):
        raise TypeError(f"videos must be a list of videos (each a list of frames or an array [frames, H, W, C]), "
                        f"got {type(videos).__name__}")
    out = []
    for i, v in enumerate(videos):
        frames = list(v) if isinstance(v, (list, tuple)) or getattr(v, "ndim", 0) == 4 else None
        if not frames:
            raise ValueError(f"video {i}: a video is a non-empty list of frames or an array [frames, H, W, C]")
        pil = [_to_pil(f, j) for j, f in enumerate(frames)]
        if len({f.size for f in pil}) > 1:
            raise ValueError(f"video {i}: its frames differ in size ({sorted({f.size for f in pil})} as (W, H)); "
                             "a video's frames must all have one size")
        out.append(pil)
    return out


def video_pixels(image_processor, frames) -> torch.Tensor:
    """A video's frames [frames, 3, H, W] as LLaVA-OneVision's video processor prepares them:
    each frame resized to the image processor's `size` (its resampling filter), rescaled and
    normalised with its mean and std (the video processor's own steps, without torchvision)."""
    size = image_processor.size
    size = size if isinstance(size, dict) else vars(size)
    h = size.get("height") or size.get("shortest_edge")
    w = size.get("width") or size.get("shortest_edge")
    resample = getattr(image_processor, "resample", 3)
    resample = int(getattr(resample, "value", resample))
    x = np.stack([np.asarray(f.resize((w, h), resample), dtype=np.float32) for f in frames])
    x = x * np.float32(getattr(image_processor, "rescale_factor", 1 / 255))
    mean = np.asarray(image_processor.image_mean, dtype=np.float32)
    std = np.asarray(image_processor.image_std, dtype=np.float32)
    return torch.from_numpy(((x - mean) / std).transpose(0, 3, 1, 2).copy())


def pixels(processor, pil):
    """The processor's pixel values of PIL images (None for none)."""
    if not pil:
        return None
    return processor.image_processor(pil, return_tensors="pt")["pixel_values"]
