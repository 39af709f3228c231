"""Engine on a CUDA GPU: CUDA-graph paths lossless against AR, no leaks, and a bf16
LLaVA-1.5-7B-shaped smoke run (random weights built on the GPU)."""
import dataclasses

import pytest
import torch

from models import model_dir
from tabed_engine import Engine, SamplingParams
from tabed_engine.models.tiny import random_image, words

pytestmark = pytest.mark.gpu


def _prompt(n_images):
    return "".join(f"<image>\n{words(i, 2, 173)} " for i in range(n_images)) + words(3, 6, 173), \
        [random_image(40 + i) for i in range(n_images)]


@pytest.fixture(scope="module")
def engine():
    return Engine.from_pretrained(model_dir("mha"), model_dir("mha", perturb=0.6), device="cuda",
                                  dtype=torch.float32)


def _configure(engine, views, policy="w-grid", gamma=4):
    engine.configure(views=views, policy=policy, gamma=gamma)


def assert_same_or_fp_tie(engine, text, imgs, a, b, tol=1e-4):
    """a == b, or they part at a position where the target's top two logits are within `tol`
    (float32 kernels that sum in a different order may break exact ties differently)."""
    if a == b:
        return
    i = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    from tabed_engine.engine.prompt import prepare

    prep = prepare(engine.processor, text, imgs, engine.target.image_token_id, engine.tokens_per_image)
    prep.ids = prep.ids + a[:i]
    with torch.inference_mode():
        _, logits, _ = engine.prefill_target(prep)
    top = torch.topk(logits[0], 2).values
    assert float(top[0] - top[1]) < tol, (i, a[i - 2: i + 2], b[i - 2: i + 2], float(top[0] - top[1]))


@pytest.mark.parametrize("views", [("M",), ("M", "T"), ("M", "T", "P", "C")])
# kld and hedge start with the first-block view tree (eager tree verification + KV compaction)
@pytest.mark.parametrize("policy", ["uniform", "w-grid", "kld", "hedge", "confidence"])
def test_graph_sd_equals_ar_fp32(engine, views, policy):
    _configure(engine, views, policy)
    for n in (1, 2):
        text, imgs = _prompt(n)
        sp = SamplingParams(max_new_tokens=40)
        ar = engine.generate(text, images=imgs, sampling=sp, speculative=False).token_ids
        sd = engine.generate(text, images=imgs, sampling=sp, caption="w1 w2")
        assert_same_or_fp_tie(engine, text, imgs, sd.token_ids, ar)
        assert sd.stats.target_forwards < len(ar)  # drafts were accepted


def test_tvd_history_takes_the_normalisers_in_graphs(engine):
    """`tvd`: the verification graph writes the target's normalisers (greedy: the chain
    verification's own pass; sampling: a logsumexp) and the history graph takes the views'
    from the draft loop. Greedy: lossless, and the weights those of the CPU engine (which
    computes the same divergences with the PyTorch references) wherever the blocks agree."""
    _configure(engine, ("M", "T"), "tvd")
    engine.configure(adaptive=False)       # block by block against the CPU engine: speculate every block
    cpu = Engine.from_pretrained(model_dir("mha"), model_dir("mha", perturb=0.6), device="cpu",
                                 dtype=torch.float32)
    _configure(cpu, ("M", "T"), "tvd")
    text, imgs = _prompt(1)
    sp = SamplingParams(max_new_tokens=40)
    sd = engine.generate(text, images=imgs, sampling=sp, caption="w1 w2")
    ar = engine.generate(text, images=imgs, sampling=sp, speculative=False).token_ids
    assert_same_or_fp_tie(engine, text, imgs, sd.token_ids, ar)
    ref = cpu.generate(text, images=imgs, sampling=sp, caption="w1 w2")
    n = next((i for i, (a, b) in enumerate(zip(sd.stats.accepted_lengths, ref.stats.accepted_lengths)) if a != b),
             len(sd.stats.accepted_lengths))
    assert n >= 3 and len({tuple(w) for w in sd.stats.weights[:n]}) > 1     # weights moved
    # block i's weights come from the blocks before it
    torch.testing.assert_close(torch.tensor(sd.stats.weights[:n + 1]), torch.tensor(ref.stats.weights[:n + 1]),
                               atol=2e-3, rtol=0)
    sampled = engine.generate(text, images=imgs, sampling=SamplingParams(max_new_tokens=40, temperature=0.8, seed=1),
                              caption="w1 w2")
    w = torch.tensor(sampled.stats.weights)
    assert torch.isfinite(w).all() and torch.allclose(w.sum(-1), torch.ones(len(w)), atol=1e-3)
    engine.configure(adaptive=None)


def test_graphs_match_eager_and_cpu(engine):
    _configure(engine, ("M", "T"))
    text, imgs = _prompt(1)
    sp = SamplingParams(max_new_tokens=30)
    eager = Engine.from_pretrained(model_dir("mha"), model_dir("mha", perturb=0.6), device="cuda",
                                   dtype=torch.float32, cuda_graphs=False)
    cpu = Engine.from_pretrained(model_dir("mha"), model_dir("mha", perturb=0.6), device="cpu",
                                 dtype=torch.float32)
    a = engine.generate(text, images=imgs, sampling=sp).token_ids
    assert_same_or_fp_tie(engine, text, imgs, a, eager.generate(text, images=imgs, sampling=sp).token_ids)
    assert_same_or_fp_tie(engine, text, imgs, a, cpu.generate(text, images=imgs, sampling=sp).token_ids)


def test_no_memory_growth_over_1000_generations(engine):
    _configure(engine, ("M", "T"))
    text, imgs = _prompt(1)
    sp = SamplingParams(max_new_tokens=8, temperature=0.8, seed=0)
    engine.warmup(max_batch=1, sampling=sp)    # every graph a sampled request may need, captured
    for i in range(20):
        engine.generate(text, images=imgs, sampling=sp)
    torch.cuda.synchronize()
    base, graphs = torch.cuda.memory_allocated(), set(engine.graphs.graphs)
    for i in range(1000):
        sp = dataclasses.replace(sp, seed=i)
        engine.generate(text, images=imgs, sampling=sp)
    torch.cuda.synchronize()
    assert set(engine.graphs.graphs) == graphs      # nothing captured after warm-up
    assert torch.cuda.memory_allocated() <= base + (1 << 20)


def test_device_images_equal_processor_pixels(engine):
    """Preprocessing on the device (the GPU default) and through the processor on the host give
    the same tokens, AR and SD, one and two images."""
    _configure(engine, ("M", "T", "P"))
    assert engine.device_images
    sp = SamplingParams(max_new_tokens=24)
    for n in (1, 2):
        text, imgs = _prompt(n)
        for speculative in (False, True):
            on = engine.generate(text, images=imgs, sampling=sp, speculative=speculative).token_ids
            engine.device_images = False
            try:
                off = engine.generate(text, images=imgs, sampling=sp, speculative=speculative).token_ids
            finally:
                engine.device_images = True
            assert on == off


def test_llava_7b_shaped_bf16_smoke():
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    from tabed_engine.models.loader import lvlm_from_hf
    from tabed_engine.models.tiny import build_processor

    vc = CLIPVisionConfig(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
                          num_attention_heads=16, image_size=336, patch_size=14, projection_dim=768)
    tc = LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                     num_key_value_heads=32, vocab_size=32064, max_position_embeddings=4096, rms_norm_eps=1e-5)
    cfg = LlavaConfig(vision_config=vc, text_config=tc, image_token_index=4, vision_feature_layer=-2,
                      vision_feature_select_strategy="default", image_seq_length=576)
    torch.manual_seed(0)
    with torch.device("cuda"):
        hf = LlavaForConditionalGeneration(cfg).eval()   # float32 first: the reference
    proc = build_processor(32064, 336, 14, "default")
    img = random_image(1, 336)
    text = "<image>\n " + words(5, 40, 32064)
    enc = proc(text=text, images=[img], return_tensors="pt").to("cuda")
    with torch.inference_mode():
        ref32 = hf(**enc).logits[0, -1]
    # (build the reference before casting: `.to(bfloat16)` also rounds transformers' RoPE
    # inv_freq buffer, which `.float()` cannot undo)
    hf = hf.to(torch.bfloat16)
    eng = Engine(lvlm_from_hf(hf), proc, device=torch.device("cuda"), dtype=torch.bfloat16, max_len=2048)
    out = eng.generate(text, images=[img], sampling=SamplingParams(max_new_tokens=16, stop_at_eos=False),
                       speculative=False)
    assert len(out.token_ids) == 16
    # our bf16 prefill logits: error w.r.t. the float32 reference at most ~2x that of
    # transformers' own bf16 run on the same weights
    from tabed_engine.engine.prompt import prepare

    prep = prepare(proc, text, [img], 4, 576)
    with torch.inference_mode():
        _, ours, _ = eng.prefill_target(prep)
        ref16 = hf(**enc).logits[0, -1].float()
    err_ours = ((ours[0] - ref32).norm() / ref32.norm()).item()
    err_hf = ((ref16 - ref32).norm() / ref32.norm()).item()
    assert err_ours <= 2 * err_hf + 1e-3, (err_ours, err_hf)
    assert out.token_ids[0] in torch.topk(ref32, 5).indices.tolist()

@pytest.mark.parametrize("V", [173, 1000])
def test_ops_at_engine_shapes(V):
    """The ensemble ops exactly as the engine calls them (strided views of graph buffers,
    small vocabularies) against their references."""
    from tabed_engine.ops.window_divergence import window_divergence, window_divergence_reference
    from tabed_engine.speculation.ensemble import EnsembleConfig

    torch.manual_seed(0)
    gamma, B, K = 4, 1, 2
    tl = torch.randn(B, gamma + 1, V, device="cuda") * 3
    ql = torch.randn(gamma, B * K, V, device="cuda") * 3
    p, q = tl[:, :gamma], ql.view(gamma, B, K, V).permute(1, 2, 0, 3)
    grid = EnsembleConfig(num_views=K).grid("cuda")
    got = window_divergence(p, q, grid=grid)
    torch.cuda.synchronize()
    want = window_divergence_reference(p, q, grid=grid)
    for g, w in zip(got, want):
        if g.dtype == torch.bool:
            assert (g == w).float().mean() > 0.99
        else:
            torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("graphs", [False, True])
@pytest.mark.parametrize("views", [("M", "T", "P", "C"), ("M", "P"), ("M", "C"), ("M", "T")])
def test_fresh_engine_views_lossless(graphs, views):
    """A fresh engine per view set (no reuse of captured graphs across configurations)."""
    eng = Engine.from_pretrained(model_dir("mha"), model_dir("mha", perturb=0.6), device="cuda",
                                 dtype=torch.float32, views=views, gamma=4, cuda_graphs=graphs)
    for n in (1, 2):
        text, imgs = _prompt(n)
        sp = SamplingParams(max_new_tokens=40)
        ar = eng.generate(text, images=imgs, sampling=sp, speculative=False).token_ids
        sd = eng.generate(text, images=imgs, sampling=sp, caption="w1 w2")
        assert_same_or_fp_tie(eng, text, imgs, sd.token_ids, ar)


@pytest.mark.parametrize("V", [173, 1000, 32064])
@pytest.mark.parametrize("K", [1, 2, 4])
def test_ensemble_mix_greedy_small_vocab(V, K):
    from tabed_engine.ops.ensemble_mix import ensemble_mix, ensemble_mix_reference

    torch.manual_seed(V + K)
    logits = torch.randn(K, V, device="cuda") * 3
    w = torch.softmax(torch.randn(1, K, device="cuda"), -1)
    tok, prob, _, lse = ensemble_mix(logits, w, greedy=True)
    rtok, rprob, _, rlse = ensemble_mix_reference(logits, w, greedy=True)
    torch.cuda.synchronize()
    assert int(tok) == int(rtok)
    torch.testing.assert_close(lse, rlse, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_captured_target_forwards_are_deterministic(engine, dtype):
    # a captured decode step (1 row), chain verification (6) and tree verification (64 nodes)
    # over prefixes whose attention splits (arrival counters, partials) replayed hundreds of
    # times give the same bits: no race between programs or between launches (PDL)
    from tabed_engine.models.decoder import KVCache

    lm = engine.target.lm if dtype == torch.float32 else Engine.from_pretrained(
        model_dir("mha"), device="cuda", dtype=dtype).target.lm
    g = torch.Generator(device="cuda").manual_seed(0)
    for R, prefix in ((1, 1500), (3, 700)):
        cache = KVCache(lm.cfg, R, 2048, "cuda", dtype)
        cache.k.normal_(generator=g)
        cache.v.normal_(generator=g)
        lens = torch.full((R,), prefix, device="cuda", dtype=torch.int32)
        for N in (1, 6, 64):
            ids = torch.randint(0, lm.cfg.vocab_size, (R, N), device="cuda", generator=g)
            pos = lens.long()[:, None] + torch.arange(N, device="cuda")
            parents = [-1] + [int(torch.randint(0, i, (1,), generator=torch.Generator().manual_seed(i))) for i in range(1, N)]
            mask = torch.zeros(N, N, dtype=torch.bool)
            for i in range(N):
                j = i
                while j >= 0:
                    mask[i, j], j = True, parents[j]
            mask = mask.cuda()[None].expand(R, N, N).contiguous()
            with torch.inference_mode():
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    lm(cache, pos, input_ids=ids, lengths=lens, tree_mask=mask)
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    out = lm(cache, pos, input_ids=ids, lengths=lens, tree_mask=mask)
                graph.replay()
                first = out.clone()
                differing = 0
                for _ in range(50):
                    for _ in range(8):
                        graph.replay()
                    differing += not torch.equal(out, first)
            assert differing == 0, (R, prefix, N, differing)


def test_streams_that_may_run_at_once_are_distinct(engine):
    """Streams whose work can overlap never coincide (torch's pools of 32 hand a stream out
    again, and with it its cuBLAS workspace, which a captured GEMM keeps by address): after a
    speculative generation with an image, the runner's draft-view stream, its graphs' capture
    stream and the vision towers' capture streams are pairwise distinct; a held stream is not
    handed out again while its owner lives, and is free again once the owner is gone."""
    import gc

    from tabed_engine.engine import graphs as graphs
    from tabed_engine.engine.graphs import private_stream

    gc.collect()                             # earlier tests' engines let their streams go
    _configure(engine, ("M", "T"), "hedge")
    text, imgs = _prompt(1)
    engine.generate(text, images=imgs, sampling=SamplingParams(max_new_tokens=8))
    r = engine.runner
    towers = [v for v in (engine.target.vision, engine.draft.vision) if getattr(v, "_graphs", None) is not None]
    assert towers, "no vision tower ran as a graph"
    held = [r._side.cuda_stream, r.graphs.stream.cuda_stream] + [v._graphs.stream.cuda_stream for v in towers]
    assert len(set(held)) == len(held)

    class Owner:
        pass

    free = 64 - len(graphs._HELD)            # both pools of 32, less what is held now
    for _ in range(2):                       # the second round gets them only if the first let go
        owners = [Owner() for _ in range(free)]
        got = [private_stream(o).cuda_stream for o in owners]
        assert len(set(got)) == free and not set(got) & set(held)
        del owners
        gc.collect()
