"""Every bad input gets a clear ValueError / TypeError naming the culprit, through the API and
the CLI (one `error:` line, exit status 2, no traceback), and the engine keeps answering
exactly as before; calls never corrupt each other (threads, open streams); the engine leaves
torch's global state alone (RNG, inference mode)."""
import dataclasses
import gc
import io
import json
import math
import os
import shutil
import threading
import time

import numpy as np
import pytest
import torch

from models import model_dir
from tabed_engine import Engine, SamplingParams
from tabed_engine.serving.cli import build_parser, engine_kwargs, main
from tabed_engine.models.tiny import random_image

GOOD_TEXT = "<image>\n w1 w2 w3"
GOOD_SP = SamplingParams(max_new_tokens=8)


@pytest.fixture(scope="module")
def dirs():
    return model_dir("mha"), model_dir("mha", perturb=0.6)


@pytest.fixture(scope="module")
def eng(dirs):
    return Engine.from_pretrained(*dirs, device="cpu", dtype=torch.float32)


@pytest.fixture(scope="module")
def img():
    return random_image(1)


@pytest.fixture(scope="module")
def ref(eng, img):
    """The good request's answer, computed before any bad input reached the engine."""
    return eng.generate(GOOD_TEXT, images=[img], sampling=GOOD_SP).token_ids


def assert_usable(eng, img, ref):
    assert eng.generate(GOOD_TEXT, images=[img], sampling=GOOD_SP).token_ids == ref


# ----------------------------------------------------------------------------- API: requests
def _float255(img):
    return torch.from_numpy(np.array(img)).permute(2, 0, 1).float()            # 0..255, CHW


ONE = object()   # stands for the module's test image in the table below

BAD_REQUESTS = [
    # (id, generate() kwargs or a callable of the image giving them, exception, message)
    ("placeholders>images", dict(prompt="<image> <image> w1", images=ONE), ValueError, "placeholder"),
    ("images>placeholders", dict(prompt="w1 w2", images=ONE), ValueError, "placeholder"),
    ("cache overflow", dict(prompt="w1", sampling=SamplingParams(max_new_tokens=100000)), ValueError,
     "max_new_tokens"),
    ("empty string", dict(prompt=""), ValueError, "empty"),
    ("empty list", dict(prompt=[]), ValueError, "empty"),
    ("empty tensor", dict(prompt=torch.zeros(0, dtype=torch.long)), ValueError, "empty"),
    ("prompt int", dict(prompt=12), TypeError, "prompt"),
    ("token id out of range", dict(prompt=[1, 2, 100000]), ValueError, "token ids"),
    ("negative token id", dict(prompt=[1, -3]), ValueError, "token ids"),
    ("float token ids", dict(prompt=[1.0, 2.0]), TypeError, "token ids"),
    ("float id tensor", dict(prompt=torch.tensor([[1.0, 2.0]])), TypeError, "integer"),
    ("image lists for one prompt", dict(prompt=GOOD_TEXT, images=[[ONE]]), ValueError, "list of prompts"),
    ("image type", dict(prompt="<image> w1", images=["x"]), TypeError, "image type"),
    ("float tensor 0..255", lambda im: dict(prompt=GOOD_TEXT, images=[_float255(im)]), ValueError,
     "divide by 255"),
    ("numpy float 0..255", lambda im: dict(prompt=GOOD_TEXT, images=[np.asarray(im).astype(np.float32)]),
     ValueError, "divide by 255"),
    ("NaN image", dict(prompt=GOOD_TEXT, images=[torch.full((3, 30, 30), math.nan)]), ValueError, r"\[0, 1\]"),
    ("int image > 255", dict(prompt=GOOD_TEXT, images=[np.full((30, 30, 3), 300)]), ValueError, "0..255"),
    ("4-D image batch", dict(prompt=GOOD_TEXT, images=[torch.rand(1, 3, 30, 30)]), ValueError, "shape"),
    ("bool image", dict(prompt=GOOD_TEXT, images=[np.ones((30, 30, 3), bool)]), TypeError, "uint8"),
    ("sampling type", dict(prompt="w1", sampling="greedy"), TypeError, "sampling"),
    ("sampling list", dict(prompt="w1", sampling=[GOOD_SP]), TypeError, "sampling"),
    ("caption type", dict(prompt=GOOD_TEXT, images=ONE, caption=3), TypeError, "caption"),
    ("caption count", dict(prompt=GOOD_TEXT, images=ONE, caption=["a", "b"]), ValueError, "caption"),
    ("speculative type", dict(prompt="w1", speculative="yes"), TypeError, "speculative"),
]


@pytest.mark.parametrize("kwargs, exc, msg", [c[1:] for c in BAD_REQUESTS], ids=[c[0] for c in BAD_REQUESTS])
@pytest.mark.parametrize("call", ["generate", "stream"])
def test_bad_request_then_engine_still_works(eng, img, ref, call, kwargs, exc, msg):
    kwargs = kwargs(img) if callable(kwargs) else dict(kwargs)
    images = kwargs.get("images")
    if images is ONE:                                       # the module's image (built once)
        kwargs["images"] = [img]
    elif isinstance(images, list) and isinstance(images[0], list) and images[0][0] is ONE:
        kwargs["images"] = [[img]]
    with pytest.raises(exc, match=msg):
        getattr(eng, call)(**kwargs)          # stream() too raises at the call, before any next()
    assert_usable(eng, img, ref)


BAD_BATCHES = [
    ("one image list for two prompts", dict(prompts=["w1 w2", "w3"], images=[ONE]), ValueError, "one per prompt"),
    ("an id list out of vocab", dict(prompts=[[1, 2], [3, 10 ** 6]]), ValueError, "prompt 1: .*vocab"),
    ("too few samplings", dict(prompts=torch.ones(2, 3, dtype=torch.long), sampling=[SamplingParams()]),
     ValueError, "one per prompt"),
    ("a bad sampling among them", dict(prompts=["w1", "w2"], sampling=[GOOD_SP, "greedy"]), TypeError,
     "prompt 1: sampling"),
    ("too few captions", dict(prompts=["w1", "w2"], captions=["c"]), ValueError, "one per prompt"),
]


@pytest.mark.parametrize("kwargs, exc, msg", [c[1:] for c in BAD_BATCHES], ids=[c[0] for c in BAD_BATCHES])
@pytest.mark.parametrize("call", ["generate", "stream_batch"])
def test_bad_batch_then_engine_still_works(eng, img, ref, call, kwargs, exc, msg):
    """A list call is checked whole, before any work; the error names the prompt."""
    kwargs = dict(kwargs)
    if kwargs.get("images") is not None:
        kwargs["images"] = [[img] if x is ONE else x for x in kwargs["images"]]
    prompts = kwargs.pop("prompts")
    with pytest.raises(exc, match=msg):
        getattr(eng, call)(prompts, **kwargs)
    assert not eng.has_unfinished()
    assert_usable(eng, img, ref)


def test_one_prompt_calls_refuse_a_list(eng, img, ref):
    with pytest.raises(ValueError, match="stream_batch"):
        eng.stream(["w1", "w2"])
    with pytest.raises(TypeError, match="captions="):
        eng.generate(["w1", "w2"], caption="c")
    assert_usable(eng, img, ref)


def test_c_view_without_caption_names_the_cli_flag(dirs, img):
    e = Engine.from_pretrained(*dirs, device="cpu", views=("M", "T", "C"))
    with pytest.raises(ValueError, match=r"caption=.*--caption"):
        e.stream(GOOD_TEXT, images=[img], sampling=GOOD_SP)
    out = e.generate(GOOD_TEXT, images=[img], sampling=GOOD_SP, caption="w5 w6")
    assert out.token_ids == e.generate(GOOD_TEXT, images=[img], sampling=GOOD_SP, speculative=False).token_ids


def test_images_of_every_type_mean_the_same(eng, img, ref):
    u8 = np.array(img)                                                   # HWC uint8
    forms = {
        "numpy uint8 HWC": u8,
        "numpy uint8 CHW": u8.transpose(2, 0, 1).copy(),
        "tensor uint8 CHW": torch.from_numpy(u8).permute(2, 0, 1),
        "tensor uint8 HWC": torch.from_numpy(u8),
        "tensor int64 CHW": torch.from_numpy(u8).permute(2, 0, 1).long(),
        "tensor float CHW [0, 1]": torch.from_numpy(u8).permute(2, 0, 1).float() / 255,
        "numpy float HWC [0, 1]": u8.astype(np.float32) / 255,
        "numpy float64 CHW [0, 1]": u8.transpose(2, 0, 1) / 255.0,
    }
    for name, im in forms.items():
        got = eng.generate(GOOD_TEXT, images=[im], sampling=GOOD_SP).token_ids
        assert got == ref, name
    grey = eng.generate(GOOD_TEXT, images=[np.asarray(img.convert("L"))], sampling=GOOD_SP).token_ids
    assert grey == eng.generate(GOOD_TEXT, images=[img.convert("L")], sampling=GOOD_SP).token_ids


def test_token_id_tensors_n_and_1xn(eng, img, ref):
    ids = eng.processor(text=GOOD_TEXT, images=[img], return_tensors="pt")["input_ids"]     # [1, n]
    assert ids.dim() == 2
    assert eng.generate(ids, images=[img], sampling=GOOD_SP).token_ids == ref
    assert eng.generate(ids[0], images=[img], sampling=GOOD_SP).token_ids == ref
    assert eng.generate(ids[0].numpy(), images=[img], sampling=GOOD_SP).token_ids == ref
    assert eng.generate([np.int64(t) for t in ids[0]], images=[img], sampling=GOOD_SP).token_ids == ref


# ------------------------------------------------------------------------ SamplingParams
@pytest.mark.parametrize("kw, exc, name", [
    (dict(temperature=math.nan), ValueError, "temperature"),
    (dict(temperature=math.inf), ValueError, "temperature"),
    (dict(temperature=-0.1), ValueError, "temperature"),
    (dict(temperature="0.5"), TypeError, "temperature"),
    (dict(top_p=math.nan), ValueError, "top_p"),
    (dict(top_p=1.5), ValueError, "top_p"),
    (dict(top_p=0.0), ValueError, "top_p"),
    (dict(max_new_tokens=0), ValueError, "max_new_tokens"),
    (dict(max_new_tokens=True), TypeError, "max_new_tokens"),
    (dict(max_new_tokens=8.0), TypeError, "max_new_tokens"),
    (dict(top_k=-1), ValueError, "top_k"),
    (dict(top_k=2.5), TypeError, "top_k"),
    (dict(seed=-1), ValueError, "seed"),
    (dict(seed=1.5), TypeError, "seed"),
    (dict(seed=False), TypeError, "seed"),
    (dict(stop_at_eos="no"), TypeError, "stop_at_eos"),
])
def test_sampling_params_rejects(kw, exc, name):
    with pytest.raises(exc, match=name):
        SamplingParams(**kw)


def test_sampling_params_frozen():
    sp = SamplingParams(max_new_tokens=4, temperature=0.5, seed=3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        sp.max_new_tokens = 0                             # would skip the validation above
    assert sp.max_new_tokens == 4
    assert dataclasses.replace(sp, seed=4).seed == 4
    with pytest.raises(ValueError, match="max_new_tokens"):
        dataclasses.replace(sp, max_new_tokens=0)        # replace() validates again


def test_sampling_params_normalises_numpy_numbers():
    sp = SamplingParams(max_new_tokens=np.int64(4), temperature=np.float32(0.5), seed=np.uint32(3))
    assert (type(sp.max_new_tokens), type(sp.temperature), type(sp.seed)) == (int, float, int)


# --------------------------------------------------------------------- API: construction
def _truncated(src, dst):
    w = os.path.join(dst, "model.safetensors")
    with open(w, "r+b") as f:
        f.truncate(os.path.getsize(w) // 2)
    return "model.safetensors"


def _empty(src, dst):
    open(os.path.join(dst, "model.safetensors"), "wb").close()
    return "model.safetensors"


def _bad_json(src, dst):
    with open(os.path.join(dst, "config.json"), "w") as f:
        f.write('{"model_type": "llava", "text_config": {')
    return "config.json"


def _bad_arch(src, dst):
    p = os.path.join(dst, "config.json")
    cfg = json.load(open(p))
    cfg["model_type"], cfg["architectures"] = "blip-2", ["Blip2ForConditionalGeneration"]
    json.dump(cfg, open(p, "w"))
    return "unsupported architecture"


def _no_weights(src, dst):
    os.remove(os.path.join(dst, "model.safetensors"))
    return "safetensors"


BROKEN_CHECKPOINTS = {"truncated safetensors": _truncated, "empty safetensors": _empty,
                      "corrupted config.json": _bad_json, "unsupported architecture": _bad_arch,
                      "missing weights": _no_weights}


@pytest.fixture(scope="module")
def broken(tmp_path_factory, dirs):
    """name -> (checkpoint dir, what the error must name)."""
    root, out = tmp_path_factory.mktemp("broken"), {}
    for name, spoil in BROKEN_CHECKPOINTS.items():
        dst = str(root / name.replace(" ", "_"))
        shutil.copytree(dirs[0], dst)
        out[name] = dst, spoil(dirs[0], dst)
    return out


BAD_OPTIONS = [
    (dict(gamma=2.5), TypeError, "gamma"),
    (dict(gamma=0), ValueError, "gamma"),
    (dict(gamma=True), TypeError, "gamma"),
    (dict(dtype="float8"), ValueError, "dtype"),
    (dict(dtype=5), TypeError, "dtype"),
    (dict(dtype=torch.int8), ValueError, "dtype"),
    (dict(device="tpu"), ValueError, "device"),
    (dict(device="gpu0"), ValueError, "device"),
    (dict(pool_size=0), ValueError, "pool_size"),
    (dict(pool_size=6), ValueError, "pool_size"),          # the tiny draft's grid is 5x5
    (dict(pool_size=2.0), TypeError, "pool_size"),
    (dict(max_len=4096), ValueError, "max_position_embeddings"),
    (dict(max_len=0), ValueError, "max_len"),
    (dict(escape_token=9999), ValueError, "escape_token"),
    (dict(views=("M", "X")), ValueError, "views"),
    (dict(views=("M", "M")), ValueError, "views"),
    (dict(views=5), TypeError, "views"),
    (dict(policy="best"), ValueError, "policy"),
    (dict(window=-1), ValueError, "window"),
    (dict(window=1.5), TypeError, "window"),
    (dict(weight_temperature=math.nan), ValueError, "weight_temperature"),
    (dict(weight_temperature=0.0), ValueError, "weight_temperature"),
    (dict(captioner="a caption"), TypeError, "captioner"),
    (dict(gamma_size=3), TypeError, "gamma_size"),
]
if not torch.cuda.is_available():
    BAD_OPTIONS.append((dict(device="cuda"), ValueError, "device"))


@pytest.mark.parametrize("kw, exc, msg", BAD_OPTIONS, ids=[str(c[0]) for c in BAD_OPTIONS])
def test_bad_engine_options(dirs, eng, img, ref, kw, exc, msg):
    with pytest.raises(exc, match=msg):
        Engine.from_pretrained(*dirs, **{"device": "cpu", **kw})
    assert_usable(eng, img, ref)


@pytest.mark.parametrize("name", list(BROKEN_CHECKPOINTS) + ["missing directory", "draft vocabulary"])
def test_bad_checkpoints(broken, tmp_path, eng, img, ref, name):
    if name == "missing directory":
        target, draft, culprit = str(tmp_path / "nope"), None, "not found"
    elif name == "draft vocabulary":
        target, draft, culprit = model_dir("mha"), model_dir("mha", vocab_size=181), "vocabulary"
    else:
        (target, culprit), draft = broken[name], None
    with pytest.raises(ValueError, match=culprit):
        Engine.from_pretrained(target, draft, device="cpu")
    assert_usable(eng, img, ref)


def test_dtype_names_accepted(dirs):
    e = Engine.from_pretrained(dirs[0], device="cpu", dtype="bfloat16")
    assert e.dtype == torch.bfloat16 and e.target.lm.embed_tokens.weight.dtype == torch.bfloat16
    assert Engine.from_pretrained(dirs[0], device="cpu", dtype="torch.float16").dtype == torch.float16


# ----------------------------------------------------------------------------------- CLI
def _cli(args, capsys):
    rc = main(["generate", "--device", "cpu", *args])
    out, err = capsys.readouterr()
    return rc, out, err


def assert_cli_error(rc, err, culprit):
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert rc == 2 and "Traceback" not in err, err
    assert len(errors) == 1 and err.rstrip().splitlines()[-1] == errors[0], err
    assert culprit.lower() in errors[0].lower(), err


BAD_CLI = [
    # (options replacing the defaults: value None drops the option, True makes it a bare flag; culprit)
    ({"--temperature": "nan"}, "temperature"),
    ({"--temperature": "inf"}, "temperature"),
    ({"--top-p": "2"}, "top_p"),
    ({"--max-new-tokens": "0"}, "max_new_tokens"),
    ({"--max-new-tokens": "100000"}, "max_new_tokens"),
    ({"--seed": "-1"}, "seed"),
    ({"--gamma": "0"}, "gamma"),
    ({"--views": "M,X"}, "views"),
    ({"--policy": "best"}, "policy"),
    ({"--escape-token": "9999"}, "escape_token"),
    ({"--views": "M,T,C"}, "--caption"),
    ({"--prompt": "<image> <image> w1"}, "placeholder"),
    ({"--prompt": "<image> w1", "--raw": True, "--image": None}, "placeholder"),
    ({"--prompt": "", "--raw": True, "--image": None}, "empty"),
    ({"--prompt": " "}, "empty"),
    ({"--image": "/nonexistent/img.png"}, "cannot read image"),
    ({"--device": "tpu"}, "device"),
    ({"--max-len": "0"}, "max_len"),
    ({"--max-len": "12"}, "cache length"),
    ({"--max-len": "100000"}, "max_position_embeddings"),
]
if not torch.cuda.is_available():
    BAD_CLI.append(({"--device": "cuda"}, "device"))


@pytest.mark.parametrize("opts, culprit", BAD_CLI, ids=[" ".join(f"{k} {v}" for k, v in c[0].items()) for c in BAD_CLI])
def test_cli_bad_input(dirs, tmp_path, capsys, eng, img, ref, opts, culprit):
    path = str(tmp_path / "img.png")
    img.save(path)
    opts = {"--target": dirs[0], "--draft": dirs[1], "--image": path, "--prompt": "w1 w2 w3",
            "--max-new-tokens": "4", **opts}
    args = []
    for k, v in opts.items():
        args += [] if v is None else [k] if v is True else [k, v]
    rc, out, err = _cli(args, capsys)
    assert_cli_error(rc, err, culprit)
    assert_usable(eng, img, ref)


@pytest.mark.parametrize("name", list(BROKEN_CHECKPOINTS) + ["missing directory", "draft vocabulary"])
def test_cli_bad_checkpoints(broken, tmp_path, capsys, name):
    if name == "missing directory":
        target, draft, culprit = str(tmp_path / "nope"), [], "not found"
    elif name == "draft vocabulary":
        target, draft, culprit = model_dir("mha"), ["--draft", model_dir("mha", vocab_size=181)], "vocabulary"
    else:
        (target, culprit), draft = broken[name], []
    rc, out, err = _cli(["--target", target, *draft, "--prompt", "w1 w2"], capsys)
    assert_cli_error(rc, err, culprit)


def test_cli_chat_template_by_default_raw_on_request(dirs, tmp_path, capsys, eng, img):
    path = str(tmp_path / "img.png")
    img.save(path)
    common = ["--target", dirs[0], "--draft", dirs[1], "--image", path, "--max-new-tokens", "6", "--json"]
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "w1 w2 w3"}]}]
    sp = SamplingParams(max_new_tokens=6)
    chat = eng.generate(msgs, images=[img], sampling=sp).token_ids
    raw = eng.generate("<image>\nw1 w2 w3", images=[img], sampling=sp).token_ids
    assert chat != raw                      # the two prompts are told apart by their answers
    rc, out, _ = _cli([*common, "--prompt", "w1 w2 w3"], capsys)
    assert rc == 0 and json.loads(out)["token_ids"] == chat
    rc, out, _ = _cli([*common, "--prompt", "<image> w1 w2 w3"], capsys)       # placeholder where given
    assert rc == 0 and json.loads(out)["token_ids"] == chat
    rc, out, _ = _cli([*common, "--prompt", "w1 w2 w3", "--raw"], capsys)
    assert rc == 0 and json.loads(out)["token_ids"] == raw


class _Recorder(io.StringIO):
    """stdout that records each write with the time it came."""

    def __init__(self):
        super().__init__()
        self.writes = []

    def write(self, s):
        self.writes.append((time.perf_counter(), s))
        return super().write(s)


def test_cli_streams_and_shows_loading(dirs, monkeypatch, capsys, eng):
    rec = _Recorder()
    monkeypatch.setattr("sys.stdout", rec)
    rc = main(["generate", "--device", "cpu", "--target", dirs[0], "--draft", dirs[1], "--prompt", "w1 w2 w3",
               "--max-new-tokens", "12", "--no-view-tree"])
    err = capsys.readouterr().err
    assert rc == 0
    msgs = [{"role": "user", "content": [{"type": "text", "text": "w1 w2 w3"}]}]
    want = eng.generate(msgs, sampling=SamplingParams(max_new_tokens=12)).text
    assert rec.getvalue() == want + "\n"
    assert len([s for _, s in rec.writes if s.strip()]) >= 3      # pieces as blocks are accepted
    assert "loading target" in err and "loading draft" in err and "done in" in err


def test_cli_warns_on_unknown_words(dirs, capsys):
    rc, out, err = _cli(["--target", dirs[0], "--prompt", "w1 What w2 picture?", "--max-new-tokens", "2",
                         "--raw"], capsys)
    assert rc == 0
    warn = [line for line in err.splitlines() if line.startswith("warning:")]
    assert len(warn) == 1 and "'What'" in warn[0] and "'picture?'" in warn[0] and "<unk>" in warn[0]
    rc, out, err = _cli(["--target", dirs[0], "--prompt", "w1 w2", "--max-new-tokens", "2"], capsys)
    assert rc == 0 and "warning" not in err


def test_cli_engine_options_reach_the_engine():
    args = build_parser().parse_args(["serve", "--target", "t", "--max-len", "256", "--no-adaptive",
                                      "--memory-fraction", "0.5"])
    kw = engine_kwargs(args)
    assert kw["max_len"] == 256 and kw["adaptive"] is False and args.memory_fraction == 0.5
    kw = engine_kwargs(build_parser().parse_args(["generate", "--target", "t", "--prompt", "p"]))
    assert kw["max_len"] is None and "adaptive" not in kw         # the engine's defaults


def test_cli_help_matches_behaviour():
    g = build_parser()._subparsers._group_actions[0].choices["generate"]
    text = g.format_help()
    assert "--raw" in text and "chat template" in text
    assert "--chat" not in text                   # the chat template is the default now
    assert "stream" in text.lower()


# --------------------------------------------------------------------------- concurrency
def _requests(img):
    imgs = [random_image(i) for i in range(3)]
    return [
        dict(prompt="<image>\n w1 w2 w3", images=[imgs[0]], sampling=SamplingParams(max_new_tokens=14)),
        dict(prompt="w9 w8 w7 w6 w5", sampling=SamplingParams(max_new_tokens=12, temperature=0.8, seed=3)),
        dict(prompt="<image>\n w4 <image>\n w5", images=imgs[1:], sampling=SamplingParams(max_new_tokens=10),
             speculative=False),
        dict(prompt="<image>\n w40 w41", images=[imgs[2]],
             sampling=SamplingParams(max_new_tokens=16, temperature=1.0, top_k=20, seed=11)),
    ]


def test_threads_get_their_sequential_answers(eng, img):
    reqs = _requests(img)
    want = [eng.generate(**r).token_ids for r in reqs]
    got, errors = {}, []
    start = threading.Barrier(len(reqs) * 2)

    def worker(i):
        try:
            start.wait()
            for rep in range(2):
                got[(i % len(reqs), rep, i)] = eng.generate(**reqs[i % len(reqs)]).token_ids
        except Exception as e:      # a thread's failure must fail the test
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(reqs) * 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors and len(got) == len(reqs) * 4
    for (k, _, _), ids in got.items():
        assert ids == want[k]


def _in_thread(fn, timeout):
    """fn() in another thread; (finished, result or exception) after `timeout` seconds."""
    box = {}

    def run():
        try:
            box["out"] = fn()
        except BaseException as e:
            box["out"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    return t, box


def test_generate_while_a_stream_is_open(eng, img, ref):
    reqs = _requests(img)
    want = [eng.generate(**r) for r in reqs[:2]]
    s = eng.stream(**reqs[0])
    first = next(s)
    # same thread: a clear error (waiting for itself would hang), the stream unharmed
    with pytest.raises(RuntimeError, match="close"):
        eng.generate(**reqs[1])
    with pytest.raises(RuntimeError, match="close"):
        next(eng.stream(**reqs[1]))
    # another thread: waits for the stream, then gets its own answer
    t, box = _in_thread(lambda: eng.generate(**reqs[1]), 1.0)
    assert t.is_alive()
    assert first + "".join(s) == want[0].text
    t.join(120)
    assert box["out"].token_ids == want[1].token_ids
    # the stream's return value is the whole output
    s = eng.stream(**reqs[1])
    pieces = []
    while True:
        try:
            pieces.append(next(s))
        except StopIteration as stop:
            assert stop.value.token_ids == want[1].token_ids and "".join(pieces) == stop.value.text
            break


@pytest.mark.parametrize("how", ["close", "garbage-collected", "never started"])
def test_abandoned_stream_releases_the_engine(eng, img, ref, how):
    s = eng.stream(GOOD_TEXT, images=[img], sampling=SamplingParams(max_new_tokens=30))
    if how != "never started":
        next(s)
        assert not torch.is_inference_mode_enabled()      # the engine's mode ends at each yield
    if how == "close":
        s.close()
    else:
        del s
        gc.collect()
    t, box = _in_thread(lambda: eng.generate(GOOD_TEXT, images=[img], sampling=GOOD_SP), 60)
    assert not t.is_alive(), "the abandoned stream still holds the engine"
    assert box["out"].token_ids == ref


# ------------------------------------------------------------------------- global state
@pytest.mark.parametrize("speculative", [True, False])
def test_unseeded_generation_leaves_the_global_rng_alone(eng, img, speculative):
    torch.manual_seed(0)
    a = torch.rand(3)
    torch.manual_seed(0)
    eng.generate(GOOD_TEXT, images=[img], sampling=SamplingParams(max_new_tokens=6, temperature=0.7),
                 speculative=speculative)
    b = torch.rand(3)
    assert torch.equal(a, b)
    outs = {tuple(eng.generate("w1 w2", sampling=SamplingParams(max_new_tokens=12, temperature=1.5),
                               speculative=speculative).token_ids) for _ in range(4)}
    assert len(outs) > 1          # unseeded still means fresh randomness per call


def test_stream_loop_body_runs_outside_inference_mode(eng, img, ref):
    w = torch.ones(3, requires_grad=True)
    pieces = 0
    for piece in eng.stream(GOOD_TEXT, images=[img], sampling=SamplingParams(max_new_tokens=8, stop_at_eos=False)):
        assert not torch.is_inference_mode_enabled()
        loss = (w * len(piece)).sum()
        loss.backward()
        pieces += 1
    assert pieces > 1 and w.grad is not None
    assert_usable(eng, img, ref)


def test_stream_validates_at_the_call(eng):
    with pytest.raises(ValueError, match="placeholder"):
        eng.stream("<image> w1")                                # no next(): the call itself raises
    with pytest.raises(ValueError, match="max_new_tokens"):
        eng.stream("w1", sampling=SamplingParams(max_new_tokens=100000))



@pytest.mark.parametrize("where,exc", [("prefill", RuntimeError), ("sd_block", RuntimeError),
                                       ("ar_step", RuntimeError), ("prefill", ValueError)])
def test_an_engine_failure_is_logged_with_its_traceback(eng, img, ref, where, exc, monkeypatch, caplog):
    """A failure inside the engine (not the caller's input) ends the request with an error and
    is logged at ERROR with its traceback (the request's error string alone has no stack, and
    a server's log is where an operator looks); a ValueError (a request the engine refuses) is
    a warning without one. The engine keeps answering as before."""
    import logging

    runner = eng.runner
    name = {"prefill": "prefill_begin"}.get(where, where)     # (the default admission's entry)
    real = getattr(runner, name)

    def fails(*args, **kwargs):
        raise exc(f"injected failure in {where}")

    monkeypatch.setattr(runner, name, fails)
    with caplog.at_level(logging.WARNING, logger="tabed_engine.engine"):
        with pytest.raises(RuntimeError, match=f"injected failure in {where}"):
            eng.generate(GOOD_TEXT, images=[img], sampling=GOOD_SP, speculative=where != "ar_step")
    logged = [r for r in caplog.records if r.name == "tabed_engine.engine"]
    assert len(logged) == 1 and f"injected failure in {where}" in logged[0].getMessage() + str(logged[0].exc_info)
    if exc is RuntimeError:
        assert logged[0].levelno == logging.ERROR and logged[0].exc_info[1].args == (f"injected failure in {where}",)
    else:
        assert logged[0].levelno == logging.WARNING and not logged[0].exc_info
    monkeypatch.setattr(runner, name, real)
    assert_usable(eng, img, ref)
