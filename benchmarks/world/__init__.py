"""A procedural multimodal world: scenes of coloured shapes, a word-level tokenizer,
scenario generators (S1-S5), the demo-model trainer and the acceptance-rate proxy.

Used to build the bundled demo target/draft LLaVA pair (`tabed_engine/assets/demo/`)
and as the acceptance-rate test bed of TABED's views.
"""
from .scenarios import SCENARIOS, Example, caption, examples, make_example
from .scenes import Scene, random_scene, render
from .text import build_tokenizer

__all__ = ["SCENARIOS", "Example", "Scene", "build_tokenizer", "caption", "examples", "make_example",
           "random_scene", "render"]
