"""The public engine: load a target (and optionally a draft) checkpoint of a supported family, then
generate autoregressively or speculatively (TABED chain ensembles or draft trees)."""
from __future__ import annotations

import inspect
import itertools
import threading
import time
from typing import Any, Callable, Generator, Iterator, Optional, Sequence

from tabed_engine.config import SamplingParams, check_int, check_real
from tabed_engine.engine.chunked import DEFAULT_PREFILL_CHUNK, check_prefill_chunk
from tabed_engine.engine.intake import RequestIntake
from tabed_engine.engine.limits import EngineLimits
from tabed_engine.engine.options import (KEEP, check_draft_vocab, check_options, check_same_tokenizer, is_batch,
                                          resolve_device, resolve_dtype)
from tabed_engine.engine.outputs import GenerationOutput
from tabed_engine.engine.request import Request, RequestOutput
from tabed_engine.engine.runner import Runner
from tabed_engine.engine.scheduler import CostModel, Scheduler
from tabed_engine.engine.warmup import run_warmup
from tabed_engine.models.decoder import cache_rows
from tabed_engine.models.loader import LoadedLVLM, image_layout, load_lvlm, load_processor, random_lvlm, read_config, vocab_size
from tabed_engine.models.vocab import fit_vocab
from tabed_engine.speculation.tree import parse_tree


class Engine(RequestIntake, EngineLimits):
    """Speculative-decoding engine for vision-language models (the families in models/registry.py).

    Use `Engine.from_pretrained(target_dir, draft_dir, ...)`; see `generate` and `stream`.
    """

    runner_class = Runner      # (a tensor-parallel rank 0 mirrors some runner calls to its workers)

    def __init__(self, target: LoadedLVLM, processor, *, draft: Optional[LoadedLVLM] = None,
                 device=None, dtype=None, views: Sequence[str] = ("M", "T"), policy: str = "hedge",
                 window: int = 0, gamma: int = 5, tree=None, max_len: Optional[int] = None,
                 escape_token: Optional[int] = None, pool_size: Optional[int] = None,
                 captioner: Optional[Callable] = None, weight_temperature: Optional[float] = None,
                 grid_step: float = 0.1, timing: bool = False, cuda_graphs: bool = True,
                 view_tree: bool = True, max_batch: int = 16, memory_fraction: float = 0.9,
                 adaptive: Optional[bool] = None, device_images: Optional[bool] = None, draft_processor=None,
                 prefill_chunk: Optional[int] = DEFAULT_PREFILL_CHUNK,
                 prefix_cache: bool = True, invariant: bool = False, kv_cache_tokens: Optional[int] = None,
                 mixed_steps: bool = False):
        self.gamma, self.views, self.ensemble = check_options(
            gamma, views, policy, window, weight_temperature, grid_step, max_len, pool_size, captioner)
        check_int("max_batch", max_batch, 1)
        if not 0.0 < check_real("memory_fraction", memory_fraction) <= 1.0:
            raise ValueError(f"memory_fraction must be in (0, 1], got {memory_fraction}")
        if adaptive is not None and not isinstance(adaptive, bool):
            raise TypeError(f"adaptive must be None or a bool, got {type(adaptive).__name__}")
        self.target, self.draft, self.processor = target, draft, processor
        weights = target.lm.embed_tokens.weight
        self.device = weights.device if device is None else resolve_device(device)
        self.dtype = weights.dtype if dtype is None else resolve_dtype(dtype, self.device)
        self.tokenizer = processor.tokenizer
        tcfg = target.lm.cfg
        self.max_len = self._max_len(max_len)
        # the draft's view rows end within its own position limit, which may be shorter than
        # the target's cache (a LLaVA-1.5 draft, 2048, for a LLaVA-NeXT target, 4096): checked
        # per request (`_draft_room`); the draft cache keeps max_len slots (the runner's layout)
        self.draft_len = (self.max_len if draft is None
                          else min(self.max_len, draft.lm.cfg.max_position_embeddings))
        # dynamic draft trees (tabed_engine.speculation.tree) instead of chains: None, True, a TreeConfig,
        # a dict of its fields or "DEPTHxWIDTHxBRANCH"
        self.tree = parse_tree(tree)
        # greedy first block with several views and a divergence policy: verify every view's
        # own chain as a branch of one tree (speculative.view_tree_block) instead of a mixture
        # chain drafted with weights that have no evidence yet
        self.view_tree = bool(view_tree)
        self.timing = timing
        # prompt tokens a scheduler step may prefill: a longer prompt is prefilled in chunks, the
        # running requests decoding between them (engine/chunked.py; None: whole prompts)
        self.prefill_chunk = prefill_chunk
        # a step's prompt chunks inside the running batch's AR step or chain verification: one
        # target forward (engine/chunked.py, mixed steps); off: the chunks and the block are two
        # forwards of the step. Greedy tokens are the same either way (float32). Off by default
        # until its GPU step times are measured against the graphed separate forwards
        self.mixed_steps = mixed_steps
        self.captioner = captioner
        self.escape_token = self._escape_token(escape_token)
        # (a vision side whose image grids follow the processor's settings takes them: Qwen2.5-VL's
        # min / max pixels)
        target.vision.bind_processor(getattr(processor, "image_processor", None))
        self.tokens_per_image = self._tokens_per_image()
        self.pool_size = self._pool_size(pool_size)
        shared = None          # a draft of another (padded) vocabulary size: the range both have
        if draft is not None:
            if draft.image_token_id != target.image_token_id:
                raise ValueError("draft and target use different image token ids")
            if draft.lm.cfg.vocab_size != tcfg.vocab_size:
                # published pairs pad to different row counts (152000 vs 152128): the tokenizers
                # must agree on the shared range, then the draft's head and embedding are fitted
                # to the target's vocabulary once, here (models/vocab.py)
                if draft_processor is None:
                    raise ValueError(f"the draft's vocabulary ({draft.lm.cfg.vocab_size}) differs from the "
                                     f"target's ({tcfg.vocab_size}): pass draft_processor= (the draft "
                                     "checkpoint's processor; from_pretrained loads it) so that their tokenizers "
                                     "can be compared")
                shared = min(tcfg.vocab_size, draft.lm.cfg.vocab_size)
                check_draft_vocab(processor.tokenizer, draft_processor.tokenizer, tcfg.vocab_size,
                                  draft.lm.cfg.vocab_size)
                fit_vocab(draft.lm, tcfg.vocab_size)
        # a draft of another image layout (a LLaVA-1.5 draft for a LLaVA-NeXT target) sees its
        # own preprocessing: its processor's pixels, its own image-token counts in the M/P rows
        self.draft_processor = None
        if draft is not None and image_layout(draft.config) != image_layout(target.config):
            if draft_processor is None:
                raise ValueError(f"the draft's image layout {image_layout(draft.config)} differs from the "
                                 f"target's {image_layout(target.config)}: pass draft_processor= (the draft "
                                 "checkpoint's processor; from_pretrained loads it)")
            check_same_tokenizer(processor.tokenizer, draft_processor.tokenizer, shared)
            self.draft_processor = draft_processor
        elif draft_processor is not None:
            check_same_tokenizer(processor.tokenizer, draft_processor.tokenizer, shared)
        if draft is not None:
            draft.vision.bind_processor(getattr(self.draft_processor or processor, "image_processor", None))
        self.eos_ids = self._eos_ids()
        # images preprocessed on the device (bit-exact with the processor, image_ops): by
        # default on the GPU when the processor's steps are ones image_ops reproduces
        from tabed_engine.models.image_ops import supports
        if device_images is not None and not isinstance(device_images, bool):
            raise TypeError(f"device_images must be None or a bool, got {type(device_images).__name__}")
        can = (supports(processor.image_processor, target.vision.anyres)
               if hasattr(processor, "image_processor") else False)
        if device_images and not can:
            raise ValueError("device_images=True but the processor's image preprocessing is not one "
                             "tabed_engine.models.image_ops reproduces (see image_ops.pixel_plan)")
        self.device_images = can and self.device.type == "cuda" if device_images is None else device_images
        # a draft with its own processor (views.build_views) preprocesses on the device alike
        self.draft_device_images = (self.device_images and self.draft_processor is not None
                                    and supports(self.draft_processor.image_processor, draft.vision.anyres))
        # the runner owns the caches (allocated on the first request), ensemble history and
        # CUDA graphs; the scheduler the queue and the batch
        self._cuda_graphs, self._adaptive = cuda_graphs, adaptive
        if not isinstance(prefix_cache, bool):
            raise TypeError(f"prefix_cache must be a bool, got {type(prefix_cache).__name__}")
        # finished requests' KV kept in their slots and reused by prompts that start the same
        # way (engine/prefix_cache.py)
        self.prefix_cache = prefix_cache
        if not isinstance(invariant, bool):
            raise TypeError(f"invariant must be a bool, got {type(invariant).__name__}")
        # decode and verification with launch configs that do not follow the number of rows
        # (models/decoder.py `LlamaLM.invariant`): on the GPU a request's tokens do not depend on
        # speculation or on the batch around it
        # (a tree's nodes sit at other cache slots than plain decoding puts their tokens: their
        # attention reads each node's path in the AR step's order, `tree_attention`'s paths)
        self.invariant = invariant
        for model in (m for m in (target, draft) if m is not None):
            model.lm.invariant = invariant
        self.kv_cache_tokens = self._kv_cache_tokens(kv_cache_tokens, max_batch, memory_fraction)  # the KV pages
        self.runner = self.runner_class(self, max_batch, cuda_graphs)
        self.scheduler = self._new_scheduler()
        self._ids = itertools.count()
        self._undelivered: list[RequestOutput] = []   # step() outputs produced inside generate()
        # the KV pages, ensemble history and graphs are shared by every call: calls are
        # served one at a time (a stream holds the engine from its first next() to its end)
        self._lock = threading.Lock()      # not an RLock: a stream may be closed by another thread
        self._holder: Optional[int] = None   # the thread running (or last resuming) the generation
        self._prepare_lock = threading.Lock()   # the fast tokenizer is not safe to share across threads

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_pretrained(cls, target_dir: str, draft_dir: Optional[str] = None, device=None, dtype=None,
                        log: Optional[Callable[[str], Any]] = None, tensor_parallel: int = 1,
                        random_weights: bool = False, **kwargs) -> "Engine":
        """Load local HF LLaVA checkpoints (no network). device: "cpu", "cuda" (default when
        a GPU is usable) or "cuda:N"; dtype: a torch.dtype or "float32" / "bfloat16" /
        "float16" (default bfloat16 on CUDA, float32 on the CPU). log: optional callable
        receiving progress text ("loading target DIR ... ", "done in 2.1 s\n"). Other keyword
        arguments: views, policy, window, gamma, tree, max_len, escape_token, pool_size,
        captioner, weight_temperature, grid_step, view_tree (see the README); those that need
        no model are checked before anything loads. tensor_parallel: N > 1 shards the target
        over N processes (this one and N - 1 workers it starts, one GPU each on CUDA; see
        docs/parallel.md) and returns a `TensorParallelEngine`: call its `close()` (or use a
        `with` block) to stop them. random_weights: for benchmarks of published shapes only, the
        weights are drawn at random from the directories' configs (`loader.random_lvlm`; no
        weight file is read, the processor files are), the same on every call."""
        device = resolve_device(device)
        dtype = resolve_dtype(dtype, device)
        try:
            bound = inspect.signature(cls.__init__).bind(None, None, None, **kwargs)
        except TypeError as e:
            raise TypeError(f"Engine.from_pretrained: {e}") from None
        bound.apply_defaults()
        args = bound.arguments
        check_options(*(args[k] for k in ("gamma", "views", "policy", "window", "weight_temperature",
                                           "grid_step", "max_len", "pool_size", "captioner")))
        parse_tree(args["tree"])
        check_prefill_chunk(args["prefill_chunk"])
        if not isinstance(args["mixed_steps"], bool):
            raise TypeError(f"mixed_steps must be a bool, got {type(args['mixed_steps']).__name__}")
        if not isinstance(random_weights, bool):
            raise TypeError(f"random_weights must be a bool, got {type(random_weights).__name__}")
        if isinstance(tensor_parallel, bool) or tensor_parallel != 1:
            from tabed_engine.parallel.startup import from_pretrained_tp

            if cls is not Engine:
                raise TypeError(f"tensor_parallel is for Engine.from_pretrained, not {cls.__name__}'s")
            return from_pretrained_tp(target_dir, draft_dir, device, dtype, log, tensor_parallel, kwargs,
                                      random_weights)
        load = random_lvlm if random_weights else load_lvlm
        target, processor, draft = cls.load_parts(target_dir, draft_dir, device, dtype, log, kwargs, load, load)
        return cls(target, processor, draft=draft, device=device, dtype=dtype, **kwargs)

    @staticmethod
    def load_parts(target_dir: str, draft_dir: Optional[str], device, dtype, log, kwargs: dict,
                   load_target: Callable = load_lvlm, load_draft: Callable = load_lvlm):
        """`from_pretrained`'s loading: (target, processor, draft or None); `kwargs` gains the
        draft's own processor where the draft needs one. `load_target(path, device, dtype)`
        loads the target (a tensor-parallel rank loads its shard), `load_draft` the draft."""

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
        raw = {path: read_config(path) for path in (target_dir, draft_dir) if path}
        processor = load_processor(target_dir)
        if draft_dir and (image_layout(raw[draft_dir]) != image_layout(raw[target_dir])
                          or vocab_size(raw[draft_dir]) != vocab_size(raw[target_dir])):
            if kwargs.get("draft_processor") is None:     # its own image preprocessing, or its tokenizer
                kwargs["draft_processor"] = load_processor(draft_dir)
            dtok = kwargs["draft_processor"].tokenizer    # checked before the weights load
            if vocab_size(raw[draft_dir]) != vocab_size(raw[target_dir]):
                check_draft_vocab(processor.tokenizer, dtok, vocab_size(raw[target_dir]), vocab_size(raw[draft_dir]))
            else:
                check_same_tokenizer(processor.tokenizer, dtok)
        target = load("target", lambda p: load_target(p, device, dtype), target_dir)
        draft = load("draft", lambda p: load_draft(p, device, dtype), draft_dir) if draft_dir else None
        return target, processor, draft

    @property
    def lookahead(self) -> int:
        """Cache slots a speculative block may write past the committed tokens: γ for a chain,
        the tree's node count for a tree."""
        return self.gamma if self.tree is None else self.tree.nodes

    @property
    def adaptive(self) -> bool:
        """Whether the cost model picks each block: autoregressive, or a speculative chain of
        the length (1..γ) it expects to give the most tokens per second (trees: the tree or
        AR); off, every block of a speculative request is a γ-chain (or the tree).
        `adaptive=None` (default): where CUDA graphs make block times steady (the GPU)."""
        if self._adaptive is not None:
            return self._adaptive
        return self.runner.graphs is not None

    @property
    def mixed_steps(self) -> bool:
        """Whether a step's prompt chunks run in the running batch's block's target forward
        (`LlamaLM.forward_mixed`) rather than as a forward of their own; may be changed
        between steps."""
        return self._mixed_steps

    @mixed_steps.setter
    def mixed_steps(self, value):
        if not isinstance(value, bool):
            raise TypeError(f"mixed_steps must be a bool, got {type(value).__name__} {value!r}")
        self._mixed_steps = value

    @property
    def prefill_chunk(self) -> Optional[int]:
        """Prompt tokens one scheduler step may prefill (None: no limit). A prompt longer than
        this is prefilled in chunks over several steps, the running requests decoding between
        them; may be changed between steps (`engine/chunked.py`, docs/serving.md)."""
        return self._prefill_chunk

    @prefill_chunk.setter
    def prefill_chunk(self, value):
        self._prefill_chunk = check_prefill_chunk(value)

    def configure(self, *, views=None, policy=None, window=None, gamma=None, tree=KEEP,
                  weight_temperature=KEEP, grid_step=None, view_tree=None, adaptive=KEEP):
        """Change speculation options between generations (the loaded models stay; caches and
        graphs are rebuilt for the next request). Arguments as the constructor's; those not
        given keep their values (tree=None means chains). Raises RuntimeError while requests
        are queued or running."""
        with self._lock:
            if self.scheduler.has_unfinished():
                raise RuntimeError("configure() needs an idle engine: requests are queued or running")
            ens = self.ensemble
            gamma, views, ensemble = check_options(
                self.gamma if gamma is None else gamma, self.views if views is None else views,
                ens.policy if policy is None else policy, ens.window if window is None else window,
                ens.temperature if weight_temperature is KEEP else weight_temperature,
                ens.grid_step if grid_step is None else grid_step, self.max_len, self.pool_size, self.captioner)
            new_tree = self.tree if tree is KEEP else parse_tree(tree)
            if view_tree is not None:
                self.view_tree = bool(view_tree)
            if adaptive is not KEEP:
                if adaptive is not None and not isinstance(adaptive, bool):
                    raise TypeError(f"adaptive must be None or a bool, got {type(adaptive).__name__}")
                self._adaptive = adaptive
                self.scheduler.cost.enabled = self.adaptive
            if (gamma, views, ensemble, new_tree) == (self.gamma, self.views, self.ensemble, self.tree):
                return                                   # the caches and graphs still fit
            self.gamma, self.views, self.ensemble, self.tree = gamma, views, ensemble, new_tree
            max_batch = self.runner.max_batch
            self.runner = None                          # free the old caches before allocating
            self.runner = self.runner_class(self, max_batch, self._cuda_graphs)
            self.scheduler = self._new_scheduler()

    def _new_scheduler(self) -> Scheduler:
        return Scheduler(self.runner, CostModel(self.adaptive, self.gamma, chains=self.tree is None,
                                                tree_depth=None if self.tree is None else self.tree.depth))

    def close(self) -> None:
        """Release what the engine holds outside this process: a tensor-parallel engine's
        workers (`TensorParallelEngine.close`); nothing for one process. An engine is also a
        context manager that closes on exit."""

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def graphs(self):
        """The captured CUDA graphs (None without them)."""
        return self.runner.graphs

    @property
    def bench_accept_schedule(self) -> Optional[Callable[[int], int]]:
        """Benchmark only: f(block index) -> accepted drafts, overriding verification (NOT
        lossless); lets benchmarks run a fixed acceptance schedule with everything else real."""
        return self.runner.bench_accept_schedule

    @bench_accept_schedule.setter
    def bench_accept_schedule(self, fn):
        self.runner.bench_accept_schedule = fn

    # ------------------------------------------------------------------ public API
    # Thread safety: `add_request` and `abort` may be called from any thread. `step`,
    # `generate` and `stream` are served one at a time (each waits for the engine), so every
    # caller gets exactly its answer; a stream holds the engine from its first next() until it
    # ends or is closed (or garbage-collected); a call made meanwhile from the thread that runs
    # the open stream would wait for itself, so it raises RuntimeError instead.
    def add_request(self, prompt: Any, images=None, sampling: Optional[SamplingParams] = None, caption=None,
                    speculative: bool = True, request_id: Optional[str] = None, views=None, videos=None) -> str:
        """Queue one request for `step()`; returns its id. The input is checked and tokenized
        here (ValueError/TypeError naming the problem; the engine stays usable). views: the
        subset of the engine's views this request's ensemble mixes (default all)."""
        req = self._request(prompt, images, sampling, caption, speculative, request_id, views, videos)
        self.scheduler.add(req)
        return req.request_id

    def step(self) -> list[RequestOutput]:
        """One scheduler iteration: admit waiting requests (prefill; their first tokens are the
        output) or run one block for the running batch. Returns a `RequestOutput` for every
        request that got tokens or finished."""
        self._check_holder()
        with self._lock:
            outs, self._undelivered = self._undelivered, []
            return outs + self.scheduler.step()

    def abort(self, request_id: str) -> None:
        """Finish a queued or running request at the next step (finish_reason "abort")."""
        self.scheduler.abort(request_id)

    def has_unfinished(self) -> bool:
        """Whether any request is queued or running (or has output not yet returned by step)."""
        return self.scheduler.has_unfinished() or bool(self._undelivered)

    def generate(self, prompt: Any, images=None, sampling=None, caption=None, speculative: bool = True,
                 captions=None, views=None, videos=None):
        """Generate completions.

        prompt: a string with one `<image>` per image, a list of chat messages (rendered by
        the processor's chat template), or token ids (a list of ints or an integer tensor of
        shape [n] or [1, n]) with the image token where each image goes; or a LIST of such
        prompts (a list of strings, of message lists or of token-id lists, or a tensor
        [n_prompts, n]), decoded together as one batch.
        images: one image per placeholder, each a PIL image, or a numpy array or tensor
        (HWC or CHW, 1/3/4 channels) of uint8 values 0..255 or float values in [0, 1]; for a
        list of prompts, one such list per prompt (or None).
        videos (LLaVA-OneVision, Qwen2.5-VL): one video per video placeholder (`<video>`,
        `<|video_pad|>`), each a list of frames of one size (as images) or an array / tensor
        [frames, H, W, C]; for a list of prompts, one list per prompt.
        sampling: a `SamplingParams`, or one per prompt.
        caption: the C view's caption (a string, or one per image); `captions`: one per prompt.
        views: the subset of the engine's views the request's ensemble mixes (a tuple of names;
        for a list of prompts one tuple for all or one per prompt); default all. The other
        views' rows still run (weight 0): a request without a caption can leave out "C".
        Policies "kld", "tvd", "hedge" and "uniform" only.
        speculative=False (or no draft) decodes autoregressively.
        Returns a `GenerationOutput` (token ids, text, stats, finish_reason), or a list of
        them in prompt order. Raises ValueError/TypeError on bad input before any work (the
        engine stays usable); a list call returns a failed request's output with
        finish_reason "error" while the others finish, a single call raises RuntimeError.
        """
        batch = is_batch(prompt)
        reqs = self._requests(prompt, images, sampling, caption, captions, speculative, batch, views, videos)
        for r in reqs:
            r.pieces = False              # the text once at the end, not a piece per block
        for _ in self._drive(reqs):
            pass
        outs = [r.output() for r in reqs]
        if not batch:
            if outs[0].finish_reason == "error":
                raise RuntimeError(f"generation failed: {outs[0].error}")
            return outs[0]
        return outs

    def stream(self, prompt: Any, images=None, sampling: Optional[SamplingParams] = None,
               caption=None, speculative: bool = True, views=None,
               videos=None) -> Generator[str, None, GenerationOutput]:
        """Like `generate` for one prompt, but yields text pieces as tokens are accepted. The
        input is checked here, at the call; the generator's return value
        (`StopIteration.value`) is the `GenerationOutput`. The loop body runs outside the
        engine's inference mode. The engine is held until the stream ends: finish it or call
        its `close()`."""
        if is_batch(prompt):
            raise ValueError("stream() takes one prompt; stream_batch() streams a list of prompts (with images, "
                             "sampling and captions one per prompt)")
        req = self._request(prompt, images, sampling, caption, speculative, views=views, videos=videos)
        return self._stream_one(req)

    def stream_batch(self, prompts: Sequence, images=None, sampling=None, captions=None,
                     speculative: bool = True, views=None, videos=None) -> Iterator[tuple[int, str]]:
        """Decode several prompts as one batch, yielding (prompt index, text piece) as tokens
        are accepted; each prompt's pieces join to its final text. Arguments as `generate`
        with a list of prompts. The engine is held until the iterator ends or is closed."""
        reqs = self._requests(prompts, images, sampling, None, captions, speculative, True, views, videos)
        index = {r.request_id: i for i, r in enumerate(reqs)}

        def pieces():
            for o in self._drive(reqs):
                if o.new_text:
                    yield index[o.request_id], o.new_text
        return pieces()

    def warmup(self, max_batch: Optional[int] = None, images: bool = True,
               sampling: "SamplingParams | Sequence[SamplingParams] | None" = None) -> float:
        """Decode a few tokens at every batch bucket up to `max_batch` (default: all the engine
        has), autoregressively and, with a draft, speculatively at every chain length the cost
        model may pick, and a speculative block after AR steps (the draft's catch-up), with one
        image per request when `images`: the CUDA graphs of those buckets are captured and the
        kernels compiled before the first real request (a server would otherwise stall its
        first requests at each new batch size). The target's prefill graphs of every
        prompt-length bucket and of prompt rests are captured too (`Runner.capture_prefill`),
        and the draft views' prefill runs once per bucket (`Runner.warm_draft_prefill`); with
        `mixed_steps`, the mixed steps of a long prompt's full chunks at the current
        `prefill_chunk`, per block kind and bucket (`warmup.warm_mixed`; a chunk of another
        length captures its graph on first use). The cost model keeps the
        block times it measured. `sampling`: the settings (one or several) the block graphs
        are captured for (greedy and sampled requests run graphs of their own, sampled ones per
        draft temperature and top-k / top-p use; default greedy); their token counts and stop
        settings are the warm-up's. Returns the seconds taken."""
        return run_warmup(self, max_batch, images, sampling)

    def prefill_target(self, prep):
        """Diagnostics and benchmarks: prefill a prepared prompt (`tabed_engine.engine.prompt.prepare`)
        into slot 0 of an idle engine. Returns (the slot's cache, logits of the last prompt
        position [1, V], the target's selected image features or None)."""
        if self.scheduler.has_unfinished():
            raise RuntimeError("prefill_target() needs an idle engine")
        r = self.runner
        r.allocate()
        r.pending = None
        logits, sel = r.prefill_target(prep, 0)
        return cache_rows(r.tcache, 0, 1), logits.clone(), sel     # a copy: not a graph's output buffer

    # ------------------------------------------------------------------ internals
    def _stream_one(self, req: Request) -> Generator[str, None, GenerationOutput]:
        for o in self._drive([req]):
            if o.new_text:
                yield o.new_text
        out = req.output()
        if out.finish_reason == "error":
            raise RuntimeError(f"generation failed: {out.error}")
        return out

    def _check_holder(self):
        if self._holder == threading.get_ident():
            raise RuntimeError("this thread is already running a generation of this engine (an open "
                               "stream(): finish it or call its close() before starting another; the "
                               "engine runs one generation at a time)")

    def _drive(self, reqs: list[Request]) -> Iterator[RequestOutput]:
        """Step the engine until `reqs` finish, yielding their outputs; holds the engine
        throughout (outputs of other callers' requests are kept for their `step()`). Closing
        the iterator early aborts the requests."""
        self._check_holder()
        self._lock.acquire()
        try:
            for r in reqs:
                self.scheduler.add(r)
            left = {r.request_id for r in reqs}
            mine = set(left)
            while left:
                self._holder = threading.get_ident()   # a stream may be resumed by another thread
                for o in self.scheduler.step():
                    if o.request_id not in mine:
                        self._undelivered.append(o)
                        continue
                    if o.finished:
                        left.discard(o.request_id)
                    yield o
        finally:
            self.scheduler.drop([r for r in reqs if not r.finished])
            self._holder = None
            self._lock.release()

