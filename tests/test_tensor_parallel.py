"""Tensor parallelism on the CPU: gloo, 2 processes (this one and a worker it starts).

The target is a GQA decoder (4 q heads, 2 KV heads; an odd MLP size, 83, split 42 / 41; an odd
vocabulary, 173, in shards of 87 with one padding row), a second one has 1 KV head (replicated
on both ranks). Greedy AR, chains, trees and batches must give transformers' tokens in float32;
every rank's outputs must be the same (step digests); bad degrees fail before anything loads;
a killed worker fails the next call with a clear error, and nothing is left running.
"""
import os
import signal
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from models import model_dir
from tabed_engine import Engine, SamplingParams
from tabed_engine.engine.chunked import DEFAULT_PREFILL_CHUNK
from tabed_engine.models.loader import load_lvlm
from tabed_engine.models.tiny import random_image, words
from tabed_engine.parallel.comm import TPGroup
from tabed_engine.parallel.load import load_shard
from tabed_engine.parallel.shard import check_degree, shard_lm, vocab_shard
from tabed_engine.parallel.spmd import Spmd

pytestmark = pytest.mark.one_worker     # one engine and its worker process for the module (`tp`)

VOCAB = 173
N = 12


def target_dir():
    return model_dir("mha", kv_heads=2)


def draft_dir():
    return model_dir("mha", kv_heads=2, perturb=0.6)


def children() -> set[int]:
    """This process's live child processes (Linux /proc)."""
    out = set()
    for tid in os.listdir(f"/proc/{os.getpid()}/task"):
        with open(f"/proc/{os.getpid()}/task/{tid}/children") as f:
            out |= {int(p) for p in f.read().split()}
    return out


_HF = {}


def hf_greedy(path, text, images, n=N):
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    if path not in _HF:
        _HF[path] = (AutoProcessor.from_pretrained(path, local_files_only=True),
                     LlavaForConditionalGeneration.from_pretrained(path, local_files_only=True,
                                                                   dtype=torch.float32).eval())
    proc, hf = _HF[path]
    enc = proc(text=text, images=images or None, return_tensors="pt")
    with torch.no_grad():
        out = hf.generate(**enc, max_new_tokens=n, do_sample=False, pad_token_id=0)
    new = out[0, enc["input_ids"].shape[1]:].tolist()
    eos = hf.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    return next((new[: i + 1] for i, t in enumerate(new) if t in eos), new)


def prompt(i: int, n_images: int = 1):
    return "<image>\n" * n_images + words(10 + i, 6, VOCAB), [random_image(100 + i + k) for k in range(n_images)]


@pytest.fixture(scope="module")
def tp():
    before = children()
    eng = Engine.from_pretrained(target_dir(), draft_dir(), device="cpu", dtype=torch.float32, tensor_parallel=2,
                                 gamma=3)
    assert len(eng.worker_pids) == 1 and set(eng.worker_pids) <= children() - before
    yield eng
    eng.close()
    assert not children() - before


def sp(n=N):
    return SamplingParams(max_new_tokens=n)


def test_ar_and_chain_match_transformers(tp):
    text, imgs = prompt(0)
    want = hf_greedy(target_dir(), text, imgs)
    assert tp.generate(text, images=imgs, sampling=sp(), speculative=False).token_ids == want
    out = tp.generate(text, images=imgs, sampling=sp())
    assert out.token_ids == want and out.stats.speculative
    assert tp.verify_ranks() > 0


def test_tree_matches_transformers(tp):
    text, imgs = prompt(1)
    tp.configure(tree="3x2x2")          # mirrored to the worker (its caches and graphs rebuilt alike)
    try:
        assert tp.generate(text, images=imgs, sampling=sp()).token_ids == hf_greedy(target_dir(), text, imgs)
    finally:
        tp.configure(tree=None)
    tp.verify_ranks()


def test_batch_matches_transformers(tp):
    prompts = [prompt(2, 1), prompt(3, 0), prompt(4, 2)]
    outs = tp.generate([p for p, _ in prompts], images=[im for _, im in prompts], sampling=sp())
    assert [o.token_ids for o in outs] == [hf_greedy(target_dir(), p, im) for p, im in prompts]
    tp.verify_ranks()


def test_adaptive_and_sampled_ranks_agree(tp):
    """The cost model (wall times: different per rank) and unseeded sampling (seeds drawn on
    rank 0) are rank 0's decisions; the step digests show every rank followed them."""
    text, imgs = prompt(5)
    tp.configure(adaptive=True)
    try:
        assert tp.generate(text, images=imgs, sampling=sp()).token_ids == hf_greedy(target_dir(), text, imgs)
        tp.generate([text, text], images=[imgs, imgs], sampling=SamplingParams(max_new_tokens=N, temperature=1.0))
        rid = tp.add_request(text, images=imgs, sampling=SamplingParams(max_new_tokens=N, temperature=0.7))
        tp.abort(rid)
        while tp.has_unfinished():
            tp.step()
    finally:
        tp.configure(adaptive=None)
    assert tp.verify_ranks() > 0


def test_chunked_mixed_arrivals_match_transformers(tp):
    """A prompt with two images arriving while another request decodes, prefilled in chunks of
    8 inside the running chain's verifications (mixed steps), both set between steps on rank 0
    and followed by the worker: transformers' tokens, the ranks in step."""
    a_text, a_imgs = prompt(6, 0)
    b_text, b_imgs = prompt(7, 2)
    tp.prefill_chunk, tp.mixed_steps = 8, True
    try:
        a = tp.add_request(a_text, sampling=sp(3 * N))
        got = {a: []}
        while len(got[a]) < 2:
            for o in tp.step():
                got[o.request_id] += o.new_token_ids
        b, mixed0 = tp.add_request(b_text, images=b_imgs, sampling=sp()), tp.scheduler.mixed_steps
        got[b] = []
        while tp.has_unfinished():
            for o in tp.step():
                got[o.request_id] += o.new_token_ids
                if o.request_id == b and o.finished:
                    chunks = o.output.stats.prefill_chunks
        mixed = tp.scheduler.mixed_steps - mixed0
    finally:
        tp.prefill_chunk, tp.mixed_steps = DEFAULT_PREFILL_CHUNK, False
    assert chunks > 2 and mixed == chunks
    assert got[a] == hf_greedy(target_dir(), a_text, a_imgs, 3 * N)
    assert got[b] == hf_greedy(target_dir(), b_text, b_imgs)
    assert tp.verify_ranks() > 0
    with pytest.raises(TypeError, match="mixed_steps must be a bool"):
        tp.mixed_steps = 1


def test_divergence_is_detected():
    """Rank 0 compares each worker's step digests with its own: a mismatch fails loudly."""
    out = lambda tokens: SimpleNamespace(request_id="r", new_token_ids=tokens, finished=False)  # noqa: E731
    sent = []
    worker = Spmd(TPGroup(1, 2), link=SimpleNamespace(send=lambda msg: sent.append(msg[1])))
    leader = Spmd(TPGroup(0, 2), pool=SimpleNamespace(procs=[None], pending=lambda i: bool(sent),
                                                      recv=lambda i, tag, t: sent.pop(0), close=lambda wait: None))
    for rank in (leader, worker):
        rank.record([out([5])])
    leader.compare(block=True)
    assert leader.seen == [1] and not leader.broken
    leader.record([out([7])])
    worker.record([out([8])])                 # a worker that picked another token
    with pytest.raises(RuntimeError, match="rank 1's outputs at step 2 differ"):
        leader.compare(block=False)
    assert leader.broken


@pytest.mark.parametrize("n", [0, -1, 1.5, "2", True, 3, 8])
def test_bad_degree_refused_before_loading(n):
    before = children()
    with pytest.raises(ValueError, match="tensor_parallel"):
        Engine.from_pretrained(target_dir(), device="cpu", tensor_parallel=n)
    assert not children() - before


def test_degree_rules():
    assert check_degree(4, 8, 2) == 4          # KV heads fewer than ranks: replicated
    assert check_degree(2, 8, 8) == 2
    with pytest.raises(ValueError, match="KV heads"):
        check_degree(2, 6, 3)
    with pytest.raises(ValueError, match="attention heads"):
        check_degree(4, 6, 6)
    assert [vocab_shard(173, 2, r) for r in (0, 1)] == [(0, 87, 87), (87, 86, 87)]


@pytest.mark.parametrize("name,world", [("gqa_tied_full", 2), ("gqa_headdim", 4)])
def test_shard_loads_straight_from_checkpoint(name, world):
    """Each rank's slices streamed from the files == the loaded full model sliced (tied
    embeddings, a legacy sharded checkpoint, 1 KV head replicated over 4 ranks)."""
    path = model_dir(name)
    full = load_lvlm(path, "cpu", torch.float32).lm
    for rank in range(world):
        ref = shard_lm(load_lvlm(path, "cpu", torch.float32).lm, TPGroup(rank, world))
        got = load_shard(path, "cpu", torch.float32, TPGroup(rank, world)).lm
        a, b = ref.state_dict(), got.state_dict()
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        assert got.cfg.num_kv_heads == 1 and got.cfg.vocab_size == full.cfg.vocab_size
    hd = full.cfg.head_dim
    qkv = got.layers[0].self_attn.qkv_proj.weight         # the last rank: q heads 3, KV head 0
    full_qkv = full.layers[0].self_attn.qkv_proj.weight
    assert torch.equal(qkv[:hd], full_qkv[3 * hd:4 * hd]) and torch.equal(qkv[hd:2 * hd], full_qkv[4 * hd:5 * hd])


def test_killed_worker_fails_the_next_call(tp):
    """Runs last on the module's engine: a worker killed in the middle of a generation fails
    it with the worker's rank and exit code, not a hang, and so does the next call; nothing is
    left running after close()."""
    (pid,) = tp.worker_pids
    text, imgs = prompt(6)
    killer = threading.Timer(0.3, os.kill, (pid, signal.SIGKILL))
    try:
        killer.start()
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match=r"rank 1 .*exited with code -9"):
            tp.generate(text, images=imgs, sampling=SamplingParams(max_new_tokens=200, stop_at_eos=False))
        killer.join()
        assert time.monotonic() - t0 < 30
        with pytest.raises(RuntimeError, match="rank 1"):
            tp.generate(text, images=imgs, sampling=sp())
    finally:
        tp.close()          # (the next test starts an engine of its own: one per process)
    assert pid not in children()


CTRL_C = """
import signal, sys, torch
# a terminal's Ctrl-C: Python raises KeyboardInterrupt only where SIGINT was not ignored at its
# start, and an ignored SIGINT is inherited (a test run started in the background of a
# non-interactive shell ignores it)
signal.signal(signal.SIGINT, signal.default_int_handler)
torch.set_num_threads(1)
from tabed_engine import Engine, SamplingParams
from tabed_engine.engine.chunked import DEFAULT_PREFILL_CHUNK
eng = Engine.from_pretrained(sys.argv[1], device="cpu", dtype=torch.float32, tensor_parallel=2)
# one short generation first: the lazy imports of a first request are done before the signal (an
# interrupt inside a class body being created comes out as a RuntimeError, not KeyboardInterrupt)
eng.generate("w1", sampling=SamplingParams(max_new_tokens=1))
print(eng.worker_pids[0], flush=True)
eng.generate("w1 w2 w3", sampling=SamplingParams(max_new_tokens=1000, stop_at_eos=False))
"""


def test_ctrl_c_leaves_no_worker():
    """Ctrl-C reaches the terminal's whole process group: the worker ignores it, the user's
    process gets the KeyboardInterrupt mid-generation and stops the worker; none is orphaned."""
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", CTRL_C, target_dir()],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        worker = int(proc.stdout.readline())
        time.sleep(0.5)                                   # in the middle of the generation
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode != 0 and "KeyboardInterrupt" in err
    with pytest.raises(ProcessLookupError):
        os.kill(worker, 0)


def test_replicated_kv_head_and_close():
    """1 KV head over 2 ranks (each keeps it) gives transformers' tokens; close() stops the
    worker and later calls fail clearly. (After the module's engine is closed: one
    tensor-parallel engine per process at a time.)"""
    path = model_dir("gqa_headdim")
    before = children()
    eng = Engine.from_pretrained(path, device="cpu", dtype=torch.float32, tensor_parallel=2)
    try:
        text, imgs = "<image>\n" + words(3, 5, 199), [random_image(7)]
        assert eng.generate(text, images=imgs, sampling=sp()).token_ids == hf_greedy(path, text, imgs)
        assert eng.verify_ranks() > 0
    finally:
        eng.close()
    assert not children() - before
    with pytest.raises(RuntimeError, match="closed"):
        eng.generate(text, images=imgs, sampling=sp())


# ---------------------------------------------------------------- GPU (run later, -m gpu)

def _gpus(n):
    if torch.cuda.device_count() < n:
        pytest.skip(f"needs {n} GPUs")


@pytest.mark.gpu
def test_gpu_tp2_tokens_equal_one_gpu():
    _gpus(2)
    text, imgs = prompt(0)
    one = Engine.from_pretrained(target_dir(), draft_dir(), device="cuda:0", dtype=torch.float32)
    want = [one.generate(text, images=imgs, sampling=sp(), speculative=s).token_ids for s in (False, True)]
    del one
    with Engine.from_pretrained(target_dir(), draft_dir(), device="cuda", dtype=torch.float32,
                                tensor_parallel=2) as eng:
        got = [eng.generate(text, images=imgs, sampling=sp(), speculative=s).token_ids for s in (False, True)]
        assert eng.verify_ranks() > 0
    assert got == want


@pytest.mark.gpu
def test_gpu_teardown_frees_memory():
    _gpus(2)
    free0 = torch.cuda.mem_get_info(1)[0]
    before = children()
    eng = Engine.from_pretrained(target_dir(), draft_dir(), device="cuda", dtype=torch.float32, tensor_parallel=2)
    eng.generate(*prompt(0), sampling=sp())
    assert torch.cuda.mem_get_info(1)[0] < free0          # the worker holds GPU 1
    eng.close()
    assert not children() - before
    assert torch.cuda.mem_get_info(1)[0] >= free0 - (64 << 20)
