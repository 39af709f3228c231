"""The procedural world: scenes, tokenizer/processor, scenarios, views, bundled demo models."""
import os

import numpy as np
import pytest
import torch

from benchmarks.world import proxy
from benchmarks.world.scenarios import SCENARIOS, TEXT, caption, examples, make_example
from benchmarks.world.scenes import OOD_STYLES, random_scene, render
from benchmarks.world.text import build_tokenizer
from benchmarks.world.train import build_model, build_processor

DEMO = os.path.join(os.path.dirname(__file__), "..", "tabed_engine", "assets", "demo")


@pytest.fixture(scope="module")
def saved_processor(tmp_path_factory):
    d = tmp_path_factory.mktemp("proc")
    build_processor().save_pretrained(d)
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(str(d), local_files_only=True)


def test_render_deterministic_by_seed():
    for style in ("normal",) + OOD_STYLES:
        a = random_scene(np.random.default_rng(3), style=style)
        b = random_scene(np.random.default_rng(3), style=style)
        assert a == b
        ia, ib = np.asarray(render(a)), np.asarray(render(b))
        assert ia.shape == (64, 64, 3) and ia.dtype == np.uint8
        assert np.array_equal(ia, ib)
    c = random_scene(np.random.default_rng(4))
    assert not np.array_equal(np.asarray(render(c)), np.asarray(render(random_scene(np.random.default_rng(3)))))


def test_examples_deterministic_by_seed():
    for sc in SCENARIOS + (TEXT,):
        a, b = make_example(sc, 11), make_example(sc, 11)
        assert (a.prompt, a.answer, a.scenes) == (b.prompt, b.answer, b.scenes)
    assert len({make_example("S1", i).answer for i in range(20)}) > 15


def test_tokenizer_round_trip():
    tok = build_tokenizer()
    nl, img = tok.convert_tokens_to_ids("\n"), tok.convert_tokens_to_ids("<image>")
    assert nl != tok.unk_token_id and img != tok.unk_token_id and nl != img
    text = "USER : <image>\n<image>\n describe the second image . ASSISTANT : there is one shape ."
    ids = tok(text).input_ids
    assert ids[0] == tok.bos_token_id and tok.unk_token_id not in ids
    assert ids.count(img) == 2 and ids.count(nl) == 2
    assert tok(tok.decode(ids), add_special_tokens=False).input_ids == ids
    assert tok.decode(ids, skip_special_tokens=True).split() == text.replace("<image>", " ").split()


def test_processor_offline_expands_image_tokens(saved_processor):
    proc = saved_processor
    ex = make_example("S5", 0)
    while len(ex.scenes) != 2:
        ex = make_example("S5", np.random.default_rng(len(ex.prompt)).integers(1000))
    enc = proc(text=ex.prompt, images=ex.images, return_tensors="pt")
    img = proc.tokenizer.convert_tokens_to_ids("<image>")
    assert int((enc.input_ids == img).sum()) == 2 * 16
    assert enc.pixel_values.shape == (2, 3, 64, 64)
    ours = proxy.pixel_values(proc.image_processor, ex.images)
    assert torch.allclose(enc.pixel_values.float(), ours, atol=2e-2)
    text = proc.apply_chat_template(ex.messages(), add_generation_prompt=True)
    assert text.split() == ex.prompt.split()


def test_model_config_matches_processor():
    proc = build_processor()
    for kind in ("target", "draft"):
        m = build_model(kind, proc.tokenizer)
        assert m.config.image_token_index == proc.tokenizer.convert_tokens_to_ids("<image>")
        assert m.config.image_seq_length == proxy.n_image_tokens(m) == 16
        assert m.config.text_config.vocab_size == len(proc.tokenizer)


@pytest.mark.parametrize("sc", SCENARIOS)
def test_scenarios_well_formed(sc):
    tok = build_tokenizer()
    for ex in examples(sc, 40, seed=5):
        ids = tok(ex.prompt + " " + ex.answer + " </s>").input_ids
        assert tok.unk_token_id not in ids
        assert ex.prompt.count("<image>") == len(ex.scenes) >= 1
        assert ex.prompt.endswith("ASSISTANT :") and ex.answer
        if sc in ("S3", "S4"):
            assert ex.turns[-1].n_images == 0 or sc == "S3"
        if sc == "S4":
            assert len(ex.turns) == 2 and ex.turns[0].n_images == 1
        if sc == "S5":
            assert len(ex.scenes) == 2 or ex.scenes[0].style in OOD_STYLES
        for s in ex.scenes:
            assert caption(s) and caption(s) in " ".join(ex.captions)


def test_views_encode():
    tok = build_tokenizer()
    ex = make_example("S4", 3)
    img, nl = tok.convert_tokens_to_ids("<image>"), tok.convert_tokens_to_ids("\n")
    m = proxy.encode(tok, ex, "M", 16)
    t = proxy.encode(tok, ex, "T", 16)
    p = proxy.encode(tok, ex, "P", 16)
    c = proxy.encode(tok, ex, "C", 16)
    assert m.ids.count(img) == 16 and p.ids.count(img) == 4 and img not in t.ids and img not in c.ids
    assert t.ids.count(nl) == m.ids.count(nl) + 1 and len(t.ids) == len(m.ids) - 15
    assert tok.decode(c.ids).split()[:6] == ["<s>", "USER", ":", "image", ":", ex.scenes[0].objects[0].color]


def test_block_efficiency():
    assert proxy.block_efficiency(np.ones(10, bool), 5) == pytest.approx(10 / 2)
    assert proxy.block_efficiency(np.zeros(6, bool), 5) == pytest.approx(1.0)
    # 3 matches, miss, 5 matches, match: blocks [3+1], [5+1] -> 10 tokens / 2 forwards
    assert proxy.block_efficiency(np.array([1, 1, 1, 0, 1, 1, 1, 1, 1, 1], bool), 5) == pytest.approx(5.0)


def test_views_match_hf_forward():
    """The proxy's M-view inputs give the same logits as HF's own forward with pixel_values."""
    proc = build_processor()
    torch.manual_seed(0)
    model = build_model("draft", proc.tokenizer).eval()
    ex = make_example("S5", 1)
    enc = proc(text=ex.prompt, images=ex.images, return_tensors="pt")
    with torch.no_grad():
        ref = model(**enc).logits
        ours = proxy.logits_of(model, proc.image_processor, [proxy.encode(proc.tokenizer, ex, "M", 16)], 0)
    assert ours.shape == ref.shape
    assert torch.allclose(ours, ref, atol=1e-4)


def _demo(name):
    d = os.path.join(DEMO, name)
    if not os.path.exists(os.path.join(d, "config.json")):
        pytest.skip(f"no bundled checkpoint at {d}")
    return d


def test_bundled_checkpoints_load_and_generate():
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    total = 0
    models = {}
    for name in ("target", "draft"):
        d = _demo(name)
        total += sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d) if f.endswith(".safetensors"))
        models[name] = LlavaForConditionalGeneration.from_pretrained(d, local_files_only=True, dtype=torch.float32).eval()
    assert total <= 12 * 2**20
    proc = AutoProcessor.from_pretrained(_demo("target"), local_files_only=True)
    assert models["target"].config.text_config.vocab_size == models["draft"].config.text_config.vocab_size
    ex = make_example("S1", 7)  # the sample image's scene
    assert np.array_equal(np.asarray(render(ex.scenes[0])), np.asarray(__import__("PIL.Image").Image.open(
        os.path.join(DEMO, "sample.png")).convert("RGB")))
    enc = proc(text=ex.prompt, images=ex.images, return_tensors="pt")
    for name, m in models.items():
        out = m.generate(**enc, max_new_tokens=48, do_sample=False)[0, enc.input_ids.shape[1]:]
        assert int(out[-1]) == proc.tokenizer.eos_token_id  # a finished answer
        words = proc.tokenizer.decode(out, skip_special_tokens=True).split()
        # both count the three shapes right (the small demo models still confuse some shapes)
        assert words[:5] == ex.answer.split()[:5], words
        assert words[5:7] == ["a", "purple"] and words[8:12] == ["in", "row", "one", "column"], words
