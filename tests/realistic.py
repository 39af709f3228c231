"""Tiny random LLaVA checkpoints whose tokenizer and processor files look published.

Each fixture is a target and a close draft (same seed, perturbed language model) with
tokenizer and processor files laid out as `llava-hf/llava-1.5-7b-hf` publishes them
(`<image>` special right after the base vocabulary, `<pad>` after it, the embedding padded
to a multiple of 64, CLIP preprocessing, the LLaVA-1.5 chat template), around a tokenizer
trained here, offline, on a small generated corpus:

llama      Llama-2 SentencePiece: BPE, byte fallback, dummy prefix, digits split;
           "\\n" encodes as ["▁", "<0x0A>"]. tokenizer.model + tokenizer.json, legacy false,
           chat_template.json, legacy (transformers 4.x) weight names.
mistral    Mistral SentencePiece: the same recipe on another corpus and vocabulary size;
           tokenizer.model only (converted at load), legacy true, chat_template.jinja.
bytelevel  Llama-3 / Qwen2 byte-level BPE (`tokenizers` ByteLevel, Llama-3 split regex):
           "\\n" is the one token "Ċ"; <|begin_of_text|> / <|end_of_text|> after the merges.
nonewline  byte-level BPE trained without "Ċ" in its alphabet: "\\n" has no token at all.

Built once per test session under $TABED_TEST_MODELS (or a temporary directory).
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import random
import shutil
import tempfile

from tabed_engine.models.tiny import build_tiny_llava

IMAGE_SIZE, PATCH_SIZE = 56, 14          # 4 x 4 patches: 16 image tokens per image
TOKENS_PER_IMAGE = (IMAGE_SIZE // PATCH_SIZE) ** 2

# The chat template llava-hf publishes for LLaVA-1.5 (chat_template.json).
LLAVA_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] != 'system' %}{{ message['role'].upper() + ': '}}"
    "{% endif %}{# Render all images first #}{% for content in message['content'] | "
    "selectattr('type', 'equalto', 'image') %}{{ '<image>\n' }}{% endfor %}{# Render all text next #}"
    "{% if message['role'] != 'assistant' %}{% for content in message['content'] | "
    "selectattr('type', 'equalto', 'text') %}{{ content['text'] + ' '}}{% endfor %}{% else %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}{% generation %}"
    "{{ content['text'] + ' '}}{% endgeneration %}{% endfor %}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)

# Llama-3's pre-tokenizer split (tiktoken cl100k style): ".\n" and "\n\n" stay one chunk.
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")

FIXTURES = {
    "llama": dict(kind="sentencepiece", vocab=700, corpus_seed=0, legacy=False, tokenizer_json=True,
                  template="json", layout="legacy", seed=11),
    "mistral": dict(kind="sentencepiece", vocab=900, corpus_seed=1, legacy=True, tokenizer_json=False,
                    template="jinja", layout="current", seed=12),
    "bytelevel": dict(kind="bytelevel", vocab=800, corpus_seed=2, newline=True, template="json",
                      layout="current", seed=13),
    "nonewline": dict(kind="bytelevel", vocab=500, corpus_seed=3, newline=False, template="json",
                      layout="current", seed=14),
}
MODEL = dict(hidden=48, layers=2, heads=4, kv_heads=2, intermediate=83, vision_hidden=32,
             image_size=IMAGE_SIZE, patch_size=PATCH_SIZE, feature_layer=-2, strategy="default")
# relative LM noise of the draft: at 0.03 the M view's blocks accept 0-5 of 5 tokens (varied)
DRAFT_PERTURB = 0.03

_ROOT = os.path.join(os.environ.get("TABED_TEST_MODELS") or tempfile.mkdtemp(prefix="tabed_models_"),
                     "realistic")

_WORDS = (
    "the a an cat dog sat on mat image picture photo shows red blue green large small two three people "
    "standing near tree house car street sky clouds water boat man woman child playing with ball table "
    "chair window door light dark bright color describe compare left right top bottom background "
    "foreground what is in this there are of and to it was for as by at from be have has not but they we "
    "you he she his her their which would could should about after before under over between into "
    "through during without again once here when where why how all any both each few more most other "
    "some such only own same than too very can will just now first last long great little old new good "
    "high different following important question answer across around bicycle kitchen mountain river "
    "forest building animal yellow wooden metal sitting walking holding looking").split()
_SYLLABLES = "ka re to mi su lo ne ra ti po an el or in ar us ith ent ion ous ble ly ed ing".split()


def corpus(seed: int, lines: int = 4000) -> list[str]:
    """English-like sentences: common words, made-up words, numbers and punctuation."""
    rng = random.Random(seed)

    def word():
        if rng.random() < 0.8:
            return rng.choice(_WORDS)
        return "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(2, 4)))

    out = []
    for _ in range(lines):
        s = " ".join(word() for _ in range(rng.randint(3, 14)))
        s = s[0].upper() + s[1:]
        if rng.random() < 0.3:
            s += f" {rng.randint(0, 99999)}"
        out.append(s + rng.choice(".?!,:;"))
    return out


# ---------------------------------------------------------------------------- tokenizers
def _token_entry(content: str) -> dict:
    return {"content": content, "lstrip": False, "normalized": False, "rstrip": False,
            "single_word": False, "special": True}


def train_sentencepiece(vocab_size: int, seed: int) -> bytes:
    """A serialized SentencePiece model trained as Llama-2's was (BPE, byte fallback, dummy
    prefix, digits split, identity normalization, <unk>=0 <s>=1 </s>=2, no pad)."""
    import sentencepiece as spm

    model = io.BytesIO()
    # one line a sentence: "\n" never enters a piece, it falls back to the byte <0x0A>
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus(seed)), model_writer=model, model_type="bpe", vocab_size=vocab_size,
        byte_fallback=True, add_dummy_prefix=True, split_digits=True, unk_id=0, bos_id=1, eos_id=2,
        pad_id=-1, normalization_rule_name="identity", remove_extra_whitespaces=False,
        allow_whitespace_only_pieces=True, character_coverage=0.99995, split_by_unicode_script=True,
        split_by_whitespace=True, max_sentence_length=4192, num_threads=1, minloglevel=2)
    return model.getvalue()


def write_sentencepiece_tokenizer(out_dir: str, *, vocab: int, corpus_seed: int, legacy: bool,
                                  tokenizer_json: bool) -> int:
    """tokenizer.model (+ tokenizer.json), tokenizer_config.json and special_tokens_map.json as
    llava-hf publishes them. Returns the tokenizer's length (base vocabulary + <image>, <pad>)."""
    from transformers import LlamaTokenizer

    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "tokenizer.model"), "wb") as f:
        f.write(train_sentencepiece(vocab, corpus_seed))
    added = {0: "<unk>", 1: "<s>", 2: "</s>", vocab: "<image>", vocab + 1: "<pad>"}
    config = {
        "add_bos_token": True, "add_eos_token": False,
        "added_tokens_decoder": {str(i): _token_entry(t) for i, t in added.items()},
        "bos_token": "<s>", "clean_up_tokenization_spaces": False, "eos_token": "</s>",
        "legacy": legacy, "model_max_length": 1000000000000000019884624838656, "pad_token": "<pad>",
        "padding_side": "left", "processor_class": "LlavaProcessor", "sp_model_kwargs": {},
        "tokenizer_class": "LlamaTokenizer", "trust_remote_code": False, "unk_token": "<unk>",
        "use_default_system_prompt": False,
    }
    _dump(out_dir, "tokenizer_config.json", config)
    _dump(out_dir, "special_tokens_map.json", {
        "bos_token": _token_entry("<s>"), "eos_token": _token_entry("</s>"), "pad_token": "<pad>",
        "unk_token": _token_entry("<unk>")})
    if tokenizer_json:
        tok = LlamaTokenizer.from_pretrained(out_dir, local_files_only=True)
        tok._tokenizer.save(os.path.join(out_dir, "tokenizer.json"))
    return vocab + 2


def write_byte_level_tokenizer(out_dir: str, *, vocab: int, corpus_seed: int, newline: bool) -> int:
    """tokenizer.json (byte-level BPE trained on the corpus, Llama-3 layout: the specials after
    the merges, <|begin_of_text|> added by the post-processor) and its tokenizer_config.json.
    newline=False: "Ċ" is left out of the alphabet and the corpus, so "\\n" has no token."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    os.makedirs(out_dir, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    lines = corpus(corpus_seed)
    if newline:   # documents of three lines: "\n" after punctuation gets merges of its own
        docs = ["\n".join(lines[i:i + 3]) for i in range(0, len(lines), 3)]
    else:
        docs = lines
        alphabet = [c for c in alphabet if c != "Ċ"]
    tok.train_from_iterator(docs, trainers.BpeTrainer(vocab_size=vocab, initial_alphabet=alphabet,
                                                      show_progress=False))
    base = tok.get_vocab_size()
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<image>", "<pad>"]
    tok.add_special_tokens(specials)
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.TemplateProcessing(single="<|begin_of_text|> $A",
                                                       pair="<|begin_of_text|> $A <|begin_of_text|> $B",
                                                       special_tokens=[("<|begin_of_text|>", bos)])
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    _dump(out_dir, "tokenizer_config.json", {
        "added_tokens_decoder": {str(base + i): _token_entry(t) for i, t in enumerate(specials)},
        "bos_token": "<|begin_of_text|>", "clean_up_tokenization_spaces": False,
        "eos_token": "<|end_of_text|>", "model_input_names": ["input_ids", "attention_mask"],
        "model_max_length": 1000000000000000019884624838656, "pad_token": "<pad>",
        "padding_side": "left", "processor_class": "LlavaProcessor",
        "tokenizer_class": "PreTrainedTokenizerFast"})
    return base + len(specials)


def write_llava_processor_files(out_dir: str, template: str = "json"):
    """preprocessor_config.json, processor_config.json and the chat template as published for
    llava-hf/llava-1.5-7b-hf, at this module's image size (336 there)."""
    _dump(out_dir, "preprocessor_config.json", {
        "crop_size": {"height": IMAGE_SIZE, "width": IMAGE_SIZE}, "do_center_crop": True,
        "do_convert_rgb": True, "do_normalize": True, "do_rescale": True, "do_resize": True,
        "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_processor_type": "CLIPImageProcessor",
        "image_std": [0.26862954, 0.26130258, 0.27577711], "processor_class": "LlavaProcessor",
        "resample": 3, "rescale_factor": 0.00392156862745098, "size": {"shortest_edge": IMAGE_SIZE}})
    _dump(out_dir, "processor_config.json", {
        "image_token": "<image>", "num_additional_image_tokens": 1, "patch_size": PATCH_SIZE,
        "processor_class": "LlavaProcessor", "vision_feature_select_strategy": "default"})
    if template == "json":
        _dump(out_dir, "chat_template.json", {"chat_template": LLAVA_CHAT_TEMPLATE})
    else:
        with open(os.path.join(out_dir, "chat_template.jinja"), "w") as f:
            f.write(LLAVA_CHAT_TEMPLATE)


def _dump(out_dir: str, name: str, obj):
    with open(os.path.join(out_dir, name), "w") as f:
        json.dump(obj, f, indent=2, ensure_ascii=False)
        f.write("\n")


# ---------------------------------------------------------------------------- checkpoints
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                    "processor_config.json", "preprocessor_config.json", "chat_template.json",
                    "chat_template.jinja")


def _write_tokenizer(out_dir: str, spec: dict) -> int:
    if spec["kind"] == "sentencepiece":
        n = write_sentencepiece_tokenizer(out_dir, vocab=spec["vocab"], corpus_seed=spec["corpus_seed"],
                                          legacy=spec["legacy"], tokenizer_json=spec["tokenizer_json"])
    else:
        n = write_byte_level_tokenizer(out_dir, vocab=spec["vocab"], corpus_seed=spec["corpus_seed"],
                                       newline=spec["newline"])
    write_llava_processor_files(out_dir, spec["template"])
    return n


def _ids(tok_dir: str) -> dict:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tok_dir, local_files_only=True)
    return {"image": tok.convert_tokens_to_ids("<image>"), "pad": tok.convert_tokens_to_ids("<pad>"),
            "bos": tok.bos_token_id, "eos": tok.eos_token_id}


def _build_model(out_dir: str, tok_dir: str, vocab: int, ids: dict, spec: dict, perturb: float):
    """A tiny LLaVA whose config points at the tokenizer's ids (as llava-1.5-7b-hf's does:
    image_token_index 32000, pad_token_id 32001, vocab 32064), with the tokenizer's files."""
    build_tiny_llava(out_dir, vocab_size=vocab, seed=spec["seed"], layout=spec["layout"], perturb=perturb,
                     **MODEL)
    for name in _TOKENIZER_FILES:
        if os.path.exists(os.path.join(out_dir, name)):
            os.remove(os.path.join(out_dir, name))
    with open(os.path.join(out_dir, "config.json")) as f:
        cfg = json.load(f)
    cfg.update(image_token_index=ids["image"], pad_token_id=ids["pad"])
    cfg["text_config"].update(bos_token_id=ids["bos"], eos_token_id=ids["eos"], pad_token_id=ids["pad"])
    _dump(out_dir, "config.json", cfg)
    _dump(out_dir, "generation_config.json", {"bos_token_id": ids["bos"], "eos_token_id": ids["eos"],
                                              "pad_token_id": ids["pad"]})
    for name in os.listdir(tok_dir):
        shutil.copy(os.path.join(tok_dir, name), out_dir)


def checkpoint(name: str) -> tuple[str, str]:
    """(target_dir, draft_dir) of the named fixture, built on first use."""
    spec = FIXTURES[name]
    # the directory is named for everything it is built from, so a changed spec never reuses it
    key = json.dumps([spec, MODEL, DRAFT_PERTURB, IMAGE_SIZE, PATCH_SIZE], sort_keys=True)
    path = os.path.join(_ROOT, f"{name}-{hashlib.sha1(key.encode()).hexdigest()[:10]}")
    if not os.path.isfile(os.path.join(path, "draft", "config.json")):
        os.makedirs(_ROOT, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=name + ".", dir=_ROOT)
        tok_dir = os.path.join(tmp, "tokenizer")
        n = _write_tokenizer(tok_dir, spec)
        vocab = -(-n // 64) * 64          # embedding padded to a multiple of 64, as published
        ids = _ids(tok_dir)
        _build_model(os.path.join(tmp, "target"), tok_dir, vocab, ids, spec, 0.0)
        _build_model(os.path.join(tmp, "draft"), tok_dir, vocab, ids, spec, DRAFT_PERTURB)
        try:
            os.rename(tmp, path)          # atomic: parallel workers may build the same fixture
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
    return os.path.join(path, "target"), os.path.join(path, "draft")


def image(seed: int, size=(80, 64)):
    """A deterministic random RGB image, not square (resized and centre-cropped)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))


def prompt(n_images):
    """A request in the fixtures' language: n images separated by text, and the images."""
    text = "".join(f"<image>\nPicture {i + 1} shows a street. " for i in range(n_images))
    return text + "Describe what you see in detail.", [image(100 + i) for i in range(n_images)]


def greedy_new_tokens(hf, enc, n_new: int) -> list[int]:
    """transformers' greedy new tokens for the processor output `enc`, up to and including EOS."""
    import torch

    with torch.no_grad():
        out = hf.generate(**enc, max_new_tokens=n_new, do_sample=False)
    new = out[0, enc["input_ids"].shape[1]:].tolist()
    eos = hf.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    return next((new[:i + 1] for i, t in enumerate(new) if t in eos), new)
