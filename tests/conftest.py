"""Shared pytest set-up.

Triton kernels are tested on the CPU through the Triton interpreter, which must be
switched on before triton is first imported; on a CUDA machine the real kernels run.
"""
import os

try:
    import torch

    _HAS_CUDA = torch.cuda.is_available()
except Exception:  # pragma: no cover - torch is a hard dependency
    _HAS_CUDA = False

if not _HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # The tests run tiny ops: one thread avoids intra-op thread hand-offs that cost more than
    # the ops themselves on a small, busy machine (a 3-token generation: 9 ms vs 200 ms).
    torch.set_num_threads(1)

import pytest  # noqa: E402


def _patch_triton_language_once_per_launch():
    """The Triton interpreter re-patches `triton.language` (an `inspect.getmembers` walk of
    four modules) at every @triton.jit helper call inside a kernel, though the launch running
    it already patched the same modules: the re-patch sets the same replacements again (and
    is never undone). Skip a helper's re-patch of modules this launch already patched: 40-45%
    of the interpreter's time in the kernel tests (one ensemble_mix launch of 60 rows: 4.1 s
    -> 2.4 s); the programs run the same way."""
    import inspect

    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    original = getattr(interpreter, "_patch_lang", None)
    launch = getattr(getattr(interpreter, "GridExecutor", None), "__call__", None)
    if original is None or launch is None or not hasattr(interpreter, "_LangPatchScope"):
        return                                  # another triton: leave it as it is
    running = []                                # [ids of the modules patched] during a launch
    # id(a helper's globals) -> (those globals, ids of tl / tl.core among them): the walk over
    # a module's globals once, not at every helper call (the globals are held: no id reuse)
    lang_mods = {}

    def patch_lang(fn):
        known = lang_mods.get(id(fn.__globals__))
        if known is None or known[0] is not fn.__globals__:
            known = lang_mods[id(fn.__globals__)] = (fn.__globals__, frozenset(
                id(v) for v in fn.__globals__.values()
                if inspect.ismodule(v) and (v is interpreter.tl or v is interpreter.tl.core)))
        mods = known[1]
        if running and running[0] and mods <= running[0]:   # a helper call: its modules are patched
            return interpreter._LangPatchScope()
        if running:                             # the launch's own patch, or other modules
            running[0] |= mods
        return original(fn)

    def launch_once_patched(self, *args, **kwargs):
        running.append(set())
        try:
            return launch(self, *args, **kwargs)
        finally:
            running.clear()

    interpreter._patch_lang = patch_lang
    interpreter.GridExecutor.__call__ = launch_once_patched


def _cache_interpreter_np_dtypes():
    """The interpreter's `_get_np_dtype` (every cast, splat, load and narrowing binary op)
    builds its 19-entry dtype table anew at each call: one table, built once, answers the
    same. With the cached module walk above: a sampling kernel test's interpreter time
    -33% (test_split_sampling_follows_mixture_and_skips_empty_chunks: 123 -> 82 CPU-s)."""
    try:
        import numpy as np
        from triton.runtime import interpreter
    except ImportError:
        return
    original = getattr(interpreter, "_get_np_dtype", None)
    tl = getattr(interpreter, "tl", None)
    if original is None or tl is None:
        return
    try:
        table = {t: original(t) for t in (tl.int1, tl.float16, tl.float32, tl.float64, tl.int8, tl.uint8, tl.int16,
                                          tl.uint16, tl.int32, tl.uint32, tl.int64, tl.uint64, tl.bfloat16)}
    except Exception:                           # another triton: leave it as it is
        return
    pointer, block = tl.pointer_type, tl.block_type

    def get_np_dtype(tt_dtype):
        if isinstance(tt_dtype, block):
            tt_dtype = tt_dtype.element_ty
        if isinstance(tt_dtype, pointer):
            return np.dtype(np.uint64)
        got = table.get(tt_dtype)
        return got if got is not None else original(tt_dtype)   # (fp8 types: the original table)

    interpreter._get_np_dtype = get_np_dtype


def _skip_discarded_overflow_checks():
    """The interpreter's options ask for integer-overflow checks (`sanitize_overflow`) but not
    for `debug`, and the check's `device_assert` does nothing without `debug`: every int32
    add / sub / mul also computed its int64 result, two comparisons and their `and`, then
    dropped them. Off while `debug` is off, the programs compute the same values."""
    import dataclasses

    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    builder = getattr(interpreter, "interpreter_builder", None)
    options = getattr(builder, "options", None)
    if options is None or getattr(options, "debug", True) or not hasattr(options, "sanitize_overflow"):
        return                                  # another triton, or checks that assert: leave them
    builder.options = dataclasses.replace(options, sanitize_overflow=False)


if os.environ.get("TRITON_INTERPRET") == "1":
    _patch_triton_language_once_per_launch()
    _cache_interpreter_np_dtypes()
    _skip_discarded_overflow_checks()

# parallel workers of one run (pytest-xdist) share the checkpoints the tests build
# (tests/models.py, tests/realistic.py), instead of each building its own
if os.environ.get("PYTEST_XDIST_TESTRUNUID") and not os.environ.get("TABED_TEST_MODELS"):
    import tempfile

    os.environ["TABED_TEST_MODELS"] = os.path.join(
        tempfile.gettempdir(), "tabed_models_" + os.environ["PYTEST_XDIST_TESTRUNUID"])


def pytest_configure(config):
    config.addinivalue_line("markers", "one_worker: the module's tests share a module-scoped server or "
                                       "worker process: run them on one xdist worker, which starts it once")


def pytest_collection_modifyitems(config, items):
    # the long tests (marked slow) first, so that parallel workers (`make test`: -n 2 with work
    # stealing) end together instead of one finishing a long test while the other idles; before
    # them the modules marked one_worker: work stealing (`--dist worksteal`, which ignores
    # xdist_group) hands each worker a contiguous range and later takes the tail of a worker's
    # queue, so the head of the first range stays on one worker. A module split over both
    # workers started its server twice (test_data_parallel 2 x 17 s, test_server 2 x 12 s).
    items.sort(key=lambda item: 0 if "one_worker" in item.keywords else 1 if "slow" in item.keywords else 2)
    if _HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def kernel_device():
    """Device the Triton kernels run on: CUDA when present, else the CPU interpreter."""
    return "cuda" if _HAS_CUDA else "cpu"
