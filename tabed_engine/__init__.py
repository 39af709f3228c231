"""tabed_engine: speculative decoding for vision-language models.

    from tabed_engine import Engine, SamplingParams
"""
from .config import SamplingParams
from .engine import Engine
from .outputs import GenerationOutput, GenerationStats
from .tree import TreeConfig

__all__ = ["Engine", "SamplingParams", "TreeConfig", "GenerationOutput", "GenerationStats"]
