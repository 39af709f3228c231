"""Draft views of one request (TABED): the same prompt shown to the draft four ways.

M  multimodal: the draft's own image features at the image tokens.
T  text-only: each image's token run replaced by one escape token: the tokenizer's newline
   token (`resolve_escape_token`), or, for a tokenizer without one, nothing (the image's
   tokens are dropped).
P  image-pooled: the draft's vision feature grid average-pooled (24×24 -> 12×12 default).
C  caption: each image replaced by the text "image: <caption>".
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from .prompt import Prepared


@dataclass
class ViewRow:
    ids: list[int]
    spans: list[tuple[int, int]]            # image-token runs in `ids`
    feats: list[torch.Tensor]               # projected features per span


def resolve_escape_token(tokenizer) -> Optional[int]:
    """The id of the token that stands alone for "\n" in `tokenizer`, or None.

    Tried in order: a single-token encoding of "\n" that decodes back to it (word-level and
    byte-level BPE tokenizers: "\n" or "Ċ"; not a tokenizer's unknown token); the
    byte-fallback piece `<0x0A>` (Llama-2 / Mistral SentencePiece, whose `encode("\n")` is
    `["▁", "<0x0A>"]` because of the dummy prefix); the last piece of `encode("\n")` when it
    alone decodes to a newline.
    """
    ids = tokenizer.encode("\n", add_special_tokens=False)
    if len(ids) == 1 and tokenizer.decode(ids) == "\n":
        return int(ids[0])
    byte = tokenizer.convert_tokens_to_ids("<0x0A>")
    if isinstance(byte, int) and byte != tokenizer.unk_token_id and 0 <= byte < len(tokenizer):
        return byte
    if ids and tokenizer.decode(ids[-1:]) == "\n":
        return int(ids[-1])
    return None


def pool_features(sel: torch.Tensor, size: int, has_cls: bool) -> torch.Tensor:
    """Average-pool a square feature grid. sel: [n, (1+) g*g, C] -> [n, (1+) size*size, C]."""
    cls, grid = (sel[:, :1], sel[:, 1:]) if has_cls else (sel[:, :0], sel)
    n, gg, C = grid.shape
    g = int(round(gg ** 0.5))
    if g * g != gg:
        raise ValueError(f"image features of {gg} tokens are not a square grid; P view cannot pool")
    if not 1 <= size <= g:
        raise ValueError(f"pool size must be in [1, {g}], got {size}")
    x = grid.transpose(1, 2).reshape(n, C, g, g).float()
    x = F.adaptive_avg_pool2d(x, size).reshape(n, C, size * size).transpose(1, 2).to(sel.dtype)
    return torch.cat([cls, x], dim=1)


def _replace_images(prep: Prepared, pieces: list[list[int]]) -> tuple[list[int], list[tuple[int, int]]]:
    """Rebuild `prep.ids` with image i's token run replaced by pieces[i]; returns the ids and
    the (start, length) of every piece."""
    out, spans, prev = [], [], 0
    for (start, n), piece in zip(prep.image_spans, pieces):
        out += prep.ids[prev:start]
        spans.append((len(out), len(piece)))
        out += piece
        prev = start + n
    return out + prep.ids[prev:], spans


def build_views(engine, prep: Prepared, target_sel: Optional[torch.Tensor],
                caption) -> list[ViewRow]:
    """One `ViewRow` per engine view, in `engine.views` order."""
    draft, target = engine.draft, engine.target
    sel = None
    if prep.num_images:
        same = (draft.vision_sd_hash == target.vision_sd_hash
                and draft.vision.feature_layer == target.vision.feature_layer
                and draft.vision.strategy == target.vision.strategy)
        sel = target_sel if same and target_sel is not None else \
            draft.vision.select(prep.pixel_values.to(engine.device))
    img_tok = target.image_token_id
    rows = []
    for v in engine.views:
        if v == "M" and sel is not None:
            feats = list(draft.vision.project(sel))
            ids, spans = _replace_images(prep, [[img_tok] * f.shape[0] for f in feats])
            rows.append(ViewRow(ids, spans, feats))
        elif v == "P" and sel is not None:
            g = int(round((sel.shape[1] - (draft.vision.strategy == "full")) ** 0.5))
            pooled = pool_features(sel, engine.pool_size or max(g // 2, 1), draft.vision.strategy == "full")
            feats = list(draft.vision.project(pooled))
            ids, spans = _replace_images(prep, [[img_tok] * f.shape[0] for f in feats])
            rows.append(ViewRow(ids, spans, feats))
        elif v == "T" and sel is not None:
            escape = [] if engine.escape_token is None else [engine.escape_token]
            ids, _ = _replace_images(prep, [escape] * prep.num_images)
            rows.append(ViewRow(ids, [], []))
        elif v == "C" and sel is not None:
            caps = _captions(engine, prep, caption)
            pieces = [engine.tokenizer.encode("image: " + c, add_special_tokens=False) for c in caps]
            ids, _ = _replace_images(prep, pieces)
            rows.append(ViewRow(ids, [], []))
        else:  # text-only request: every view is the plain prompt
            rows.append(ViewRow(list(prep.ids), [], []))
    return rows


def _captions(engine, prep: Prepared, caption) -> list[str]:
    n = prep.num_images
    if caption is not None:
        caps = [caption] * n if isinstance(caption, str) else list(caption)
    elif engine.captioner is not None:
        caps = [engine.captioner(im) for im in prep.images]
    else:
        raise ValueError("view 'C' needs caption= in generate() or a captioner given to the engine")
    if len(caps) != n or not all(isinstance(c, str) for c in caps):
        raise ValueError(f"caption must be a string or a list of {n} strings (one per image)")
    return caps
