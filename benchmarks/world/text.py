"""Word-level tokenizer and chat template of the procedural world.

The vocabulary is closed (every word any scenario can produce), so a `tokenizers`
WordLevel model is exact: no `<unk>` ever appears in generated data. Pre-tokenization
splits on spaces and isolates "\\n" and punctuation, so "\\n" is a real token (the T
view replaces each image's run of image tokens with it). `<s>` is added by the
tokenizer's post-processor, not by the chat template, so `processor(text=...)` and
`processor.apply_chat_template(...)` give the same ids.
"""
from __future__ import annotations

from tokenizers import Regex, Tokenizer, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from .scenes import COLORS, SHAPES

PAD, BOS, EOS, UNK, IMAGE = "<pad>", "<s>", "</s>", "<unk>", "<image>"
SPECIALS = (PAD, BOS, EOS, UNK, IMAGE)
NEWLINE = "\n"

NUMBERS = ("zero one two three four five six seven eight nine ten eleven twelve thirteen "
           "fourteen fifteen sixteen seventeen eighteen nineteen twenty").split()
NOUNS = "apple dog cat tree house car bird fish book cup hat ball sun moon key door".split()
PLURALS = tuple(s + "s" for s in SHAPES)
FUNCTION_WORDS = (
    "USER ASSISTANT image there is are a an the in row column shape shapes word words "
    "what which where how many color colour describe list count from to reverse sort copy "
    "numbers add and plus is it yes no of first second both images total left right "
    "tell me your answer again say repeat nothing none colors".split()
)
PUNCT = (":", ".", ",", "?")


def vocabulary() -> list[str]:
    """All tokens in id order: specials first, then "\\n", punctuation and words."""
    words = [NEWLINE, *PUNCT]
    for w in [*FUNCTION_WORDS, *COLORS, *SHAPES, *PLURALS, *NUMBERS, *NOUNS]:
        if w not in words:
            words.append(w)
    return [*SPECIALS, *words]


# USER/ASSISTANT turns; images as "<image>\n" like LLaVA-1.5. `<s>` comes from the
# tokenizer, `</s>` closes every assistant turn.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'user' -%}"
    "{{- ' USER :' if not loop.first else 'USER :' -}}"
    "{%- if message['content'] is string -%}{{- ' ' + message['content'] -}}"
    "{%- else -%}{%- for c in message['content'] -%}"
    "{%- if c['type'] == 'image' -%}{{- ' <image>\\n' -}}"
    "{%- elif c['type'] == 'text' -%}{{- ' ' + c['text'] -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{%- else -%}"
    "{{- ' ASSISTANT :' -}}"
    "{%- if message['content'] is string -%}{{- ' ' + message['content'] -}}"
    "{%- else -%}{%- for c in message['content'] if c['type'] == 'text' -%}{{- ' ' + c['text'] -}}{%- endfor -%}{%- endif -%}"
    "{{- ' </s>' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- ' ASSISTANT :' -}}{%- endif -%}"
)


def build_tokenizer() -> PreTrainedTokenizerFast:
    """The world's tokenizer (deterministic: ids depend only on `vocabulary()`)."""
    vocab = {w: i for i, w in enumerate(vocabulary())}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(" ", behavior="removed"),
        pre_tokenizers.Split(Regex(r"[\n:.,?]"), behavior="isolated"),
    ])
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, vocab[BOS])])
    # no decoder: `tokenizers` then joins the words with single spaces
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, unk_token=UNK, pad_token=PAD,
        extra_special_tokens={"image_token": IMAGE},
        clean_up_tokenization_spaces=False, model_max_length=512, padding_side="right",
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast
