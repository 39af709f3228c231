"""Tensor parallelism (gloo, 2 processes) for the Qwen2-based families the large checkpoints use:
Qwen2.5-VL (M-RoPE in prefill, decode, drafting and verification; the 72B), LLaVA-OneVision
(q/k/v bias, anyres-max-9 images and a video; the 72B) and LLaVA-NeXT on a Qwen1.5 LM (as many
KV heads as query heads; llava-next-72b / -110b). Greedy AR and SD must give transformers'
tokens in float32 with the target and the draft sharded over both ranks.
"""
import pytest
import torch

from tabed_engine import Engine, SamplingParams

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
