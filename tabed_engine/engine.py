"""The public engine: load a target (and optionally a draft) LLaVA checkpoint, then
generate autoregressively or speculatively (TABED chain ensembles or draft trees)."""
from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, Callable, Iterator, Optional, Sequence

import torch

from .config import SamplingParams
from .ensemble import EnsembleConfig, EnsembleState
from .loader import LoadedLVLM, load_lvlm, load_processor
from .graphs import GraphCache
from .outputs import GenerationOutput, GenerationStats
from .model import KVCache
from .prompt import Prepared, prepare
from .sampling import pick_tokens
from .speculative import run_speculative
from .views import resolve_escape_token

VIEW_NAMES = ("M", "T", "P", "C")


class Engine:
    """Speculative-decoding engine for LLaVA-family models.

    Use `Engine.from_pretrained(target_dir, draft_dir, ...)`; see `generate` and `stream`.
    """

    def __init__(self, target: LoadedLVLM, processor, *, draft: Optional[LoadedLVLM] = None,
                 device=None, dtype=None, views: Sequence[str] = ("M", "T"), policy: str = "hedge",
                 window: int = 0, gamma: int = 5, tree=None, max_len: Optional[int] = None,
                 escape_token: Optional[int] = None, pool_size: Optional[int] = None,
                 captioner: Optional[Callable] = None, weight_temperature: Optional[float] = None,
                 grid_step: float = 0.1, timing: bool = False, cuda_graphs: bool = True,
                 view_tree: bool = True):
        self.target, self.draft, self.processor = target, draft, processor
        self.device = torch.device(device or target.lm.embed_tokens.weight.device)
        self.dtype = dtype or target.lm.embed_tokens.weight.dtype
        self.tokenizer = processor.tokenizer
        tcfg = target.lm.cfg
        self.max_len = int(max_len or min(tcfg.max_position_embeddings, 4096))
        if gamma < 1:
            raise ValueError(f"gamma must be >= 1, got {gamma}")
        self.gamma = gamma
        if tree is not None:
            # the tree kernels exist (tree_attention, verify_tree, compact_kv) but the decoding
            # loop only drafts chains: refuse rather than silently decode something else
            raise ValueError("draft trees (tree=...) are not supported by the engine yet; use chains")
        self.tree = None
        # greedy first block with several views and a divergence policy: verify every view's
        # own chain as a branch of one tree (speculative.view_tree_block) instead of a mixture
        # chain drafted with weights that have no evidence yet
        self.view_tree = bool(view_tree)
        self.timing = timing
        views = tuple(views)
        if not views or any(v not in VIEW_NAMES for v in views) or len(set(views)) != len(views):
            raise ValueError(f"views must be a non-empty subset of {VIEW_NAMES} without repeats, got {views}")
        self.views = views
        self.ensemble = EnsembleConfig(policy=policy, window=window, temperature=weight_temperature,
                                       grid_step=grid_step, num_views=len(views))
        self.captioner = captioner
        self.escape_token = self._escape_token(escape_token)
        self.tokens_per_image = self._tokens_per_image()
        self.pool_size = pool_size
        if draft is not None:
            if draft.lm.cfg.vocab_size != tcfg.vocab_size:
                raise ValueError(f"draft vocabulary ({draft.lm.cfg.vocab_size}) differs from the "
                                 f"target's ({tcfg.vocab_size})")
            if draft.image_token_id != target.image_token_id:
                raise ValueError("draft and target use different image token ids")
        self.eos_ids = self._eos_ids()
        # one static cache per (model, rows), kept for the engine's life: captured graphs
        # hold pointers into them
        self._caches: dict[tuple[str, int], KVCache] = {}
        self._ens_states: dict = {}
        # benchmark only: f(block_index) -> accepted drafts, overriding verification (NOT
        # lossless); lets benchmarks run a fixed acceptance schedule with everything else real
        self.bench_accept_schedule: Optional[Callable[[int], int]] = None
        self.graphs = GraphCache() if cuda_graphs and self.device.type == "cuda" else None

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_pretrained(cls, target_dir: str, draft_dir: Optional[str] = None, device=None, dtype=None,
                        **kwargs) -> "Engine":
        """Load local HF LLaVA checkpoints (no network). device defaults to CUDA when present;
        dtype to bfloat16 on CUDA and float32 on the CPU. Other keyword arguments: views,
        policy, window, gamma, tree, max_len, escape_token, pool_size, captioner,
        weight_temperature, grid_step, view_tree (see the README)."""
        device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if dtype is None:
            dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        target = load_lvlm(target_dir, device, dtype)
        draft = load_lvlm(draft_dir, device, dtype) if draft_dir else None
        return cls(target, load_processor(target_dir), draft=draft, device=device, dtype=dtype, **kwargs)

    def _escape_token(self, given: Optional[int]) -> Optional[int]:
        """The T view's image escape: `given`, else the tokenizer's newline token, else None
        (the T view then drops each image's tokens)."""
        if given is None:
            return resolve_escape_token(self.tokenizer)
        vocab = self.target.lm.cfg.vocab_size
        if isinstance(given, bool) or not isinstance(given, int) or not 0 <= given < vocab:
            raise ValueError(f"escape_token must be a token id in [0, {vocab}), got {given!r}")
        return given

    def _tokens_per_image(self) -> int:
        vc = self.target.config.get("vision_config", {})
        grid = (vc.get("image_size", 336) // vc.get("patch_size", 14)) ** 2
        return grid + (1 if self.target.config.get("vision_feature_select_strategy", "default") == "full" else 0)

    def _eos_ids(self) -> set[int]:
        ids = set()
        if self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        eos = self.target.config.get("text_config", {}).get("eos_token_id")
        for e in (eos if isinstance(eos, list) else [eos]):
            if e is not None:
                ids.add(int(e))
        return ids

    # ------------------------------------------------------------------ caches
    def target_cache(self, rows: int) -> KVCache:
        return self._cache("target", self.target, rows)

    def draft_cache(self, rows: int) -> KVCache:
        return self._cache("draft", self.draft, rows)

    def _cache(self, which: str, model: LoadedLVLM, rows: int) -> KVCache:
        c = self._caches.get((which, rows))
        if c is None:
            with torch.inference_mode(False):   # normal tensors: usable in and out of inference mode
                c = self._caches[(which, rows)] = KVCache(model.lm.cfg, rows, self.max_len, self.device,
                                                          self.dtype)
        c.lengths.zero_()
        return c

    def ensemble_state(self, batch: int, positions: int):
        """The (reset) ensemble history for `batch` requests and at least `positions` recorded
        positions; kept per capacity (a power of two) so captured graphs stay valid."""
        cap = 1 << max(6, (positions - 1).bit_length())
        key = (batch, cap, dataclasses.astuple(self.ensemble))
        st = self._ens_states.get(key)
        if st is None:
            with torch.inference_mode(False):
                st = self._ens_states[key] = EnsembleState(self.ensemble, batch, cap, self.device)
        st.reset()
        return st

    def run_graph(self, key, fn, inputs: dict, kv_len: Optional[int] = None):
        """fn(**inputs) as a captured CUDA graph (per key) on the GPU; eagerly with a bucketed
        attention span (`kv_len`) elsewhere."""
        if self.graphs is not None:
            return self.graphs.run(key, fn, inputs)
        return fn(**inputs, kv_len=kv_len)

    def kv_bucket(self, needed: int) -> int:
        """Attend over a bucketed cache prefix (fewer bytes than S_max, few distinct shapes)."""
        return min(self.max_len, -(-needed // 128) * 128)

    # ------------------------------------------------------------------ public API
    def generate(self, prompt: Any, images=None, sampling: Optional[SamplingParams] = None,
                 caption: Optional[str] = None, speculative: bool = True) -> GenerationOutput:
        """Generate a completion.

        prompt: a string with one `<image>` per image, a list of chat messages (rendered by
        the processor's chat template), or a list of token ids with the image token where each
        image goes. images: PIL images, HWC uint8 arrays or tensors. speculative=False (or no
        draft) decodes autoregressively. Returns token ids, text and `GenerationStats`.
        """
        tokens: list[int] = []
        run = self._run(prompt, images, sampling, caption, speculative)
        try:
            while True:
                tokens += next(run)
        except StopIteration as stop:
            stats = stop.value
        return GenerationOutput(tokens, self.tokenizer.decode(tokens, skip_special_tokens=True), stats)

    def stream(self, prompt: Any, images=None, sampling: Optional[SamplingParams] = None,
               caption: Optional[str] = None, speculative: bool = True) -> Iterator[str]:
        """Like `generate`, but yields text pieces as tokens are accepted."""
        tokens: list[int] = []
        shown = ""
        for new in self._run(prompt, images, sampling, caption, speculative):
            tokens += new
            text = self.tokenizer.decode(tokens, skip_special_tokens=True)
            if len(text) > len(shown) and not text.endswith("\ufffd"):
                yield text[len(shown):]
                shown = text

    # ------------------------------------------------------------------ internals
    def _run(self, prompt, images, sampling, caption, speculative):
        sp = sampling or SamplingParams()
        if not isinstance(sp, SamplingParams):
            raise TypeError("sampling must be a SamplingParams")
        prep = prepare(self.processor, prompt, images, self.target.image_token_id, self.tokens_per_image)
        need = len(prep.ids) + sp.max_new_tokens + self.gamma + 2
        if need > self.max_len:
            raise ValueError(f"prompt ({len(prep.ids)} tokens) + max_new_tokens ({sp.max_new_tokens}) "
                             f"+ draft lookahead exceeds the cache length {self.max_len}")
        use_sd = speculative and self.draft is not None
        if use_sd and "C" in self.views and caption is None and self.captioner is None \
                and prep.num_images > 0:
            raise ValueError("view 'C' needs caption= in generate() or a captioner given to the engine")
        gen = torch.Generator(device=self.device)
        gen.manual_seed(sp.seed if sp.seed is not None else torch.seed() % (2 ** 63))
        with torch.inference_mode():
            if use_sd:
                return (yield from run_speculative(self, prep, sp, gen, caption))
            return (yield from self._run_ar(prep, sp, gen))

    def sync(self):
        if self.timing and self.device.type == "cuda":
            torch.cuda.synchronize()

    def encode_images(self, model: LoadedLVLM, prep: Prepared) -> Optional[torch.Tensor]:
        """Projected image features [n_images, tokens, hidden] for `model`."""
        if prep.pixel_values is None:
            return None
        return model.vision(prep.pixel_values.to(self.device))

    @staticmethod
    def embed(model: LoadedLVLM, ids: list[int], spans, feats) -> torch.Tensor:
        """Token embeddings [len(ids), hidden] with image features placed at each span."""
        dev = model.lm.embed_tokens.weight.device
        x = model.lm.embed_tokens(torch.tensor(ids, device=dev))
        for i, (start, n) in enumerate(spans):
            if feats[i].shape[0] != n:
                raise ValueError(f"image {i} has {feats[i].shape[0]} features for {n} image tokens")
            x[start:start + n] = feats[i].to(x.dtype)
        return x

    def prefill_target(self, prep: Prepared):
        """Encode images, prefill the target's cache (1 row) and return
        (cache, logits of the last prompt position [1, V], pre-projector image features)."""
        lm, n = self.target.lm, len(prep.ids)
        sel = None if prep.pixel_values is None else \
            self.target.vision.select(prep.pixel_values.to(self.device))
        feats = None if sel is None else self.target.vision.project(sel)
        cache = self.target_cache(1)
        x = self.embed(self.target, prep.ids, prep.image_spans, feats)
        pos = torch.arange(n, device=self.device)[None]
        logits = lm(cache, pos, embeds=x[None], logits_index=torch.tensor([[n - 1]], device=self.device),
                    kv_len=self.kv_bucket(n), fresh=True)[:, -1]
        cache.lengths += n
        return cache, logits, sel

    def _run_ar(self, prep: Prepared, sp: SamplingParams, gen):
        """Autoregressive decoding, pipelined one step deep: step t + 1 is queued on the device
        (its input token never leaves the device) before the host waits for token t, so the
        GPU does not idle while the host reads a token and launches the next step. When token
        t turns out to be EOS, the queued step is discarded (its KV lands past the sequence;
        the tokens are those of the unpipelined loop, and the sampler's draws for emitted
        tokens come in the same order)."""
        stats = GenerationStats(speculative=False, prompt_tokens=len(prep.ids))
        t0 = time.perf_counter()
        cache, logits, _ = self.prefill_target(prep)
        if self.timing:
            self.sync()
            stats.time_prefill = time.perf_counter() - t0
        step_fn = functools.partial(decode_step, self.target.lm, cache)
        length = len(prep.ids)
        cuda = self.device.type == "cuda"
        host = torch.empty(1, dtype=torch.long, pin_memory=cuda)
        ready = torch.cuda.Event() if cuda else None
        tok = pick_tokens(logits, sp, gen)              # [1], on the device
        for step in range(sp.max_new_tokens):
            host.copy_(tok, non_blocking=True)
            if ready is not None:
                ready.record()
            last = step == sp.max_new_tokens - 1
            if not last:                                # queue step + 1 before waiting for token step
                logits = self.run_graph(("ar", 1), step_fn, {"tok": tok[:, None], "lens": cache.lengths},
                                        kv_len=self.kv_bucket(length + 1))
                cache.lengths += 1
                length += 1
                nxt = pick_tokens(logits, sp, gen)
            if ready is not None:
                ready.synchronize()                     # the step's one host wait
            t = int(host[0])
            if step == 0:
                stats.time_first_token = time.perf_counter() - t0
            stats.new_tokens += 1
            yield [t]
            if last or (sp.stop_at_eos and t in self.eos_ids):
                break
            stats.target_forwards += 1
            tok = nxt
        self.sync()
        stats.time_total = time.perf_counter() - t0
        return stats


def decode_step(lm, cache: KVCache, tok: torch.Tensor, lens: torch.Tensor,
                kv_len: Optional[int] = None) -> torch.Tensor:
    """One autoregressive step: tok [R, 1] written at slots lens [R]; returns logits [R, V].
    Idempotent in its inputs (the caller advances the lengths), as a captured graph's
    warm-up run must be."""
    return lm(cache, lens.long()[:, None], input_ids=tok, lengths=lens, kv_len=kv_len)[:, -1]
