"""Time to first token, the vision part: image preprocessing and the vision tower at the
LLaVA-1.5-7B vision shape (CLIP ViT-L/14-336, feature layer -2), random bf16 weights.

    python benchmarks/ttft_vision.py --out benchmarks/results/ttft_vision_h200.json   # H100/H200, ~1 min
    python benchmarks/ttft_vision.py --tiny --out /tmp/ttft_vision.json              # CPU smoke, seconds

For 1 and 3 images (640x480, 500x375, 480x640 random photos):
* preprocessing: the checkpoint's image processor on the host (as prompt.py calls it) plus
  the upload of its pixel_values, against `image_ops.device_pixels` (uint8 upload, resize,
  crop and normalise on the device); synchronized wall clock, median. `device_host_ms`: the
  time until device_pixels returns, unsynchronized (the host's share). Max abs difference
  of the two (0: bit-exact), and of a float resize (interpolate bicubic antialias on float
  pixels, then the same crop and normalisation) for contrast.
* vision tower: transformers' tower as the engine ran it before (`tower(pv,
  output_hidden_states=True)`, its default attention), our `CLIPTower` eager, and
  `VisionEncoder.select` (a CUDA-graph replay plus the copies in and out); CUDA events.
* floor: 2 x the multiply-adds of the patch embedding and the layers the selection needs
  (23 of 24; LayerNorm, softmax and GELU left out), at the TFLOP/s of an 8192^3 bf16 matrix
  product measured in the same run; achieved TFLOP/s of each tower. The device-to-device copy
  bandwidth of the run is recorded too (`copy_gbs`).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from _common import copy_bandwidth_gbs, event_ms, provenance, wall_ms  # noqa: E402
from e2e import CLIP_L336, PRESETS  # noqa: E402
from e2e_common import build_hf_llava  # noqa: E402

IMAGE_SIZES = ((640, 480), (500, 375), (480, 640))     # (width, height)
TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
            num_key_value_heads=4, vocab_size=512, rms_norm_eps=1e-5, max_position_embeddings=512)


def tower_flops(vc, layers_run: int) -> int:
    """FLOPs (2 x multiply-adds) of one image through the patch embedding and `layers_run`
    layers: q, k, v, out, fc1, fc2 and the two attention products."""
    d, inner, p = vc.hidden_size, vc.intermediate_size, vc.patch_size
    g = vc.image_size // p
    t = g * g + 1
    per_layer = 2 * t * (4 * d * d + 2 * d * inner) + 2 * 2 * t * t * d
    return 2 * g * g * (vc.num_channels * p * p) * d + layers_run * per_layer


def images(n: int, tiny: bool):
    from PIL import Image

    rng = np.random.default_rng(0)
    sizes = [(w // 8, h // 8) for w, h in IMAGE_SIZES] if tiny else IMAGE_SIZES
    return [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for w, h in sizes[:n]]


def float_resize_pixels(imgs, plan, device):
    """The float alternative: interpolate(bicubic, antialias) on float pixels, same crop and
    normalisation (what the device path would give without fixed-point rounding)."""
    from tabed_engine.models.image_ops import _crop_axis, _normalize, _resized_size

    out = []
    for im in imgs:
        x = torch.from_numpy(np.array(im)).to(device).permute(2, 0, 1)[None].double()
        rh, rw = _resized_size(x.shape[2], x.shape[3], plan.resize)
        x = torch.nn.functional.interpolate(x, size=(rh, rw), mode="bicubic", antialias=True)[0]
        y0, ny, _, _ = _crop_axis(rh, plan.crop[0], plan.backend)
        x0, nx, _, _ = _crop_axis(rw, plan.crop[1], plan.backend)
        x = x[:, y0:y0 + ny, x0:x0 + nx].clamp(0, 255).round()
        out.append(_normalize(x, plan, torch.empty(x.shape, device=device)))
    return torch.stack(out)


def timed(fn, device, reps: int) -> float:
    """Median ms of fn(): CUDA events on the GPU, synchronized wall clock on the CPU."""
    if device.type == "cuda":
        return event_ms(fn, reps)
    fn()
    return statistics.median(wall_ms(fn, device)[1] for _ in range(reps))


def host_ms(fn, device, reps: int) -> float:
    """Median wall-clock ms until fn() returns (the device synchronized before, not after)."""
    times = []
    for _ in range(reps + 1):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times[1:])


def gemm_tflops(device, dtype) -> float | None:
    if device.type != "cuda":
        return None
    n = 8192
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    return 2 * n ** 3 / (event_ms(lambda: a @ b, 10) * 1e-3) / 1e12


def run(args) -> dict:
    from tabed_engine.models.image_ops import device_pixels, pixel_plan
    from tabed_engine.models.loader import lvlm_from_hf
    from tabed_engine.models.tiny import build_processor

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    vision = PRESETS["tiny"].vision if args.tiny else CLIP_L336
    reps = args.repeats or (3 if args.tiny else 20)
    hf = build_hf_llava(vision, TEXT, device, dtype, 0.02, 0, 4)
    encoder = lvlm_from_hf(hf).vision
    hf_tower = hf.model.vision_tower
    ip = build_processor(TEXT["vocab_size"], vision["image_size"], vision["patch_size"]).image_processor
    vc = hf.config.vision_config
    layers_run = max(encoder.tower.layers)
    flops1 = tower_flops(vc, layers_run)
    ceiling = gemm_tflops(device, dtype)
    R = {"provenance": provenance(device),
         "config": {"vision": vision, "dtype": str(dtype), "feature_layer": encoder.feature_layer,
                    "layers_run": layers_run, "image_sizes_wh": IMAGE_SIZES, "repeats": reps,
                    "image_processor": type(ip).__name__, "processor_backend": pixel_plan(ip).backend,
                    "hf_attn_implementation": getattr(vc, "_attn_implementation", None)},
         "method": __doc__.split("\n\n", 2)[2], "gemm_tflops": ceiling, "flops_per_image": flops1,
         "copy_gbs": copy_bandwidth_gbs(device, 1 << 30 if device.type == "cuda" else 64 << 20)}
    for n in (1, 3):
        imgs = images(n, args.tiny)
        proc = lambda: ip(imgs, return_tensors="pt")["pixel_values"].to(device, dtype)  # noqa: E731
        dev = lambda: device_pixels(imgs, ip, device, dtype)                             # noqa: E731
        ref = ip(imgs, return_tensors="pt")["pixel_values"].to(device)
        exact = device_pixels(imgs, ip, device, torch.float32)
        floaty = float_resize_pixels(imgs, pixel_plan(ip), device)
        pv = proc()
        eager = lambda: encoder._features(pv)                                          # noqa: E731
        hf_run = lambda: hf_tower(pv, output_hidden_states=True)                       # noqa: E731
        with torch.no_grad():
            ours, theirs = encoder.select(pv), hf_tower(pv, output_hidden_states=True).hidden_states[-2][:, 1:]
            r = {"host_preprocess_ms": timed(proc, device, reps),
                 "device_preprocess_ms": timed(dev, device, reps),
                 "device_preprocess_host_ms": host_ms(dev, device, reps),
                 "device_vs_processor_max_abs": (exact - ref).abs().max().item(),
                 "float_resize_vs_processor_max_abs": (floaty - ref).abs().max().item(),
                 "tower_hf_ms": timed(hf_run, device, reps),
                 "tower_ours_eager_ms": timed(eager, device, reps),
                 "tower_ours_select_ms": timed(lambda: encoder.select(pv), device, reps),
                 "ours_vs_hf_max_abs": (ours.float() - theirs.float()).abs().max().item(),
                 "hf_feature_max_abs": theirs.float().abs().max().item()}
        flops = n * flops1
        r["floor_ms"] = None if ceiling is None else flops / (ceiling * 1e12) * 1e3
        for k in ("tower_hf_ms", "tower_ours_eager_ms", "tower_ours_select_ms"):
            r[k.replace("_ms", "_tflops")] = flops / (r[k] * 1e-3) / 1e12
        R[f"{n}_images"] = r
    one = R["1_images"]
    R["targets"] = {"tower_le_2ms_1_image": one["tower_ours_select_ms"] <= 2.0,
                    "host_preprocess_le_1ms_1_image": one["device_preprocess_host_ms"] <= 1.0,
                    "preprocess_bit_exact": all(R[f"{n}_images"]["device_vs_processor_max_abs"] == 0
                                                for n in (1, 3))}
    return R


def markdown(R: dict) -> str:
    pv = R["provenance"]
    lines = [f"## ttft_vision — {pv['device']}",
             f"torch {pv['torch']}, transformers {pv['transformers']}, CUDA {pv['cuda']}, {pv['date_utc']}, "
             f"commit {pv['git']['commit'][:10]}; bf16 GEMM ceiling {R['gemm_tflops'] or 0:.0f} TFLOP/s, "
             f"copy {R['copy_gbs']:.0f} GB/s; "
             f"processor {R['config']['image_processor']} ({R['config']['processor_backend']})", "",
             "| images | host preprocess | device preprocess (host part) | tower HF | ours eager | ours graph "
             "| floor | graph TFLOP/s |", "|---|---|---|---|---|---|---|---|"]
    for n in (1, 3):
        r = R[f"{n}_images"]
        floor = "—" if r["floor_ms"] is None else f"{r['floor_ms']:.2f}"
        lines.append(f"| {n} | {r['host_preprocess_ms']:.2f} | {r['device_preprocess_ms']:.2f} "
                     f"({r['device_preprocess_host_ms']:.2f}) | {r['tower_hf_ms']:.2f} | "
                     f"{r['tower_ours_eager_ms']:.2f} | {r['tower_ours_select_ms']:.2f} | {floor} | "
                     f"{r['tower_ours_select_tflops']:.0f} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="JSON file to write")
    ap.add_argument("--tiny", action="store_true", help="small tower and images (CPU smoke test)")
    ap.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    ap.add_argument("--repeats", type=int, default=None)
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    R = run(args)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(R, f, indent=1, default=str)
    print(markdown(R), flush=True)
    return R


if __name__ == "__main__":
    main()
