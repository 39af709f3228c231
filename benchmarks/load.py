"""Checkpoint loading against transformers, side by side in one process.

    python benchmarks/load.py --out benchmarks/results/load_h200.json      # H200: ~3 min
    python benchmarks/load.py --smoke --device cpu --out /tmp/load_smoke.json   # CPU, < 1 min

Builds, with random weights and no download, a LLaVA-1.5-7B-shaped target (CLIP ViT-L/14-336
tower, Llama-2-7B text config, vocab 32064, image token 32000) written by transformers'
`save_pretrained` into 3 safetensors shards, and a LLaVA-68M-shaped draft (Llama 2 x 768, the
same tower with the target's tower weights, as the real pair shares them), plus a word-level
tokenizer with Llama-2's special ids and a CLIP-336 LLaVA processor. The weights are drawn on
the device (modules built on meta, `to_empty`, `normal_`) so building costs what writing costs.

Then, page cache warm (every file read once before timing), `--reps` times in turn, each time
synchronized wall clock with the previous model freed:
  (a) hf_from_pretrained: `LlavaForConditionalGeneration.from_pretrained(target, dtype, device_map)`
  (b) load_lvlm_target:   our `load_lvlm(target)`  (goal: <= (a))
  (c) engine_from_pretrained: `Engine.from_pretrained(target, draft)` (processor included)
  (d) ttft_first_generate: the first `generate` after (c): one 336x336 image + 8 words,
      max_new_tokens=1 (rep 0 also pays torch.compile / Triton JIT: reported per rep).
Medians and every rep go to the JSON, with GB/s = checkpoint bytes / time, and two ceilings
measured in the same run: page-cache read bandwidth (one thread, 64 MiB reads of the target's
shards) and pinned host-to-device copy bandwidth (1 GiB).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from _common import provenance  # noqa: E402

CLIP_L_336 = dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
                  image_size=336, patch_size=14, projection_dim=768)
LLAMA2_7B = dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=32, vocab_size=32064, max_position_embeddings=4096, rms_norm_eps=1e-5)
LLAMA_68M = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=2, num_attention_heads=12,
                 num_key_value_heads=12, vocab_size=32064, max_position_embeddings=2048, rms_norm_eps=1e-6)
SHAPES = {  # name: (vision, target text, draft text, image token)
    "llava-1.5-7b": (CLIP_L_336, LLAMA2_7B, LLAMA_68M, 32000),
    "smoke": (dict(hidden_size=32, intermediate_size=67, num_hidden_layers=2, num_attention_heads=4,
                   image_size=28, patch_size=14, projection_dim=16),
              dict(hidden_size=64, intermediate_size=171, num_hidden_layers=3, num_attention_heads=4,
                   num_key_value_heads=2, vocab_size=128, max_position_embeddings=512),
              dict(hidden_size=32, intermediate_size=83, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=4, vocab_size=128, max_position_embeddings=512), 100),
}


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device):
    sync(device)
    t = time.perf_counter()
    out = fn()
    sync(device)
    return out, time.perf_counter() - t


def free(device):
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


# ------------------------------------------------------------------ building the checkpoints

def build_tokenizer(vocab_size: int, image_token: int):
    """Word-level tokenizer with Llama-2's ids: <unk> 0, <s> 1, </s> 2, "\\n" 13 (one token),
    <image> = image_token, <pad> = image_token + 1, words `w{i}` elsewhere."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from tabed_engine.models.tiny import CHAT_TEMPLATE

    fixed = {0: "<unk>", 1: "<s>", 2: "</s>", 13: "\n", image_token: "<image>", image_token + 1: "<pad>",
             3: "user:", 4: "assistant:", 5: "image:"}
    vocab = {fixed.get(i, f"w{i}"): i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_tokens([AddedToken("\n", normalized=False)])
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>", pad_token="<pad>")
    fast.add_special_tokens({"additional_special_tokens": ["<image>"]})
    fast.chat_template = CHAT_TEMPLATE
    assert fast.convert_tokens_to_ids("<image>") == image_token
    return fast


def random_llava(vision: dict, text: dict, image_token: int, device, dtype, seed: int):
    """A LlavaForConditionalGeneration with N(0, 0.02) weights drawn on `device`."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    tc = LlamaConfig(**text, bos_token_id=1, eos_token_id=2, pad_token_id=image_token + 1,
                     tie_word_embeddings=False)
    grid = (vision["image_size"] // vision["patch_size"]) ** 2
    cfg = LlavaConfig(vision_config=CLIPVisionConfig(**vision), text_config=tc, image_token_index=image_token,
                      vision_feature_layer=-2, vision_feature_select_strategy="default",
                      image_seq_length=grid, tie_word_embeddings=False)
    with torch.device("meta"):
        model = LlavaForConditionalGeneration(cfg)
    model = model.to(dtype).to_empty(device=device)
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for _, p in model.named_parameters():
            p.normal_(0.0, 0.02, generator=g)
    return model.eval()


def tower_params(model):
    return {k: p for k, p in model.named_parameters() if "vision_tower" in k}


def save_sharded(model, out_dir: str, shards: int):
    """save_pretrained into `shards` safetensors files (max_shard_size from the weight bytes)."""
    sizes = [p.numel() * p.element_size() for p in model.parameters()]
    model.save_pretrained(out_dir, max_shard_size=-(-sum(sizes) // shards) + max(sizes))


def build_checkpoints(root: str, shape: str, device, dtype):
    from tabed_engine.models.tiny import build_processor

    vision, text, draft_text, image_token = SHAPES[shape]
    target_dir, draft_dir = os.path.join(root, "target"), os.path.join(root, "draft")
    target = random_llava(vision, text, image_token, device, dtype, seed=0)
    save_sharded(target, target_dir, 3)
    draft = random_llava(vision, draft_text, image_token, device, dtype, seed=1)
    with torch.no_grad():   # the draft shares the target's tower weights (as the published pair)
        src = tower_params(target)
        for k, p in tower_params(draft).items():
            p.copy_(src[k])
    del target
    free(device)
    save_sharded(draft, draft_dir, 1)
    del draft
    free(device)
    tok = build_tokenizer(text["vocab_size"], image_token)
    build_processor(tok, vision["image_size"], vision["patch_size"], "default").save_pretrained(target_dir)
    return target_dir, draft_dir


def weight_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".safetensors"))


# ------------------------------------------------------------------ ceilings

def read_files_gbs(path: str) -> float:
    """One thread reading the checkpoint's safetensors files in 64 MiB pieces, GB/s."""
    buf = bytearray(64 << 20)
    total, t = 0, time.perf_counter()
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            with open(os.path.join(path, f), "rb", buffering=0) as fh:
                while n := fh.readinto(buf):
                    total += n
    return total / (time.perf_counter() - t) / 1e9


def h2d_pinned_gbs(device, nbytes: int = 1 << 30) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst.copy_(src, non_blocking=True)
    times = []
    for _ in range(5):
        _, s = timed(lambda: dst.copy_(src, non_blocking=True), device)
        times.append(s)
    del src, dst
    return nbytes / statistics.median(times) / 1e9


# ------------------------------------------------------------------ the measurements

HF_MODE = {}


def hf_load(path, device, dtype):
    """transformers' load, with device_map=device (CPU: no device_map; without accelerate,
    which older transformers need for device_map: load, then .to(device); HF_MODE says which)."""
    import transformers
    from packaging.version import Version
    from transformers import LlavaForConditionalGeneration

    kw = {"dtype" if Version(transformers.__version__) >= Version("4.56") else "torch_dtype": dtype}
    if device.type == "cpu":
        HF_MODE["mode"] = "from_pretrained (cpu, no device_map)"
        return LlavaForConditionalGeneration.from_pretrained(path, **kw)
    if HF_MODE.get("mode", "").startswith("device_map") or not HF_MODE:
        try:
            m = LlavaForConditionalGeneration.from_pretrained(path, device_map=device.type, **kw)
            HF_MODE["mode"] = f"device_map={device.type!r}"
            return m
        except ValueError as e:
            if "accelerate" not in str(e):
                raise
    HF_MODE["mode"] = "from_pretrained then .to(device) (no accelerate for device_map)"
    return LlavaForConditionalGeneration.from_pretrained(path, **kw).to(device)


def run(args):
    from tabed_engine import Engine, SamplingParams
    from tabed_engine.models.loader import load_lvlm
    from tabed_engine.models.tiny import random_image

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shape = "smoke" if args.smoke else "llava-1.5-7b"
    root = args.workdir or tempfile.mkdtemp(prefix="tabed_load_bench_")
    target_dir, draft_dir = os.path.join(root, "target"), os.path.join(root, "draft")
    t0 = time.perf_counter()
    try:
        if os.path.isfile(os.path.join(draft_dir, "config.json")) and \
                os.path.isfile(os.path.join(target_dir, "preprocessor_config.json")):
            log(f"reusing the checkpoints in {root}")
            build_s = None
        else:
            log(f"building {shape} checkpoints in {root} ...")
            build_checkpoints(root, shape, device, dtype)
            build_s = time.perf_counter() - t0
            log(f"  built in {build_s:.1f} s")
        size, draft_size = weight_bytes(target_dir), weight_bytes(draft_dir)
        shards = sorted(f for f in os.listdir(target_dir) if f.endswith(".safetensors"))
        read_files_gbs(target_dir), read_files_gbs(draft_dir)        # warm the page cache
        ceilings = {"page_cache_read_gbs_1thread": read_files_gbs(target_dir)}
        if device.type == "cuda":
            ceilings["h2d_pinned_gbs"] = h2d_pinned_gbs(device)
        log(f"target {size / 1e9:.2f} GB in {len(shards)} shards, draft {draft_size / 1e9:.2f} GB; "
            f"ceilings {ceilings}")
        image = random_image(0, SHAPES[shape][0]["image_size"])
        prompt = "<image>\n w41 w42 w43 w44 w45 w46 w47 w48"
        rows = {k: [] for k in ("hf_from_pretrained", "load_lvlm_target", "engine_from_pretrained",
                                "ttft_first_generate")}
        for rep in range(args.reps):
            m, s = timed(lambda: hf_load(target_dir, device, dtype), device)
            rows["hf_from_pretrained"].append(s)
            del m
            free(device)
            m, s = timed(lambda: load_lvlm(target_dir, device, dtype), device)
            rows["load_lvlm_target"].append(s)
            del m
            free(device)
            eng, s = timed(lambda: Engine.from_pretrained(target_dir, draft_dir, device=device, dtype=dtype),
                           device)
            rows["engine_from_pretrained"].append(s)
            out, s = timed(lambda: eng.generate(prompt, images=[image],
                                                sampling=SamplingParams(max_new_tokens=1)), device)
            rows["ttft_first_generate"].append(s)
            assert len(out.token_ids) == 1
            del eng, out
            free(device)
            log(f"  rep {rep}: " + ", ".join(f"{k} {v[-1]:.3f} s" for k, v in rows.items()))
    finally:
        if not args.keep and not args.workdir:
            shutil.rmtree(root, ignore_errors=True)
    bytes_of = {"hf_from_pretrained": size, "load_lvlm_target": size, "engine_from_pretrained": size + draft_size}
    results = {}
    for k, v in rows.items():
        med = statistics.median(v)
        results[k] = {"median_s": med, "reps_s": v}
        if k in bytes_of:
            results[k]["gbs"] = bytes_of[k] / med / 1e9
    import safetensors

    out = {
        "benchmark": "checkpoint loading (benchmarks/load.py)",
        "provenance": {**provenance(device), "safetensors": safetensors.__version__},
        "shape": shape, "dtype": str(dtype), "reps": args.reps, "build_s": build_s,
        "hf_load_mode": HF_MODE.get("mode"),
        "checkpoint": {"target_gb": size / 1e9, "target_shards": len(shards), "draft_gb": draft_size / 1e9,
                       "dir": root if (args.keep or args.workdir) else None},
        "ceilings": ceilings,
        "results": results,
        "goal_load_lvlm_le_hf": results["load_lvlm_target"]["median_s"] <= results["hf_from_pretrained"]["median_s"],
        "notes": "page cache warm; wall clock with device syncs; rep 0 of ttft_first_generate "
                 "includes torch.compile/Triton JIT; gbs = checkpoint bytes / median time",
    }
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="JSON file to write")
    p.add_argument("--smoke", action="store_true", help="tiny shapes (CPU check)")
    p.add_argument("--device", default=None, help="cuda (default when present) or cpu")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--workdir", default=None, help="build into / reuse checkpoints in this directory (kept)")
    p.add_argument("--keep", action="store_true", help="keep the temporary checkpoints")
    args = p.parse_args(argv)
    if args.reps < 1:
        p.error("--reps must be >= 1")
    out = run(args)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    r = out["results"]
    print(f"{out['provenance']['device']}: target {out['checkpoint']['target_gb']:.2f} GB "
          f"({out['checkpoint']['target_shards']} shards), median of {out['reps']}")
    for k, v in r.items():
        gbs = f"  {v['gbs']:.2f} GB/s" if "gbs" in v else ""
        print(f"  {k:24s} {v['median_s']:8.3f} s{gbs}   reps {', '.join(f'{x:.3f}' for x in v['reps_s'])}")
    print(f"  load_lvlm <= transformers: {out['goal_load_lvlm_le_hf']}; wrote {args.out}")


if __name__ == "__main__":
    main()
