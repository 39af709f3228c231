"""Whether the compiled extension `tabed_engine._C` loaded, decided once at import.

Importing it registers the `torch.ops.tabed_engine.*` custom ops (CPU kernels always,
CUDA kernels when it was built with nvcc). The ops modules dispatch on these flags and
the tensor device, never by catching a failing kernel call.
"""
import torch

try:
    from tabed_engine import _C  # noqa: F401  (registers torch.ops.tabed_engine.*)

    HAS_EXT = True
    EXT_ERROR = None
except ImportError as exc:  # not built (TABED_NO_EXT=1, no compiler, failed build)
    HAS_EXT = False
    EXT_ERROR = str(exc)


def _has_kernel(op: str, key: str) -> bool:
    return HAS_EXT and torch._C._dispatch_has_kernel_for_dispatch_key(f"tabed_engine::{op}", key)


# Which backends the extension was built with (the CUDA kernels need an nvcc build).
HAS_CPU_KERNELS = _has_kernel("verify_tree", "CPU") and _has_kernel("compact_kv", "CPU")
HAS_CUDA_KERNELS = _has_kernel("verify_tree", "CUDA") and _has_kernel("compact_kv", "CUDA")


def use_ext(device: torch.device) -> bool:
    """True when the compiled kernel serves tensors on `device`."""
    if device.type == "cuda":
        return HAS_CUDA_KERNELS
    if device.type == "cpu":
        return HAS_CPU_KERNELS
    return False
