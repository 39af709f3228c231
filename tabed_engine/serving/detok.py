"""Incremental detokenization (vLLM / TGI's prefix and read offsets): a request's text is
decoded a short window at a time instead of whole every block, so streaming and stop strings
cost O(new tokens) host time per block rather than O(all tokens)."""
from __future__ import annotations

import re

_BYTE_PIECE = re.compile(r"<0x[0-9A-Fa-f]{2}>")   # SentencePiece byte-fallback pieces


class Detokenizer:
    """The text of a growing list of token ids, final up to `read`.

    `ids[prefix:read]` is the window decoded in front of the new tokens: decoding it alone and
    with the new tokens and keeping the difference gives the new tokens' text as the whole
    sequence's decode has it (SentencePiece strips one leading space of a decode; a window
    that starts after earlier text keeps the new tokens' spaces). Text is made final only
    where it cannot change any more:

    * not before a trailing run of byte-fallback pieces: the bytes decode as one group and an
      incomplete group turns all of its bytes, complete characters too, into U+FFFD;
    * not when it ends in U+FFFD (an incomplete UTF-8 sequence of byte-level BPE);
    * the window never starts inside a byte group (`read` only ever ends after a whole one);
      a window whose text alone is empty (a lone "▁", skipped special tokens) is not taken:
      the older one grows instead, so a decoder that drops the leading space of the first
      token it sees can never drop a new token's.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.prefix = self.read = 0
        self._prefix_text = ""            # decode(ids[prefix:read])

    def _decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _is_byte(self, t: int) -> bool:
        return _BYTE_PIECE.fullmatch(self.tokenizer.convert_ids_to_tokens(t) or "") is not None

    def update(self, ids: list[int], end: int, tail: bool = False) -> tuple[str, str]:
        """Advance over ids[read:end]. Returns (the text made final, the text of ids[read:end]
        still pending after it, which may end in U+FFFD); the pending text is decoded only
        when `tail` (stop strings look at it: the whole decode at this token holds it)."""
        stable = end
        while stable > self.read and self._is_byte(ids[stable - 1]):
            stable -= 1
        n = len(self._prefix_text)
        full = self._decode(ids[self.prefix:end]) if end > self.read and (tail or stable == end) else None
        done = ""
        if stable > self.read:
            # ids[stable:end] are byte pieces of a group of their own: `text` is a prefix of `full`
            text = full if stable == end else self._decode(ids[self.prefix:stable])
            if len(text) > n and not text.endswith("\ufffd"):
                done = text[n:]
                window = self._decode(ids[self.read:stable])
                if window:
                    self.prefix, self._prefix_text = self.read, window
                else:                     # keep the older window: see the class docstring
                    self._prefix_text = text
                self.read = stable
        return done, (full[n + len(done):] if tail and full is not None else "")
