"""The target's prefill padded to a prompt-length bucket (a CUDA graph per bucket on the GPU):
the bucket rule, padding that changes no logit, token or real cache entry (CPU, float32, the
padded step run eagerly), the CUDA prefill's fused RoPE + cache write against the PyTorch
chain (CPU, through the Triton interpreter), and on the GPU the captured graphs against the eager prefill across
buckets and slots, the eager rule above the last bucket, lossless greedy decoding through the
engine with graphs on, and the draft's views on a second stream."""
import os

import pytest
import torch

from models import model_dir
from tabed_engine import Engine, SamplingParams
from tabed_engine.models.decoder import KVCache
from tabed_engine.engine.prefill import PREFILL_STEP, prefill_bucket, prefill_buckets, prefill_step
from tabed_engine.models.tiny import random_image, words
from tabed_engine.ops.paged import gather_rows


# ------------------------------------------------------------------ the bucket rule (CPU)
@pytest.mark.parametrize("max_len", [100, 256, 2048, 5000])
def test_bucket_rule(max_len):
    limit = 4096
    for n in range(1, max_len + 2):
        P = prefill_bucket(n, max_len, limit)
        if n > min(max_len, limit):
            assert P is None, n
            continue
        assert n <= P <= max_len and (P % PREFILL_STEP == 0 or P == max_len), (n, P)
        assert P - n < PREFILL_STEP, (n, P)                     # bounded waste
    buckets = prefill_buckets(max_len, limit)
    m = min(max_len, limit)
    assert buckets == sorted(set(buckets)) and buckets[-1] == min(-(-m // PREFILL_STEP) * PREFILL_STEP, max_len)
    assert len(buckets) == -(-min(max_len, limit) // PREFILL_STEP)
    assert prefill_bucket(0, max_len) is None
    assert prefill_bucket(65, 2048, limit=64) is None            # above the last bucket: eager


# ------------------------------------------------------------------ padding changes nothing (CPU)
def _lm(name="mha"):
    eng = Engine.from_pretrained(model_dir(name), device="cpu", dtype=torch.float32)
    return eng.target.lm


@pytest.mark.parametrize("name", ["mha", "gqa_headdim"])
@pytest.mark.parametrize("n", [1, 37, 64, 65])
def test_padded_step_equals_unpadded_prefill(name, n):
    """prefill_step on a padded prompt into row 2 of a 3-row cache (run eagerly) against the
    plain fresh prefill of the unpadded prompt: the same last-position logits and cache
    entries [0, n); the other rows untouched (NaN-poisoned before)."""
    lm = _lm(name)
    cfg = lm.cfg
    torch.manual_seed(n)
    x = torch.randn(1, n, cfg.hidden_size)
    P = prefill_bucket(n, 256)
    ref = KVCache(cfg, 1, 256, "cpu", torch.float32)
    with torch.inference_mode():
        want = lm(ref, torch.arange(n)[None], embeds=x, logits_index=torch.tensor([[n - 1]]), fresh=True)[:, -1]
        cache = KVCache(cfg, 3, 256, "cpu", torch.float32)
        cache.k.fill_(float("nan"))
        cache.v.fill_(float("nan"))
        xp = torch.cat([x, torch.randn(1, P - n, cfg.hidden_size) * 5], dim=1)   # any padding
        got = prefill_step(lm, cache, xp, torch.tensor([2]), torch.tensor([[n - 1]]))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert got.argmax() == want.argmax()
    for c, r in ((cache.k, ref.k), (cache.v, ref.v)):
        torch.testing.assert_close(row_kv(c, cache, 2, n), row_kv(r, ref, 0, n), atol=1e-5, rtol=1e-5)
        rows01 = cache.block_table[:2].flatten().long()
        assert torch.isnan(c[:, rows01]).all()                   # rows 0 and 1's pages untouched
    assert torch.isnan(row_kv(cache.k, cache, 2, 256)[:, :, P:]).all()   # nothing past the bucket


def row_kv(pool, cache, r, n):
    """Slots [0, n) of cache row r of a [L, pages, kv, page, hd] pool: [L, kv, n, hd]."""
    return torch.stack([gather_rows(p, cache.block_table[r:r + 1], n)[0] for p in pool])


def test_slot_needs_a_fresh_causal_prefill():
    lm = _lm()
    cache = KVCache(lm.cfg, 2, 64, "cpu", torch.float32)
    with pytest.raises(ValueError, match="fresh"):
        lm(cache, torch.arange(4)[None], input_ids=torch.zeros(1, 4, dtype=torch.long), slot=torch.tensor([1]))


@pytest.mark.parametrize("name", ["mha", "gqa_headdim"])
def test_fused_prefill_equals_pytorch_chain(name, monkeypatch):
    """The CUDA prefill path (one `rope_kv_write` launch per layer: rows=, dense k/v out, q in
    SDPA's layout) run on the CPU through the Triton interpreter, against the PyTorch chain the
    CPU runs, float32: bit-identical logits and caches for the padded step into row 2 of a
    3-row cache (slot=), a one-row fresh prefill and a fresh two-row batch (masked SDPA)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("runs the kernel on CPU tensors through the interpreter (on a GPU the -m gpu tests cover it)")
    import tabed_engine.models.layers as model
    import tabed_engine.ops.rope_kv_write as ops
    from tabed_engine.kernels import rope_kv_write as kernel

    lm = _lm(name)
    cfg = lm.cfg
    torch.manual_seed(5)
    n = 37
    P = prefill_bucket(n, 256)
    x1, x2 = torch.randn(1, P, cfg.hidden_size), torch.randn(2, 23, cfg.hidden_size)

    def run():
        caches = [KVCache(cfg, 3, 256, "cpu", torch.float32), KVCache(cfg, 1, 256, "cpu", torch.float32),
                  KVCache(cfg, 2, 64, "cpu", torch.float32)]
        for c in caches[:2]:  # the two-row batch attends over its cache (masked): no NaN there
            c.k.fill_(float("nan"))
            c.v.fill_(float("nan"))
        with torch.inference_mode():
            logits = [prefill_step(lm, caches[0], x1, torch.tensor([2]), torch.tensor([[n - 1]])),
                      lm(caches[1], torch.arange(P)[None], embeds=x1, fresh=True),
                      lm(caches[2], torch.arange(23)[None].expand(2, 23), embeds=x2, fresh=True)]
        return logits + [t for c in caches for t in (c.k, c.v)]

    want = run()
    calls = []
    launch = kernel.rope_kv_write

    def counted(*args, **kw):
        calls.append(kw["rows"])
        return launch(*args, **kw)

    # the device check is the only thing CPU tensors fail: the same code as on CUDA runs
    for mod in (model, ops):
        monkeypatch.setattr(mod, "use_kernel", lambda qkv, head_dim: head_dim % 2 == 0)
    monkeypatch.setattr(kernel, "rope_kv_write", counted)
    got = run()
    assert len(calls) == 3 * cfg.num_layers and calls[0].tolist() == [2] and calls[-1] is None
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0, equal_nan=True)
    assert torch.isnan(got[3][:, :2]).all() and torch.isnan(got[3][:, 2, :, P:]).all()


def test_padded_engine_equals_transformers_batched():
    """The engine with the padded prefill forced on the CPU (the GPU graphs' inputs, run
    eagerly): six requests of different lengths through four slots, AR and SD, each equal to
    transformers' greedy decoding of it alone (float32)."""
    from test_batch import batch_inputs, engine, expected

    names, prompts, imgs, sps = batch_inputs()
    for speculative in (False, True):
        eng = engine(max_batch=4, policy="hedge")
        eng.runner.prefill_graphs = True
        outs = eng.generate(prompts, images=imgs, sampling=sps, speculative=speculative)
        for name, out in zip(names, outs):
            assert out.token_ids == expected(name), (speculative, name)
        assert eng.runner._prefill_bufs is not None                # the padded path ran


# ------------------------------------------------------------------ GPU
def _prompt(n_images, n_words=6):
    return "".join(f"<image>\n{words(i, 2, 173)} " for i in range(n_images)) + words(3, n_words, 173), \
        [random_image(40 + i) for i in range(n_images)]


def _gpu_engine(dtype=torch.float32, **kw):
    return Engine.from_pretrained(model_dir("mha"), model_dir("mha", perturb=0.6), device="cuda", dtype=dtype,
                                  **{"max_batch": 4, "max_len": 512, **kw})


def _prefill_both(eng, prep, slot):
    """(graph logits, eager logits, graph row's KV [L, kv, n, hd] x2, eager row's) of `prep` in `slot`."""
    r = eng.runner
    r.allocate()
    n = len(prep.ids)
    out = {}
    pool = r.pages.target
    pool.assign([(slot, None, 0, n)])                           # the row's pages (a request's prefill takes them)
    table = r.tcache.block_table[slot:slot + 1]
    for graphs in (False, True):
        r.prefill_graphs = graphs
        r.tcache.k.fill_(float("nan"))
        with torch.inference_mode():
            sel, feats = r.encode(prep)
            logits = r.prefill_lm(prep, feats, slot).clone()
        torch.cuda.synchronize()
        out[graphs] = (logits, *(torch.stack([gather_rows(c[i], table, n)[0] for i in range(c.shape[0])])
                                 for c in (r.tcache.k, r.tcache.v)))
        others = [p for p in range(1, r.tcache.pages) if p not in pool.rows[slot]]
        assert torch.isnan(r.tcache.k[:, others]).all()          # no other row's page written (the padding: scratch)
    r.prefill_graphs = True
    return out[True], out[False]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_graph_prefill_matches_eager(dtype):
    """Captured prefill graphs of several buckets, into slots 0, 1 and 3, against the eager
    prefill: float32 within GEMM rounding, bf16 within twice the eager bf16 error (against
    the float32 eager prefill). The same bucket's graph serves every slot."""
    from tabed_engine.engine.prompt import prepare

    eng = _gpu_engine(dtype)
    ref_eng = _gpu_engine(torch.float32) if dtype != torch.float32 else None
    cases = [(0, 3, 0), (1, 2, 1), (2, 30, 3), (1, 60, 0), (3, 150, 1), (2, 300, 2)]   # (images, words, slot)
    buckets = set()
    for n_img, n_words, slot in cases:
        text, imgs = _prompt(n_img, n_words)
        prep = prepare(eng.processor, text, imgs, eng.target.image_token_id, eng.tokens_per_image)
        (g, gk, gv), (e, ek, ev) = _prefill_both(eng, prep, slot)
        P = prefill_bucket(len(prep.ids), eng.max_len)
        buckets.add(P)
        assert ("prefill", P) in eng.graphs.graphs
        if dtype == torch.float32:
            torch.testing.assert_close(g, e, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(gk, ek, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(gv, ev, atol=1e-4, rtol=1e-4)
        else:
            prep32 = prepare(ref_eng.processor, text, imgs, ref_eng.target.image_token_id, ref_eng.tokens_per_image)
            _, (ref, _, _) = _prefill_both(ref_eng, prep32, slot)
            err_g, err_e = (g - ref).norm() / ref.norm(), (e - ref).norm() / ref.norm()
            assert err_g <= 2 * err_e + 1e-3, (err_g, err_e)
            assert torch.isfinite(gk).all() and torch.isfinite(gv).all()
    assert len(buckets) >= 3
    assert sum(1 for k in eng.graphs.graphs if k[0] == "prefill") == len(buckets)


@pytest.mark.gpu
def test_prompt_longer_than_last_bucket_prefills_eagerly():
    """Above `prefill_graph_max` no graph is captured and the logits are the eager ones."""
    from tabed_engine.engine.prompt import prepare

    eng = _gpu_engine()
    eng.runner.prefill_graph_max = 64
    text, imgs = _prompt(2, 30)
    prep = prepare(eng.processor, text, imgs, eng.target.image_token_id, eng.tokens_per_image)
    assert len(prep.ids) > 64
    (g, _, _), (e, _, _) = _prefill_both(eng, prep, 2)
    assert not any(k[0] == "prefill" for k in eng.graphs.graphs)
    assert torch.equal(g, e)
    from test_gpu_engine import assert_same_or_fp_tie

    sp = SamplingParams(max_new_tokens=20)
    a = eng.generate(text, images=imgs, sampling=sp).token_ids
    assert_same_or_fp_tie(eng, text, imgs, a, _gpu_engine(cuda_graphs=False).generate(
        text, images=imgs, sampling=sp).token_ids)
    assert not any(k[0] == "prefill" for k in eng.graphs.graphs)


@pytest.mark.gpu
@pytest.mark.parametrize("overlap", [True, False])
def test_graph_prefill_engine_lossless_batched(overlap):
    """Greedy SD == AR == the eager engine (no graphs) == the CPU engine, float32, four requests
    of different lengths (0 to 3 images) batched through four slots, prefill graphs on, the
    draft's views on a second stream or not."""
    from test_gpu_engine import assert_same_or_fp_tie

    # no prefix cache: the requests share prefixes, and cached prefixes would shorten the
    # prefills below the buckets this test means to run
    eng = _gpu_engine(views=("M", "T", "P"), gamma=4, adaptive=False, prefix_cache=False)   # speculate every block
    eng.runner.overlap_draft = overlap
    eager = _gpu_engine(views=("M", "T", "P"), gamma=4, cuda_graphs=False, prefix_cache=False)
    cases = [_prompt(n, w) for n, w in ((1, 6), (0, 9), (3, 2), (2, 150))]
    texts, imgs = [c[0] for c in cases], [c[1] for c in cases]
    sp = SamplingParams(max_new_tokens=24)
    ar = eng.generate(texts, images=imgs, sampling=sp, speculative=False)
    sd = eng.generate(texts, images=imgs, sampling=sp)
    ref = eager.generate(texts, images=imgs, sampling=sp, speculative=False)
    prefill_keys = {k for k in eng.graphs.graphs if k[0] == "prefill"}
    assert len(prefill_keys) >= 3                                    # several buckets ran as graphs
    for t, im, a, s, e in zip(texts, imgs, ar, sd, ref):
        assert_same_or_fp_tie(eng, t, im, s.token_ids, a.token_ids)
        assert_same_or_fp_tie(eng, t, im, a.token_ids, e.token_ids)
        assert 0 < s.stats.time_first_token <= s.stats.time_prefill + s.stats.time_queued + 1e-6
    assert sum(s.stats.target_forwards for s in sd) < sum(len(a.token_ids) for a in ar)   # drafts accepted


@pytest.mark.gpu
def test_second_stream_gives_the_same_weights():
    """The draft's first-token distributions feed the first block's weights: with the views on
    the second stream the weights trace and tokens equal those of the one-stream prefill."""
    outs = []
    for overlap in (True, False):
        eng = _gpu_engine(views=("M", "T"), policy="kld", gamma=4, view_tree=False, adaptive=False)
        eng.runner.overlap_draft = overlap
        text, imgs = _prompt(1)
        outs.append(eng.generate(text, images=imgs, sampling=SamplingParams(max_new_tokens=24), caption="w1 w2"))
    assert outs[0].token_ids == outs[1].token_ids
    assert outs[0].stats.weights == outs[1].stats.weights


@pytest.mark.gpu
def test_warmup_captures_every_prefill_bucket():
    from tabed_engine.engine.prefix_cache import suffix_buckets
    eng = _gpu_engine(max_batch=1)
    eng.warmup(images=True)
    keys = {k[1] for k in eng.graphs.graphs if k[0] == "prefill"}
    assert keys == set(prefill_buckets(eng.max_len))
    rests = suffix_buckets(min(eng.runner.prefill_graph_max, eng.max_len))
    assert {k[1] for k in eng.graphs.graphs if k[0] == "suffix"} == set(rests) and rests[:4] == [16, 32, 48, 64]
    n = len(eng.graphs)
    text, imgs = _prompt(2, 20)
    out = eng.generate(text, images=imgs, sampling=SamplingParams(max_new_tokens=8))
    eng.generate(text + " Why?", images=imgs, sampling=SamplingParams(max_new_tokens=8))   # a cache hit
    assert len(eng.graphs) == n                                      # no capture after warm-up
    assert out.token_ids


# ------------------------------------------------------------------ benchmark smoke (CPU)
def test_ttft_benchmark_smoke(tmp_path):
    """benchmarks/ttft.py --preset tiny on the CPU: every section written, every mode timed,
    and (float32, greedy) every engine mode's first token equal to transformers'."""
    import json

    from bench_scripts import load_benchmark

    load_benchmark("ttft").main(["--preset", "tiny", "--device", "cpu", "--repeats", "1", "--out", str(tmp_path)])
    R = json.loads((tmp_path / "ttft_tiny.json").read_text())
    for section in ("setup", "ttft", "split", "target_prefill", "hf"):
        assert "error" not in R[section], (section, R[section])
    for name in ("1_image", "3_images"):
        modes = R["ttft"][name]
        assert {"AR", "AR eager prefill", "SD K=1", "SD K=2", "SD K=4"} <= set(modes)
        assert all(v["wall_ms"] > 0 and v["stat_ms"] > 0 for k, v in modes.items() if k != "floor_ms")
        assert R["split"][name]["target_prefill_ms"] > 0 and R["split"][name]["draft_views_K4_ms"] > 0
        tp = R["target_prefill"][name]
        assert tp["tokens"] <= tp["bucket"] < tp["tokens"] + 64
    assert R["setup"]["prompts"]["3_images"]["tokens"] > R["setup"]["prompts"]["1_image"]["tokens"]
    assert R["targets"]["first_tokens_agree"]["value"] is True
    assert "| SD K=2 |" in (tmp_path / "ttft_tiny.md").read_text()
