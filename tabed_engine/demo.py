"""`make demo`: speculative generation on the default checkpoint pair and a sample image.

Uses the bundled synthetic-world pair (tabed_engine/assets/demo) when it is installed,
otherwise builds a small random pair in a temporary directory. Never downloads anything.
Prints the answer, block efficiency, the per-view weights and walltime against AR.
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch

ASSETS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets", "demo")


def _bundled():
    t, d = os.path.join(ASSETS, "target"), os.path.join(ASSETS, "draft")
    if all(os.path.isfile(os.path.join(p, "config.json")) for p in (t, d)):
        return t, d, os.path.join(ASSETS, "sample.png")
    return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--views", default="M,T", help="draft views (default M,T)")
    ap.add_argument("--policy", default="hedge", help="ensemble policy (default hedge)")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--device", default=None)
    args = ap.parse_args(argv)

    from PIL import Image

    from tabed_engine import Engine, SamplingParams

    views = tuple(v.strip() for v in args.views.split(","))
    bundled = _bundled()
    tmp = None
    if bundled:
        target, draft, image_path = bundled
        image = Image.open(image_path).convert("RGB")
        prompt = [{"role": "user", "content": [{"type": "image"},
                                                {"type": "text", "text": "describe the image ."}]}]
        source = "bundled synthetic-world pair"
    else:
        from tabed_engine.models.tiny import build_tiny_llava, random_image

        tmp = tempfile.mkdtemp(prefix="tabed_demo_")
        target, draft = os.path.join(tmp, "target"), os.path.join(tmp, "draft")
        print("[demo] no bundled models installed: building a small random pair in", tmp, flush=True)
        build_tiny_llava(target, vocab_size=512, hidden=96, layers=4, heads=4, kv_heads=2, intermediate=256,
                         image_size=42, patch_size=6, seed=0)
        build_tiny_llava(draft, vocab_size=512, hidden=96, layers=4, heads=4, kv_heads=2, intermediate=256,
                         image_size=42, patch_size=6, seed=0, perturb=0.1)
        image = random_image(0, 42)
        prompt = "<image>\n w1 w2 w3 w4"
        source = "random pair (target + perturbed copy as draft)"
    print(f"[demo] loading {source}", flush=True)
    engine = Engine.from_pretrained(target, draft, device=args.device, views=views, policy=args.policy)
    sp = SamplingParams(max_new_tokens=args.max_new_tokens)
    caption = "a synthetic scene" if "C" in views else None
    engine.generate(prompt, images=[image], sampling=sp, caption=caption)            # warm-up
    t0 = time.perf_counter()
    sd = engine.generate(prompt, images=[image], sampling=sp, caption=caption)
    t_sd = time.perf_counter() - t0
    t0 = time.perf_counter()
    ar = engine.generate(prompt, images=[image], sampling=sp, speculative=False)
    t_ar = time.perf_counter() - t0
    s = sd.stats
    print(f"\nanswer: {sd.text}\n")
    print(f"tokens: {s.new_tokens}   identical to AR: {sd.token_ids == ar.token_ids}")
    print(f"block efficiency: {s.block_efficiency:.2f} tokens per target forward "
          f"(accepted per block: {s.accepted_lengths})")
    if s.view_tree_view is not None:   # the first block verified every view's own chain
        print(f"first block: view tree, {s.view_tree_view}'s chain accepted ({s.accepted_lengths[0]} drafts)")
        first = ("after the first block", s.weights[1] if len(s.weights) > 1 else "-")
    else:
        first = ("first block", s.weights[0] if s.weights else "-")
    print(f"view weights ({', '.join(views)}): {first[0]} {first[1]}, "
          f"last block {s.weights[-1] if s.weights else '-'}")
    print(f"walltime: speculative {t_sd * 1e3:.1f} ms vs autoregressive {t_ar * 1e3:.1f} ms "
          f"({t_ar / t_sd:.2f}x) on {engine.device}")
    print(f"first token after {s.time_first_token * 1e3:.1f} ms, {s.new_tokens} tokens in "
          f"{s.time_total * 1e3:.1f} ms (per-phase times: Engine(timing=True))")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
