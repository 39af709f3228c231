"""Greedy decoding on checkpoints that look published (tests/realistic.py): Llama-2 and
Mistral SentencePiece tokenizers ("\\n" is two pieces), byte-level BPE, and one without any
newline token; llava-hf processor files and chat template. AR and every SD configuration
must be token-identical to transformers `generate(do_sample=False)` (float32, CPU)."""
import functools
import json
import os
import shutil

import pytest
import torch
from transformers import AutoProcessor, AutoTokenizer, LlamaTokenizer, LlavaForConditionalGeneration

from realistic import FIXTURES, checkpoint, greedy_new_tokens, image
from tabed_engine import Engine, SamplingParams
from tabed_engine.serving.cli import main as cli_main
from tabed_engine.models.loader import load_lvlm, load_processor
from tabed_engine.engine.prompt import prepare
from tabed_engine.speculation.views import build_views, resolve_escape_token

N_NEW = 16
TOKENIZERS = ("llama", "mistral", "bytelevel", "nonewline")
DESCRIBE = "Describe the picture in detail."
ASK = "What is shown in this photo? Answer in twelve words."
PROMPTS = {   # name: (prompt, number of images)
    "one_image": ("<image>\n" + DESCRIBE, 1),
    "separated": ("The first photo: <image>\nThe second photo: <image>\nWhat is different between them?", 2),
    "adjacent": ("<image><image>\nCompare them", 2),
    "chat": ([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": ASK}]}], 1),
    "chat_turns": ([{"role": "user", "content": [{"type": "image"}, {"type": "image"},
                                                 {"type": "text", "text": "Compare the two photos."}]},
                    {"role": "assistant", "content": [{"type": "text", "text": "The first one is darker."}]},
                    {"role": "user", "content": [{"type": "text", "text": "Why is that?"}]}], 2),
    "text": ("Question: how many people are standing near the old house 42?\nAnswer:", 0),
}
VIEW_SETS = (("M",), ("M", "T"), ("M", "T", "P"))
POLICIES = ("hedge", "kld", "w-grid")


def images(n):
    return [image(10 + i) for i in range(n)]


@functools.lru_cache(maxsize=None)
def loaded(name):
    target, draft = checkpoint(name)
    return load_lvlm(target, "cpu", torch.float32), load_lvlm(draft, "cpu", torch.float32), load_processor(target)


def engine(name, views=("M", "T"), policy="hedge", gamma=5):
    """An engine over the fixture's (shared, loaded once) target and draft."""
    target, draft, processor = loaded(name)
    return Engine(target, processor, draft=draft, device="cpu", dtype=torch.float32, views=views,
                  policy=policy, gamma=gamma, max_len=256)


@functools.lru_cache(maxsize=None)
def transformers_model(name):
    path = checkpoint(name)[0]
    return (AutoProcessor.from_pretrained(path, local_files_only=True),
            LlavaForConditionalGeneration.from_pretrained(path, local_files_only=True, dtype=torch.float32).eval())


@functools.lru_cache(maxsize=None)
def reference(name, prompt_name):
    """transformers' greedy new tokens (up to and including EOS), through its own processor;
    chat messages through `apply_chat_template(tokenize=True)` with the images in them."""
    proc, hf = transformers_model(name)
    prompt, n = PROMPTS[prompt_name]
    imgs = images(n)
    if isinstance(prompt, list):
        it = iter(imgs)
        msgs = [{**m, "content": [{**c, "image": next(it)} if c["type"] == "image" else c for c in m["content"]]}
                for m in prompt]
        enc = proc.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=True,
                                       return_tensors="pt")
    else:
        enc = proc(text=prompt, images=imgs or None, return_tensors="pt")
    return greedy_new_tokens(hf, enc, N_NEW)


def generate(eng, prompt_name, speculative):
    prompt, n = PROMPTS[prompt_name]
    return eng.generate(prompt, images=images(n), sampling=SamplingParams(max_new_tokens=N_NEW),
                        speculative=speculative)


# ---------------------------------------------------------------------------- the fixtures
@pytest.mark.parametrize("name,newline", [("llama", ["▁", "<0x0A>"]), ("mistral", ["▁", "<0x0A>"]),
                                          ("bytelevel", ["Ċ"]), ("nonewline", [])])
def test_fixture_tokenizers_look_published(name, newline):
    path = checkpoint(name)[0]
    tok = AutoProcessor.from_pretrained(path, local_files_only=True).tokenizer
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    assert tok.convert_ids_to_tokens(tok.encode("\n", add_special_tokens=False)) == newline
    assert len(tok.tokenize(" photograph bicycle")) >= 4           # words split into pieces
    image_id, pad_id = tok.convert_tokens_to_ids("<image>"), tok.convert_tokens_to_ids("<pad>")
    assert (image_id, pad_id) == (len(tok) - 2, len(tok) - 1)      # right after the base vocabulary
    assert tok.added_tokens_decoder[image_id].special and tok.decode([image_id], skip_special_tokens=True) == ""
    assert cfg["image_token_index"] == image_id and cfg["pad_token_id"] == pad_id
    vocab = cfg["text_config"]["vocab_size"]
    assert vocab % 64 == 0 and vocab > len(tok)                     # padded embedding, as published
    if FIXTURES[name]["kind"] == "sentencepiece":
        assert (tok.unk_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
        assert tok.convert_ids_to_tokens(tok.encode("2024", add_special_tokens=False)) == ["▁", "2", "0", "2", "4"]


def test_sentencepiece_model_loads_through_llama_tokenizer(tmp_path):
    """The llama fixture's tokenizer.json is what LlamaTokenizer builds from tokenizer.model."""
    path = checkpoint("llama")[0]
    for name in ("tokenizer.model", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(os.path.join(path, name), tmp_path)
    from_model = LlamaTokenizer.from_pretrained(str(tmp_path), local_files_only=True)
    published = AutoTokenizer.from_pretrained(path, local_files_only=True)
    text = "USER: <image>\nWhat is shown in this photo 2024? ASSISTANT:"
    assert from_model.encode(text) == published.encode(text)
    assert from_model.convert_ids_to_tokens(from_model.encode("\n", add_special_tokens=False)) == ["▁", "<0x0A>"]


# ---------------------------------------------------------------------------- greedy equality
@pytest.mark.parametrize("prompt_name", list(PROMPTS))
@pytest.mark.parametrize("name", TOKENIZERS)
def test_ar_equals_transformers(name, prompt_name):
    ref = reference(name, prompt_name)
    assert len(set(ref)) >= 4, "the fixture's greedy output is too uniform to compare"
    out = generate(engine(name), prompt_name, speculative=False)
    assert out.token_ids == ref
    assert not out.stats.speculative


@pytest.mark.parametrize("views", VIEW_SETS, ids="+".join)
@pytest.mark.parametrize("prompt_name", list(PROMPTS))
@pytest.mark.parametrize("name", TOKENIZERS)
def test_sd_equals_transformers(name, prompt_name, views):
    # policies and gamma rotate with the prompt, so each tokenizer sees every views x policy pair
    k = list(PROMPTS).index(prompt_name) + VIEW_SETS.index(views)
    policy, gamma = POLICIES[k % 3], (3, 5)[k % 2]
    out = generate(engine(name, views, policy, gamma), prompt_name, speculative=True)
    assert out.token_ids == reference(name, prompt_name)
    s = out.stats
    assert s.speculative and len(s.accepted_lengths) == s.target_forwards >= 1
    assert all(0 <= a <= gamma for a in s.accepted_lengths)
    assert all(len(w) == len(views) for w in s.weights)


def test_m_view_drafts_are_accepted():
    """The draft is close enough that blocks accept several tokens (the equality tests above
    then cover acceptance and rollback, not only rejection)."""
    accepted = []
    for prompt_name in ("one_image", "adjacent", "chat"):
        accepted += generate(engine("llama", ("M",), "kld", 5), prompt_name, speculative=True).stats.accepted_lengths
    assert max(accepted) >= 3 and min(accepted) < 5


@pytest.mark.parametrize("name", TOKENIZERS)
def test_from_pretrained_without_draft(name):
    eng = Engine.from_pretrained(checkpoint(name)[0], device="cpu", dtype=torch.float32, views=("M",))
    assert eng.draft is None
    assert generate(eng, "one_image", speculative=True).token_ids == reference(name, "one_image")


@pytest.mark.parametrize("views", [("M",), ("M", "T")], ids="+".join)
@pytest.mark.parametrize("name", TOKENIZERS)
def test_token_id_prompt_equals_transformers(name, views):
    """A prompt of token ids with one image token per image (adjacent here) is expanded to
    each image's run, as the processor expands the text."""
    eng = engine(name, views, "kld", 3)
    ids = eng.tokenizer.encode(PROMPTS["adjacent"][0])
    assert ids.count(eng.target.image_token_id) == 2
    out = eng.generate(ids, images=images(2), sampling=SamplingParams(max_new_tokens=N_NEW))
    assert out.token_ids == reference(name, "adjacent")


@pytest.mark.parametrize("name", TOKENIZERS)
def test_caption_view_equals_transformers(name):
    eng = engine(name, ("M", "T", "P", "C"), "hedge", 3)
    prompt, n = PROMPTS["separated"]
    out = eng.generate(prompt, images=images(n), sampling=SamplingParams(max_new_tokens=N_NEW),
                       caption=["a red car on the street", "two people near 3 trees"])
    assert out.token_ids == reference(name, "separated")




@pytest.mark.parametrize("name", TOKENIZERS)
def test_prompts_tokenized_for_device_images_equal_the_processors(name):
    """with_pixels=False (images preprocessed on the device) tokenizes without the image processor and
    expands each placeholder itself: the same ids and spans as the processor, every prompt."""
    from tabed_engine.models import image_ops as image_ops

    _, _, processor = loaded(name)
    image_token = processor.tokenizer.convert_tokens_to_ids("<image>")
    for prompt_name, (prompt, n) in PROMPTS.items():
        if isinstance(prompt, list):
            prompt = [{**m, "content": [dict(c) for c in m["content"]]} for m in prompt]
        a = prepare(processor, prompt, images(n), image_token, 16)
        b = prepare(processor, prompt, images(n), image_token, 16, with_pixels=False)
        assert (a.ids, a.image_spans) == (b.ids, b.image_spans), prompt_name
        assert b.pixel_values is None
        if n:
            pv = image_ops.device_pixels(b.images, processor.image_processor, "cpu")
            assert torch.equal(pv, a.pixel_values)


def test_stream_joins_to_the_generated_text():
    """Byte-fallback and byte-level tokens make a decoded prefix unstable (<0x58> alone is "X",
    <0x58> <0xCB> is two U+FFFD); the random fixtures' greedy outputs are full of them."""
    wrong = []
    for name in TOKENIZERS:
        eng = engine(name)
        for prompt_name, (prompt, n) in PROMPTS.items():
            text = generate(eng, prompt_name, speculative=False).text
            pieces = list(eng.stream(prompt, images=images(n), sampling=SamplingParams(max_new_tokens=N_NEW),
                                     speculative=False))
            if "".join(pieces) != text:
                wrong.append((name, prompt_name, pieces, text))
    assert not wrong


# ---------------------------------------------------------------------------- the T view
@pytest.mark.parametrize("name,piece", [("llama", "<0x0A>"), ("mistral", "<0x0A>"), ("bytelevel", "Ċ"),
                                        ("nonewline", None)])
def test_t_view_escape_token(name, piece):
    eng = engine(name, ("M", "T"))
    escape = None if piece is None else eng.tokenizer.convert_tokens_to_ids(piece)
    assert eng.escape_token == escape
    prep = prepare(eng.processor, "<image>\nCompare<image><image> them", images(3), eng.target.image_token_id,
                   eng.tokens_per_image)
    assert prep.num_images == 3
    m_row, t_row = build_views(eng, prep, None, None)
    assert m_row.ids == prep.ids
    expected, prev = [], 0
    for start, n in prep.image_spans:      # each image's run becomes the escape token (or nothing)
        expected += prep.ids[prev:start] + ([] if escape is None else [escape])
        prev = start + n
    assert t_row.ids == expected + prep.ids[prev:]
    assert eng.target.image_token_id not in t_row.ids


def test_escape_token_is_never_the_unknown_token():
    """A tokenizer that maps "\n" to its unknown token has no newline: the T view drops the
    image tokens instead of showing <unk> for each image."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({"<unk>": 0, "a": 1, "b": 2}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("\n", behavior="isolated")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")
    assert fast.encode("\n", add_special_tokens=False) == [fast.unk_token_id]
    assert resolve_escape_token(fast) is None
    tok.add_tokens(["\n"])
    assert resolve_escape_token(PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")) == 3


# ---------------------------------------------------------------------------- the CLI
@pytest.mark.parametrize("extra,prompt_name,speculative", [
    ([], "chat", True),                           # --prompt goes through the chat template
    (["--views", "M,T,P", "--policy", "w-grid", "--gamma", "3"], "chat", True),
    (["--raw"], "one_image", True),               # as it is: "<image>\n" + prompt
    (["--raw", "--no-speculative"], "one_image", False),
])
@pytest.mark.parametrize("as_json", [True, False], ids=["json", "stream"])
def test_cli_equals_engine(tmp_path, capsys, extra, prompt_name, speculative, as_json):
    target, draft = checkpoint("llama")
    path = tmp_path / "photo.png"
    images(1)[0].save(path)
    text = ASK if prompt_name == "chat" else DESCRIBE
    rc = cli_main(["generate", "--target", target, "--draft", draft, "--image", str(path), "--prompt", text,
                   "--max-new-tokens", str(N_NEW), "--device", "cpu", "--dtype", "float32", *extra]
                  + (["--json"] if as_json else []))
    assert rc == 0
    stdout = capsys.readouterr().out
    want = generate(engine("llama"), prompt_name, speculative)
    assert want.token_ids == reference("llama", prompt_name)
    if as_json:
        got = json.loads(stdout)
        assert got["token_ids"] == want.token_ids and got["text"] == want.text
        assert got["stats"]["speculative"] is speculative
    else:
        assert stdout == want.text + "\n"
