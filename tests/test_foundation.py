"""Loader, decoder and autoregressive generation against transformers (float32, CPU)."""
import json
import os
import shutil

import numpy as np
import pytest
import torch
from transformers import AutoProcessor, LlavaForConditionalGeneration

from models import CONFIGS, model_dir
from tabed_engine import Engine, SamplingParams
from tabed_engine.models.tiny import random_image, words


def hf_greedy(path, text, images, n):
    proc = AutoProcessor.from_pretrained(path, local_files_only=True)
    hf = LlavaForConditionalGeneration.from_pretrained(path, local_files_only=True, dtype=torch.float32)
    hf.eval()
    enc = proc(text=text, images=images or None, return_tensors="pt")
    with torch.no_grad():
        out = hf.generate(**enc, max_new_tokens=n, do_sample=False, pad_token_id=0)
    new = out[0, enc["input_ids"].shape[1]:].tolist()
    eos = hf.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    for i, t in enumerate(new):
        if t in eos:
            return new[: i + 1]
    return new


@pytest.fixture(scope="module")
def engines():
    return {name: Engine.from_pretrained(model_dir(name), device="cpu", dtype=torch.float32)
            for name in CONFIGS}


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("n_images", [0, 1, 2])
def test_greedy_matches_transformers(engines, name, n_images):
    eng = engines[name]
    vocab = CONFIGS[name]["vocab_size"]
    size = CONFIGS[name].get("image_size", 30)
    images = [random_image(10 * n_images + i, size) for i in range(n_images)]
    text = "".join(f"<image>\n{words(i, 2, vocab)} " for i in range(n_images)) + words(99, 7, vocab)
    want = hf_greedy(model_dir(name), text, images, 24)
    out = eng.generate(text, images=images, sampling=SamplingParams(max_new_tokens=24), speculative=False)
    assert out.token_ids == want
    assert out.stats.new_tokens == len(want)
    assert out.stats.block_efficiency == 1.0
    st = out.stats   # the first token is known after the prefill and before the last one
    assert st.time_prefill <= st.time_first_token <= st.time_total and st.time_first_token > 0


def test_prompt_forms_agree(engines):
    eng = engines["mha"]
    img = random_image(5)
    sp = SamplingParams(max_new_tokens=10)
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "w3 w7 w9"}]}]
    text = eng.processor.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    a = eng.generate(msgs, images=[img], sampling=sp, speculative=False).token_ids
    b = eng.generate(text, images=[img], sampling=sp, speculative=False).token_ids
    ids = eng.processor(text=text, images=[img], return_tensors="pt")["input_ids"][0].tolist()
    c = eng.generate(ids, images=[img], sampling=sp, speculative=False).token_ids
    collapsed = []  # one image token per image instead of the expanded run
    for t in ids:
        if not (t == eng.target.image_token_id and collapsed and collapsed[-1] == t):
            collapsed.append(t)
    d = eng.generate(collapsed, images=[np.asarray(img)], sampling=sp, speculative=False).token_ids
    assert a == b == c == d


def test_seeded_sampling_reproducible(engines):
    eng = engines["gqa_headdim"]
    sp = SamplingParams(max_new_tokens=16, temperature=1.0, top_k=50, top_p=0.9, seed=1234)
    a = eng.generate("w1 w2 w3", sampling=sp, speculative=False).token_ids
    b = eng.generate("w1 w2 w3", sampling=sp, speculative=False).token_ids
    c = eng.generate("w1 w2 w3", sampling=SamplingParams(max_new_tokens=16, temperature=1.0, seed=7),
                     speculative=False).token_ids
    assert a == b
    assert a != c


def test_stream_yields_generate_text(engines):
    eng = engines["mha"]
    sp = SamplingParams(max_new_tokens=12)
    pieces = list(eng.stream("w4 w5 w6", sampling=sp, speculative=False))
    assert len(pieces) > 1
    assert "".join(pieces) == eng.generate("w4 w5 w6", sampling=sp, speculative=False).text


@pytest.mark.parametrize("bad, exc, msg", [
    (dict(prompt="<image> w1", images=None), ValueError, "placeholder"),
    (dict(prompt="w1 w2", images=["x"]), TypeError, "image type"),
    (dict(prompt="<image> <image> w1", images=[0]), ValueError, "placeholder"),
    (dict(prompt=12), TypeError, "prompt"),
    (dict(prompt=[1, 2, 100000]), ValueError, "token ids"),
    (dict(prompt="w1", sampling=SamplingParams(max_new_tokens=100000)), ValueError, "cache length"),
])
def test_bad_input_then_engine_still_works(engines, bad, exc, msg):
    eng = engines["mha"]
    if bad.get("images") == [0]:
        bad = {**bad, "images": [random_image(1)]}
    with pytest.raises(exc, match=msg):
        eng.generate(**bad, speculative=False)
    ok = eng.generate("w1 w2", sampling=SamplingParams(max_new_tokens=3), speculative=False)
    assert len(ok.token_ids) >= 1


def test_sampling_params_validation():
    for kw in (dict(max_new_tokens=0), dict(temperature=-1.0), dict(top_p=0.0), dict(top_k=-2)):
        with pytest.raises(ValueError):
            SamplingParams(**kw)


def test_loader_errors(tmp_path):
    with pytest.raises(ValueError, match="not found"):
        Engine.from_pretrained(str(tmp_path / "nope"), device="cpu")
    src = model_dir("mha")
    # unsupported architecture
    bad = tmp_path / "bad_arch"
    shutil.copytree(src, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["model_type"], cfg["architectures"] = "blip-2", ["Blip2ForConditionalGeneration"]
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unsupported architecture"):
        Engine.from_pretrained(str(bad), device="cpu")
    # missing weights
    nowt = tmp_path / "no_weights"
    shutil.copytree(src, nowt)
    os.remove(nowt / "model.safetensors")
    with pytest.raises(ValueError, match="safetensors"):
        Engine.from_pretrained(str(nowt), device="cpu")
    # vocabulary mismatch between draft and target
    with pytest.raises(ValueError, match="vocabulary"):
        Engine.from_pretrained(src, model_dir("gqa_headdim"), device="cpu")


def test_legacy_config_style_loads_identically(tmp_path, engines):
    """transformers-4.x style config: `rope_theta` in text_config, no `rope_parameters`,
    no `head_dim`; same weights must give the same tokens."""
    src = model_dir("gqa_tied_full")
    dst = tmp_path / "legacy_cfg"
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    tc = cfg["text_config"]
    theta = (tc.pop("rope_parameters", None) or {}).get("rope_theta", 10000.0)
    tc["rope_theta"] = theta
    tc.pop("head_dim", None)
    (dst / "config.json").write_text(json.dumps(cfg))
    eng = Engine.from_pretrained(str(dst), device="cpu", dtype=torch.float32)
    assert eng.target.lm.cfg.head_dim == tc["hidden_size"] // tc["num_attention_heads"]
    sp = SamplingParams(max_new_tokens=12)
    text, img = "<image>\n w3 w4 w5", [random_image(3)]
    assert eng.generate(text, images=img, sampling=sp, speculative=False).token_ids == \
        engines["gqa_tied_full"].generate(text, images=img, sampling=sp, speculative=False).token_ids


def test_cli_generate_json(tmp_path, capsys):
    from tabed_engine.serving.cli import main

    img = tmp_path / "img.png"
    random_image(4).save(img)
    rc = main(["generate", "--target", model_dir("mha"), "--draft", model_dir("mha", perturb=0.6),
               "--image", str(img), "--prompt", "w1 w2 w3", "--max-new-tokens", "6", "--json",
               "--device", "cpu"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["token_ids"]) == 6 and out["stats"]["speculative"]
    rc = main(["generate", "--target", model_dir("mha"), "--draft", model_dir("mha", perturb=0.6),
               "--image", str(img), "--prompt", "w1 w2 w3", "--max-new-tokens", "6", "--json",
               "--device", "cpu", "--no-view-tree"])
    assert rc == 0 and json.loads(capsys.readouterr().out)["token_ids"] == out["token_ids"]
    # bad input: a clear error and exit code 2, no traceback
    rc = main(["generate", "--target", model_dir("mha"), "--prompt", "<image> w1", "--device", "cpu"])
    assert rc == 2 and "placeholder" in capsys.readouterr().err
