"""The model-family registry: which module loads a checkpoint, chosen from its config.json.

A family module (`tabed_engine/models/<family>.py`) builds a `Family` and passes it to
`register`; `FAMILY_MODULES` names them all, and `family_of(config)` imports them on first use
and picks the one whose `architectures` or `model_type` the checkpoint names. Adding a family is
one entry here and its own file: the loader and the engine only talk to a `Family`.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable, Optional

# the modules under tabed_engine.models that register a family, in lookup order
FAMILY_MODULES = ("llava", "llava_next", "llava_onevision", "qwen2_5_vl")

_FAMILIES: list["Family"] = []
_imported = False


@dataclass(frozen=True)
class Family:
    """How one checkpoint family maps onto the engine's pieces.

    name: short name used in messages. architectures / model_types: the config.json values it
    loads (either one matches). lm_config(config) -> LMConfig: the decoder's shape.
    build_lm(LMConfig) -> the decoder module (weights filled by the loader).
    build_vision(hf_config, config) -> the vision side (a `VisionEncoder`: tower, projector,
    image-token counting). canonical_key(checkpoint key) -> (part, key) with part "lm",
    "vision" or "proj" and key as our modules name it, or None for a tensor the family does not
    have. image_layout(config) -> a hashable summary of what its image preprocessing depends
    on (a draft whose layout differs from the target's gets its own processor).
    image_token_id(config) -> the token id of an image placeholder.
    load_processor(path) -> the checkpoint's processor, for a family whose transformers
    processor cannot be loaded as it is (None: `AutoProcessor`).
    video_token_id(config) -> the token id of a video placeholder (None: the family takes no
    videos).
    """

    name: str
    architectures: tuple[str, ...]
    model_types: tuple[str, ...]
    lm_config: Callable[[dict], object]
    build_lm: Callable[[object], object]
    build_vision: Callable[[object, dict], object]
    canonical_key: Callable[[str], Optional[tuple[str, str]]]
    image_layout: Callable[[dict], tuple]
    image_token_id: Callable[[dict], Optional[int]]
    load_processor: Optional[Callable[[str], object]] = None
    video_token_id: Optional[Callable[[dict], Optional[int]]] = None

    def matches(self, config: dict) -> bool:
        archs = config.get("architectures") or []
        return config.get("model_type") in self.model_types or bool(set(archs) & set(self.architectures))


def register(family: Family) -> Family:
    """Add a family (called by its module at import); returns it."""
    if any(f.name == family.name for f in _FAMILIES):
        raise ValueError(f"model family {family.name!r} is registered twice")
    _FAMILIES.append(family)
    return family


def families() -> list[Family]:
    """Every registered family, importing the family modules on first use."""
    global _imported
    if not _imported:
        for name in FAMILY_MODULES:
            importlib.import_module(f"tabed_engine.models.{name}")
        _imported = True
    return list(_FAMILIES)


def family_of(config: dict, where: str = "the checkpoint") -> Family:
    """The family that loads a checkpoint's config (a dict). ValueError naming the supported
    architectures when none does. Architectures are matched before model types, so a config
    naming both is read as its architecture says."""
    fams = families()
    archs = config.get("architectures") or []
    for fam in fams:
        if set(archs) & set(fam.architectures):
            return fam
    for fam in fams:
        if config.get("model_type") in fam.model_types:
            return fam
    supported = ", ".join(a for f in fams for a in f.architectures)
    raise ValueError(f"unsupported architecture in {where}: model_type={config.get('model_type')!r}, "
                     f"architectures={archs}; supported: {supported}")
