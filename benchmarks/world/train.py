"""Train the world's target and draft LLaVA models and save them as HF checkpoints.

    python -m benchmarks.world.train --out DIR [--device cuda|cpu] [--steps N] [--draft-steps N]
    python -m benchmarks.world.train --out DIR --eval-only     # evaluate a saved pair

writes DIR/target/, DIR/draft/ (fp16 safetensors + tokenizer + processor), DIR/sample.png,
DIR/TRAINING.md and DIR/training.json.

Data (what makes TABED's phenomenon appear): the target is trained on everything with
the real multimodal prompt, including text tasks asked next to images (S3, S4) and
unusual image styles and two-image prompts (S5). The draft sees images only on
image-grounded questions (S1, S2) in the normal style, and text tasks only WITHOUT
pixels (as the T view shows them, or with no image at all), plus caption-form prompts
(the C view) and some pooled-feature prompts (the P view). So its M view is out of
distribution on S3/S4 where T is in distribution, T is blind on S1/S2, and on S5 its
vision path is unreliable where captions help. A small share of image questions without
their pixels (S1/S2 through the T view) teaches the text path to hedge where it cannot
know the answer instead of guessing confidently, which is what lets a mixture follow the
view that does know (measured with the same target, 50 prompts per scenario: the kld
ensemble's block efficiency rose 3-12% per scenario with this share in the draft's mix).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

from .proxy import Encoded, encode, format_table, logits_of, measure, answer_accuracy, n_image_tokens
from .scenarios import GRID_READ, SCENARIOS, TEXT, examples, make_example
from .scenes import IMAGE_SIZE, Scene, random_scene, render
from .text import CHAT_TEMPLATE, IMAGE, build_tokenizer

PATCH = 16
CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]

# (scenario, view, weight) of each model's training mixture
TARGET_MIX = [("S1", "M", 0.18), ("S2", "M", 0.30), ("S3", "M", 0.12), ("S4", "M", 0.12),
              ("S5", "M", 0.15), (TEXT, "M", 0.08), (GRID_READ, "M", 0.18)]
DRAFT_MIX = [("S1", "M", 0.17), ("S2", "M", 0.26), ("S1", "P", 0.04), ("S2", "P", 0.06),
             ("S1", "C", 0.05), ("S2", "C", 0.07), ("S5", "C", 0.05),
             ("S3", "T", 0.10), ("S4", "T", 0.08), (TEXT, "M", 0.12), (GRID_READ, "M", 0.12),
             ("S1", "T", 0.03), ("S2", "T", 0.04)]

READ_MIX = [(GRID_READ, "M", 1.0)]

SIZES = {
    "target": dict(text=dict(hidden_size=192, intermediate_size=512, num_hidden_layers=4,
                             num_attention_heads=4, num_key_value_heads=2),
                   vision=dict(hidden_size=96, intermediate_size=384, num_hidden_layers=3,
                               num_attention_heads=4)),
    "draft": dict(text=dict(hidden_size=96, intermediate_size=256, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2),
                  vision=dict(hidden_size=48, intermediate_size=192, num_hidden_layers=2,
                              num_attention_heads=2)),
}


def build_processor():
    from transformers import CLIPImageProcessor, LlavaProcessor
    tok = build_tokenizer()
    ip = CLIPImageProcessor(size={"shortest_edge": IMAGE_SIZE},
                            crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE},
                            image_mean=CLIP_MEAN, image_std=CLIP_STD)
    return LlavaProcessor(image_processor=ip, tokenizer=tok, patch_size=PATCH,
                          vision_feature_select_strategy="default", chat_template=CHAT_TEMPLATE,
                          num_additional_image_tokens=1)


def build_model(kind: str, tokenizer):
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration
    s = SIZES[kind]
    text = LlamaConfig(vocab_size=len(tokenizer), max_position_embeddings=256, rope_theta=10000.0,
                       rms_norm_eps=1e-5, tie_word_embeddings=False, pad_token_id=tokenizer.pad_token_id,
                       bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, **s["text"])
    vision = CLIPVisionConfig(image_size=IMAGE_SIZE, patch_size=PATCH, projection_dim=s["vision"]["hidden_size"],
                              **s["vision"])
    grid = IMAGE_SIZE // PATCH
    cfg = LlavaConfig(vision_config=vision.to_dict(), text_config=text.to_dict(),
                      image_token_index=tokenizer.convert_tokens_to_ids(IMAGE), image_seq_length=grid * grid,
                      vision_feature_layer=-1, vision_feature_select_strategy="default",
                      projector_hidden_act="gelu", pad_token_id=tokenizer.pad_token_id,
                      bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                      tie_word_embeddings=False)
    model = LlavaForConditionalGeneration(cfg)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    return model


def sample_batches(rng: random.Random, mix, batch_size: int, tokenizer, n_img: int, k: int = 4) -> list[list[Encoded]]:
    """k batches drawn from the mixture, grouped by length (less padding: ~40% fewer tokens)."""
    names = [(s, v) for s, v, _ in mix]
    weights = [w for _, _, w in mix]
    rows = []
    for _ in range(batch_size * k):
        sc, view = rng.choices(names, weights)[0]
        ex = make_example(sc, rng.randrange(2**31))
        rows.append(encode(tokenizer, ex, view, n_img, with_answer=True))
    rows.sort(key=lambda e: len(e.ids))
    batches = [rows[i * batch_size:(i + 1) * batch_size] for i in range(k)]
    rng.shuffle(batches)
    return batches


def loss_of(model, image_processor, batch: list[Encoded], pad_id: int) -> torch.Tensor:
    logits = logits_of(model, image_processor, batch, pad_id)
    S = logits.shape[1]
    labels = torch.full((len(batch), S), -100, dtype=torch.long)
    for i, e in enumerate(batch):  # predict the answer tokens (and </s>) only
        labels[i, e.n_prompt - 1: len(e.ids) - 1] = torch.tensor(e.ids[e.n_prompt:])
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.to(logits.device).reshape(-1),
                           ignore_index=-100)


def train_one(kind: str, steps: int, processor, device: str, seed: int, batch_size: int, lr: float,
              log=print, vision_lr_mult: float = 1.0, mix=None, arch: str | None = None,
              read_steps: int | None = None) -> tuple:
    """Train one model from scratch. The first `read_steps` steps (default 20%) train only
    the grid read-out: with the full mixture from the start the LM settles on text
    priors and never reads the image (0% grid accuracy after 1500 steps at lr 1e-3,
    measured), while on the read-out alone it learns to read within ~200 steps."""
    torch.manual_seed(seed)
    tok, ip = processor.tokenizer, processor.image_processor
    model = build_model(arch or kind, tok).to(device)
    n_img = n_image_tokens(model)
    mix = mix or (TARGET_MIX if kind == "target" else DRAFT_MIX)
    rng = random.Random(seed)
    vis = [p for n, p in model.named_parameters() if "vision_tower" in n or "multi_modal_projector" in n]
    ids = {id(p) for p in vis}
    rest = [p for p in model.parameters() if id(p) not in ids]
    opt = torch.optim.AdamW([{"params": rest}, {"params": vis, "lr": lr * vision_lr_mult}], lr=lr,
                            betas=(0.9, 0.98), weight_decay=0.01)
    warm = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, s / steps)))))
    t0, ema, history = time.time(), None, []
    model.train()
    read_steps = steps * 20 // 100 if read_steps is None else read_steps
    queue = []
    for step in range(steps):
        if step == read_steps:
            queue = []
        if not queue:
            queue = sample_batches(rng, READ_MIX if step < read_steps else mix, batch_size, tok, n_img)
        batch = queue.pop()
        loss = loss_of(model, ip, batch, tok.pad_token_id)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
        if (step + 1) % 50 == 0 or step == steps - 1:
            history.append((step + 1, round(ema, 4)))
            log(f"[{kind}] step {step + 1}/{steps} loss {ema:.4f} ({time.time() - t0:.0f}s)")
    model.eval()
    return model, ema, time.time() - t0, history


def evaluate(out: str, eval_n: int = 50, device: str = "cpu") -> dict:
    """Evaluate the saved (fp16) pair in `out` on held-out seeds: answer accuracy and the
    acceptance proxy; adds them to out/training.json and (re)writes out/TRAINING.md."""
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    with open(os.path.join(out, "training.json")) as f:
        info = json.load(f)
    processor = AutoProcessor.from_pretrained(os.path.join(out, "target"))
    models = {k: LlavaForConditionalGeneration.from_pretrained(os.path.join(out, k), dtype=torch.float32)
              .to(device).eval() for k in ("target", "draft")}
    tok, ip = processor.tokenizer, processor.image_processor
    # held-out seeds: training draws example seeds from a Random stream, evaluation uses 10_007
    by_sc = {s: examples(s, eval_n, seed=10_007) for s in SCENARIOS}
    acc = {k: {s: answer_accuracy(m, tok, ip, e) for s, e in by_sc.items()} for k, m in models.items()}
    res = measure(models["target"], models["draft"], tok, ip, by_sc)
    info.update(answer_accuracy=acc, proxy=res, eval_prompts_per_scenario=eval_n)
    with open(os.path.join(out, "training.json"), "w") as f:
        json.dump(info, f, indent=1)
    md = [
        "# Demo models of the procedural world", "",
        f"Trained by `{info['command']}` ({info['device']}, torch {info['torch']}, transformers "
        f"{info['transformers']}) in {info['wall_time_s'] / 60:.1f} min wall time"
        + (f" ({info['note']})." if info.get("note") else "."), "",
        f"* target: {info['params']['target'] / 1e6:.2f} M params, {info['target_steps']} steps, "
        f"final loss {info['final_loss']['target']:.4f}",
        f"* draft: {info['params']['draft'] / 1e6:.2f} M params, {info['draft_steps']} steps, "
        f"final loss {info['final_loss']['draft']:.4f}",
        f"* seeds: target {info['seed']}, draft {info['seed'] + 1}; batch {info['batch_size']}; AdamW; "
        "loss on answer tokens",
        "", "Answer exact-match accuracy (greedy, M prompt; evaluated from the saved fp16 weights):", "",
        "| model | " + " | ".join(SCENARIOS) + " |", "|---|" + "---|" * len(SCENARIOS),
        *[f"| {k} | " + " | ".join(f"{100 * acc[k][s]:.0f}%" for s in SCENARIOS) + " |" for k in acc],
        "", f"Proxy ({eval_n} prompts per scenario, target greedy continuation up to 24 tokens, "
        "teacher-forced): draft argmax = target token rate:", "", format_table(res, "match"),
        "", "Block efficiency of a greedy chain with gamma = 5 (tokens per target forward):", "",
        format_table(res, "block_eff"), "",
        f"Sample (`sample.png`): prompt `{info['sample']['prompt']!r}`, caption `{info['sample']['caption']}`.", "",
    ]
    with open(os.path.join(out, "TRAINING.md"), "w") as f:
        f.write("\n".join(md))
    print("\n".join(md))
    return info


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--steps", type=int, default=6000, help="target training steps")
    ap.add_argument("--draft-steps", type=int, default=8000, help="draft training steps")
    ap.add_argument("--lr", type=float, default=1e-3, help="peak AdamW learning rate (3e-3 never learns to read images)")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval-n", type=int, default=50, help="prompts per scenario for the proxy")
    ap.add_argument("--skip-eval", action="store_true", help="train and save only (evaluate later with --eval-only)")
    ap.add_argument("--eval-only", action="store_true", help="evaluate the pair already saved in --out")
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.eval_only:
        evaluate(args.out, args.eval_n, args.device)
        return
    if args.device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    draft_steps = args.draft_steps
    t_all = time.time()
    processor = build_processor()
    target, t_loss, t_time, t_hist = train_one("target", args.steps, processor, args.device, args.seed,
                                               args.batch_size, args.lr)
    draft, d_loss, d_time, d_hist = train_one("draft", draft_steps, processor, args.device, args.seed + 1,
                                              args.batch_size, args.lr)
    os.makedirs(args.out, exist_ok=True)
    for name, m in (("target", target), ("draft", draft)):
        d = os.path.join(args.out, name)
        m.to(torch.float16).save_pretrained(d, safe_serialization=True)
        processor.save_pretrained(d)
    sample = make_example("S1", 7)
    render(sample.scenes[0]).save(os.path.join(args.out, "sample.png"))
    dev_name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    info = {
        "command": "python -m benchmarks.world.train " + " ".join(argv if argv is not None else sys.argv[1:]),
        "seed": args.seed, "target_steps": args.steps, "draft_steps": draft_steps, "batch_size": args.batch_size,
        "device": dev_name, "torch": torch.__version__, "transformers": __import__("transformers").__version__,
        "host": platform.platform(), "threads": torch.get_num_threads(),
        "wall_time_s": round(time.time() - t_all, 1), "train_time_s": {"target": round(t_time, 1), "draft": round(d_time, 1)},
        "final_loss": {"target": round(t_loss, 4), "draft": round(d_loss, 4)},
        "loss_history": {"target": t_hist, "draft": d_hist},
        "params": {"target": sum(p.numel() for p in target.parameters()),
                   "draft": sum(p.numel() for p in draft.parameters())},
        "sample": {"prompt": sample.prompt, "answer": sample.answer, "caption": sample.captions[0]},
    }
    with open(os.path.join(args.out, "training.json"), "w") as f:
        json.dump(info, f, indent=1)
    print(f"saved {args.out} ({info['wall_time_s'] / 60:.1f} min)", flush=True)
    if not args.skip_eval:
        evaluate(args.out, args.eval_n, args.device)


if __name__ == "__main__":
    main()
