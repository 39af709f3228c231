"""The vision tower (tabed_engine/models/vision.py): our compact CLIP encoder gives transformers'
features in float32 (each checkpoint layout, feature layer and selection strategy), other
towers run as transformers modules, and on CUDA the graph-replayed bf16 tower is as close
to float32 as transformers' own bf16 tower; plus the vision benchmark's CPU smoke run."""
import json
import os

import pytest
import torch

from bench_scripts import load_benchmark
from models import CONFIGS, model_dir
from tabed_engine.models.loader import load_lvlm
from tabed_engine.models.vision import VisionEncoder, hf_vision_tower

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
EPS32 = torch.finfo(torch.float32).eps


def hf_select(tower, pixel_values, feature_layer, strategy):
    """transformers' LLaVA feature selection (get_image_features without the projector)."""
    hs = tower(pixel_values, output_hidden_states=True).hidden_states
    layers = [feature_layer] if isinstance(feature_layer, int) else feature_layer
    feats = [hs[i][:, 1:] if strategy == "default" else hs[i] for i in layers]
    return torch.cat(feats, dim=-1)


def assert_as_close_as_transformers(ours, hf32, hf64):
    """float32: allclose to transformers' float32 features, and no further from the float64
    truth than twice transformers' own float32 error (+ a few float32 ulps of the scale)."""
    torch.testing.assert_close(ours, hf32)
    err, base = (ours.double() - hf64).abs().max().item(), (hf32.double() - hf64).abs().max().item()
    assert err <= 2 * base + 8 * EPS32 * hf64.abs().max().item(), (err, base)


def realistic_target():
    import realistic

    return realistic.checkpoint("llama")[0]


@pytest.mark.parametrize("name", sorted(CONFIGS) + ["realistic"])
def test_select_equals_transformers(name):
    """Every tiny checkpoint (both key layouts, feature layer -1 / -2, "default" / "full", two
    image grids): our select() against transformers' own model loaded from the same files."""
    from transformers import LlavaForConditionalGeneration

    path = realistic_target() if name == "realistic" else model_dir(name)
    ours = load_lvlm(path, "cpu", torch.float32).vision
    hf = LlavaForConditionalGeneration.from_pretrained(path, local_files_only=True, dtype=torch.float32)
    cfg = hf.config
    size = cfg.vision_config.image_size
    pv = torch.randn(3, 3, size, size, generator=torch.Generator().manual_seed(0))
    args = cfg.vision_feature_layer, cfg.vision_feature_select_strategy
    with torch.no_grad():
        hf32 = hf_select(hf.model.vision_tower, pv, *args)
        hf64 = hf_select(hf.model.vision_tower.double(), pv.double(), *args)
    assert ours.compact
    assert_as_close_as_transformers(ours.select(pv), hf32, hf64)


def clip_llava_config(layers=4, feature_layer=-2, strategy="default"):
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig

    vc = CLIPVisionConfig(hidden_size=40, intermediate_size=83, num_hidden_layers=layers, num_attention_heads=5,
                          image_size=30, patch_size=6, projection_dim=16)
    tc = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                     num_key_value_heads=4, vocab_size=64)
    return LlavaConfig(vision_config=vc, text_config=tc, vision_feature_layer=feature_layer,
                       vision_feature_select_strategy=strategy)


def random_encoder(cfg, dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    enc = VisionEncoder(cfg, cfg.vision_feature_layer, cfg.vision_feature_select_strategy)
    with torch.no_grad():
        for p in enc.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.1 if p.dim() > 1 else 0.5))
    return enc.to(device, dtype).eval()


class Unreachable(torch.nn.Module):
    def forward(self, x):
        raise AssertionError("a layer past the deepest selected one ran")


@pytest.mark.parametrize("feature_layer, strategy, run", [(-2, "default", 3), ([-3, 1], "full", 2),
                                                          ([0, -1], "default", 4)])
def test_feature_layers(feature_layer, strategy, run):
    """Lists of layers (concatenated), layer 0 (the embeddings), "full" keeps CLS; the layers
    past the deepest selected one never run."""
    cfg = clip_llava_config(feature_layer=feature_layer, strategy=strategy)
    enc = random_encoder(cfg)
    ref = hf_vision_tower(enc, cfg)
    pv = torch.randn(2, 3, 30, 30, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        hf32 = hf_select(ref, pv, feature_layer, strategy)
        hf64 = hf_select(hf_vision_tower(enc, cfg).double(), pv.double(), feature_layer, strategy)
    for i in range(run, 4):
        enc.tower.encoder.layers[i] = Unreachable()
    ours = enc.select(pv)
    n_layers = 1 if isinstance(feature_layer, int) else len(feature_layer)
    assert ours.shape == (2, 25 + (strategy == "full"), 40 * n_layers)
    assert_as_close_as_transformers(ours, hf32, hf64)


def test_select_checks_the_image_size():
    enc = random_encoder(clip_llava_config())
    with pytest.raises(ValueError, match="30x30"):
        enc.select(torch.zeros(1, 3, 36, 36))


def test_other_towers_run_as_transformers_modules():
    """A SigLIP tower is no CLIP: the transformers module, its own weight names."""
    from transformers import LlamaConfig, LlavaConfig, SiglipVisionConfig

    vc = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                            image_size=28, patch_size=14)
    cfg = LlavaConfig(vision_config=vc, text_config=LlamaConfig(hidden_size=32, intermediate_size=64,
                      num_hidden_layers=1, num_attention_heads=4, vocab_size=64), vision_feature_layer=-1,
                      vision_feature_select_strategy="full")
    enc = random_encoder(cfg)
    assert not enc.compact
    assert set(enc.checkpoint_targets()) == {k.removeprefix("vision_model.") for k in enc.tower.state_dict()}
    pv = torch.randn(2, 3, 28, 28)
    with torch.no_grad():
        assert torch.equal(enc.select(pv), hf_select(enc.tower, pv, -1, "full"))


def test_benchmark_smoke(tmp_path):
    """benchmarks/ttft_vision.py --tiny on the CPU: every number written, the device path
    bit-exact with the processor, our tower equal to transformers' in float32."""
    mod = load_benchmark("ttft_vision")
    out = tmp_path / "ttft_vision.json"
    mod.main(["--tiny", "--device", "cpu", "--repeats", "1", "--out", str(out)])
    R = json.loads(out.read_text())
    assert R["targets"]["preprocess_bit_exact"] is True
    for n in (1, 3):
        r = R[f"{n}_images"]
        assert r["ours_vs_hf_max_abs"] <= 1e-5 * max(1.0, r["hf_feature_max_abs"])
        assert r["float_resize_vs_processor_max_abs"] > 0     # why the device path is fixed point
        assert all(r[k] > 0 for k in ("host_preprocess_ms", "device_preprocess_ms", "tower_hf_ms",
                                      "tower_ours_eager_ms", "tower_ours_select_ms"))
    assert R["flops_per_image"] > 0 and R["config"]["layers_run"] == 1


# ------------------------------------------------------------------ GPU

def gpu_config(layers=4):
    """A CLIP tower big enough for tensor-core kernels and flash attention (head_dim 64)."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig

    vc = CLIPVisionConfig(hidden_size=256, intermediate_size=1024, num_hidden_layers=layers, num_attention_heads=4,
                          image_size=112, patch_size=14, projection_dim=64)
    tc = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                     num_key_value_heads=4, vocab_size=64)
    return LlavaConfig(vision_config=vc, text_config=tc, vision_feature_layer=-2,
                       vision_feature_select_strategy="default")


@pytest.mark.gpu
def test_cuda_graph_bf16_within_transformers_bf16_error():
    """bf16 through the captured graph vs the float32 features: error at most twice that of
    transformers' own bf16 tower (+ one bf16 ulp of the scale), for 1, 3 and 9 images (9: graphs
    of 8 and 1)."""
    cfg = gpu_config()
    enc = random_encoder(cfg, torch.bfloat16, "cuda")
    ref32 = hf_vision_tower(enc, cfg).float()
    ref16 = hf_vision_tower(enc, cfg)
    for n in (1, 3, 9):
        pv = torch.randn(n, 3, 112, 112, device="cuda", generator=torch.Generator("cuda").manual_seed(n))
        with torch.no_grad():
            truth = hf_select(ref32, pv, -2, "default")
            base = (hf_select(ref16, pv.bfloat16(), -2, "default").float() - truth).abs().max().item()
        ours = enc.select(pv)
        assert ours.dtype == torch.bfloat16 and ours.shape == truth.shape
        err = (ours.float() - truth).abs().max().item()
        assert err <= 2 * base + 2 ** -8 * truth.abs().max().item(), (n, err, base)
        torch.testing.assert_close(ours, enc._features(pv.bfloat16()))     # replay == eager
    assert len(enc._graphs) == 3                                          # n = 1, 3, 8


@pytest.mark.gpu
def test_cuda_graph_result_is_not_the_static_buffer():
    enc = random_encoder(gpu_config(2), torch.bfloat16, "cuda")
    a_in, b_in = (torch.randn(2, 3, 112, 112, device="cuda") for _ in range(2))
    a = enc.select(a_in)
    kept = a.clone()
    b = enc.select(b_in)
    assert torch.equal(a, kept) and not torch.equal(a, b)
    enc.use_graphs = False
    torch.testing.assert_close(enc.select(a_in), kept)


@pytest.mark.gpu
def test_cuda_graph_captured_in_inference_mode_runs_outside_it():
    # the engine captures under inference mode; a caller's own no_grad code replays the same graph
    enc = random_encoder(gpu_config(2), torch.bfloat16, "cuda")
    a_in, b_in = (torch.randn(2, 3, 112, 112, device="cuda") for _ in range(2))
    with torch.inference_mode():
        a = enc.select(a_in).clone()
    with torch.no_grad():
        b = enc.select(b_in)
        torch.testing.assert_close(enc.select(a_in), a)
    with torch.inference_mode():
        torch.testing.assert_close(enc.select(b_in), b)
    assert len(enc._graphs) == 1
