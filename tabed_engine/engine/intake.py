"""Request intake: every input of a call checked and tokenized before any device work, and
the cache room each request gets (the prompt, its new tokens and the draft's lookahead within
the target's cache, the draft views' position limit and the KV page pool)."""
from __future__ import annotations

import secrets
from typing import Optional

import torch

from tabed_engine.config import SamplingParams
from tabed_engine.engine.pages import check_pool
from tabed_engine.engine.prompt import pixels, prepare
from tabed_engine.engine.request import Request
from tabed_engine.speculation.views import _captions, view_lengths


class RequestIntake:
    """`Engine`'s input side (a mixin: it reads the engine's models, processor and options)."""

    def _draft_room(self, prep, caption, mask, sp: SamplingParams, room: int):
        """A speculative request's draft views must hold their prompt, the new tokens and the
        lookahead within `draft_len` (the draft's max_position_embeddings when it is shorter
        than the target's cache). Returns (caption, room): the caption the C view will use and
        the tokens both caches hold after the prompts. Raises ValueError naming the numbers."""
        skip = frozenset(v for v, m in zip(self.views, mask or ()) if not m)
        with self._prepare_lock:                      # (captions given: the tokenizer encodes them)
            lengths = view_lengths(self, prep, caption, skip)
        if None in lengths and self.draft_len < self.max_len:
            # the C view's length needs its captions: the captioner runs now instead of at prefill
            caption = _captions(self, prep, None)
            with self._prepare_lock:
                lengths = view_lengths(self, prep, caption, skip)
        known = [n for n in lengths if n is not None]    # (None: the runner checks it at prefill)
        if not known:
            return caption, room
        longest = max(known)
        limit = (f"the draft's max_position_embeddings ({self.draft_len})" if self.draft_len < self.max_len
                 else f"the cache length {self.max_len}")
        droom = self._check_room(sp, self.draft_len - longest, f"a draft view of {longest} tokens", limit,
                                 "shorten the prompt or decode without the draft (speculative=False)")
        # (within the target's cache the runner fits max_new_tokens=None to the views at prefill)
        return caption, min(room, droom) if self.draft_len < self.max_len else room

    def _check_room(self, sp: SamplingParams, free: int, what: str, limit: str, advice: str) -> int:
        """The new tokens a cache holds when `free` of its slots are left after `what` (the
        prompt, or a draft view), less the draft lookahead; raises ValueError naming the numbers
        when that is none, or fewer than sp.max_new_tokens."""
        room = free - self.lookahead - 2
        if sp.max_new_tokens is None and room < 1:
            raise ValueError(f"{what} + draft lookahead ({self.lookahead} + 2) exceeds {limit} (no room for new "
                             f"tokens): {advice}")
        if sp.max_new_tokens is not None and sp.max_new_tokens > room:
            raise ValueError(f"{what} + max_new_tokens ({sp.max_new_tokens}) + draft lookahead ({self.lookahead} "
                             f"+ 2) exceeds {limit}: lower max_new_tokens (at most {max(room, 0)} here), {advice}")
        return room

    def _requests(self, prompt, images, sampling, caption, captions, speculative, batch, views=None,
                  videos=None) -> list[Request]:
        """Validate every request of a call before any work. Raises ValueError/TypeError naming
        the prompt's index for a list call."""
        if not batch:
            if captions is not None:
                raise TypeError("captions= is for a list of prompts; pass caption= with one prompt")
            return [self._request(prompt, images, sampling, caption, speculative, views=views, videos=videos)]
        if caption is not None:
            raise TypeError("caption= is for one prompt; pass captions= (one per prompt) with a list of prompts")
        prompts = list(prompt) if not isinstance(prompt, torch.Tensor) else [p for p in prompt]
        n = len(prompts)

        def per_prompt(name, value, single):
            if value is None or single(value):
                return [value] * n
            if not isinstance(value, (list, tuple)) or len(value) != n:
                raise ValueError(f"{name} must be one value for all prompts or a list of {n} (one per prompt)")
            return list(value)
        imgs = [None] * n if images is None else images
        if not isinstance(imgs, (list, tuple)) or len(imgs) != n:
            raise ValueError(f"images must be a list of {n} image lists (one per prompt, None or [] for none)")
        vids = [None] * n if videos is None else videos
        if not isinstance(vids, (list, tuple)) or len(vids) != n:
            raise ValueError(f"videos must be a list of {n} video lists (one per prompt, None or [] for none)")
        sps = per_prompt("sampling", sampling, lambda v: isinstance(v, SamplingParams))
        caps = per_prompt("captions", captions, lambda v: False)
        vws = per_prompt("views", views, lambda v: isinstance(v, str) or all(isinstance(x, str) for x in v))
        reqs = []
        for i in range(n):
            try:
                reqs.append(self._request(prompts[i], imgs[i], sps[i], caps[i], speculative, views=vws[i],
                                          videos=vids[i]))
            except (ValueError, TypeError) as e:
                raise type(e)(f"prompt {i}: {e}") from None
        return reqs

    def _request(self, prompt, images, sampling, caption, speculative, request_id=None, views=None,
                 videos=None) -> Request:
        """Validate one request and tokenize it (no device work). Raises ValueError/TypeError."""
        sp = SamplingParams() if sampling is None else sampling
        if not isinstance(sp, SamplingParams):
            raise TypeError(f"sampling must be a SamplingParams, got {type(sp).__name__}")
        if not isinstance(speculative, bool):
            raise TypeError(f"speculative must be a bool, got {type(speculative).__name__}")
        if request_id is not None and not isinstance(request_id, str):
            raise TypeError(f"request_id must be a string, got {type(request_id).__name__}")
        with self._prepare_lock:
            prep = prepare(self.processor, prompt, images, self.target.image_token_id, self.tokens_per_image,
                           with_pixels=not self.device_images, videos=videos,
                           video_token_id=self.target.video_token_id,
                           video_tokens=getattr(self.target.vision, "video_tokens", None))
        vocab = self.target.lm.cfg.vocab_size
        if max(prep.ids) >= vocab:
            raise ValueError(f"prompt token id {max(prep.ids)} is outside the model's vocabulary ({vocab})")
        bad = [t for t in sp.stop_token_ids if t >= vocab]
        if bad:
            raise ValueError(f"stop_token_ids {bad} are outside the model's vocabulary ({vocab})")
        room = self._check_room(sp, self.max_len - len(prep.ids), f"the prompt ({len(prep.ids)} tokens)",
                                f"the cache length {self.max_len}",
                                "shorten the prompt or build the engine with a larger max_len")
        use_sd = speculative and self.draft is not None
        mask = self._view_mask(views)
        if use_sd and self.draft_processor is not None and prep.num_images and not self.draft_device_images:
            with self._prepare_lock:
                prep.draft_pixel_values = pixels(self.draft_processor, prep.images)
        if caption is not None:
            if not (isinstance(caption, str) or (isinstance(caption, (list, tuple))
                                                 and all(isinstance(c, str) for c in caption))):
                raise TypeError(f"caption must be a string or a list of strings (one per image), got "
                                f"{type(caption).__name__}")
            if not isinstance(caption, str) and len(caption) != prep.num_images:
                raise ValueError(f"caption has {len(caption)} strings for {prep.num_images} image(s)")
        elif (use_sd and "C" in self.views and (mask is None or mask[self.views.index("C")])
              and self.captioner is None and prep.num_images > 0):
            raise ValueError("view 'C' needs a caption per image: pass caption= to generate() / stream() "
                             "(CLI: --caption) or give the engine a captioner")
        if use_sd:
            caption, room = self._draft_room(prep, caption, mask, sp, room)
        room = check_pool(self, len(prep.ids), sp.max_new_tokens, room, use_sd)   # within the KV pages
        # the request's own generator, seeded from the OS when unseeded: torch's global RNG
        # (the user's) is neither reseeded nor advanced
        gen = torch.Generator(device=self.device)
        gen.manual_seed(sp.seed if sp.seed is not None else secrets.randbits(63))
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        return Request(rid, prep, sp, caption, use_sd, gen, self.tokenizer, frozenset(self.eos_ids),
                       max_new=room if sp.max_new_tokens is None else sp.max_new_tokens, view_mask=mask)

    def _view_mask(self, views) -> Optional[tuple[bool, ...]]:
        """A request's `views=` as a mask over the engine's views (None: all)."""
        if views is None:
            return None
        if isinstance(views, str):
            views = [v.strip() for v in views.split(",") if v.strip()]
        if not isinstance(views, (list, tuple)) or not views or any(v not in self.views for v in views):
            raise ValueError(f"views must be a non-empty subset of the engine's views {self.views}, got {views!r}")
        mask = tuple(v in views for v in self.views)
        if all(mask):
            return None
        if self.ensemble.policy in ("w-grid", "confidence"):
            raise ValueError(f"per-request views need a policy of kld, tvd, hedge or uniform (the engine's is "
                             f"{self.ensemble.policy!r})")
        return mask
