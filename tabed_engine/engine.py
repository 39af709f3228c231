"""The public engine: load a target (and optionally a draft) LLaVA checkpoint, then
generate autoregressively or speculatively (TABED chain ensembles or draft trees)."""
from __future__ import annotations

import dataclasses
import functools
import inspect
import re
import secrets
import threading
import time
from typing import Any, Callable, Generator, Iterator, NamedTuple, Optional, Sequence

import torch

from .config import SamplingParams, check_int, check_real
from .ensemble import EnsembleConfig, EnsembleState
from .loader import LoadedLVLM, load_lvlm, load_processor, read_config
from .graphs import GraphCache
from .outputs import GenerationOutput, GenerationStats
from .model import KVCache
from .prompt import Prepared, prepare
from .sampling import pick_tokens
from .speculative import run_speculative
from .tree import parse_tree
from .views import resolve_escape_token

VIEW_NAMES = ("M", "T", "P", "C")
_BYTE_PIECE = re.compile(r"<0x[0-9A-Fa-f]{2}>")   # SentencePiece byte-fallback pieces
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
          "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}


def resolve_device(device) -> torch.device:
    """`device` (None, "cpu", "cuda", "cuda:N" or a torch.device) as a usable torch.device;
    None = CUDA when a GPU is usable, else the CPU."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            why = (f"this torch ({torch.__version__}) is a CPU-only build" if torch.version.cuda is None
                   else "this torch sees no CUDA GPU")
            raise ValueError(f"device={device!r} but {why}; use device='cpu'")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"device={device!r} but only {torch.cuda.device_count()} CUDA GPU(s) are visible")
    elif dev.type != "cpu":
        raise ValueError(f"device must be 'cpu' or 'cuda' (the engine runs on nothing else), got {device!r}")
    return dev


def resolve_dtype(dtype, device: torch.device) -> torch.dtype:
    """`dtype` (None, a torch.dtype or its name: "float32", "bfloat16", "float16", ...) as a
    torch.dtype; None = bfloat16 on CUDA, float32 on the CPU."""
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, str):
        key = dtype.lower().removeprefix("torch.")
        if key not in DTYPES:
            raise ValueError(f"dtype must be 'float32', 'bfloat16' or 'float16' (or a torch.dtype), got {dtype!r}")
        return DTYPES[key]
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype or its name, got {type(dtype).__name__} {dtype!r}")
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype}")
    return dtype


def _check_options(gamma, views, policy, window, weight_temperature, grid_step, max_len, pool_size,
                   captioner):
    """The constructor arguments that need no model (checked before any checkpoint loads).
    Returns (gamma, views, EnsembleConfig)."""
    gamma = check_int("gamma", gamma, 1)
    if isinstance(views, str):       # "M,T" as on the command line
        views = [v.strip() for v in views.split(",") if v.strip()]
    if not isinstance(views, (list, tuple)):
        raise TypeError(f"views must be a tuple of view names from {VIEW_NAMES}, got {type(views).__name__}")
    views = tuple(views)
    if not views or any(v not in VIEW_NAMES for v in views) or len(set(views)) != len(views):
        raise ValueError(f"views must be a non-empty subset of {VIEW_NAMES} without repeats, got {views}")
    window = check_int("window", window, 0)
    if weight_temperature is not None and check_real("weight_temperature", weight_temperature) <= 0:
        raise ValueError(f"weight_temperature must be > 0, got {weight_temperature}")
    check_real("grid_step", grid_step)
    for name, value in (("max_len", max_len), ("pool_size", pool_size)):
        if value is not None:
            check_int(name, value, 1)
    if captioner is not None and not callable(captioner):
        raise TypeError(f"captioner must be a callable (PIL image -> caption string), got "
                        f"{type(captioner).__name__}")
    return gamma, views, EnsembleConfig(policy=policy, window=window, temperature=weight_temperature,
                                        grid_step=grid_step, num_views=len(views))


class _Request(NamedTuple):
    """One validated request (what `_run` needs)."""

    prep: Prepared
    sp: SamplingParams
    caption: Any
    speculative: bool


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
        self.gamma, self.views, self.ensemble = _check_options(
            gamma, views, policy, window, weight_temperature, grid_step, max_len, pool_size, captioner)
        self.target, self.draft, self.processor = target, draft, processor
        weights = target.lm.embed_tokens.weight
        self.device = weights.device if device is None else resolve_device(device)
        self.dtype = weights.dtype if dtype is None else resolve_dtype(dtype, self.device)
        self.tokenizer = processor.tokenizer
        tcfg = target.lm.cfg
        self.max_len = self._max_len(max_len)
        # dynamic draft trees (tabed_engine.tree) instead of chains: None, True, a TreeConfig,
        # a dict of its fields or "DEPTHxWIDTHxBRANCH"
        self.tree = parse_tree(tree)
        # greedy first block with several views and a divergence policy: verify every view's
        # own chain as a branch of one tree (speculative.view_tree_block) instead of a mixture
        # chain drafted with weights that have no evidence yet
        self.view_tree = bool(view_tree)
        self.timing = timing
        self.captioner = captioner
        self.escape_token = self._escape_token(escape_token)
        self.tokens_per_image = self._tokens_per_image()
        self.pool_size = self._pool_size(pool_size)
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
        # the static caches, ensemble states and graphs are shared by every call: one
        # generation at a time (a stream holds the engine from its first next() to its end)
        self._lock = threading.Lock()      # not an RLock: a stream may be closed by another thread
        self._holder: Optional[int] = None   # the thread running (or last resuming) the generation
        self._prepare_lock = threading.Lock()   # the fast tokenizer is not safe to share across threads

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_pretrained(cls, target_dir: str, draft_dir: Optional[str] = None, device=None, dtype=None,
                        log: Optional[Callable[[str], Any]] = None, **kwargs) -> "Engine":
        """Load local HF LLaVA checkpoints (no network). device: "cpu", "cuda" (default when
        a GPU is usable) or "cuda:N"; dtype: a torch.dtype or "float32" / "bfloat16" /
        "float16" (default bfloat16 on CUDA, float32 on the CPU). log: optional callable
        receiving progress text ("loading target DIR ... ", "done in 2.1 s\n"). Other keyword
        arguments: views, policy, window, gamma, tree, max_len, escape_token, pool_size,
        captioner, weight_temperature, grid_step, view_tree (see the README); those that need
        no model are checked before anything loads."""
        device = resolve_device(device)
        dtype = resolve_dtype(dtype, device)
        try:
            bound = inspect.signature(cls.__init__).bind(None, None, None, **kwargs)
        except TypeError as e:
            raise TypeError(f"Engine.from_pretrained: {e}") from None
        bound.apply_defaults()
        args = bound.arguments
        _check_options(*(args[k] for k in ("gamma", "views", "policy", "window", "weight_temperature",
                                           "grid_step", "max_len", "pool_size", "captioner")))
        parse_tree(args["tree"])

        def load(what, fn, path):
            if log is None:
                return fn(path)
            t0 = time.perf_counter()
            log(f"loading {what} {path} ... ")
            try:
                out = fn(path)
            except BaseException:
                log("failed\n")
                raise
            log(f"done in {time.perf_counter() - t0:.1f} s\n")
            return out

        # the configs and the processor first: a wrong directory or a broken tokenizer fails
        # before gigabytes of weights are read
        for path in (target_dir, draft_dir):
            if path:
                read_config(path)
        processor = load_processor(target_dir)
        target = load("target", lambda p: load_lvlm(p, device, dtype), target_dir)
        draft = load("draft", lambda p: load_lvlm(p, device, dtype), draft_dir) if draft_dir else None
        return cls(target, processor, draft=draft, device=device, dtype=dtype, **kwargs)

    @property
    def lookahead(self) -> int:
        """Cache slots a speculative block may write past the committed tokens: γ for a chain,
        the tree's node count for a tree."""
        return self.gamma if self.tree is None else self.tree.nodes

    def _max_len(self, given: Optional[int]) -> int:
        """The static cache length: `given` (at most every model's max_position_embeddings,
        past which RoPE positions were never trained), else min(that, 4096)."""
        models = [("target", self.target)] + ([("draft", self.draft)] if self.draft is not None else [])
        which, limit = min(((w, m.lm.cfg.max_position_embeddings) for w, m in models), key=lambda x: x[1])
        if given is None:
            return min(limit, 4096)
        if given > limit:
            raise ValueError(f"max_len ({given}) exceeds the {which}'s max_position_embeddings ({limit})")
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
    # Thread safety: calls from several threads are served one at a time (each waits for the
    # engine), so every caller gets exactly its sequential answer. A stream holds the engine
    # from its first next() until it ends or is closed (or garbage-collected); a generate()
    # or another stream started meanwhile in the thread that runs the open stream would wait
    # for itself, so it raises RuntimeError instead (finish or close the stream first).
    def generate(self, prompt: Any, images=None, sampling: Optional[SamplingParams] = None,
                 caption=None, speculative: bool = True) -> GenerationOutput:
        """Generate a completion.

        prompt: a string with one `<image>` per image, a list of chat messages (rendered by
        the processor's chat template), or token ids (a list of ints or an integer tensor of
        shape [n] or [1, n]) with the image token where each image goes. One prompt per call.
        images: one image per placeholder, each a PIL image, or a numpy array or tensor
        (HWC or CHW, 1/3/4 channels) of uint8 values 0..255 or float values in [0, 1].
        caption: the C view's caption (a string, or one per image). speculative=False (or no
        draft) decodes autoregressively. Returns token ids, text and `GenerationStats`.
        Raises ValueError/TypeError on bad input (the engine stays usable) and RuntimeError
        when called while this thread has a stream of this engine open.
        """
        steps = self._steps(self._request(prompt, images, sampling, caption, speculative), stepwise=False)
        tokens: list[int] = []
        try:
            while True:
                tokens += next(steps)
        except StopIteration as stop:
            stats = stop.value
        return GenerationOutput(tokens, self.tokenizer.decode(tokens, skip_special_tokens=True), stats)

    def stream(self, prompt: Any, images=None, sampling: Optional[SamplingParams] = None,
               caption=None, speculative: bool = True) -> Generator[str, None, GenerationOutput]:
        """Like `generate`, but yields text pieces as tokens are accepted. The input is
        checked here, at the call; the generator's return value (`StopIteration.value`) is
        the `GenerationOutput`. The loop body runs outside the engine's inference mode. The
        engine is held until the stream ends: finish it or call its `close()`."""
        return self._text(self._steps(self._request(prompt, images, sampling, caption, speculative),
                                      stepwise=True))

    # ------------------------------------------------------------------ internals
    def _text(self, steps) -> Generator[str, None, GenerationOutput]:
        """Text pieces that join to the final text: the text of the tokens before a trailing
        run of byte-fallback pieces (`<0xCB>`: bytes decode as a group, and an incomplete
        group turns the bytes before it into U+FFFD too) is shown once it no longer ends in
        U+FFFD, and the rest at the end."""
        tokens: list[int] = []
        shown = ""
        try:
            while True:
                try:
                    new = next(steps)
                except StopIteration as stop:
                    stats = stop.value
                    break
                tokens += new
                stable = len(tokens)
                while stable and _BYTE_PIECE.fullmatch(self.tokenizer.convert_ids_to_tokens(tokens[stable - 1]) or ""):
                    stable -= 1
                text = self.tokenizer.decode(tokens[:stable], skip_special_tokens=True)
                if len(text) > len(shown) and text.startswith(shown) and not text.endswith("\ufffd"):
                    yield text[len(shown):]
                    shown = text
        finally:
            steps.close()          # a stream closed early releases the engine now
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        if len(text) > len(shown) and text.startswith(shown):
            yield text[len(shown):]
        return GenerationOutput(tokens, text, stats)

    def _steps(self, req: _Request, stepwise: bool) -> Generator[list[int], None, GenerationStats]:
        """The request's token blocks, holding the engine throughout. stepwise (streams): in
        inference mode only while the engine computes, not while the caller runs between
        blocks; else (generate, no caller code between blocks) in one inference-mode context
        (entering it per token would cost ~5 us a token in the AR loop)."""
        me = threading.get_ident()
        if self._holder == me:
            raise RuntimeError("this thread is already running a generation of this engine (an open "
                               "stream(): finish it or call its close() before starting another; the "
                               "engine runs one generation at a time)")
        self._lock.acquire()
        try:
            run = self._run(req)
            if not stepwise:
                with torch.inference_mode():
                    return (yield from run)
            while True:
                self._holder = threading.get_ident()   # a stream may be resumed by another thread
                with torch.inference_mode():
                    try:
                        new = next(run)
                    except StopIteration as stop:
                        return stop.value
                yield new
        finally:
            self._holder = None
            self._lock.release()

    def _request(self, prompt, images, sampling, caption, speculative) -> _Request:
        """Validate one request and tokenize it (no device work). Raises ValueError/TypeError."""
        sp = SamplingParams() if sampling is None else sampling
        if not isinstance(sp, SamplingParams):
            raise TypeError(f"sampling must be a SamplingParams (one per call), got {type(sp).__name__}")
        if not isinstance(speculative, bool):
            raise TypeError(f"speculative must be a bool, got {type(speculative).__name__}")
        with self._prepare_lock:
            prep = prepare(self.processor, prompt, images, self.target.image_token_id, self.tokens_per_image)
        vocab = self.target.lm.cfg.vocab_size
        if max(prep.ids) >= vocab:
            raise ValueError(f"prompt token id {max(prep.ids)} is outside the model's vocabulary ({vocab})")
        need = len(prep.ids) + sp.max_new_tokens + self.lookahead + 2
        if need > self.max_len:
            raise ValueError(f"prompt ({len(prep.ids)} tokens) + max_new_tokens ({sp.max_new_tokens}) "
                             f"+ draft lookahead exceeds the cache length {self.max_len}: lower "
                             "max_new_tokens or build the engine with a larger max_len")
        use_sd = speculative and self.draft is not None
        if caption is not None:
            if not (isinstance(caption, str) or (isinstance(caption, (list, tuple))
                                                 and all(isinstance(c, str) for c in caption))):
                raise TypeError(f"caption must be a string or a list of strings (one per image), got "
                                f"{type(caption).__name__}")
            if not isinstance(caption, str) and len(caption) != prep.num_images:
                raise ValueError(f"caption has {len(caption)} strings for {prep.num_images} image(s)")
        elif use_sd and "C" in self.views and self.captioner is None and prep.num_images > 0:
            raise ValueError("view 'C' needs a caption per image: pass caption= to generate() / stream() "
                             "(CLI: --caption) or give the engine a captioner")
        return _Request(prep, sp, caption, use_sd)

    def _run(self, req: _Request):
        """The request's decoding loop (a generator of token blocks returning the stats)."""
        # the engine's own generator, seeded from the OS when unseeded: torch's global RNG
        # (the user's) is neither reseeded nor advanced
        gen = torch.Generator(device=self.device)
        gen.manual_seed(req.sp.seed if req.sp.seed is not None else secrets.randbits(63))
        if req.speculative:
            return (yield from run_speculative(self, req.prep, req.sp, gen, req.caption))
        return (yield from self._run_ar(req.prep, req.sp, gen))

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
