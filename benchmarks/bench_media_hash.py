"""Benchmark: a picture's host work before its upload, as the scheduler does it for an image
request with the prefix cache on: the cache's key (`prefix_cache.media_keys`) and the array the
device upload reads, against the one-pass BLAKE2b key and separate conversion they replaced.

    python benchmarks/bench_media_hash.py [--out benchmarks/results/media_hash_cpu.json]

Per picture size (RGB), medians of `--reps` calls after one warm-up, ms: `tobytes` and `array`
(PIL to bytes, PIL to a uint8 array: `np.array`), `blake2b` (tobytes + one BLAKE2b pass, the
former key), `before` (the former key + the upload's own `np.array`), `now` (`media_keys`: the
array of `Prepared.host_pixels`, which the upload reuses, + SHA-256, pieces of HASH_PIECE bytes
on a thread pool past two pieces). Host CPU only: no device work.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys

import numpy as np
from PIL import Image

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from _common import median_ms, provenance  # noqa: E402
from tabed_engine.engine.prefix_cache import media_keys  # noqa: E402
from tabed_engine.engine.prompt import Prepared  # noqa: E402

SIZES = [(336, 336), (384, 384), (672, 672), (1024, 1024), (2048, 1536), (4000, 3000)]


def blake2b_key(im) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    h.update(repr((im.mode, im.size)).encode())
    h.update(im.tobytes())
    return h.digest()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join("benchmarks", "results", "media_hash_cpu.json"))
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--sizes", type=int, nargs="+", default=None, help="W H pairs (default: 336 336 ... 4000 3000)")
    args = ap.parse_args(argv)
    sizes = SIZES if args.sizes is None else list(zip(args.sizes[::2], args.sizes[1::2]))
    rng = np.random.default_rng(0)
    rows = []
    print(f"{'picture':>11} {'MB':>6} {'tobytes':>8} {'array':>8} {'blake2b':>8} {'before':>8} {'now':>8}  ms")
    for w, h in sizes:
        im = Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
        key = lambda: media_keys(Prepared([0, 1], None, [(1, 1)], [im]))   # noqa: E731 (uncached: a new Prepared)
        r = {"width": w, "height": h, "megabytes": w * h * 3 / 1e6,
             "tobytes_ms": median_ms(im.tobytes, "cpu", args.reps),
             "array_ms": median_ms(lambda: np.array(im), "cpu", args.reps),
             "blake2b_ms": median_ms(lambda: blake2b_key(im), "cpu", args.reps),
             "before_ms": median_ms(lambda: (blake2b_key(im), np.array(im)), "cpu", args.reps),
             "now_ms": median_ms(key, "cpu", args.reps)}
        rows.append(r)
        print(f"{w:>5}x{h:<5} {r['megabytes']:6.2f} " + " ".join(
            f"{r[k + '_ms']:8.2f}" for k in ("tobytes", "array", "blake2b", "before", "now")))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"provenance": provenance("cpu"), "reps": args.reps, "rows": rows}, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
