"""tabed_engine: speculative decoding for vision-language models.

    from tabed_engine import Engine, SamplingParams
"""
from .config import SamplingParams
from .engine import Engine
from .outputs import GenerationOutput, GenerationStats

__all__ = ["Engine", "SamplingParams", "GenerationOutput", "GenerationStats"]
