"""Fixed-point bicubic resampling coefficients as the image processors compute them: Pillow's
`ImagingResample` (a = -0.5, 22 fractional bits) and torch's uint8 antialiased kernel (int16
coefficients, the precision chosen from the largest weight), applied one axis at a time (image_ops.py):
exact in float64 in any summation order. An axis is one matmul with a dense [in, out] matrix where
that matrix is small (`DENSE_BYTES`); a long axis resized to a long one (Qwen2-VL keeps a
3700-pixel side near 3700) would need a matrix quadratic in the side (108 MB there, 20 GB for a
50000-pixel side), so there it goes in blocks of output pixels, each a matmul over only the inputs
the block reads (`resample_axis`)."""
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


def _matrix(xmin, k, bits: int, in_size: int, whole: bool):
    """(lo, hi, [hi - lo, n] float64 matrix) of the n output pixels whose first inputs and taps
    are xmin [n], k [n, ksize]: the coefficients over 2^bits (exact: a power of two) at rows
    lo..hi of the input, the whole input (whole) or only the rows these outputs read."""
    rows = np.minimum(xmin[:, None] + np.arange(k.shape[1]), in_size - 1)   # taps past the edge are 0
    lo, hi = (0, in_size) if whole else (int(rows.min()), int(rows.max()) + 1)
    m = np.zeros((hi - lo, len(xmin)))
    np.add.at(m, (rows - lo, np.arange(len(xmin))[:, None]), k / (1 << bits))
    return lo, hi, m


class _MatrixCache:
    """Resampling matrices (whole, or in blocks) on the device by (sizes, kept range, backend, device),
    least recently used first out past `max_bytes`: a repeated image size costs no host work or
    upload."""

    def __init__(self, max_bytes: int = 64 << 20):
        self.max_bytes, self.bytes, self.items = max_bytes, 0, OrderedDict()

    def get(self, in_size: int, out_size: int, start: int, count: int, backend: str, device) -> torch.Tensor:
        """[in_size, count] float64 matrix of output pixels start..start+count: the fixed-point
        coefficients over 2^bits (exact: a power of two), so x @ m is the accumulator over 2^bits."""
        return self._cached((in_size, out_size, start, count, backend, device), None)[0][2]

    def blocks(self, in_size: int, out_size: int, start: int, count: int, backend: str, device):
        """Output pixels start..start+count in blocks of `BLOCK`, each (lo, hi, [hi - lo, block]
        matrix): a block reads input pixels lo..hi only (a few taps an output, so about the block's
        width), so x[..., lo:hi] @ matrix is its accumulator."""
        return self._cached((in_size, out_size, start, count, backend, device), BLOCK)

    def _cached(self, key: tuple, block):
        key = key + (block,)
        hit = self.items.get(key)
        if hit is not None:
            self.items.move_to_end(key)
            return hit
        in_size, out_size, start, count, backend, device = key[:6]
        xmin, k, bits = _coefficients(in_size, out_size, backend)
        step = count if block is None else block
        hit = []
        for j in range(start, start + count, step):
            n = min(step, start + count - j)
            lo, hi, m = _matrix(xmin[j:j + n], k[j:j + n], bits, in_size, block is None)
            hit.append((lo, hi, torch.from_numpy(m).to(device)))
        self.items[key] = hit = tuple(hit)
        self.bytes += sum(m.nbytes for _, _, m in hit)
        while self.bytes > self.max_bytes and len(self.items) > 1:    # (the newest always stays)
            self.bytes -= sum(m.nbytes for _, _, m in self.items.popitem(last=False)[1])
        return hit


matrices = _MatrixCache()

# the largest dense resampling matrix (bytes): 2048 x 2048 in float64; a longer axis resized to a
# long one goes in blocks of BLOCK output pixels (`resample_axis`)
DENSE_BYTES = 32 << 20
BLOCK = 256


def resample_axis(x: torch.Tensor, dim: int, in_size: int, out_size: int, start: int, count: int,
                  backend: str) -> torch.Tensor:
    """The fixed-point accumulator (over 2^bits) of resizing float64 `x` (uint8 values) along `dim`
    (-1: columns, -2: rows) from in_size to out_size pixels, output pixels start..start+count."""
    if in_size * count * 8 <= DENSE_BYTES:
        m = matrices.get(in_size, out_size, start, count, backend, x.device)      # [in, count]
        return x @ m if dim == -1 else torch.matmul(m.t(), x)
    parts = [x[..., lo:hi] @ m if dim == -1 else torch.matmul(m.t(), x[..., lo:hi, :])
             for lo, hi, m in matrices.blocks(in_size, out_size, start, count, backend, x.device)]
    return torch.cat(parts, dim)


def fixed_point(acc: torch.Tensor) -> torch.Tensor:
    """Round a fixed-point accumulator (over 2^bits) to uint8 values as both backends do: add
    half, shift right, clip (in place)."""
    return acc.add_(0.5).floor_().clamp_(0, 255)
