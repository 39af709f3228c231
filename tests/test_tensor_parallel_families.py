"""Tensor parallelism (gloo, 2 processes) for the Qwen2-based families the large checkpoints use:
Qwen2.5-VL (M-RoPE in prefill, decode, drafting and verification; the 72B), LLaVA-OneVision
(q/k/v bias, anyres-max-9 images and a video; the 72B) and LLaVA-NeXT on a Qwen1.5 LM (as many
KV heads as query heads; llava-next-72b / -110b). Greedy AR and SD must give transformers'
tokens in float32 with the target and the draft sharded over both ranks.
"""
import pytest
import torch

from tabed_engine import Engine, SamplingParams
from tabed_engine.models.tiny import random_image

pytestmark = pytest.mark.one_worker     # each family's engine starts its worker once


def tp_engine(target, draft, **kw):
    return Engine.from_pretrained(target, draft, device="cpu", dtype=torch.float32, tensor_parallel=2,
                                  adaptive=False, **kw)


def test_qwen2_5_vl(tmp_path):
    """Qwen2.5-VL (the 72B's family): M-RoPE ids through the sharded prefill, AR steps and
    chains, images of two grids and text only."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    from tabed_engine.models.tiny_qwen2_5_vl import build_tiny_qwen2_5_vl
    from test_qwen2_5_vl import SP, chat, reference

    target, draft = str(tmp_path / "target"), str(tmp_path / "draft")
    build_tiny_qwen2_5_vl(target)
    build_tiny_qwen2_5_vl(draft, layout="nested", perturb=0.05)
    hf = Qwen2_5_VLForConditionalGeneration.from_pretrained(target, dtype=torch.float32).eval()
    eng = tp_engine(target, draft, views=("M", "T", "P"), gamma=3)
    try:
        for kind in ("two images", "text only"):
            text, images = chat(eng, kind)
            want = reference(hf, eng.processor, text, images)
            assert eng.generate(text, images=images, sampling=SP, speculative=False).token_ids == want, kind
            out = eng.generate(text, images=images, sampling=SP)
            assert out.token_ids == want and sum(out.stats.accepted_lengths) > 0, kind
    finally:
        eng.close()


def test_onevision():
    """LLaVA-OneVision (the 72B's family): several anyres images, a video beside an image."""
    from test_onevision import N_NEW, PROMPTS, checkpoints, images, reference, videos

    eng = tp_engine(*checkpoints(), views=("M", "T"), gamma=4, max_len=1024)
    sp = SamplingParams(max_new_tokens=N_NEW)
    try:
        for name in ("several", "video-image"):
            for speculative in (False, True):
                out = eng.generate(PROMPTS[name][0], images=images(name), videos=videos(name), sampling=sp,
                                   speculative=speculative)
                assert out.token_ids == reference(name), (name, speculative)
            assert sum(out.stats.accepted_lengths) > 0, name
    finally:
        eng.close()


def test_llava_next_on_qwen1_5():
    """The llava-next-72b / -110b shape: a Qwen1.5 LM, 4 query heads and 4 KV heads (2 a rank)."""
    from next_models import checkpoint
    from test_llava_next import generate, reference

    eng = tp_engine(*checkpoint("qwen"), views=("M", "T"), gamma=3)
    try:
        assert eng.target.lm.cfg.num_kv_heads == 2           # this rank's share of the 4
        for prompt_name in ("wide", "chat"):
            assert generate(eng, prompt_name, False).token_ids == reference("qwen", prompt_name)
            out = generate(eng, prompt_name, True)
            assert out.token_ids == reference("qwen", prompt_name) and sum(out.stats.accepted_lengths) > 0
    finally:
        eng.close()


def config_only(src: str, dst) -> str:
    """A copy of checkpoint `src` without its weight files (config, tokenizer, processor)."""
    import shutil

    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors", "*.safetensors.index.json", "*.bin"))
    return str(dst)


def test_random_weights_for_benchmarks(tmp_path):
    """`random_weights=True` (benchmarks of published shapes): no weight file read, the same
    weights on every call, and under tensor parallelism every rank draws the same replicated
    weights (its sharded ones its own), so the ranks agree step by step; greedy SD gives AR's
    tokens in both."""
    from models import model_dir

    target = config_only(model_dir("mha", kv_heads=2), tmp_path / "target")    # vocabulary 173: a padding row
    draft = config_only(model_dir("mha", kv_heads=2, perturb=0.6), tmp_path / "draft")
    with pytest.raises(Exception):
        Engine.from_pretrained(target, device="cpu")                            # no weights: refused
    text, images = "<image>\nwhat is it", [random_image(3)]
    sp = SamplingParams(max_new_tokens=12, stop_at_eos=False)
    one = [Engine.from_pretrained(target, draft, device="cpu", dtype=torch.float32, random_weights=True, gamma=3)
           for _ in range(2)]
    ar = one[0].generate(text, images=images, sampling=sp, speculative=False).token_ids
    assert one[1].generate(text, images=images, sampling=sp, speculative=False).token_ids == ar
    assert one[0].generate(text, images=images, sampling=sp).token_ids == ar
    eng = tp_engine(target, draft, random_weights=True, gamma=3)
    try:
        tp_ar = eng.generate(text, images=images, sampling=sp, speculative=False).token_ids
        assert eng.generate(text, images=images, sampling=sp).token_ids == tp_ar
        # a benchmark's acceptance schedule reaches the workers (the ranks follow it alike)
        from benchmarks.e2e import accept_schedule

        eng.bench_accept_schedule = accept_schedule(3.0, 3)
        out = eng.generate(text, images=images, sampling=sp)
        assert out.stats.accepted_lengths[:-1] == [2] * (len(out.stats.accepted_lengths) - 1)
        eng.bench_accept_schedule = None
        with pytest.raises(ValueError, match="picklable"):
            eng.bench_accept_schedule = lambda b, depth=None: 1
        eng.verify_ranks()
    finally:
        eng.close()


def test_random_shards_share_the_replicated_weights(tmp_path):
    """`random_lvlm` per rank: the weights every rank holds whole (norms, replicated biases, the
    vision side) are equal on both ranks, the sharded ones differ, and the vocabulary shard's
    padding row is zero. (The ranks' outputs cannot show a replicated difference: each rank's
    logits shard is gathered, so every rank picks the same tokens either way.)"""
    from models import model_dir

    from tabed_engine.models.loader import random_lvlm
    from tabed_engine.parallel.comm import TPGroup

    path = config_only(model_dir("mha", kv_heads=2), tmp_path / "target")
    ranks = [random_lvlm(path, "cpu", torch.float32, tp=TPGroup(r, 2)) for r in range(2)]
    whole = random_lvlm(path, "cpu", torch.float32)
    shapes = {n: p.shape for n, p in whole.lm.named_parameters()}
    for part in ("lm", "vision"):
        a, b = (dict(getattr(m, part).named_parameters()) for m in ranks)
        for name in a:
            if part == "vision" or a[name].shape == shapes[name]:
                assert torch.equal(a[name], b[name]), name
            else:
                assert not torch.equal(a[name], b[name]), name
    head = ranks[1].lm.lm_head
    real = head.cuts[0].size
    assert real < head.weight.shape[0] and not head.weight[real:].any() and head.weight[:real].any()
