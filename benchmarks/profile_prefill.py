"""Where the target's prefill time goes: the LLaVA-1.5-7B-shaped language model on a
616-token prompt (one 336x336 image + 40 text tokens) and a 1,800-token one, timed with CUDA
events and run under torch.profiler; CUDA kernel time grouped by kernel name and by kind
(GEMM, attention, SwiGLU, norms, RoPE + KV write, other), against the FLOP floor (2 x
parameters x tokens at the bf16 dense rate measured in the same run). Each length runs
eagerly and as the engine runs it (`runner.prefill_step` padded to its bucket, one captured
CUDA graph), and each of the two also at the other's row count.

    python benchmarks/profile_prefill.py [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from collections import defaultdict

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import event_ms, provenance  # noqa: E402

from tabed_engine.models.config import LMConfig  # noqa: E402
from tabed_engine.engine.graphs import GraphCache  # noqa: E402
from tabed_engine.models.decoder import KVCache, LlamaLM  # noqa: E402
from tabed_engine.engine.prefill import prefill_bucket, prefill_step  # noqa: E402

LLAMA2_7B = LMConfig(vocab_size=32064, hidden_size=4096, intermediate_size=11008, num_layers=32, num_heads=32,
                     num_kv_heads=32, head_dim=128, rms_norm_eps=1e-5, max_position_embeddings=4096)


def dense_tflops(n: int = 8192, reps: int = 20) -> float:
    """Measured bf16 GEMM rate (TFLOP/s) of an n x n x n matmul."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(reps):
        a @ b
    e.record()
    torch.cuda.synchronize()
    return 2 * n ** 3 * reps / (s.elapsed_time(e) * 1e-3) / 1e12


KINDS = (("gemm", ("nvjet", "gemm", "cutlass", "sm90_xmma", "_gemv")), ("attention", ("flash", "fmha", "attention", "sdpa")),
         ("swiglu", ("silu",)), ("norm", ("rms_norm", "norm", "rsqrt")), ("rope_kv", ("rope",)))


def kind_of(name: str) -> str:
    low = name.lower()
    return next((k for k, keys in KINDS if any(key in low for key in keys)), "other")


def kernels(fn) -> dict:
    """CUDA kernel ms of one call of fn by kernel name."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as p:
        fn()
        torch.cuda.synchronize()
    by_name = defaultdict(float)
    for ev in p.key_averages():
        t = getattr(ev, "device_time_total", 0) or getattr(ev, "cuda_time_total", 0)
        if t:
            by_name[ev.key] += t / 1e3
    return dict(by_name)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--tokens", type=int, nargs="+", default=[616, 1800])
    args = ap.parse_args()
    torch.manual_seed(0)
    with torch.device("meta"):
        lm = LlamaLM(LLAMA2_7B)
    lm = lm.to(torch.bfloat16).to_empty(device="cuda")
    with torch.no_grad():
        for p in lm.parameters():
            p.normal_(0, 0.02)
    lm.eval().requires_grad_(False)
    params = sum(p.numel() for p in lm.parameters()) - lm.embed_tokens.weight.numel()
    cache = KVCache(LLAMA2_7B, 1, 2048, "cuda", torch.bfloat16)
    rate = dense_tflops()
    out = {"provenance": provenance("cuda"), "bf16_gemm_tflops": rate, "non_embedding_params": params, "runs": {}}
    graphs = GraphCache()
    for n in args.tokens:
        P = prefill_bucket(n, cache.max_len, limit=cache.max_len)
        ids = torch.randint(0, 32000, (1, P), device="cuda")
        floor = 2 * params * n / (rate * 1e12) * 1e3
        run = {"flop_floor_ms": floor, "bucket": P}
        # eager and graph, each at the prompt's own length and padded to its graph bucket
        # (the engine runs "graph" at the bucket: padding changes the GEMM shapes cuBLAS picks for)
        for name, L in (("eager", n), ("eager_bucket", P), ("graph", P), ("graph_exact", n)):
            if name.endswith("bucket") and P == n:
                continue
            pos = torch.arange(L, device="cuda")[None]
            last = torch.tensor([[n - 1]], device="cuda")
            if name.startswith("eager"):
                def fn(ids=ids[:, :L], pos=pos, last=last, L=L):
                    cache.lengths.zero_()
                    with torch.inference_mode():
                        return lm(cache, pos, input_ids=ids, logits_index=last, kv_len=L, fresh=True)
            else:
                with torch.inference_mode():
                    x = lm.embed_tokens(ids[:, :L])
                slot = torch.zeros(1, device="cuda", dtype=torch.long)

                def fn(x=x, slot=slot, last=last, L=L):
                    with torch.inference_mode():
                        return graphs.run(("prefill", L), lambda x, slot, last: prefill_step(lm, cache, x, slot, last),
                                          {"x": x, "slot": slot, "last": last})
            ms = event_ms(fn, 10)
            by_name = kernels(fn)
            by_kind = defaultdict(float)
            for k, v in by_name.items():
                by_kind[kind_of(k)] += v
            top = sorted(by_name.items(), key=lambda kv: -kv[1])[:20]
            run[name] = {"tokens": L, "ms": ms, "ratio_to_floor": ms / floor, "kernel_ms_sum": sum(by_name.values()),
                         "by_kind_ms": dict(sorted(by_kind.items(), key=lambda kv: -kv[1])), "kernels_ms": dict(top)}
            print(f"prefill {n} tokens, {name} ({L} rows): {ms:.2f} ms, floor {floor:.2f} ms ({ms / floor:.2f}x) "
                  f"at {rate:.0f} TFLOP/s; kernels {sum(by_name.values()):.2f} ms: "
                  + ", ".join(f"{k} {v:.2f}" for k, v in run[name]["by_kind_ms"].items()))
            for k, v in top[:6]:
                print(f"   {v:8.3f} ms  {k[:110]}")
        out["runs"][str(n)] = run
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "profile_prefill.json"), "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
