"""Tiny random LLaVA checkpoints shared by the tests (built once per session on disk)."""
import os
import shutil
import tempfile

from tabed_engine.models.tiny import build_tiny_llava

# Odd sizes on purpose; each covers a different corner of the loader.
CONFIGS = {
    # MHA, untied, feature layer -2, "default", current key layout, single file
    "mha": dict(vocab_size=173, hidden=48, heads=4, kv_heads=4, intermediate=83, layers=2,
                feature_layer=-2, strategy="default", layout="current", seed=1),
    # GQA 6/2 with head_dim 10, tied, feature layer -1, "full" (CLS kept), legacy layout, sharded
    "gqa_tied_full": dict(vocab_size=151, hidden=60, heads=6, kv_heads=2, intermediate=97, layers=3,
                          tie=True, feature_layer=-1, strategy="full", layout="legacy",
                          shard_bytes=30000, seed=2),
    # GQA 4/1 with explicit head_dim 16 != hidden/heads, untied, legacy layout
    "gqa_headdim": dict(vocab_size=199, hidden=40, heads=4, kv_heads=1, head_dim=16, intermediate=71,
                        layers=2, feature_layer=-2, strategy="default", layout="legacy",
                        rope_theta=5000.0, seed=3),
    # MHA, tied, "full", feature -1, current layout sharded, bigger image grid
    "mha_tied_sharded": dict(vocab_size=211, hidden=56, heads=4, kv_heads=4, intermediate=101,
                             layers=3, tie=True, feature_layer=-1, strategy="full",
                             image_size=36, patch_size=6, layout="current", shard_bytes=50000, seed=4),
}

_ROOT = os.environ.get("TABED_TEST_MODELS") or tempfile.mkdtemp(prefix="tabed_models_")


def model_dir(name: str, **overrides) -> str:
    """Path of the named tiny checkpoint (built on first use; built in a temporary directory
    and renamed into place, so parallel test workers sharing the root never see half of one)."""
    key = name + "".join(f"_{k}{v}" for k, v in sorted(overrides.items()))
    path = os.path.join(_ROOT, key)
    if not os.path.isfile(os.path.join(path, "config.json")):
        os.makedirs(_ROOT, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=key + ".", dir=_ROOT)
        build_tiny_llava(tmp, **{**CONFIGS[name], **overrides})
        try:
            os.rename(tmp, path)
        except OSError:          # another worker built it first
            shutil.rmtree(tmp, ignore_errors=True)
    return path
