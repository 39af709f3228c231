"""Command line: `tabed-engine generate --target DIR [--draft DIR] [--image PATH] --prompt TEXT`
and `tabed-engine serve --target DIR [--draft DIR] [--port N]` (an OpenAI-compatible server)."""
from __future__ import annotations

import argparse
import json
import sys

EXAMPLE = """example (the bundled synthetic-world pair; its tokenizer knows only that world's words):
  tabed-engine generate --target tabed_engine/assets/demo/target --draft tabed_engine/assets/demo/draft \\
      --image tabed_engine/assets/demo/sample.png --prompt "describe the image ."
"""


def add_engine_options(p: argparse.ArgumentParser):
    """The checkpoint, speculation and device options that `generate` and `serve` share."""
    p.add_argument("--target", required=True, help="local HF LLaVA checkpoint directory of the target model")
    p.add_argument("--draft", help="local HF LLaVA checkpoint directory of the draft model "
                                   "(omit for plain autoregressive decoding)")
    p.add_argument("--views", default="M,T", help="draft views, comma separated subset of M,T,P,C (default M,T)")
    p.add_argument("--policy", default="hedge",
                   help="ensemble policy: uniform, kld, tvd, w-grid, hedge (default), confidence")
    p.add_argument("--window", type=int, default=0, help="history window in positions (0 = all)")
    p.add_argument("--gamma", type=int, default=5,
                   help="draft tokens per block at most (default 5; on the GPU the cost model may draft fewer, "
                        "or none, per block)")
    p.add_argument("--no-adaptive", action="store_true",
                   help="speculate every block with gamma drafts (default: the cost model picks AR or the chain "
                        "length per block from times it measures; on the GPU only)")
    p.add_argument("--max-len", type=int, default=None, metavar="N",
                   help="tokens a request's cache holds: prompt + new tokens (default: the target's "
                        "max_position_embeddings, at most 4096)")
    p.add_argument("--tree", default=None, metavar="DxWxB",
                   help="draft a tree per block instead of a chain: depth x width x branch, e.g. 5x4x2 "
                        "('default' = 10x3x2); the target verifies all its nodes in one forward")
    p.add_argument("--no-view-tree", action="store_true",
                   help="draft the first block as a mixture chain instead of verifying every view's own chain "
                        "as a branch of one tree (kld/tvd/hedge, greedy, several views)")
    p.add_argument("--escape-token", type=int, default=None, metavar="ID",
                   help="token id that stands for each image in the T view (default: the tokenizer's "
                        "newline token; with none, the T view drops the image tokens)")
    p.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda when available)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="weights dtype (default: bfloat16 on cuda, float32 on cpu)")
    p.add_argument("--prefill-chunk", type=int, default=None, metavar="N",
                   help="prompt tokens a scheduler step may prefill: a longer prompt is prefilled in chunks of N, "
                        "the running requests decoding between them (default: the engine's, docs/serving.md; "
                        "0 = whole prompts)")
    p.add_argument("--no-prefix-cache", action="store_true",
                   help="do not reuse the KV of earlier requests whose prompt (tokens and images) starts the "
                        "same way (prefix caching: on by default, docs/serving.md)")
    p.add_argument("--invariant", action="store_true",
                   help="row-count-invariant decoding on the GPU: a request's tokens have the same bits with "
                        "or without speculation and alone or in any batch (chains and trees; docs/api.md for its cost)")
    p.add_argument("--mixed-steps", action="store_true",
                   help="run each step's prompt chunks in the running batch's block's target forward (one pass "
                        "through the weights instead of two; docs/serving.md)")
    p.add_argument("--tensor-parallel", type=int, default=1, metavar="N",
                   help="shard the target over N processes, one GPU each from --device's index on (on the "
                        "CPU: N processes); this process starts and stops the workers (docs/parallel.md)")


def engine_kwargs(args) -> dict:
    """Engine.from_pretrained keyword arguments (besides the directories) from those options."""
    return dict(device=args.device, dtype=args.dtype, views=args.views, policy=args.policy, window=args.window,
                gamma=args.gamma, view_tree=not args.no_view_tree, escape_token=args.escape_token,
                tree=args.tree, max_len=args.max_len, **({"adaptive": False} if args.no_adaptive else {}),
                **({"prefill_chunk": args.prefill_chunk} if args.prefill_chunk is not None else {}),
                **({"tensor_parallel": args.tensor_parallel} if args.tensor_parallel != 1 else {}),
                **({"prefix_cache": False} if args.no_prefix_cache else {}),
                **({"invariant": True} if args.invariant else {}),
                **({"mixed_steps": True} if args.mixed_steps else {}))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tabed-engine",
                                description="Speculative decoding for LLaVA-family vision-language models.")
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate a completion for one prompt",
                       formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EXAMPLE,
                       description="Generate a completion and stream it to stdout as tokens are accepted. "
                                   "With --draft, decoding is speculative (lossless: the output follows "
                                   "the target's distribution). Progress and a summary go to stderr; bad "
                                   "input prints one 'error: ...' line and exits with status 2.")
    add_engine_options(g)
    g.add_argument("--image", action="append", default=[], metavar="PATH",
                   help="image file; repeat for several images")
    g.add_argument("--prompt", required=True,
                   help="the user's message. It is sent as one user turn through the checkpoint's chat "
                        "template when it has one (see --raw). Images go where the prompt has an <image> "
                        "placeholder (one per image), or before the text when it has none")
    g.add_argument("--raw", action="store_true",
                   help="send --prompt to the model as it is, without the chat template")
    g.add_argument("--chat", action="store_true", help=argparse.SUPPRESS)   # the default now; kept for old scripts
    g.add_argument("--max-new-tokens", type=int, default=128, help="maximum tokens to generate (default 128)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples")
    g.add_argument("--top-k", type=int, default=0, help="sample only among the k most likely tokens (0 = off)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1.0 = off)")
    g.add_argument("--seed", type=int, default=None, help="random seed for sampling")
    g.add_argument("--caption", action="append", default=None, metavar="TEXT",
                   help="image caption for the C view (needed with --views containing C); repeat once per "
                        "image, or give one for every image")
    g.add_argument("--timing", action="store_true",
                   help="measure per-phase times (synchronizes the device after every phase: slower)")
    g.add_argument("--no-speculative", action="store_true", help="decode autoregressively even with --draft")
    g.add_argument("--json", action="store_true",
                   help="print one JSON object (text, token ids, stats) at the end instead of streaming text")
    add_serve_parser(sub)
    return p


SERVE_EXAMPLE = """example (the bundled pair; then see the README's "Serving" section for curl and openai):
  tabed-engine serve --target tabed_engine/assets/demo/target --draft tabed_engine/assets/demo/draft --port 8000
"""


def add_serve_parser(sub):
    """`tabed-engine serve`: the engine behind an OpenAI-compatible HTTP API."""
    s = sub.add_parser("serve", help="serve an OpenAI-compatible HTTP API",
                       formatter_class=argparse.RawDescriptionHelpFormatter, epilog=SERVE_EXAMPLE,
                       description="Serve POST /v1/chat/completions (text and image_url parts: data: URLs or "
                                   "local file paths, never fetched from the network), POST /v1/completions, "
                                   "GET /v1/models, GET /health and GET /metrics (Prometheus). Needs the "
                                   "serve extra: pip install 'tabed_engine[serve]'.")
    add_engine_options(s)
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    s.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    s.add_argument("--model-name", default=None,
                   help="the model name clients send and /v1/models lists (default: the target directory's name)")
    s.add_argument("--max-batch", type=int, default=None,
                   help="requests decoded together at most (default: the engine's, 16); the KV page pool "
                        "(--kv-cache-tokens) bounds how many of them fit at once")
    s.add_argument("--kv-cache-tokens", type=int, default=None, metavar="N",
                   help="the KV page pool's size in target tokens (default: max-batch x max-len, cut to what "
                        "fits in --memory-fraction); each request reserves its prompt + max_tokens + lookahead")
    s.add_argument("--memory-fraction", type=float, default=None, metavar="F",
                   help="share of the GPU's free memory the KV page pool may take (default 0.9)")
    s.add_argument("--max-tokens-default", type=int, default=None,
                   help="max_tokens of a request that gives none (default: as many as the context holds, "
                        "as OpenAI's API does)")
    s.add_argument("--image-root", default=None, metavar="DIR",
                   help="accept local image paths only inside DIR (default: any file the server can read)")
    s.add_argument("--data-parallel", type=int, default=1, metavar="M",
                   help="serve M engine replicas behind this one HTTP front, one process each (on CUDA replica "
                        "i on GPU i, or on GPU group i with tensor parallelism; pick the GPUs with "
                        "CUDA_VISIBLE_DEVICES), each request routed to the least-loaded replica (default 1: "
                        "the engine in this process)")
    s.add_argument("--warmup", action="store_true",
                   help="before serving, decode a few tokens at every batch size the engine has, greedy and at "
                        "the API's default sampling (captures the CUDA graphs and compiles the kernels the first "
                        "requests would otherwise wait for)")


def serve_warmup(engine) -> float:
    """`engine.warmup()` for serving: greedy requests and the API's default sampling
    (temperature 1, no top-k / top-p), with and without a `seed` (seeded requests draft and
    verify by the Gumbel coupling), which run graphs of their own. Returns the seconds."""
    from tabed_engine import SamplingParams
    from tabed_engine.serving.protocol import parse_sampling

    default = SamplingParams(**parse_sampling({}, None))
    return engine.warmup(sampling=[SamplingParams(), default, SamplingParams(**{**parse_sampling({}, None), "seed": 0})])


def serve_main(args) -> int:
    """Load the engine and serve it until interrupted."""
    import os

    try:
        from tabed_engine.serving.server import serve
    except ImportError as e:
        return _error(f"{e}: the server needs the serve extra (pip install 'tabed_engine[serve]')")
    from tabed_engine import Engine

    name = args.model_name or os.path.basename(os.path.normpath(args.target))
    if args.data_parallel < 1:
        return _error(f"--data-parallel must be a positive int, got {args.data_parallel}")
    kw = engine_kwargs(args)
    if args.max_batch is not None:
        kw["max_batch"] = args.max_batch
    if args.memory_fraction is not None:
        kw["memory_fraction"] = args.memory_fraction
    if args.kv_cache_tokens is not None:
        kw["kv_cache_tokens"] = args.kv_cache_tokens
    if args.data_parallel != 1:
        return _serve_replicas(args, name, kw)
    try:
        engine = Engine.from_pretrained(args.target, args.draft,
                                        log=lambda s: print(s, end="", file=sys.stderr, flush=True), **kw)
    except (ValueError, TypeError, OSError) as e:
        return _error(e)
    if args.warmup:
        print(f"warm-up done in {serve_warmup(engine):.1f} s", file=sys.stderr, flush=True)
    print(f"serving {name!r} on http://{args.host}:{args.port}/v1", file=sys.stderr, flush=True)
    try:
        serve(engine, host=args.host, port=args.port, model_name=name,
              default_max_tokens=args.max_tokens_default, image_root=args.image_root)
    finally:
        engine.close()          # a tensor-parallel engine's workers stop with the server
    return 0


def _serve_replicas(args, name: str, kw: dict) -> int:
    """`serve --data-parallel M` (M > 1): M replica processes behind one front; this process
    owns them (started here, stopped on exit, error or Ctrl-C)."""
    import functools

    from tabed_engine.parallel.comm import nvls_off
    from tabed_engine.serving.data_parallel import ReplicaPool
    from tabed_engine.serving.replica import load_engine, plan_replicas
    from tabed_engine.serving.server import serve

    nvls_off()      # machine rule: NVLink multicast off here and in the replicas (they inherit it)
    kw = dict(kw)
    try:
        plans = plan_replicas(args.data_parallel, kw.pop("device"), getattr(args, "tensor_parallel", None) or 1)
    except ValueError as e:
        return _error(e)
    pool = ReplicaPool(functools.partial(load_engine, args.target, args.draft, kw, args.warmup), plans)
    try:
        try:
            pool.start_processes(say=lambda s: print(s, end="", file=sys.stderr, flush=True))
        except RuntimeError as e:
            return _error(e)
        except KeyboardInterrupt:       # Ctrl-C while the replicas load: they are stopped already
            return 130
        print(f"serving {name!r} on http://{args.host}:{args.port}/v1 with {len(plans)} replicas",
              file=sys.stderr, flush=True)
        serve(None, host=args.host, port=args.port, model_name=name, default_max_tokens=args.max_tokens_default,
              image_root=args.image_root, backend=pool)
    finally:
        pool.close()
    return 0


def _error(e) -> int:
    msg = " ".join(str(e).split())
    print(f"error: {msg}", file=sys.stderr)
    return 2


def _has_template(processor) -> bool:
    return bool(getattr(processor, "chat_template", None) or getattr(processor.tokenizer, "chat_template", None))


def build_prompt(processor, text: str, n_images: int, raw: bool = False, chat: bool = False) -> str:
    """The model's input text for the CLI's --prompt: one user turn through the chat template
    (unless `raw` or the checkpoint has none), images at their <image> placeholders or first."""
    image = getattr(processor, "image_token", "<image>")
    if chat and not _has_template(processor):
        raise ValueError("--chat: this checkpoint's processor has no chat template (drop --chat)")
    if raw or not _has_template(processor):
        if n_images and image not in text:
            text = f"{image}\n" * n_images + text
        return text
    content = []
    if image not in text:
        content += [{"type": "image"}] * n_images
    for i, part in enumerate(text.split(image)):
        if i:
            content.append({"type": "image"})
        if part.strip():
            content.append({"type": "text", "text": part.strip()})
    if not any(c["type"] == "text" for c in content):
        raise ValueError("--prompt is empty")
    return processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                         tokenize=False)


def unknown_words(tokenizer, text: str) -> list[str]:
    """The pieces of `text` that the tokenizer maps to its unknown token."""
    unk = tokenizer.unk_token_id
    if unk is None:
        return []
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=tokenizer.is_fast)
    ids = enc["input_ids"]
    if not tokenizer.is_fast:
        return ["?"] * sum(t == unk for t in ids)
    return [text[a:b] for t, (a, b) in zip(ids, enc["offset_mapping"]) if t == unk]


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        return serve_main(args)
    from PIL import Image

    from tabed_engine import Engine, SamplingParams

    try:
        images = [Image.open(p).convert("RGB") for p in args.image]
    except OSError as e:
        return _error(f"cannot read image: {e}")
    caption = None
    if args.caption:
        caption = args.caption[0] if len(args.caption) == 1 else args.caption
    printed = False
    try:
        sp = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                            top_k=args.top_k, top_p=args.top_p, seed=args.seed)
        engine = Engine.from_pretrained(args.target, args.draft,
                                        log=lambda s: print(s, end="", file=sys.stderr, flush=True),
                                        timing=args.timing, **engine_kwargs(args))
        prompt = build_prompt(engine.processor, args.prompt, len(images), raw=args.raw, chat=args.chat)
        unknown = unknown_words(engine.tokenizer, prompt)
        if unknown:
            shown = ", ".join(repr(w) for w in dict.fromkeys(unknown))
            print(f"warning: {len(unknown)} prompt word(s) are not in the tokenizer's vocabulary and become "
                  f"{engine.tokenizer.unk_token}: {shown}", file=sys.stderr)
        kw = dict(images=images, sampling=sp, caption=caption, speculative=not args.no_speculative)
        if args.json:
            out = engine.generate(prompt, **kw)
        else:
            stream = engine.stream(prompt, **kw)
            while True:
                try:
                    piece = next(stream)
                except StopIteration as stop:
                    out = stop.value
                    break
                sys.stdout.write(piece)
                sys.stdout.flush()
                printed = True
    except (ValueError, TypeError, RuntimeError) as e:
        if printed:
            print(flush=True)
        return _error(e)
    except KeyboardInterrupt:
        if printed:
            print(flush=True)
        return 130
    if args.json:
        print(json.dumps({"text": out.text, "token_ids": out.token_ids, "stats": out.stats.as_dict()}))
    else:
        s = out.stats
        print(flush=True)
        print(f"[{s.new_tokens} tokens, {s.time_total:.2f}s, block efficiency {s.block_efficiency:.2f}"
              + (f", final weights {s.weights[-1]}" if s.weights else "") + "]", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
