"""Shared pieces of the end-to-end benchmarks (`e2e.py`: the LLaVA-1.5-7B shape against the
bandwidth floor; `e2e_next.py`: the same at the LLaVA-NeXT llava-v1.6-vicuna-7b shape;
`e2e_demo.py`: the bundled pair with real acceptance): random LLaVA and LLaVA-NeXT models
built on the device, the target's weight bytes, the run skeleton that saves JSON and markdown
after every section, and the common command-line options."""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from _common import provenance, wall_ms  # noqa: E402

def log(msg: str):
    print(f"[e2e {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---------------------------------------------------------------------------- models
@contextlib.contextmanager
def default_dtype(dtype):
    """Modules created inside get `dtype` parameters directly (no float32 copy first: a
    float32 7B would be 27 GB on top of the bf16 one)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def llava_config(vision: dict, text: dict, image_token_id: int, pinpoints=None):
    """(config, model class) of a `LlavaForConditionalGeneration` (or, with `pinpoints`, the
    `image_grid_pinpoints` of an any-resolution model, a `LlavaNextForConditionalGeneration`
    with its `image_newline`) with a Llama text config `text`: vision feature layer -2, strategy
    "default", as LLaVA-1.5 and LLaVA-NeXT publish them; `architectures` set (what
    `lvlm_from_config` reads)."""
    from transformers import (CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration,
                              LlavaNextConfig, LlavaNextForConditionalGeneration)

    tc = LlamaConfig(**text, bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    grid = (vision["image_size"] // vision["patch_size"]) ** 2
    common = dict(vision_config=CLIPVisionConfig(**vision), text_config=tc, image_token_index=image_token_id,
                  vision_feature_layer=-2, vision_feature_select_strategy="default",
                  image_seq_length=grid, tie_word_embeddings=False)
    if pinpoints is None:
        cfg, cls = LlavaConfig(**common), LlavaForConditionalGeneration
    else:
        cfg = LlavaNextConfig(image_grid_pinpoints=[list(p) for p in pinpoints], **common)
        cls = LlavaNextForConditionalGeneration
    cfg.architectures = [cls.__name__]
    return cfg, cls


def build_hf_llava(vision: dict, text: dict, device, dtype, std: float, seed: int, image_token_id: int,
                   pinpoints=None):
    """A random `llava_config` model built directly on `device` in `dtype`: matrices ~ N(0, std),
    norm weights 1, other vectors ~ N(0, std) (never zeros)."""
    cfg, cls = llava_config(vision, text, image_token_id, pinpoints)
    with default_dtype(dtype), torch.device(device):
        model = cls(cfg)
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and "norm" in name and name.endswith("weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, std, generator=g)
    model.eval()
    model.generation_config.eos_token_id = None   # never stop early: every run makes exactly n tokens
    model.generation_config.pad_token_id = 0
    return model


def random_fill(std: float, seed: int, device):
    """fill(module) for random benchmark weights: the weights of norm modules (any class whose
    name holds "norm") 1, every other parameter ~ N(0, std), from one seeded generator."""
    g = torch.Generator(device=device).manual_seed(seed)

    @torch.no_grad()
    def fill(module):
        ones = {id(m.weight) for m in module.modules()
                if "norm" in type(m).__name__.lower() and isinstance(getattr(m, "weight", None), torch.Tensor)}
        for p in module.parameters():
            if id(p) in ones:
                p.fill_(1.0)
            else:
                p.normal_(0.0, std, generator=g)
    return fill


def build_hf_random(cls, config, device, dtype, std: float, seed: int):
    """A transformers model `cls(config)` built directly on `device` in `dtype` with
    `random_fill` weights, in eval mode, never stopping at EOS (every run makes exactly the
    tokens asked for)."""
    with default_dtype(dtype), torch.device(device):
        model = cls(config)
    random_fill(std, seed, device)(model)
    model.eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def build_lvlm(vision: dict, text: dict, device, dtype):
    """The engine's LVLM with random weights built on the device (std 0.02, seed 0; the
    transformers model it is loaded from is freed)."""
    from tabed_engine.models.loader import lvlm_from_hf

    hf = build_hf_llava(vision, text, device, dtype, 0.02, 0, 4)
    lvlm = lvlm_from_hf(hf)
    del hf
    torch.cuda.empty_cache()
    return lvlm


def build_llava_pair(p, device, dtype):
    """A LLaVA preset's processor (`tiny.build_processor`), its image token id, and its target and
    draft as the engine's LVLMs with random weights (seeds 0 and 1), the draft given the
    target's vision tower (a shared tower, as the published 68M draft has)."""
    import gc

    from tabed_engine.models.loader import lvlm_from_hf
    from tabed_engine.models.tiny import build_processor

    processor = build_processor(p.target["vocab_size"], p.vision["image_size"], p.vision["patch_size"], "default")
    image_token = processor.tokenizer.convert_tokens_to_ids("<image>")
    hf_t = build_hf_llava(p.vision, p.target, device, dtype, p.init_std, 0, image_token)
    hf_d = build_hf_llava(p.vision, p.draft, device, dtype, p.init_std, 1, image_token)
    with torch.no_grad():
        hf_d.model.vision_tower.load_state_dict(hf_t.model.vision_tower.state_dict())
    with default_dtype(dtype):
        target, draft = lvlm_from_hf(hf_t, device, dtype), lvlm_from_hf(hf_d, device, dtype)
    del hf_t, hf_d
    gc.collect()
    return processor, image_token, target, draft


def lm_weight_bytes(lvlm) -> int:
    """Bytes the target LM reads per decode step: all LM weights except the embedding table."""
    lm = lvlm.lm
    emb = lm.embed_tokens.weight
    seen = {emb.data_ptr()}
    total = 0
    for p in lm.parameters():
        if p.data_ptr() in seen:
            continue
        seen.add(p.data_ptr())
        total += p.numel() * p.element_size()
    return total


def check_limit(value, limit, le: bool = True) -> dict:
    """A target's verdict: pass None when the value or the limit is missing."""
    ok = None if value is None or limit is None else (value <= limit if le else value >= limit)
    return {"value": value, "limit": limit, "pass": ok}


def fmt(x, spec=".3f") -> str:
    return format(x, spec) if isinstance(x, (int, float)) else ("—" if x is None else str(x))


def header_lines(R: dict) -> list[str]:
    """Markdown title and provenance lines of a result."""
    pv = R["provenance"]
    return [f"## e2e {R['preset']} — {pv['device']}",
            f"torch {pv['torch']}, triton {pv['triton']}, transformers {pv['transformers']}, "
            f"CUDA {pv['cuda']}, {pv['date_utc']}, commit {pv['git']['commit'][:10]}"
            f"{' (dirty)' if pv['git'].get('dirty') else ''}",
            f"`{pv['command']}`", ""]


# ---------------------------------------------------------------------------- run
class E2EBench:
    """One end-to-end run: sections measured in order after `setup`, each saved as it ends.
    Subclasses give `setup`, `stages`, `targets` and `markdown`."""

    def __init__(self, args, preset, method: dict):
        self.args, self.p = args, preset
        self.device = torch.device(args.device)
        self.cuda = self.device.type == "cuda"
        self.dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
        self.result: dict = {"provenance": provenance(self.device), "preset": args.preset,
                             "method": method}
        self.json_path = os.path.join(args.out, f"e2e_{args.preset}.json")
        self.md_path = os.path.join(args.out, f"e2e_{args.preset}.md")

    def save(self):
        """JSON and markdown after every section: a run cut short keeps what it measured."""
        os.makedirs(self.args.out, exist_ok=True)
        self.result["targets"] = self.targets()
        with open(self.json_path, "w") as f:
            json.dump(self.result, f, indent=1, default=str)
        with open(self.md_path, "w") as f:
            f.write(self.markdown())

    def section(self, name: str, fn):
        """Run one section; record (not raise) its failure so the other numbers survive."""
        log(f"{name} ...")
        t = time.perf_counter()
        try:
            self.result[name] = fn()
        except Exception as e:  # a failing section is a result too
            traceback.print_exc()
            self.result[name] = {"error": f"{type(e).__name__}: {e}"[:2000]}
        log(f"{name} done in {time.perf_counter() - t:.1f}s")
        self.save()      # after every stage: a run cut short keeps what it measured

    def measured(self, name: str) -> dict:
        """A section's result, or {} when it failed or did not run (the markdown skips it)."""
        v = self.result.get(name)
        return v if isinstance(v, dict) and "error" not in v else {}

    def number(self, *path):
        """The number at result[path[0]][path[1]]..., or None where the path is missing."""
        x = self.result
        for k in path:
            if not isinstance(x, dict) or k not in x:
                return None
            x = x[k]
        return x if isinstance(x, (int, float)) else None

    def run(self):
        t0 = time.perf_counter()
        log(f"preset {self.args.preset} on {self.result['provenance']['device']}")
        self.section("setup", self.setup)
        if "error" in self.result["setup"]:
            raise SystemExit(f"setup failed: {self.result['setup']['error']}")
        for name, fn in self.stages():
            self.section(name, fn)
        self.result["total_s"] = time.perf_counter() - t0
        self.save()
        print(self.markdown(), flush=True)
        log(f"wrote {self.json_path} and {self.md_path} in {self.result['total_s']:.0f}s")


# ---------------------------------------------------------------------------- command line
def add_common_args(ap: argparse.ArgumentParser):
    """Options every end-to-end benchmark takes."""
    ap.add_argument("--out", default=os.path.join("benchmarks", "results"))
    ap.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    ap.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default=None,
                    help="default: bf16 on CUDA, fp32 on the CPU")
    ap.add_argument("--skip-hf", action="store_true", help="omit the transformers baselines")
    ap.add_argument("--repeats", type=int, default=None, help="timed runs per measurement (default: preset's)")


def resolve_device(args):
    """Fill in the device and dtype defaults."""
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    args.dtype = args.dtype or ("bf16" if args.device.startswith("cuda") else "fp32")
    return args


def ttft_runs(gen, repeats: int, device, name: str) -> dict:
    """Time to first token of `gen()` (an `Engine.generate(..., max_new_tokens=1)` call): one
    warm-up (prefill graphs, compilation), then `repeats` synchronized wall-clock runs; the
    medians of the wall time and of the engine's own first-token and prefill times."""
    gen()
    walls, stats = [], []
    for _ in range(repeats):
        o, ms = wall_ms(gen, device)
        if len(o.token_ids) != 1:
            raise RuntimeError(f"{name}: {len(o.token_ids)} tokens, expected 1")
        walls.append(ms)
        stats.append(o.stats)
    out = {"ttft_ms": statistics.median(walls), "ttft_runs_ms": walls,
           "time_first_token_ms": statistics.median(s.time_first_token * 1e3 for s in stats),
           "time_prefill_ms": statistics.median(s.time_prefill * 1e3 for s in stats),
           "speculative": bool(stats[0].speculative)}
    log(f"  {name}: TTFT {out['ttft_ms']:.1f} ms")
    return out
