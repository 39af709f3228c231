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
