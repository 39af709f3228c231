"""Checkpoint loading: the streaming loader writes exactly what the full-dict path did, and every
bad file is a ValueError naming the file."""
import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import load_file, save_file

from models import CONFIGS, model_dir
from tabed_engine import Engine, SamplingParams
from tabed_engine.models.loader import (fuse_projections, load_lvlm, load_processor, lvlm_from_hf, split_keys,
                                        tower_fingerprint)
from tabed_engine.models.safetensors_io import (StreamPlan, read_header, read_state_dict, stream_file, stream_plan,
                                                weight_files)
from tabed_engine.models.tiny import build_tiny_llava, random_image


def full_dict_reference(path, dtype):
    """The pre-streaming path: the whole state dict on the host, q/k/v and gate/up concatenated."""
    lm, vis, proj = split_keys(read_state_dict(path))
    return ({k: v.to(dtype) for k, v in fuse_projections(lm).items()},
            {k: v.to(dtype) for k, v in vis.items()}, {k: v.to(dtype) for k, v in proj.items()})


def assert_same_weights(loaded, ref):
    lm_ref, vis_ref, proj_ref = ref
    own = loaded.lm.state_dict()
    tied = loaded.lm.cfg.tie_word_embeddings
    assert set(own) - {"lm_head.weight"} == set(lm_ref) - {"lm_head.weight"}
    for k, v in lm_ref.items():
        if not (tied and k == "lm_head.weight"):
            assert own[k].dtype == v.dtype and torch.equal(own[k], v), k
    if tied:
        assert loaded.lm.lm_head.weight is loaded.lm.embed_tokens.weight
    tower = loaded.vision.checkpoint_targets()   # checkpoint key -> its tensor (or rows) in the tower
    assert set(tower) == set(vis_ref)
    for k, v in vis_ref.items():
        assert torch.equal(tower[k], v), k
    proj = loaded.vision.projector.state_dict()
    assert set(proj) == set(proj_ref) and all(torch.equal(proj[k], v) for k, v in proj_ref.items())


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_streaming_load_equals_full_dict(name, dtype):
    """Every tiny config (both key layouts, sharded, tied, GQA, head_dim != hidden/heads),
    bit for bit, with and without a dtype conversion on the way."""
    path = model_dir(name)
    loaded = load_lvlm(path, "cpu", dtype)
    assert_same_weights(loaded, full_dict_reference(path, dtype))
    assert next(loaded.lm.parameters()).dtype == dtype


def test_qkv_bias_lands_in_fused_rows(tmp_path):
    """Qwen2-style attention bias: q/k/v biases fill their rows of qkv_proj.bias."""
    src = model_dir("gqa_headdim")
    dst = tmp_path / "bias"
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["text_config"]["attention_bias"] = True
    (dst / "config.json").write_text(json.dumps(cfg))
    sd = load_file(dst / "model.safetensors")
    lm_cfg_heads, kv, hd = 4, 1, 16
    g = torch.Generator().manual_seed(0)
    for i in range(cfg["text_config"]["num_hidden_layers"]):
        for p, n in (("q", lm_cfg_heads * hd), ("k", kv * hd), ("v", kv * hd)):
            sd[f"language_model.model.layers.{i}.self_attn.{p}_proj.bias"] = torch.randn(n, generator=g)
    save_file(sd, dst / "model.safetensors", metadata={"format": "pt"})
    loaded = load_lvlm(str(dst), "cpu", torch.float32)
    assert loaded.lm.cfg.qkv_bias
    assert_same_weights(loaded, full_dict_reference(str(dst), torch.float32))


@pytest.mark.parametrize("chunk", [1, 13, 1000, 4099, 1 << 20])
@pytest.mark.parametrize("dtype", [None, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("direct", [False, True])
def test_stream_file_any_chunking(chunk, dtype, direct):
    """Tensors spanning many chunks, chunks holding many tensors, odd sizes: the bytes land
    where safetensors' own reader puts them, converted in the copy when dtypes differ."""
    files = weight_files(model_dir("gqa_tied_full"))     # 18 shards of 1-14 tensors
    for entries in files if chunk >= 1000 else files[-2:]:   # byte-sized chunks: two shards
        ref = load_file(entries[0].file)
        dests = [torch.full(e.shape, float("nan"), dtype=dtype or e.dtype) for e in entries]
        if len(dests) > 2:
            dests[1] = None                # a skipped tensor (a tied head) is read past
        stream_file(entries, dests, torch.device("cpu"), StreamPlan(chunk, 3, False, direct))
        for e, d in zip(entries, dests):
            if d is not None:
                assert torch.equal(d, ref[e.name].to(d.dtype)), (e.name, chunk)


def test_lvlm_from_hf_same_mapping(tmp_path):
    """An in-memory transformers model goes through the same mapping as its checkpoint."""
    for name in ("mha", "gqa_tied_full"):
        hf = build_tiny_llava(str(tmp_path / name),
                              **{**CONFIGS[name], "layout": "current", "shard_bytes": None})
        mem = lvlm_from_hf(hf, "cpu", torch.float32)
        disk = load_lvlm(model_dir(name), "cpu", torch.float32)
        a, b = mem.lm.state_dict(), disk.lm.state_dict()
        assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
        assert mem.vision_sd_hash == disk.vision_sd_hash


def test_vision_fingerprint():
    """Equal towers (a perturbed LM keeps the tower) share a fingerprint; another tower, or
    the same weights in another dtype, do not."""
    base = load_lvlm(model_dir("mha"), "cpu", torch.float32)
    same = load_lvlm(model_dir("mha", perturb=0.6), "cpu", torch.float32)
    other = load_lvlm(model_dir("mha", vision_seed=7), "cpu", torch.float32)
    half = load_lvlm(model_dir("mha"), "cpu", torch.bfloat16)
    assert base.vision_sd_hash == same.vision_sd_hash
    assert other.vision_sd_hash != base.vision_sd_hash
    assert half.vision_sd_hash != base.vision_sd_hash
    # a permutation of one tensor's elements changes it
    w = same.vision.tower.state_dict()["embeddings.patch_embedding.weight"]
    w.copy_(w.flip(0))
    assert tower_fingerprint(same.vision.tower) != base.vision_sd_hash


# ------------------------------------------------------------------ bad files


def _copy(tmp_path, name, tag):
    dst = tmp_path / tag
    shutil.copytree(model_dir(name), dst)
    return dst


def _shards(d):
    return sorted(p for p in os.listdir(d) if p.endswith(".safetensors"))


def _truncate_half(d):
    f = d / _shards(d)[-1]
    os.truncate(f, os.path.getsize(f) // 2)
    return f


def _truncate_header(d):
    f = d / "model.safetensors"
    os.truncate(f, 5)
    return f


def _empty(d):
    f = d / "model.safetensors"
    f.write_bytes(b"")
    return f


def _garbage_header(d):
    f = d / "model.safetensors"
    with open(f, "r+b") as fh:
        fh.seek(8)
        fh.write(b"#not json#")
    return f


def _bad_config(d):
    f = d / "config.json"
    f.write_text("{")
    return f


def _config_is_a_dir(d):
    f = d / "config.json"
    os.remove(f)
    os.mkdir(f)
    return f


def _delete_shard(d):
    f = d / _shards(d)[0]
    os.remove(f)
    return f


def _index_names_absent_tensor(d):
    idx = d / "model.safetensors.index.json"
    data = json.loads(idx.read_text())
    first, last = _shards(d)[0], _shards(d)[-1]
    key = next(k for k, v in data["weight_map"].items() if v == first)
    data["weight_map"][key] = last
    idx.write_text(json.dumps(data))
    return d / last


def _bad_index(d):
    f = d / "model.safetensors.index.json"
    f.write_text("{\"weight_map\": ")
    return f


def _wrong_shape(d):
    f = d / "model.safetensors"
    sd = load_file(f)
    key = next(k for k in sd if k.endswith("mlp.up_proj.weight"))
    sd[key] = sd[key][:-1].contiguous()
    save_file(sd, f, metadata={"format": "pt"})
    return f


def _unexpected_tensor(d):
    f = d / "model.safetensors"
    sd = load_file(f)
    sd["model.language_model.layers.0.mlp.extra.weight"] = torch.zeros(2, 2)
    save_file(sd, f, metadata={"format": "pt"})
    return f


def _missing_tensor(d):
    f = d / "model.safetensors"
    sd = load_file(f)
    del sd[next(k for k in sd if k.endswith("layers.1.self_attn.k_proj.weight"))]
    save_file(sd, f, metadata={"format": "pt"})
    return d


def _autoconfig_fails(d):
    f = d / "config.json"
    cfg = json.loads(f.read_text())
    cfg["vision_config"]["model_type"] = "no_such_vision_model"
    f.write_text(json.dumps(cfg))
    return d


BAD = {  # name: (checkpoint to damage, damage -> file the message must name, words in it)
    "truncated shard": ("gqa_tied_full", _truncate_half, "truncated"),
    "truncated header": ("mha", _truncate_header, "truncated"),
    "empty file": ("mha", _empty, "empty"),
    "garbage header": ("mha", _garbage_header, "damaged"),
    "corrupt config.json": ("mha", _bad_config, "not valid JSON"),
    "config.json unreadable": ("mha", _config_is_a_dir, "cannot read"),
    "missing shard": ("mha_tied_sharded", _delete_shard, "missing"),
    "index names absent tensor": ("mha_tied_sharded", _index_names_absent_tensor, "does not hold"),
    "corrupt index": ("gqa_tied_full", _bad_index, "not valid JSON"),
    "wrong shape": ("mha", _wrong_shape, "shape"),
    "unexpected tensor": ("mha", _unexpected_tensor, "mlp.extra.weight"),
    "missing tensor": ("mha", _missing_tensor, "k_proj"),
    "AutoConfig fails": ("mha", _autoconfig_fails, "could not read the config"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_checkpoint_is_a_value_error_naming_the_file(tmp_path, case):
    name, damage, words = BAD[case]
    d = _copy(tmp_path, name, "bad")
    culprit = damage(d)
    with pytest.raises(ValueError) as err:
        Engine.from_pretrained(str(d), device="cpu")
    msg = str(err.value)
    assert str(culprit) in msg and words in msg, msg
    # the good checkpoint still loads and runs after the failure
    good = Engine.from_pretrained(model_dir(name), device="cpu", dtype=torch.float32)
    out = good.generate("<image>\n w1 w2", images=[random_image(0, good_image_size(name))],
                        sampling=SamplingParams(max_new_tokens=2), speculative=False)
    assert len(out.token_ids) == 2


def good_image_size(name):
    return CONFIGS[name].get("image_size", 30)


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any directory")
def test_unreadable_directory(tmp_path):
    d = _copy(tmp_path, "mha", "locked")
    os.chmod(d, 0)
    try:
        with pytest.raises(ValueError, match="cannot read checkpoint directory"):
            load_lvlm(str(d), "cpu", torch.float32)
    finally:
        os.chmod(d, 0o755)


def test_processor_failure_names_directory(tmp_path):
    d = _copy(tmp_path, "mha", "no_tok")
    (d / "tokenizer.json").write_text("{")
    for f in os.listdir(d):
        if f.startswith("tokenizer") and f != "tokenizer.json":
            os.remove(d / f)
    with pytest.raises(ValueError, match="tokenizer/processor") as err:
        load_processor(str(d))
    assert str(d) in str(err.value)


def test_header_reader_rejects_inconsistent_offsets(tmp_path):
    f = tmp_path / "x.safetensors"
    save_file({"a": torch.zeros(3, 5)}, f)
    raw = bytearray(f.read_bytes())
    n = int.from_bytes(raw[:8], "little")
    header = raw[8:8 + n].replace(b"[3,5]", b"[5,5]")
    f.write_bytes(raw[:8] + header + raw[8 + n:])
    with pytest.raises(ValueError, match="do not fit shape") as err:
        read_header(str(f))
    assert str(f) in str(err.value)


# ------------------------------------------------------------------ host memory

_PEAK = textwrap.dedent("""
    import sys, torch
    from tabed_engine.models.loader import fuse_projections, load_lvlm, split_keys
    from tabed_engine.models.safetensors_io import read_state_dict
    path, how, warm = sys.argv[1:4]
    def status(key):   # this process's resident set (VmRSS) and its peak (VmHWM), bytes
        with open("/proc/self/status") as f:
            return next(int(l.split()[1]) * 1024 for l in f if l.startswith(key + ":"))
    load_lvlm(warm, "cpu", torch.float32)     # imports and first-call costs out of the way
    before = status("VmRSS")
    if how == "full":   # the old path: state dict and fused copies held while the model fills
        sd = read_state_dict(path)
        fused = fuse_projections(split_keys(sd)[0])
        sum(float(t.sum()) for t in sd.values())   # touch every page
    m = load_lvlm(path, "cpu", torch.float32)
    print(status("VmHWM") - before)
""")


@pytest.mark.slow
def test_streaming_holds_no_state_dict_copy(tmp_path):
    """Host memory during load_lvlm on the CPU: the model itself plus bounded chunks, not an
    extra copy of the state dict (which the full-dict path holds next to the model)."""
    path = str(tmp_path / "mid")
    build_tiny_llava(path, vocab_size=2000, hidden=512, intermediate=1376, layers=8, heads=8,
                     kv_heads=8, shard_bytes=40 << 20)
    size = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".safetensors"))
    assert size > 100e6
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}

    def peak(how):
        out = subprocess.run([sys.executable, "-c", _PEAK, path, how, model_dir("mha")], capture_output=True, text=True,
                             env=env, check=True)
        return int(out.stdout.strip().splitlines()[-1])

    stream, full = peak("stream"), peak("full")
    assert full > 2.5 * size                 # the probe sees the old path's copies
    # the model (= size in float32) plus chunks and per-tensor slack, well below model + copy
    assert stream < 1.35 * size, (stream, full, size)


def test_stream_plan():
    """Pinned read-ahead on CUDA, bounded in threads and bytes; small plain buffers on the CPU."""
    for cpus in (1, 4, 16, 128):
        p = stream_plan(torch.device("cuda"), cpus)
        assert p.pinned and 2 <= p.depth <= 8 and p.depth * p.chunk_bytes <= 256 << 20
    p = stream_plan(torch.device("cpu"))
    assert not p.pinned and p.direct and p.depth * p.chunk_bytes <= 16 << 20


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["gqa_tied_full", "mha_tied_sharded"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_streaming_equals_cpu(name, dtype):
    """The pinned, read-ahead CUDA path (events guard slot reuse) writes what the CPU path
    writes, with 1 KiB chunks so every tensor spans several slots and readers wait on events."""
    path = model_dir(name)
    cpu = load_lvlm(path, "cpu", dtype)
    gpu = load_lvlm(path, "cuda", dtype)
    for a, b in ((cpu.lm, gpu.lm), (cpu.vision, gpu.vision)):
        sa, sb = a.state_dict(), b.state_dict()
        assert set(sa) == set(sb) and all(torch.equal(sa[k], sb[k].cpu()) for k in sa)
    for entries in weight_files(path):
        ref = load_file(entries[0].file)
        dests = [torch.full(e.shape, float("nan"), dtype=dtype, device="cuda") for e in entries]
        stream_file(entries, dests, torch.device("cuda"), StreamPlan(1024, 3, True))
        assert all(torch.equal(d.cpu(), ref[e.name].to(dtype)) for e, d in zip(entries, dests))
