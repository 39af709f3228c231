"""A small byte-level BPE tokenizer with the Qwen2 family's special tokens and the published
ChatML chat templates, built offline for tests and fixtures (the shape of Qwen2 / Qwen2.5-VL /
LLaVA-OneVision tokenizers: byte-level pre-tokenization, no BOS, `<|im_end|>` / `<|endoftext|>`
as EOS, image and video placeholder tokens as added special tokens).
"""
from __future__ import annotations

from typing import Optional

# the Qwen2 special tokens, in the order the published tokenizers add them after the BPE vocabulary
QWEN2_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# LLaVA-OneVision's placeholders (transformers' llava-onevision-qwen2-*-ov-hf)
ONEVISION_SPECIALS = ("<image>", "<video>")
# Qwen2-VL / Qwen2.5-VL's vision tokens
QWEN_VL_SPECIALS = ("<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>", "<|box_end|>",
                    "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>",
                    "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>")

# llava-hf/llava-onevision-qwen2-*-ov-hf's chat template (ChatML, images before the text)
ONEVISION_CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + ' '}}"
    "{# Render all images first #}{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}"
    "{{ '<image>' }}{% endfor %}"
    "{# Render all video then #}{% for content in message['content'] | selectattr('type', 'equalto', 'video') %}"
    "{{ '<video>' }}{% endfor %}"
    "{# Render all text next #}{% if message['role'] != 'assistant' %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{{ '\n' + content['text'] }}{% endfor %}"
    "{% else %}{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{% generation %}{{ '\n' + content['text'] }}{% endgeneration %}{% endfor %}{% endif %}"
    "{{'<|im_end|>\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Qwen/Qwen2.5-VL-*-Instruct's chat template (ChatML, a default system prompt, vision blocks)
QWEN_VL_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_CORPUS = (
    "The quick brown fox jumps over the lazy dog. A red square, two blue circles and a green "
    "triangle sit on the table. What is shown in this picture? Describe the image in detail.\n"
    "There are 3 cats and 12 dogs; 1,234 mats. user assistant system You are a helpful assistant. "
    "naïve café – ☕ 東京 picture video frame left right top bottom color shape count how many"
)


def build_bpe_tokenizer(vocab_size: int = 400, specials=ONEVISION_SPECIALS, chat_template: Optional[str] = None,
                        out_dir: Optional[str] = None, eos: str = "<|im_end|>"):
    """A byte-level BPE fast tokenizer: 256 byte symbols, merges trained on a small built-in
    corpus up to `vocab_size` entries, then the Qwen2 special tokens and `specials` as added
    tokens (ids vocab_size, vocab_size + 1, ...). No BOS; pad is `<|endoftext|>`."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False, special_tokens=[])
    tok.train_from_iterator([_CORPUS] * 4, trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in (*QWEN2_SPECIALS, *specials)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, pad_token="<|endoftext|>",
                                   additional_special_tokens=list(specials))
    if chat_template is not None:
        fast.chat_template = chat_template
    if out_dir:
        fast.save_pretrained(out_dir)
    return fast
