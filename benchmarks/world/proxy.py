"""Draft views on HF LLaVA models, and the acceptance-rate proxy of the world.

The views (same draft weights, different inputs):
  M  multimodal prompt: image features at the image tokens;
  T  text-only: each image's run of image tokens replaced by ONE "\\n" token;
  P  image-pooled: the projected feature grid average-pooled 2x per side
     (4x4 -> 2x2 here), so each image gets a quarter of the image tokens;
  C  caption: each image replaced by the text "image : " + caption.

`measure(...)` is the proxy: along the target's greedy continuation, teacher-forced,
how often each view's argmax equals the target's token, and the block efficiency
(tokens per target forward) a greedy chain of `gamma` drafted tokens would reach.
Teacher forcing along the target's own greedy tokens is exact for greedy speculative
decoding: every drafted token after a mismatch is thrown away.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from .scenarios import Example

VIEWS = ("M", "T", "P", "C")
POOL = 2  # P view: average-pool the feature grid POOL x POOL


# ------------------------------------------------------------------ inputs of a view
@dataclass
class Encoded:
    ids: list[int]
    n_prompt: int  # ids[:n_prompt] is the prompt; the rest is the answer (if any)
    scenes: list  # the scenes whose features go into the image-token runs, in order
    pooled: bool


def n_image_tokens(model) -> int:
    cfg = model.config
    side = cfg.vision_config.image_size // cfg.vision_config.patch_size
    return side * side + (0 if cfg.vision_feature_select_strategy == "default" else 1)


def encode(tokenizer, example: Example, view: str, n_img: int, with_answer: bool = False) -> Encoded:
    """Token ids of `example` as seen through `view` (one image token per image position)."""
    if view not in VIEWS:
        raise ValueError(f"unknown view {view!r}; expected one of {VIEWS}")
    image_id = tokenizer.convert_tokens_to_ids("<image>")
    newline_id = tokenizer.convert_tokens_to_ids("\n")
    prompt = tokenizer(example.prompt).input_ids
    answer = tokenizer(" " + example.answer + " </s>", add_special_tokens=False).input_ids if with_answer else []
    out, scenes, k, n_prompt = [], [], 0, 0
    for j, t in enumerate(prompt + answer):
        if j == len(prompt):
            n_prompt = len(out)
        if t != image_id:
            out.append(t)
            continue
        scene = example.scenes[k]
        k += 1
        if view == "M":
            out += [image_id] * n_img
            scenes.append(scene)
        elif view == "P":
            out += [image_id] * (n_img // POOL**2)
            scenes.append(scene)
        elif view == "T":
            out.append(newline_id)
        else:  # C
            from .scenarios import caption
            out += tokenizer("image : " + caption(scene), add_special_tokens=False).input_ids
    if k != len(example.scenes):
        raise ValueError(f"{k} image placeholders for {len(example.scenes)} images")
    if not answer:
        n_prompt = len(out)
    return Encoded(out, n_prompt, scenes, view == "P")


def pixel_values(image_processor, images) -> torch.Tensor:
    """CLIP preprocessing of already-square images at the model's size (resize and crop are
    no-ops there; tests check this equals the saved image processor's output)."""
    x = np.stack([np.asarray(im, dtype=np.float32) for im in images]) * image_processor.rescale_factor
    x = (x - np.array(image_processor.image_mean, np.float32)) / np.array(image_processor.image_std, np.float32)
    return torch.from_numpy(x).permute(0, 3, 1, 2).contiguous()


def image_features(model, pixels: torch.Tensor, pooled: bool = False) -> torch.Tensor:
    """Projected features [n_images, tokens, hidden] (pooled 2x per side for P)."""
    cfg = model.config
    inner = model.model if hasattr(model, "model") and hasattr(model.model, "vision_tower") else model
    out = inner.vision_tower(pixels.to(model.dtype), output_hidden_states=True)
    feats = out.hidden_states[cfg.vision_feature_layer]
    if cfg.vision_feature_select_strategy == "default":
        feats = feats[:, 1:]
    feats = inner.multi_modal_projector(feats)
    if pooled:
        n, L, H = feats.shape
        side = int(round(L**0.5))
        grid = feats.transpose(1, 2).reshape(n, H, side, side)
        feats = F.avg_pool2d(grid, POOL).flatten(2).transpose(1, 2)
    return feats


def embed(model, image_processor, batch: list[Encoded], pad_id: int, device=None):
    """Right-padded inputs_embeds [B, S, H] and attention mask [B, S] for encoded rows."""
    device = device or model.device
    S = max(len(e.ids) for e in batch)
    ids = torch.full((len(batch), S), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), S), dtype=torch.long)
    for i, e in enumerate(batch):
        ids[i, : len(e.ids)] = torch.tensor(e.ids)
        mask[i, : len(e.ids)] = 1
    ids, mask = ids.to(device), mask.to(device)
    x = model.get_input_embeddings()(ids)
    image_id = model.config.image_token_index
    for pooled in (False, True):
        rows = [e for e in batch if e.pooled == pooled and e.scenes]
        if not rows:
            continue
        from .scenes import render
        imgs = [render(s) for e in rows for s in e.scenes]
        feats = image_features(model, pixel_values(image_processor, imgs).to(device), pooled)
        sel = torch.tensor([e.pooled == pooled and bool(e.scenes) for e in batch], device=device)
        where = (ids == image_id) & sel[:, None]
        x = x.masked_scatter(where[..., None], feats.reshape(-1, feats.shape[-1]).to(x.dtype))
    return x, mask


def logits_of(model, image_processor, batch: list[Encoded], pad_id: int) -> torch.Tensor:
    x, mask = embed(model, image_processor, batch, pad_id)
    return model(inputs_embeds=x, attention_mask=mask).logits


# ------------------------------------------------------------------------ the proxy
@torch.no_grad()
def greedy(model, tokenizer, image_processor, exs: list[Example], max_new_tokens: int) -> list[list[int]]:
    """Greedy continuation of each example's M prompt (stops after "</s>"), full recompute."""
    eos = tokenizer.eos_token_id
    n_img = n_image_tokens(model)
    rows = [encode(tokenizer, e, "M", n_img) for e in exs]
    outs = [[] for _ in rows]
    done = [False] * len(rows)
    for _ in range(max_new_tokens):
        batch = [Encoded(r.ids + o, r.n_prompt, r.scenes, False) for r, o in zip(rows, outs)]
        logits = logits_of(model, image_processor, batch, tokenizer.pad_token_id)
        for i, b in enumerate(batch):
            if not done[i]:
                t = int(logits[i, len(b.ids) - 1].argmax())
                outs[i].append(t)
                done[i] = t == eos
        if all(done):
            break
    return outs


def block_efficiency(matches: np.ndarray, gamma: int) -> float:
    """Tokens per target forward of a greedy chain that drafts `gamma` tokens per block:
    accept the longest matching prefix, then +1 (the target's own token)."""
    L, pos, blocks = len(matches), 0, 0
    while pos < L:
        k = 0
        while k < gamma and pos + k < L and matches[pos + k]:
            k += 1
        pos += k + 1
        blocks += 1
    return L / blocks if blocks else 0.0


@torch.no_grad()
def view_probs(draft, tokenizer, image_processor, exs: list[Example], conts: list[list[int]],
               view: str, batch_size: int = 32) -> list[torch.Tensor]:
    """Per example, the draft's next-token probabilities [len(cont), V] along `cont`."""
    n_img = n_image_tokens(draft)
    res = []
    for s in range(0, len(exs), batch_size):
        rows = [encode(tokenizer, e, view, n_img) for e in exs[s: s + batch_size]]
        cs = conts[s: s + batch_size]
        batch = [Encoded(r.ids + c, r.n_prompt, r.scenes, r.pooled) for r, c in zip(rows, cs)]
        probs = logits_of(draft, image_processor, batch, tokenizer.pad_token_id).float().softmax(-1)
        for i, (r, c) in enumerate(zip(rows, cs)):
            res.append(probs[i, r.n_prompt - 1: r.n_prompt - 1 + len(c)])
    return res


@torch.no_grad()
def measure(target, draft, tokenizer, image_processor, by_scenario: dict[str, list[Example]],
            views=VIEWS, mixtures: dict[str, tuple[str, ...]] | None = None,
            gamma: int = 5, max_new_tokens: int = 24) -> dict:
    """Acceptance proxy per (view, scenario).

    Returns {"match": {view: {scenario: rate}}, "block_eff": {view: {scenario: value}},
    "positions": {scenario: n}}. `mixtures` maps a name to views whose probabilities
    are averaged uniformly (default {"M+T": ("M", "T")}).
    """
    mixtures = {"M+T": ("M", "T")} if mixtures is None else mixtures
    names = list(views) + list(mixtures)
    match = {v: {} for v in names}
    beff = {v: {} for v in names}
    positions = {}
    for sc, exs in by_scenario.items():
        conts = greedy(target, tokenizer, image_processor, exs, max_new_tokens)
        probs = {v: view_probs(draft, tokenizer, image_processor, exs, conts, v) for v in views}
        for name, parts in mixtures.items():
            probs[name] = [sum(probs[p][i] for p in parts) / len(parts) for i in range(len(exs))]
        positions[sc] = sum(map(len, conts))
        for v in names:
            ms = [(p.argmax(-1).cpu() == torch.tensor(c)).numpy() for p, c in zip(probs[v], conts)]
            match[v][sc] = float(np.concatenate(ms).mean())
            beff[v][sc] = float(np.mean([block_efficiency(m, gamma) for m in ms]))
    return {"match": match, "block_eff": beff, "positions": positions}


@torch.no_grad()
def answer_accuracy(model, tokenizer, image_processor, exs: list[Example], max_new_tokens: int = 64) -> float:
    """Exact-match rate of the model's greedy answer (M view) with the reference."""
    outs = greedy(model, tokenizer, image_processor, exs, max_new_tokens)
    ok = [tokenizer.decode(o, skip_special_tokens=True).split() == e.answer.split() and o[-1:] == [tokenizer.eos_token_id]
          for o, e in zip(outs, exs)]
    return float(np.mean(ok))


def format_table(result: dict, key: str = "block_eff") -> str:
    """Markdown table view x scenario of `result[key]`."""
    tab = result[key]
    scs = list(next(iter(tab.values())))
    lines = ["| view | " + " | ".join(scs) + " |", "|---|" + "---|" * len(scs)]
    for v, row in tab.items():
        lines.append(f"| {v} | " + " | ".join(f"{row[s]:.2f}" if key == "block_eff" else f"{100 * row[s]:.0f}%" for s in scs) + " |")
    return "\n".join(lines)
