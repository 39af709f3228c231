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

    def patch_lang(fn):
        mods = {id(v) for v in fn.__globals__.values() if inspect.ismodule(v)
                and (v is interpreter.tl or v is interpreter.tl.core)}
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


if os.environ.get("TRITON_INTERPRET") == "1":
    _patch_triton_language_once_per_launch()

# parallel workers of one run (pytest-xdist) share the checkpoints the tests build
# (tests/models.py, tests/realistic.py), instead of each building its own
if os.environ.get("PYTEST_XDIST_TESTRUNUID") and not os.environ.get("TABED_TEST_MODELS"):
    import tempfile

    os.environ["TABED_TEST_MODELS"] = os.path.join(
        tempfile.gettempdir(), "tabed_models_" + os.environ["PYTEST_XDIST_TESTRUNUID"])


def pytest_collection_modifyitems(config, items):
    # the long tests (marked slow) first, so that parallel workers (`make test`: -n 2 with work
    # stealing) end together instead of one finishing a long test while the other idles
    items.sort(key=lambda item: "slow" not in item.keywords)
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
