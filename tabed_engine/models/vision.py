"""The vision side of a LLaVA checkpoint: the vision tower and the projector (`VisionEncoder`).

CLIP towers (`model_type` "clip_vision_model": every LLaVA-1.5 checkpoint) run through our
compact encoder `CLIPTower`, with the checkpoint's weights mapped in: q/k/v fused into one
projection, attention through SDPA's fused kernels, patches embedded by one GEMM, and only the
layers up to the deepest selected feature layer run (LLaVA-1.5 selects layer -2: 23 of 24).
On CUDA, `select` replays one CUDA graph per image count: the tower is ~300 kernels, launched
one by one from Python 7.8 ms for one 336x336 image on an H200 (transformers' tower 12.0 ms),
replayed 1.82 ms against a 0.49 ms FLOP floor (results/ttft_vision_h200.md).
Other towers (SigLIP, ...) run as the transformers module, eagerly. The projector is
transformers' `LlavaMultiModalProjector`. LLaVA-NeXT checkpoints (`image_grid_pinpoints`) add
any-resolution tiling: `select_images` runs every image's tiles through the tower and
`image_features` packs them per image (anyres.py) with the checkpoint's `image_newline`.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from tabed_engine.models.anyres import AnyRes, pack

# q, k, v rows of the fused projection, as the checkpoint names them
_QKV = ("q_proj", "k_proj", "v_proj")


class _Attention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv_proj = nn.Linear(dim, 3 * dim)
        self.out_proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, t, d = x.shape                                          # x: [n, T, D]
        q, k, v = self.qkv_proj(x).view(n, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v)                # [n, H, T, hd]; scale hd^-0.5 as CLIP's
        return self.out_proj(a.transpose(1, 2).reshape(n, t, d))


class _MLP(nn.Module):
    def __init__(self, dim: int, inner: int, act):
        super().__init__()
        self.fc1 = nn.Linear(dim, inner)
        self.fc2 = nn.Linear(inner, dim)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class _Layer(nn.Module):
    def __init__(self, dim: int, heads: int, inner: int, eps: float, act):
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(dim, eps=eps)
        self.self_attn = _Attention(dim, heads)
        self.layer_norm2 = nn.LayerNorm(dim, eps=eps)
        self.mlp = _MLP(dim, inner, act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class _Embeddings(nn.Module):
    def __init__(self, dim: int, channels: int, patch: int, grid: int):
        super().__init__()
        self.patch, self.grid = patch, grid
        self.class_embedding = nn.Parameter(torch.empty(dim))
        self.patch_embedding = nn.Conv2d(channels, dim, patch, stride=patch, bias=False)  # the checkpoint's layout
        self.position_embedding = nn.Embedding(grid * grid + 1, dim)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        n, c = pixel_values.shape[:2]                              # pixel_values: [n, C, S, S]
        g, p = self.grid, self.patch
        # stride-p conv == one GEMM over the flattened patches [n * g * g, C * p * p]
        x = pixel_values[:, :, :g * p, :g * p].reshape(n, c, g, p, g, p).permute(0, 2, 4, 1, 3, 5)
        w = self.patch_embedding.weight
        x = x.reshape(n, g * g, c * p * p) @ w.reshape(w.shape[0], -1).t()
        x = torch.cat([self.class_embedding.expand(n, 1, -1), x], dim=1)
        return x + self.position_embedding.weight                  # [n, g*g + 1, D]


class CLIPTower(nn.Module):
    """A CLIP vision transformer with the checkpoint's parameter names (q/k/v fused into
    `self_attn.qkv_proj`). forward returns the hidden states at `layers` (indices into
    transformers' `hidden_states`: 0 is the embedding after `pre_layrnorm`, i the output of
    layer i), running only the layers the deepest of them needs."""

    def __init__(self, vc, layers: tuple[int, ...]):
        super().__init__()
        from transformers.activations import ACT2FN

        d, n_layers = vc.hidden_size, vc.num_hidden_layers
        self.image_size = vc.image_size
        self.layers = layers
        self.embeddings = _Embeddings(d, vc.num_channels, vc.patch_size, vc.image_size // vc.patch_size)
        self.pre_layrnorm = nn.LayerNorm(d, eps=vc.layer_norm_eps)
        self.encoder = nn.Module()
        self.encoder.layers = nn.ModuleList(
            _Layer(d, vc.num_attention_heads, vc.intermediate_size, vc.layer_norm_eps, ACT2FN[vc.hidden_act])
            for _ in range(n_layers))
        self.post_layernorm = nn.LayerNorm(d, eps=vc.layer_norm_eps)   # in checkpoints; LLaVA never uses it

    def forward(self, pixel_values: torch.Tensor) -> list[torch.Tensor]:
        if pixel_values.shape[-2:] != (self.image_size, self.image_size):
            raise ValueError(f"pixel_values of {tuple(pixel_values.shape[-2:])} pixels, the vision tower takes "
                             f"{self.image_size}x{self.image_size}")
        x = self.pre_layrnorm(self.embeddings(pixel_values))
        out = {0: x}
        for i, layer in enumerate(self.encoder.layers[:max(self.layers)], start=1):
            x = out[i] = layer(x)
        return [out[i] for i in self.layers]

    def checkpoint_targets(self) -> dict[str, torch.Tensor]:
        """Checkpoint key (without `vision_model.`) -> the tensor it fills: a parameter, or its
        rows of `qkv_proj`."""
        out = {}
        for name, t in self.state_dict().items():
            if ".qkv_proj." not in name:
                out[name] = t
                continue
            pre, kind = name.split(".qkv_proj.")
            for part, rows in zip(_QKV, t.chunk(3)):
                out[f"{pre}.{part}.{kind}"] = rows
        return out


def _layer_indices(feature_layer, n_layers: int) -> tuple[int, ...]:
    layers = [feature_layer] if isinstance(feature_layer, int) else list(feature_layer)
    out = tuple(i + n_layers + 1 if i < 0 else i for i in layers)
    if not layers or not all(0 <= i <= n_layers for i in out):
        raise ValueError(f"vision_feature_layer {feature_layer!r} is outside the tower's {n_layers} layers")
    return out


class VisionEncoder(nn.Module):
    """The checkpoint's vision tower + projector; `select` then `project` per request."""

    # graphs hold at most this many images; more are encoded in chunks of it
    max_graph_images = 8

    def __init__(self, hf_config, feature_layer, strategy: str, video: bool = False):
        super().__init__()
        from transformers.models.llava.modeling_llava import LlavaMultiModalProjector

        if strategy not in ("default", "full"):
            raise ValueError(f"unsupported vision_feature_select_strategy {strategy!r}")
        vc = hf_config.vision_config
        self.feature_layer = feature_layer
        self.strategy = strategy
        self.compact = getattr(vc, "model_type", None) == "clip_vision_model"
        # CLIP towers put a CLS token first ("full" keeps it); SigLIP (OneVision) has none
        self.keeps_cls = strategy == "full" and str(getattr(vc, "model_type", "")).startswith("clip")
        self.grid = vc.image_size // vc.patch_size                 # feature grid side of one tile
        if self.compact:
            self.tower = CLIPTower(vc, _layer_indices(feature_layer, vc.num_hidden_layers))
        else:
            from transformers import AutoModel

            self.tower = AutoModel.from_config(vc)
        self.projector = LlavaMultiModalProjector(hf_config)
        # LLaVA-NeXT: tiles by image_grid_pinpoints, a learned newline after each feature row
        self.anyres = AnyRes.from_config(hf_config) if getattr(hf_config, "image_grid_pinpoints", None) else None
        self.image_newline = None
        if self.anyres is not None:
            # "full" has no reference to equal: transformers' pack_image_features views each tile's
            # g*g + 1 features as a g x g grid, which fails (or, where g*g divides the hidden size,
            # mixes channels across positions and then fails at the newline concat)
            if self.keeps_cls:
                raise ValueError(f"LLaVA-NeXT checkpoints with a CLIP tower need vision_feature_select_strategy "
                                 f"'default' (the tiles' grids are packed without CLS; transformers cannot pack "
                                 f"'full' either), got {strategy!r}")
            self.image_newline = nn.Parameter(torch.empty(hf_config.text_config.hidden_size))
        # LLaVA-OneVision videos: each frame's projected grid pooled bilinearly to ceil(g / 2) a side,
        # one image_newline after the last frame (transformers' get_video_features / apply_pooling)
        self.video_grid = -(-self.grid // 2) if video else None
        self.use_graphs = True
        self._graphs = None

    @property
    def default_pool(self) -> int:
        """The P view's pooled grid side by default: half the tower's."""
        return max(self.grid // 2, 1)

    @property
    def fixed_tokens(self) -> Optional[int]:
        """Every image's token count when it does not depend on the image (None: any resolution)."""
        return None if self.anyres is not None else self.grid ** 2 + self.keeps_cls

    def bind_processor(self, image_processor):
        """Nothing to take: the token counts follow from the config (see `QwenVision`)."""

    def positions(self, ids, spans, sizes, pool: int = 0, videos=()) -> None:
        """1-D RoPE: a prompt's positions are its slots (see `QwenVision.positions`)."""
        return None

    def reset_buffers(self):
        """Rebuild the tower's non-persistent buffers after loading."""
        from tabed_engine.models.loader import _init_buffers

        _init_buffers(self.tower)

    def video_tokens(self, video, pool: int = 0) -> int:
        """Tokens of a video: its frames' pixels [frames, 3, S, S] (or its frame count);
        ValueError for a family without videos. pool is ignored: the model already pools each
        frame, so the P view keeps M's video tokens."""
        if self.video_grid is None:
            raise ValueError("this model family takes no videos")
        frames = video if isinstance(video, int) else video.shape[0]
        return frames * self.video_grid ** 2 + 1

    def pool_video(self, feats: torch.Tensor, pixels: torch.Tensor, pool: int) -> torch.Tensor:
        """The P view's video features: M's (see `video_tokens`)."""
        return feats

    @torch.no_grad()
    def video_features(self, pixels: torch.Tensor, sel: Optional[torch.Tensor] = None) -> torch.Tensor:
        """One video's token features [frames * p^2 + 1, D] from its frames' pixels
        [frames, 3, S, S] (or their selected tower features `sel`)."""
        if self.video_grid is None:
            raise ValueError("this model family takes no videos")
        feats = self.project(self.select(pixels) if sel is None else sel)      # [T, g*g, D]
        T, gg, D = feats.shape
        x = feats.view(T, self.grid, self.grid, D).permute(0, 3, 1, 2)
        x = F.interpolate(x, size=[self.video_grid, self.video_grid], mode="bilinear")
        x = x.permute(0, 2, 3, 1).reshape(T * self.video_grid ** 2, D)
        return torch.cat([x, self.image_newline.to(x)[None]])

    def checkpoint_targets(self) -> dict[str, torch.Tensor]:
        """Canonical vision key (`loader.canonical_key`) -> the tensor of the tower it fills."""
        if self.compact:
            return self.tower.checkpoint_targets()
        return {k[len("vision_model."):] if k.startswith("vision_model.") else k: t
                for k, t in self.tower.state_dict().items()}

    def _features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        if self.compact:
            feats = self.tower(pixel_values)
        else:
            hs = self.tower(pixel_values, output_hidden_states=True).hidden_states
            feats = [hs[i] for i in ([self.feature_layer] if isinstance(self.feature_layer, int)
                                     else self.feature_layer)]
        if self.strategy == "default":
            feats = [f[:, 1:] for f in feats]
        return feats[0] if len(feats) == 1 else torch.cat(feats, dim=-1)

    @torch.no_grad()
    def select(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """pixel_values [n, 3, S, S] -> the selected tower features [n, tokens_per_image,
        vision_hidden x layers]. On CUDA (compact tower) a replay of the graph for n images; the
        result is a fresh tensor, never the graph's buffer."""
        pv = pixel_values.to(self.projector.linear_1.weight.dtype)
        if not (self.compact and self.use_graphs and pv.is_cuda):
            return self._features(pv)
        if self._graphs is None:
            from tabed_engine.engine.graphs import GraphCache

            self._graphs = GraphCache()
        outs = [self._graphs.run(tuple(chunk.shape), self._features, {"pixel_values": chunk})
                for chunk in pv.split(self.max_graph_images)]
        return torch.cat(outs) if len(outs) > 1 else outs[0].clone()

    @torch.no_grad()
    def project(self, feats: torch.Tensor) -> torch.Tensor:
        return self.projector(feats)

    def tokens_per_image(self, sizes, pool: int = 0) -> list[int]:
        """Image tokens of each image of sizes [(height, width), ...], as the processor expands
        them: the fixed grid (+ CLS with "full") per image, or any-resolution counts; pool > 0:
        the P view's, every grid pooled to pool x pool."""
        if self.anyres is not None:
            return [self.anyres.num_tokens(s, grid=pool or None) for s in sizes]
        return [(pool or self.grid) ** 2 + self.keeps_cls] * len(sizes)

    @torch.no_grad()
    def select_images(self, pixel_values: torch.Tensor, sizes=None) -> torch.Tensor:
        """A request's images -> selected features of every tile the tower sees: pixel_values
        [n, 3, S, S] as `select`; any-resolution [n, max_tiles, 3, S, S] (padded per image) with
        sizes [(height, width)] -> [sum of each image's tiles, g*g, C], image by image."""
        if self.anyres is None:
            return self.select(pixel_values)
        counts = [self.anyres.num_tiles(s) for s in sizes]
        if pixel_values.dim() != 5 or pixel_values.shape[0] != len(counts) or pixel_values.shape[1] < max(counts):
            raise ValueError(f"pixel_values {tuple(pixel_values.shape)} do not hold {counts} tiles per image "
                             "(is the processor the checkpoint's LlavaNextProcessor?)")
        return self.select(torch.cat([pv[:n] for pv, n in zip(pixel_values, counts)]))

    @torch.no_grad()
    def image_features(self, sel: torch.Tensor, sizes=None, pool: int = 0) -> list[torch.Tensor]:
        """`select_images`' features -> each image's projected token features [n_i, hidden].
        pool > 0 first average-pools every grid (each tile's and the base's; the CLS kept) to
        pool x pool; any-resolution images are then packed from their pooled tiles."""
        if pool:
            sel = pool_features(sel, pool, self.keeps_cls)
        feats = self.project(sel)
        if self.anyres is None:
            return list(feats)
        counts = [self.anyres.num_tiles(s) for s in sizes]
        return [pack(f, s, self.anyres, self.image_newline) for f, s in zip(feats.split(counts), sizes)]

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """pixel_values [n, 3, H, W] -> projected features [n, tokens_per_image, lm_hidden]."""
        return self.project(self.select(pixel_values))


def pool_features(sel: torch.Tensor, size: int, has_cls: bool) -> torch.Tensor:
    """Average-pool a square feature grid. sel: [n, (1+) g*g, C] -> [n, (1+) size*size, C]."""
    cls, grid = (sel[:, :1], sel[:, 1:]) if has_cls else (sel[:, :0], sel)
    n, gg, C = grid.shape
    g = int(round(gg ** 0.5))
    if g * g != gg:
        raise ValueError(f"image features of {gg} tokens are not a square grid; P view cannot pool")
    if not 1 <= size <= g:
        raise ValueError(f"pool size must be in [1, {g}], got {size}")
    x = grid.transpose(1, 2).reshape(n, C, g, g).float()
    x = F.adaptive_avg_pool2d(x, size).reshape(n, C, size * size).transpose(1, 2).to(sel.dtype)
    return torch.cat([cls, x], dim=1)


def hf_vision_tower(vision: VisionEncoder, hf_config) -> nn.Module:
    """transformers' own tower for `hf_config` holding `vision`'s weights (float32 reference for
    tests and benchmarks; not on the engine's path)."""
    from transformers import AutoModel

    ref = AutoModel.from_config(hf_config.vision_config).to(vision.projector.linear_1.weight)
    own = vision.checkpoint_targets()
    with torch.no_grad():
        for k, t in ref.state_dict().items():
            key = k[len("vision_model."):] if k.startswith("vision_model.") else k
            if key in own:
                t.copy_(own[key])
            elif key.endswith("position_ids"):
                t.copy_(torch.arange(t.shape[-1]).expand_as(t))
            else:
                raise KeyError(f"transformers' tower has {k!r}, ours has no such weight")
    return ref.eval()
