"""Prompt/answer generators of the procedural world, deterministic by seed.

Scenarios (what TABED's views are tested on):

* S1 image-grounded description ("describe the image .").
* S2 image-grounded question answering (counts, colours, positions, yes/no).
* S3 a text-only task (copy/reverse/sort a list, count, add, count words) asked
  next to an image that is irrelevant to it.
* S4 a second-turn text follow-up after an image turn (a text task, or "say your
  answer again").
* S5 inputs on which a draft's vision path is unreliable: out-of-distribution image
  styles (inverted, outline, dark, noise) and two-image prompts.

`Example.prompt` is the text the chat template produces (with one "<image>" per
image); `Example.answer` is the reference answer of the last turn.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from PIL import Image

from .scenes import COLORS, GRID, OOD_STYLES, SHAPES, Obj, Scene, random_scene, render
from .text import NOUNS, NUMBERS

SCENARIOS = ("S1", "S2", "S3", "S4", "S5")
TEXT = "text"  # text-only task without any image (training data)
GRID_READ = "grid"  # dense read-out of every cell (training data that teaches reading images)


@dataclass
class Turn:
    n_images: int  # images at the start of the user turn
    user: str
    answer: str


@dataclass
class Example:
    scenario: str
    turns: list[Turn]
    scenes: tuple[Scene, ...] = field(default_factory=tuple)

    @property
    def answer(self) -> str:
        return self.turns[-1].answer

    @property
    def prompt(self) -> str:
        """Chat-formatted prompt up to the final "ASSISTANT :" (what the engine gets)."""
        parts = []
        for i, t in enumerate(self.turns):
            parts.append("USER :" + " <image>\n" * t.n_images + " " + t.user + " ASSISTANT :")
            if i < len(self.turns) - 1:
                parts.append(" " + t.answer + " </s> ")
        return "".join(parts)

    @property
    def images(self) -> list[Image.Image]:
        return [render(s) for s in self.scenes]

    @property
    def captions(self) -> list[str]:
        return [caption(s) for s in self.scenes]

    def messages(self, with_answer: bool = False) -> list[dict]:
        """HF chat messages; `processor.apply_chat_template(..., add_generation_prompt=True)`
        of these equals `self.prompt` (up to spaces)."""
        msgs = []
        for i, t in enumerate(self.turns):
            content = [{"type": "image"}] * t.n_images + [{"type": "text", "text": t.user}]
            msgs.append({"role": "user", "content": content})
            if i < len(self.turns) - 1 or with_answer:
                msgs.append({"role": "assistant", "content": [{"type": "text", "text": t.answer}]})
        return msgs


# ----------------------------------------------------------------------------- words
def num(n: int) -> str:
    return NUMBERS[n]


def where(o: Obj) -> str:
    return f"in row {num(o.row + 1)} column {num(o.col + 1)}"


def caption(scene: Scene) -> str:
    """Short caption of a scene (the C view replaces the image with "image : " + this)."""
    return " , ".join(f"{o.color} {o.shape} {where(o)}" for o in scene.objects)


def a(word: str) -> str:
    """Indefinite article + word ("a red", "an orange")."""
    return ("an " if word[0] in "aeiou" else "a ") + word


def _count(n: int, noun: str) -> str:
    if n == 1:
        return f"there is one {noun} ."
    return f"there are {num(n)} {noun}s ."


def describe(scene: Scene) -> str:
    head = _count(len(scene.objects), "shape")
    return " ".join([head] + [f"{a(o.color)} {o.shape} {where(o)} ." for o in scene.objects])


# ------------------------------------------------------------------ S1 / S2 questions
S1_PROMPTS = ("describe the image .", "what is in the image ?", "list the shapes in the image .")


def s1_turn(rng: np.random.Generator, scene: Scene) -> tuple[str, str]:
    return S1_PROMPTS[int(rng.integers(len(S1_PROMPTS)))], describe(scene)


def s2_turn(rng: np.random.Generator, scene: Scene) -> tuple[str, str]:
    objs = scene.objects
    kind = int(rng.integers(7))
    if kind == 0:
        return "how many shapes are there ?", _count(len(objs), "shape")
    if kind == 1:
        color = list(COLORS)[int(rng.integers(len(COLORS)))]
        n = sum(o.color == color for o in objs)
        ans = _count(n, "shape").replace("shape", f"{color} shape") if n else f"there are zero {color} shapes ."
        return f"how many {color} shapes are there ?", ans
    if kind == 2:
        shape = SHAPES[int(rng.integers(len(SHAPES)))]
        n = sum(o.shape == shape for o in objs)
        ans = _count(n, shape) if n else f"there are zero {shape}s ."
        return f"how many {shape}s are there ?", ans
    o = objs[int(rng.integers(len(objs)))]
    if kind == 3:
        return f"what color is the {o.shape} {where(o)} ?", f"the {o.shape} is {o.color} ."
    if kind == 4:
        if rng.random() < 0.25:  # an empty cell
            taken = {(p.row, p.col) for p in objs}
            free = [c for c in range(GRID * GRID) if divmod(c, GRID) not in taken]
            r, c = divmod(free[int(rng.integers(len(free)))], GRID)
            e = Obj("circle", "red", r, c)
            return f"what is {where(e)} ?", f"there is nothing {where(e)} ."
        return f"what is {where(o)} ?", f"there is {a(o.color)} {o.shape} {where(o)} ."
    if kind == 5:
        same = [p for p in objs if p.color == o.color and p.shape == o.shape]
        if len(same) == 1:
            return f"where is the {o.color} {o.shape} ?", f"the {o.color} {o.shape} is {where(o)} ."
        return "how many shapes are there ?", _count(len(objs), "shape")
    # kind 6: yes / no
    if rng.random() < 0.5:
        c, s = o.color, o.shape
    else:
        c = list(COLORS)[int(rng.integers(len(COLORS)))]
        s = SHAPES[int(rng.integers(len(SHAPES)))]
    if any(p.color == c and p.shape == s for p in objs):
        return f"is there {a(c)} {s} ?", f"yes , there is {a(c)} {s} ."
    return f"is there {a(c)} {s} ?", f"no , there is no {c} {s} ."


def image_turn(rng: np.random.Generator, scene: Scene) -> tuple[str, str]:
    return s1_turn(rng, scene) if rng.random() < 0.4 else s2_turn(rng, scene)


# ------------------------------------------------------------------------ text tasks
ITEMS = tuple(NOUNS) + tuple(COLORS) + SHAPES


def _pairs(rng: np.random.Generator, n: int) -> list[str]:
    """n distinct "colour shape" pairs: the words an image's answer is made of, so an image
    next to a text task about them is a distractor (the answer must follow the text)."""
    names = list(COLORS)
    cells = rng.choice(len(names) * len(SHAPES), size=n, replace=False)
    return [f"{names[c // len(SHAPES)]} {SHAPES[c % len(SHAPES)]}" for c in cells]


def text_task(rng: np.random.Generator) -> tuple[str, str]:
    """A task whose answer depends on the text only."""
    kind = int(rng.integers(6))
    if kind in (0, 1):
        if rng.random() < 0.5:  # colour-shape pairs (reversal keeps each pair's word order)
            items = _pairs(rng, int(rng.integers(2, 5)))
        else:
            items = [ITEMS[i] for i in rng.choice(len(ITEMS), size=int(rng.integers(3, 6)), replace=False)]
        if kind == 0:
            return "copy the list : " + " ".join(items), " ".join(items)
        return "reverse the list : " + " ".join(items), " ".join(items[::-1])
    if kind == 2:
        ns = rng.choice(21, size=int(rng.integers(3, 5)), replace=False).tolist()
        return "sort the numbers : " + " ".join(map(num, ns)), " ".join(num(n) for n in sorted(ns))
    if kind == 3:
        a = int(rng.integers(0, 15))
        b = a + int(rng.integers(2, 9))
        b = min(b, 20)
        return f"count from {num(a)} to {num(b)} .", " ".join(num(n) for n in range(a, b + 1))
    if kind == 4:
        a = int(rng.integers(0, 11))
        b = int(rng.integers(0, 21 - a))
        return f"add {num(a)} and {num(b)} .", f"{num(a)} plus {num(b)} is {num(a + b)} ."
    items = [ITEMS[i] for i in rng.choice(len(ITEMS), size=int(rng.integers(2, 8)), replace=False)]
    return "how many words : " + " ".join(items) + " ?", _count(len(items), "word")


# ------------------------------------------------------------------------- scenarios
def _rng(scenario: str, seed: int) -> np.random.Generator:
    return np.random.default_rng([seed, sum(map(ord, scenario)) * 7919])


def make_example(scenario: str, seed: int) -> Example:
    """One example of `scenario` ("S1".."S5" or "text"); deterministic in (scenario, seed)."""
    rng = _rng(scenario, seed)
    if scenario == "S1":
        sc = random_scene(rng)
        return Example("S1", [Turn(1, *s1_turn(rng, sc))], (sc,))
    if scenario == "S2":
        sc = random_scene(rng)
        return Example("S2", [Turn(1, *s2_turn(rng, sc))], (sc,))
    if scenario == "S3":
        sc = random_scene(rng)
        return Example("S3", [Turn(1, *text_task(rng))], (sc,))
    if scenario == "S4":
        sc = random_scene(rng)
        first = Turn(1, *image_turn(rng, sc))
        if rng.random() < 0.25:
            second = Turn(0, "say your answer again .", first.answer)
        else:
            second = Turn(0, *text_task(rng))
        return Example("S4", [first, second], (sc,))
    if scenario == "S5":
        if rng.random() < 0.6:  # one image in an unusual style
            style = OOD_STYLES[int(rng.integers(len(OOD_STYLES)))]
            sc = random_scene(rng, style=style)
            return Example("S5", [Turn(1, *image_turn(rng, sc))], (sc,))
        scs = (random_scene(rng, n_max=3), random_scene(rng, n_max=3))
        kind = int(rng.integers(3))
        if kind == 2:
            n = len(scs[0].objects) + len(scs[1].objects)
            turn = Turn(2, "how many shapes are there in both images ?", _count(n, "shape"))
        else:
            which = ("first", "second")[kind]
            turn = Turn(2, f"describe the {which} image .", describe(scs[kind]))
        return Example("S5", [turn], scs)
    if scenario == GRID_READ:
        # one answer token per cell, in the order of the image tokens: the answer token
        # for cell k sits at a fixed distance from image token k, an easy attention
        # pattern through which the LM learns what the features of a cell mean
        sc = random_scene(rng)
        cells = {(o.row, o.col): o for o in sc.objects}
        attr = "color" if rng.random() < 0.5 else "shape"
        words = [getattr(cells[divmod(k, GRID)], attr) if divmod(k, GRID) in cells else "none"
                 for k in range(GRID * GRID)]
        return Example(GRID_READ, [Turn(1, f"list the {attr}s .", " ".join(words))], (sc,))
    if scenario == TEXT:
        turns = [Turn(0, *text_task(rng))]
        if rng.random() < 0.3:
            turns.append(Turn(0, *text_task(rng)) if rng.random() < 0.7
                         else Turn(0, "say your answer again .", turns[0].answer))
        return Example(TEXT, turns)
    raise ValueError(f"unknown scenario {scenario!r}; expected one of {SCENARIOS + (TEXT,)}")


def examples(scenario: str, n: int, seed: int = 0) -> list[Example]:
    """`n` examples of `scenario`, seeds seed*1_000_003 + i."""
    return [make_example(scenario, seed * 1_000_003 + i) for i in range(n)]
