"""What an engine's models and options allow, worked out once at construction: the cache
length, the KV page pool that fits the GPU's memory, the P view's pool size, the T view's escape
token, the image-token counts and the stop ids."""
from __future__ import annotations

import os
from typing import Optional

import torch

from tabed_engine.engine.options import check_kv_cache_tokens
from tabed_engine.models.safetensors_io import read_json
from tabed_engine.speculation.views import resolve_escape_token


class EngineLimits:
    """`Engine`'s construction-time checks (a mixin: it reads the loaded models and options)."""

    def _max_len(self, given: Optional[int]) -> int:
        """The static cache length of the target's rows: `given` (at most the target's
        max_position_embeddings, past which its RoPE positions were never trained), else
        min(that, 4096). The draft's rows are bounded by the draft's own limit (`draft_len`)."""
        limit = self.target.lm.cfg.max_position_embeddings
        if given is None:
            return min(limit, 4096)
        if given > limit:
            raise ValueError(f"max_len ({given}) exceeds the target's max_position_embeddings ({limit})")
        return given

    def _pool_size(self, given: Optional[int]) -> Optional[int]:
        """The P view's pooled grid side: at most the draft's vision grid side."""
        if given is None or self.draft is None:
            return given
        vc = self.draft.config.get("vision_config", {})
        grid = vc.get("image_size", 336) // vc.get("patch_size", 14)
        if given > grid:
            raise ValueError(f"pool_size must be in [1, {grid}] (the draft's vision grid is {grid}x{grid}), "
                             f"got {given}")
        return given

    def _escape_token(self, given: Optional[int]) -> Optional[int]:
        """The T view's image escape: `given`, else the tokenizer's newline token, else None
        (the T view then drops each image's tokens)."""
        if given is None:
            return resolve_escape_token(self.tokenizer)
        vocab = self.target.lm.cfg.vocab_size
        if isinstance(given, bool) or not isinstance(given, int) or not 0 <= given < vocab:
            raise ValueError(f"escape_token must be a token id in [0, {vocab}), got {given!r}")
        return given

    def _tokens_per_image(self):
        """The target's image-token count: an int for a fixed grid (LLaVA-1.5), else (any
        resolution: LLaVA-NeXT; dynamic resolution: Qwen2.5-VL) a function of a request's PIL images returning one count per
        image, as the processor expands them (`prepare` takes either)."""
        vision = self.target.vision
        if vision.fixed_tokens is None:
            return lambda images: vision.tokens_per_image([(im.height, im.width) for im in images])
        return vision.fixed_tokens

    def _eos_ids(self) -> set[int]:
        """The tokenizer's EOS, the text config's, and generation_config.json's (where
        transformers' `generate` reads its stop ids: Qwen2.5-VL lists <|im_end|> and
        <|endoftext|> there)."""
        ids = set()
        if self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        gen = os.path.join(self.target.path, "generation_config.json")
        gen_eos = read_json(gen).get("eos_token_id") if os.path.isfile(gen) else None
        for eos in (self.target.config.get("text_config", {}).get("eos_token_id"), gen_eos):
            for e in (eos if isinstance(eos, list) else [eos]):
                if e is not None:
                    ids.add(int(e))
        return ids

    def _kv_cache_tokens(self, given: Optional[int], max_batch: int, fraction: float) -> int:
        """The KV page pool's size in target tokens (`Engine(kv_cache_tokens=)`; the draft's pool
        holds K times as many): `given`, which must fit in `fraction` of the GPU's free memory,
        else max_batch * max_len (an unpaged cache's memory), cut to the whole rows of max_len
        that fit. The batch slots stay `max_batch` either way: requests shorter than max_len
        share the pool, and one that finds it full waits (`engine/pages.py`)."""
        check_kv_cache_tokens(given)
        if given is None:
            return self._max_batch(max_batch, fraction) * self.max_len
        rows = -(-given // self.max_len)
        fit = self._max_batch(rows, fraction)
        if fit < rows:
            raise ValueError(f"kv_cache_tokens={given} does not fit in {fraction:.0%} of the GPU's free memory "
                             f"(about {fit * self.max_len} tokens do): lower kv_cache_tokens")
        return given

    def _max_batch(self, given: int, fraction: float) -> int:
        """Whole rows of max_len whose KV fits in `fraction` of the GPU's free memory, at most
        `given`. Raises ValueError when not even one does."""
        per_token = lambda m: 2 * m.lm.cfg.num_layers * m.lm.cfg.num_kv_heads * m.lm.cfg.head_dim  # noqa: E731
        K = len(self.views) if self.draft is not None else 0
        row = (per_token(self.target) + (K * per_token(self.draft) if K else 0)) * self.max_len
        row *= torch.finfo(self.dtype).bits // 8
        if self.device.type != "cuda":
            return given
        free, _ = torch.cuda.mem_get_info(self.device)
        fit = int(free * fraction // row)
        if fit < 1:
            raise ValueError(f"the KV cache of one request ({row / 2**30:.2f} GiB at max_len {self.max_len}) does "
                             f"not fit in {fraction:.0%} of the GPU's free memory ({free / 2**30:.2f} GiB): "
                             "lower max_len")
        return min(given, fit)
