"""A draft whose vocabulary differs from the target's only in padding rows.

Published pairs share one tokenizer but pad their embeddings to different row counts
(LLaVA-OneVision 0.5B: 152000 rows, 7B: 152128; Qwen2.5-VL 3B: 151936, 7B: 152064). Rows past
the tokenizer are padding. `fit_vocab` adapts the draft's decoder once, at engine construction,
so that everything downstream sees one vocabulary V (the target's):

* its head emits exactly V logits: rows >= V are cut (a view of the weight, no copy), rows the
  draft lacks are zero weights with the bias `MISSING_LOGIT`, a finite logit whose softmax
  is exactly 0 in float32 (exp(-1e4) underflows) yet keeps log q finite, so KL(p || q_k) stays
  finite where the target has mass on such an id (with -inf it is inf, and the history's
  -log D turns into NaN weights);
* its embedding holds a row for every id below V (zero rows for the ids it lacks): the target
  may emit a padding id (speculative sampling is lossless, so it does whenever the target
  would), and every view then feeds it to the draft.

Speculative decoding stays lossless for any q, so a q of exactly 0 on the ids the draft lacks
changes acceptance only: those ids come from the residual max(p - q, 0) when the target picks
them.
"""
from __future__ import annotations

import dataclasses

import torch
from torch import nn

# the draft's logit for ids it has no row for: exp underflows to exactly 0 in float32 and in
# every dtype's softmax, and the value is finite in float16 (max 65504) and bfloat16
MISSING_LOGIT = -1e4


@torch.no_grad()
def fit_vocab(lm, vocab: int) -> None:
    """Make decoder `lm` (a `LlamaLM`) produce logits over exactly `vocab` ids and embed every
    id below `vocab`, in place (see the module docstring); lm.cfg.vocab_size becomes `vocab`.
    A no-op when it already has `vocab`."""
    own = lm.cfg.vocab_size
    if own == vocab:
        return
    head, emb = lm.lm_head, lm.embed_tokens
    tied = head.weight is emb.weight or head.weight.data_ptr() == emb.weight.data_ptr()
    bias = head.bias if head.bias is not None else torch.zeros(own, device=head.weight.device,
                                                               dtype=head.weight.dtype)
    if vocab < own:                                  # cut: views of the rows kept
        weight, bias = head.weight[:vocab], bias[:vocab]
        keep_bias = head.bias is not None
    else:
        extra = vocab - own
        if emb.weight.shape[0] < vocab:
            emb.weight = nn.Parameter(torch.cat([emb.weight, emb.weight.new_zeros(
                vocab - emb.weight.shape[0], emb.weight.shape[1])]), requires_grad=False)
            emb.num_embeddings = vocab
        weight = (emb.weight[:vocab] if tied
                  else torch.cat([head.weight, head.weight.new_zeros(extra, head.weight.shape[1])]))
        bias = torch.cat([bias, bias.new_full((extra,), MISSING_LOGIT)])
        keep_bias = True
    head.weight = nn.Parameter(weight, requires_grad=False)
    head.bias = nn.Parameter(bias, requires_grad=False) if keep_bias else None
    head.out_features = vocab
    head.parts = (vocab,)
    lm.cfg = dataclasses.replace(lm.cfg, vocab_size=vocab)


def check_covers_tokenizer(tokenizer, vocab: int, who: str, whose: str) -> None:
    """ValueError unless every id of `tokenizer` (`whose`, for the message) is below `vocab`,
    the `who` model's rows: the rows past the tokenizer are padding, and a model missing a real
    token's row is not a padded variant of the other."""
    top = max(len(tokenizer), max(tokenizer.get_vocab().values(), default=-1) + 1)
    if top > vocab:
        raise ValueError(f"the {who}'s vocabulary ({vocab} rows) does not cover {whose} {top} token ids: a "
                         "draft may differ from the target only in padding rows past the tokenizer")
