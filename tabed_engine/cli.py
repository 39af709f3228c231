"""Command line: `tabed-engine generate --target DIR [--draft DIR] --image PATH --prompt TEXT`."""
from __future__ import annotations

import argparse
import json
import sys


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tabed-engine",
                                description="Speculative decoding for LLaVA-family vision-language models.")
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate a completion for one prompt",
                       description="Generate a completion. With --draft, decoding is speculative "
                                   "(lossless: the output follows the target's distribution).")
    g.add_argument("--target", required=True, help="local HF LLaVA checkpoint directory of the target model")
    g.add_argument("--draft", help="local HF LLaVA checkpoint directory of the draft model "
                                   "(omit for plain autoregressive decoding)")
    g.add_argument("--image", action="append", default=[], metavar="PATH",
                   help="image file; repeat for several images (one <image> placeholder each)")
    g.add_argument("--prompt", required=True,
                   help="prompt text; put one <image> where each image goes (added at the front "
                        "when images are given and the prompt has none)")
    g.add_argument("--chat", action="store_true",
                   help="wrap the prompt as one user message through the processor's chat template")
    g.add_argument("--max-new-tokens", type=int, default=128, help="maximum tokens to generate (default 128)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples")
    g.add_argument("--top-k", type=int, default=0, help="sample only among the k most likely tokens (0 = off)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1.0 = off)")
    g.add_argument("--seed", type=int, default=None, help="random seed for sampling")
    g.add_argument("--views", default="M,T", help="draft views, comma separated subset of M,T,P,C (default M,T)")
    g.add_argument("--policy", default="hedge",
                   help="ensemble policy: uniform, kld, tvd, w-grid, hedge (default), confidence")
    g.add_argument("--window", type=int, default=0, help="history window in positions (0 = all)")
    g.add_argument("--gamma", type=int, default=5, help="draft tokens per block (default 5)")
    g.add_argument("--no-view-tree", action="store_true",
                   help="draft the first block as a mixture chain instead of verifying every view's own chain "
                        "as a branch of one tree (kld/tvd/hedge, greedy, several views)")
    g.add_argument("--caption", default=None, help="image caption for the C view")
    g.add_argument("--escape-token", type=int, default=None, metavar="ID",
                   help="token id that stands for each image in the T view (default: the tokenizer's "
                        "newline token; with none, the T view drops the image tokens)")
    g.add_argument("--timing", action="store_true",
                   help="measure per-phase times (synchronizes the device after every phase: slower)")
    g.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    g.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="weights dtype (default: bfloat16 on cuda, float32 on cpu)")
    g.add_argument("--no-speculative", action="store_true", help="decode autoregressively even with --draft")
    g.add_argument("--json", action="store_true", help="print one JSON object (text, token ids, stats)")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    import torch
    from PIL import Image

    from . import Engine, SamplingParams

    try:
        images = [Image.open(p).convert("RGB") for p in args.image]
    except OSError as e:
        print(f"error: cannot read image: {e}", file=sys.stderr)
        return 2
    prompt = args.prompt
    if images and "<image>" not in prompt:
        prompt = "<image>\n" * len(images) + prompt
    if args.chat:
        content = [{"type": "image"} for _ in images] + [{"type": "text", "text": args.prompt}]
        prompt = [{"role": "user", "content": content}]
    try:
        engine = Engine.from_pretrained(args.target, args.draft, device=args.device,
                                        dtype=getattr(torch, args.dtype) if args.dtype else None,
                                        views=tuple(v.strip() for v in args.views.split(",") if v.strip()),
                                        policy=args.policy, window=args.window, gamma=args.gamma,
                                        view_tree=not args.no_view_tree, escape_token=args.escape_token,
                                        timing=args.timing)
        sp = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                            top_k=args.top_k, top_p=args.top_p, seed=args.seed)
        out = engine.generate(prompt, images=images, sampling=sp, caption=args.caption,
                              speculative=not args.no_speculative)
    except (ValueError, TypeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"text": out.text, "token_ids": out.token_ids, "stats": out.stats.as_dict()}))
    else:
        s = out.stats
        print(out.text)
        print(f"[{s.new_tokens} tokens, {s.time_total:.2f}s, block efficiency {s.block_efficiency:.2f}"
              + (f", final weights {s.weights[-1]}" if s.weights else "") + "]", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
