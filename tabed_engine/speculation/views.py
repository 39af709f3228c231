"""Draft views of one request (TABED): the same prompt shown to the draft four ways.

M  multimodal: the draft's own image features at the image tokens.
T  text-only: each image's token run replaced by one escape token: the tokenizer's newline
   token (`resolve_escape_token`), or, for a tokenizer without one, nothing (the image's
   tokens are dropped).
P  image-pooled: the draft's vision feature grid average-pooled (24×24 -> 12×12 default;
   Qwen2.5-VL: each image's merged grid, and each temporal slice of a video's, over 2×2 windows,
   with its M-RoPE ids on the pooled grid; LLaVA-OneVision's videos keep M's features).
   Any-resolution (LLaVA-NeXT) drafts pool every tile's grid and the base tile's grid alike
   (g×g -> s×s), then pack the pooled tiles as the model packs full ones (anyres.py: unpadded
   to the image's aspect ratio at the pooled resolution, the newline after each pooled row,
   the pooled base first): s² + h_u(w_u + 1) tokens an image instead of g² + H_u(W_u + 1).
C  caption: each image replaced by the text "image: <caption>".

The draft sees its own preprocessing: with a draft of another image layout than the target's
(a LLaVA-1.5 draft for a LLaVA-NeXT target) `prep.draft_pixel_values` holds the draft
processor's pixels (computed here on the device when the engine preprocesses images there and
`image_ops` reproduces the draft's processor), and the M and P rows get the draft's own
image-token counts.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Union

import torch

from tabed_engine.engine.prompt import Prepared


@dataclass
class ViewRow:
    ids: list[int]
    spans: list[tuple[int, int]]            # image-token runs in `ids`
    # projected features per span, or a function computing them on first use (`features`): a
    # row whose images lie inside a cached prefix never runs the draft's vision tower
    feats: Union[list[torch.Tensor], Callable[[], list[torch.Tensor]]]
    positions: Optional[torch.Tensor] = None   # M-RoPE ids [3, len(ids)]; None: the slots

    def features(self) -> list[torch.Tensor]:
        """The projected features per span (computed here the first time when deferred)."""
        if callable(self.feats):
            self.feats = self.feats()
        return self.feats


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


def _replace_images(prep: Prepared, pieces: list[list[int]], video_pieces: Optional[list[list[int]]] = None
                    ) -> tuple[list[int], list[tuple[int, int]]]:
    """Rebuild `prep.ids` with image i's token run replaced by pieces[i] and video j's by
    video_pieces[j] (kept as it is without them); returns the ids and the (start, length) of
    every piece, the images' then the videos' (`prep.media_spans` order)."""
    vspans = prep.video_spans or []
    if video_pieces is None:
        video_pieces = [prep.ids[s:s + n] for s, n in vspans]
    runs = sorted(zip([*prep.image_spans, *vspans], [*pieces, *video_pieces], range(len(prep.image_spans) + len(vspans))))
    out, spans, prev = [], [None] * len(runs), 0
    for (start, n), piece, i in runs:
        out += prep.ids[prev:start]
        spans[i] = (len(out), len(piece))
        out += piece
        prev = start + n
    return out + prep.ids[prev:], spans


def build_views(engine, prep: Prepared, target_sel: Optional[torch.Tensor],
                caption, skip: frozenset = frozenset()) -> list[ViewRow]:
    """One `ViewRow` per engine view, in `engine.views` order. Views in `skip` (left out of the
    request's mixture) get the T view's row: it costs the least and needs no caption. The M and
    P rows' image features are deferred (`ViewRow.features`): their token counts follow from
    the images' sizes, and the draft's vision tower (and its preprocessing) runs only when a
    row's image tokens are prefilled, not when a cached prefix holds them."""
    draft, target = engine.draft, engine.target
    done: dict = {}

    def draft_sel() -> torch.Tensor:
        """The draft's selected image features (once per request)."""
        if "sel" not in done:
            own = prep.draft_pixel_values is not None or getattr(engine, "draft_processor", None) is not None
            same = (not own and draft.vision_sd_hash == target.vision_sd_hash
                    and draft.vision.feature_layer == target.vision.feature_layer
                    and draft.vision.strategy == target.vision.strategy)
            if same and target_sel is not None:
                done["sel"] = target_sel
            else:
                from tabed_engine.models.image_ops import device_pixels
                pixels = prep.draft_pixel_values if own else prep.pixel_values
                if pixels is None:     # preprocessed on the device (device_images), as the target's
                    proc = engine.draft_processor if own else engine.processor
                    pixels = device_pixels(prep.host_pixels(), proc.image_processor, engine.device)
                    if own:
                        prep.draft_pixel_values = pixels
                    else:
                        prep.pixel_values = pixels
                done["sel"] = draft.vision.select_images(pixels.to(engine.device), prep.image_sizes)
        return done["sel"]

    # videos: the draft's own frames' features in the M and P rows (P: `pool_video`, Qwen2.5-VL
    # pools each temporal slice's merged grid as it pools images; OneVision keeps M's, its frames
    # already pooled by the model), an escape token in the T and C rows
    nv = prep.num_videos
    vpix = [p.to(engine.device) for p in prep.video_pixels or []]
    vfeats = ([draft.vision.video_features(p) for p in vpix]
              if nv and any(v in ("M", "P") for v in engine.views if v not in skip) else [])
    vid_tok = target.video_token_id
    img_tok = target.image_token_id
    escape = [] if engine.escape_token is None else [engine.escape_token]
    media = prep.num_images > 0 or nv > 0
    rows = []
    for v in engine.views:
        v = "T" if v in skip else v
        if v in ("M", "P") and media:
            pool = 0 if v == "M" else engine.pool_size or draft.vision.default_pool
            counts = draft.vision.tokens_per_image(prep.image_sizes, pool=pool) if prep.num_images else []
            vf = [draft.vision.pool_video(f, p, pool) for f, p in zip(vfeats, vpix)]
            ids, spans = _replace_images(prep, [[img_tok] * n for n in counts],
                                         [[vid_tok] * f.shape[0] for f in vf])

            def feats(pool=pool, vf=vf):
                imgs = draft.vision.image_features(draft_sel(), prep.image_sizes, pool=pool) if prep.num_images else []
                return [*imgs, *vf]

            rows.append(ViewRow(ids, spans, feats,
                                draft.vision.positions(ids, spans[:len(counts)], prep.image_sizes, pool,
                                                       videos=[(s, p) for (s, _), p in zip(spans[len(counts):], vpix)])))
        elif v == "T" and media:
            ids, _ = _replace_images(prep, [escape] * prep.num_images, [escape] * nv)
            rows.append(ViewRow(ids, [], []))
        elif v == "C" and media:
            caps = _captions(engine, prep, caption)
            pieces = [engine.tokenizer.encode("image: " + c, add_special_tokens=False) for c in caps]
            ids, _ = _replace_images(prep, pieces, [escape] * nv)
            rows.append(ViewRow(ids, [], []))
        else:  # text-only request: every view is the plain prompt
            rows.append(ViewRow(list(prep.ids), [], []))
    return rows


def view_lengths(engine, prep: Prepared, caption, skip: frozenset = frozenset()) -> list[Optional[int]]:
    """Each view row's prompt length as `build_views` builds it, without a vision tower (the
    draft's image-token counts follow from its grid and the images' sizes); None for a C view
    whose captions the engine's captioner has yet to write (caption None)."""
    n, nv = prep.num_images, prep.num_videos
    if not n and not nv:
        return [len(prep.ids)] * len(engine.views)
    vision, sizes = engine.draft.vision, prep.image_sizes
    text = len(prep.ids) - sum(k for _, k in prep.media_spans)
    escaped = 0 if engine.escape_token is None else nv
    pool = engine.pool_size or vision.default_pool
    vids = sum(vision.video_tokens(p) for p in prep.video_pixels or [])
    out = []
    for v in engine.views:
        v = "T" if v in skip else v
        if v == "M":
            per = sum(vision.tokens_per_image(sizes)) + vids
        elif v == "P":
            per = (sum(vision.tokens_per_image(sizes, pool=pool))
                   + sum(vision.video_tokens(p, pool=pool) for p in prep.video_pixels or []))
        elif v == "T":
            per = 0 if engine.escape_token is None else n + nv
        elif caption is None and engine.captioner is not None and n:
            out.append(None)
            continue
        else:
            per = escaped + sum(len(engine.tokenizer.encode("image: " + c, add_special_tokens=False))
                                for c in _captions(engine, prep, caption))
        out.append(text + per)
    return out


def _captions(engine, prep: Prepared, caption) -> list[str]:
    n = prep.num_images
    if not n:
        return []
    if caption is not None:
        caps = [caption] * n if isinstance(caption, str) else list(caption)
    elif engine.captioner is not None:
        caps = [engine.captioner(im) for im in prep.images]
    else:
        raise ValueError("view 'C' needs caption= in generate() or a captioner given to the engine")
    if len(caps) != n or not all(isinstance(c, str) for c in caps):
        raise ValueError(f"caption must be a string or a list of {n} strings (one per image)")
    return caps
