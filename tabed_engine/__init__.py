"""tabed_engine: speculative decoding for vision-language models.

    from tabed_engine import Engine, SamplingParams
"""
from tabed_engine.config import SamplingParams
from tabed_engine.engine.engine import Engine
from tabed_engine.engine.outputs import GenerationOutput, GenerationStats
from tabed_engine.speculation.tree import TreeConfig

__all__ = ["Engine", "SamplingParams", "TreeConfig", "GenerationOutput", "GenerationStats"]
