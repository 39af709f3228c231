"""The shape of a Llama-family decoder, parsed from a checkpoint's text config."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

SUPPORTED_TEXT_MODELS = ("llama", "mistral", "qwen2", "vicuna")


@dataclass(frozen=True)
class LMConfig:
    """Shape of a Llama-family decoder (Llama, Mistral, Vicuna; Qwen2 = qkv bias)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling_factor: float = 1.0  # "linear" RoPE scaling; 1.0 = none
    qkv_bias: bool = False
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    # M-RoPE (Qwen2.5-VL): the rotary frequencies split into (temporal, height, width) sections
    # rotated by three position ids; None = one position id (1-D RoPE)
    mrope_section: Optional[tuple[int, ...]] = None

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"LMConfig.{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                             f"({self.num_kv_heads})")
        if self.mrope_section is not None and (len(self.mrope_section) != 3
                                               or sum(self.mrope_section) != self.head_dim // 2):
            raise ValueError(f"mrope_section {list(self.mrope_section)} must be 3 sections adding up to "
                             f"head_dim / 2 = {self.head_dim // 2}")

    @classmethod
    def from_text_config(cls, tc: dict, top: Optional[dict] = None) -> "LMConfig":
        """Parse a HF text config dict in either style (`rope_theta` or `rope_parameters`,
        with or without `head_dim`)."""
        top = top or {}
        model_type = tc.get("model_type", "llama")
        if model_type not in SUPPORTED_TEXT_MODELS:
            raise ValueError(f"unsupported language model architecture {model_type!r}; "
                             f"supported: {', '.join(SUPPORTED_TEXT_MODELS)}")
        if tc.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {tc.get('hidden_act')!r} (only silu)")
        heads = tc["num_attention_heads"]
        rope = tc.get("rope_parameters") or {}
        theta = rope.get("rope_theta", tc.get("rope_theta", 10000.0))
        scaling = tc.get("rope_scaling") or rope
        rope_type = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
        factor = 1.0
        if rope_type == "linear":
            factor = float(scaling["factor"])
        elif rope_type not in ("default", None):
            raise ValueError(f"unsupported RoPE type {rope_type!r} (supported: default, linear)")
        tie = tc.get("tie_word_embeddings")
        if tie is None:
            tie = top.get("tie_word_embeddings", False)
        return cls(
            vocab_size=tc["vocab_size"],
            hidden_size=tc["hidden_size"],
            intermediate_size=tc["intermediate_size"],
            num_layers=tc["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=tc.get("num_key_value_heads") or heads,
            head_dim=tc.get("head_dim") or tc["hidden_size"] // heads,
            rms_norm_eps=tc.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling_factor=factor,
            qkv_bias=bool(tc.get("attention_bias", False)) or model_type == "qwen2",
            tie_word_embeddings=bool(tie),
            max_position_embeddings=tc.get("max_position_embeddings", 4096),
        )
