"""What the engine is built with: devices and dtypes by name, the speculation options checked
before any model loads, and the check that a draft shares the target's tokenizer."""
from __future__ import annotations

import torch

from tabed_engine.config import check_int, check_real
from tabed_engine.speculation.ensemble import EnsembleConfig

VIEW_NAMES = ("M", "T", "P", "C")
KEEP = object()           # Engine.configure(): an option not given keeps its value
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


def check_kv_cache_tokens(value) -> None:
    """`Engine(kv_cache_tokens=)`: None (the default pool) or a positive int."""
    if value is not None:
        check_int("kv_cache_tokens", value, 1)


def check_options(gamma, views, policy, window, weight_temperature, grid_step, max_len, pool_size,
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


# probe strings for check_same_tokenizer: spaces, digits, a newline, punctuation, non-ASCII
_PROBES = ("USER: <image>\nWhat is shown in this photo? ASSISTANT:", " The 2 cats sat on 1,234 mats.\n\n",
           "naïve café – ☕ 東京", "<s></s><pad> hello\tworld")


def check_same_tokenizer(target_tok, draft_tok, shared=None):
    """Raise ValueError unless the two tokenizers have the same vocabulary (every token and
    id; with `shared`, every token whose id is below it) and encode the probe strings
    identically: speculative decoding compares token ids."""
    why = None
    t, d = target_tok.get_vocab(), draft_tok.get_vocab()
    if shared is not None:
        t, d = ({k: i for k, i in v.items() if i < shared} for v in (t, d))
    if shared is None and len(target_tok) != len(draft_tok):
        why = f"{len(draft_tok)} tokens against the target's {len(target_tok)}"
    elif t != d:
        diff = sorted((set(t.items()) ^ set(d.items())), key=lambda x: x[1])[:3]
        why = f"the vocabularies differ (e.g. {diff})"
    else:
        bad = next((p for p in _PROBES if target_tok.encode(p) != draft_tok.encode(p)), None)
        if bad is not None:
            why = f"{bad!r} encodes as {draft_tok.encode(bad)} against the target's {target_tok.encode(bad)}"
    if why is not None:
        where = "" if shared is None else f" in the shared token range [0, {shared})"
        raise ValueError(f"the draft's tokenizer differs from the target's{where}: {why}; the draft must share "
                         "the target's tokenizer")


def check_draft_vocab(target_tok, draft_tok, target_vocab: int, draft_vocab: int):
    """A draft whose vocabulary size differs from the target's: both tokenizers' ids lie below
    both vocabularies (the rows past them are padding) and the tokenizers agree on that shared
    range (`check_same_tokenizer`). ValueError otherwise."""
    from tabed_engine.models.vocab import check_covers_tokenizer

    shared = min(target_vocab, draft_vocab)
    who = "target" if target_vocab <= draft_vocab else "draft"
    check_covers_tokenizer(target_tok, shared, who, "the target's tokenizer")
    check_covers_tokenizer(draft_tok, shared, who, "the draft's tokenizer")
    check_same_tokenizer(target_tok, draft_tok, shared=shared)


def is_batch(prompt) -> bool:
    """Whether `prompt` is a list of prompts: a list of strings, of message lists or of token-id
    lists, or a 2-D tensor with more than one row."""
    if isinstance(prompt, torch.Tensor):
        return prompt.dim() == 2 and prompt.shape[0] > 1
    if not isinstance(prompt, (list, tuple)) or not prompt:
        return False
    return all(isinstance(p, (str, list, tuple, torch.Tensor)) for p in prompt)
