"""Fixed-point bicubic resampling coefficients as the image processors compute them: Pillow's
`ImagingResample` (a = -0.5, 22 fractional bits) and torch's uint8 antialiased kernel (int16
coefficients, the precision chosen from the largest weight), as device matrices (image_ops.py
applies them one axis at a time: exact in float64 in any summation order)."""
from __future__ import annotations

import functools
import math
from collections import OrderedDict

import numpy as np
import torch


def _cubic_pil(x):
    a = np.abs(x)      # Pillow's bicubic_filter, a = -0.5, in its operation order
    return np.where(a < 1.0, (1.5 * a - 2.5) * a * a + 1,
                    np.where(a < 2.0, (((a - 5) * a + 8) * a - 4) * -0.5, 0.0))


def _cubic_torch(x):
    a, A = np.abs(x), -0.5   # torch's aa cubic filter: cubic_convolution1/2
    return np.where(a < 1.0, ((A + 2) * a - (A + 3)) * a * a + 1,
                    np.where(a < 2.0, ((A * a - 5 * A) * a + 8 * A) * a - 4 * A, 0.0))


@functools.lru_cache(maxsize=256)
def _coefficients(in_size: int, out_size: int, backend: str):
    """Per output pixel: first input pixel, fixed-point taps [out, ksize] (float64 holding
    integers), and the fixed-point precision in bits; computed as the backend computes them."""
    scale = in_size / out_size
    fscale = max(scale, 1.0)
    support = 2.0 * fscale
    ksize = int(math.ceil(support)) * 2 + 1
    center = (np.arange(out_size, dtype=np.float64) + 0.5) * scale
    xmin = np.maximum(np.trunc(center - support + 0.5), 0).astype(np.int64)
    xcount = np.clip(np.minimum(np.trunc(center + support + 0.5).astype(np.int64), in_size) - xmin, 0, ksize)
    cubic = _cubic_pil if backend == "pil" else _cubic_torch
    k = np.zeros((out_size, ksize))
    total = np.zeros(out_size)
    for t in range(ksize):          # tap by tap: the backends sum the weights in this order
        k[:, t] = np.where(t < xcount, cubic((t + xmin - center + 0.5) * (1.0 / fscale)), 0.0)
        total = total + k[:, t]
    k = np.where(total[:, None] != 0.0, k / np.where(total == 0.0, 1.0, total)[:, None], k)
    if backend == "pil":
        bits = 22
    else:   # the most bits that keep the largest weight in int16
        bits = next((b for b in range(22) if int(0.5 + k.max() * (1 << (b + 1))) >= 1 << 15), 22)
    v = k * (1 << bits)
    return xmin, np.where(v < 0, np.trunc(v - 0.5), np.trunc(v + 0.5)), bits


class _MatrixCache:
    """Resampling matrices on the device by (sizes, kept range, backend, device), least recently
    used first out past `max_bytes`: a repeated image size costs no host work or upload."""

    def __init__(self, max_bytes: int = 64 << 20):
        self.max_bytes, self.bytes, self.items = max_bytes, 0, OrderedDict()

    def get(self, in_size: int, out_size: int, start: int, count: int, backend: str, device) -> torch.Tensor:
        """[in_size, count] float64 matrix of output pixels start..start+count: the fixed-point
        coefficients over 2^bits (exact: a power of two), so x @ m is the accumulator over 2^bits."""
        key = (in_size, out_size, start, count, backend, device)
        hit = self.items.get(key)
        if hit is not None:
            self.items.move_to_end(key)
            return hit
        xmin, k, bits = _coefficients(in_size, out_size, backend)
        xmin, k = xmin[start:start + count], k[start:start + count]
        m = np.zeros((in_size, count))
        rows = np.minimum(xmin[:, None] + np.arange(k.shape[1]), in_size - 1)   # taps past the edge are 0
        np.add.at(m, (rows, np.arange(count)[:, None]), k / (1 << bits))
        self.items[key] = hit = torch.from_numpy(m).to(device)
        self.bytes += m.nbytes
        while self.bytes > self.max_bytes and len(self.items) > 1:
            self.bytes -= self.items.popitem(last=False)[1].nbytes
        return hit


matrices = _MatrixCache()


def fixed_point(acc: torch.Tensor) -> torch.Tensor:
    """Round a fixed-point accumulator (over 2^bits) to uint8 values as both backends do: add
    half, shift right, clip (in place)."""
    return acc.add_(0.5).floor_().clamp_(0, 255)
