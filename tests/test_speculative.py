"""TABED speculative decoding: lossless greedy and sampling, one batched draft forward per
step, adaptive weights (float32, CPU). Engine tests run on the Llama-2-style fixture of
tests/realistic.py (SentencePiece with byte fallback, llava-hf processor files); the sampling
test enumerates the first tokens exactly, so it keeps the tiny word-level vocabulary."""
import dataclasses
import functools
import itertools
import math
from collections import Counter

import numpy as np
import pytest
import torch

import realistic
from models import model_dir
from shards import merge_when_complete, shared_dir
from tabed_engine import Engine, SamplingParams
from tabed_engine.speculation.ensemble import POLICIES
from tabed_engine.models.decoder import KVCache
from tabed_engine.models.tiny import random_image, words

VOCAB = 173
VIEW_SETS = [("M",), ("T",), ("M", "T"), ("M", "T", "P", "C")]


def target_dir():
    return model_dir("mha")


def draft_dir():
    # same seed as the target + noise on the LM: a close but imperfect draft, same vision tower
    return model_dir("mha", perturb=0.6)


@pytest.fixture(scope="module")
def engine():
    target, draft = realistic.checkpoint("llama")
    return Engine.from_pretrained(target, draft, device="cpu", dtype=torch.float32)


prompt = realistic.prompt


def word_prompt(n_images):
    """A prompt of the word-level tiny vocabulary (the sampling tests' checkpoints)."""
    return "".join(f"<image>\n{words(i, 2, VOCAB)} " for i in range(n_images)) + words(7, 6, VOCAB), \
        [random_image(100 + i) for i in range(n_images)]


@pytest.fixture(scope="module")
def ar_reference(engine):
    out = {}
    for n in (1, 2):
        text, imgs = prompt(n)
        out[n] = engine.generate(text, images=imgs, sampling=SamplingParams(max_new_tokens=20),
                                 speculative=False).token_ids
    return out


@pytest.fixture(scope="module")
def twin():
    """Draft = target (same weights): every drafted token the M view proposes is accepted."""
    target, _ = realistic.checkpoint("llama")
    return Engine.from_pretrained(target, target, device="cpu", dtype=torch.float32)


def configure(engine, views, policy, gamma, window=0):
    """Reconfigure a module-scoped engine in place."""
    engine.configure(views=views, policy=policy, gamma=gamma, window=window)
    return engine


@pytest.mark.parametrize("views,policy,gamma", list(itertools.product(VIEW_SETS, POLICIES, [1, 3, 5])))
def test_greedy_sd_equals_ar(engine, ar_reference, views, policy, gamma):
    configure(engine, views, policy, gamma)
    for n in (1, 2):
        text, imgs = prompt(n)
        out = engine.generate(text, images=imgs, sampling=SamplingParams(max_new_tokens=20),
                              caption=["a red car on the street", "two people near 3 trees"][:n])
        assert out.token_ids == ar_reference[n]
        s = out.stats
        assert len(s.accepted_lengths) == s.target_forwards == len(s.weights)
        assert all(0 <= a <= gamma for a in s.accepted_lengths)
        assert all(abs(sum(w) - 1) < 1e-3 and len(w) == len(views) for w in s.weights)


def test_draft_forwards_per_block_is_gamma(engine):
    """All views run as rows of one batch: γ draft forwards per block for any K."""
    calls = []
    lm = engine.draft.lm
    orig = lm.forward
    lm.forward = lambda *a, **k: (calls.append(k.get("input_ids", None) is None) or orig(*a, **k))
    try:
        for views in (("M",), ("M", "T", "P", "C")):
            for gamma in (2, 4):
                configure(engine, views, "w-grid", gamma)
                calls.clear()
                text, imgs = prompt(1)
                out = engine.generate(text, images=imgs, sampling=SamplingParams(max_new_tokens=15),
                                      caption="w1")
                prefills = sum(calls)  # the batched view prefill passes embeddings
                assert prefills == 1
                assert len(calls) - prefills == gamma * out.stats.target_forwards
    finally:
        lm.forward = orig


@pytest.mark.parametrize("gamma", [1, 3, 5])
def test_draft_equal_to_target_accepts_everything(twin, gamma):
    eng = configure(twin, ("M",), "hedge", gamma)
    text, imgs = prompt(1)
    n = 1 + 4 * (gamma + 1)  # the prefill token + four full blocks
    out = eng.generate(text, images=imgs, sampling=SamplingParams(max_new_tokens=n, stop_at_eos=False))
    assert out.stats.accepted_lengths == [gamma] * 4
    assert out.stats.block_efficiency == gamma + 1
    st = out.stats
    assert 0 < st.time_first_token <= st.time_total


@pytest.mark.parametrize("policy", ["kld", "tvd", "w-grid", "hedge"])
@pytest.mark.parametrize("order", [("M", "T"), ("T", "M")])
def test_adaptive_weights_move_to_matching_view(twin, policy, order):
    """Draft = target: the M view sees the real image and matches the target exactly; the
    T view has no image. The weights must move to M within a few blocks."""
    eng = configure(twin, order, policy, 3)
    text, imgs = prompt(1)
    out = eng.generate(text, images=imgs, sampling=SamplingParams(max_new_tokens=25, stop_at_eos=False))
    w = out.stats.weights
    m = order.index("M")
    # the first block is weighted by the prefill's position (the target's first token):
    # already towards M, which matches the target there exactly
    assert w[0][m] > 0.5, w
    assert len(w) >= 4
    assert all(ws[m] >= 0.85 for ws in w[3:]), w


def test_sampled_tvd_weights_move_to_matching_view(twin):
    """Sampling with `tvd`: the history's TV takes the target normalisers computed in the
    verification graph and the views' from the draft loop; the weights still find M."""
    eng = configure(twin, ("T", "M"), "tvd", 3)
    text, imgs = prompt(1)
    out = eng.generate(text, images=imgs, sampling=SamplingParams(max_new_tokens=25, stop_at_eos=False,
                                                                  temperature=0.8, seed=3))
    w = out.stats.weights
    assert len(w) >= 4 and all(ws[1] >= 0.85 for ws in w[3:]), w


def test_first_block_weights_come_from_the_prefill_position(engine):
    """Before the first block, each view's KL from the target's distribution of the first
    token (free from the two prefills) is the history's first entry: kld weights ∝ 1/KL."""
    from tabed_engine.engine.prompt import prepare
    from tabed_engine.models.decoder import cache_rows
    from tabed_engine.speculation.chain import prefill_draft
    from tabed_engine.speculation.views import build_views

    eng = configure(engine, ("M", "T"), "kld", 2)
    text, imgs = prompt(1)
    out = eng.generate(text, images=imgs, sampling=SamplingParams(max_new_tokens=4, stop_at_eos=False))
    with torch.inference_mode():
        prep = prepare(eng.processor, text, imgs, eng.target.image_token_id, eng.tokens_per_image)
        _, p_logits, sel = eng.prefill_target(prep)
        _, q_logits = prefill_draft(eng.runner, build_views(eng, prep, sel, None),
                                    cache_rows(eng.runner.dcache, 0, 2))
    logp = p_logits.double().log_softmax(-1)
    kl = (logp.exp() * (logp - q_logits.double().log_softmax(-1))).sum(-1)    # [K]
    expect = (1 / kl) / (1 / kl).sum()
    assert torch.allclose(torch.tensor(out.stats.weights[0], dtype=torch.float64), expect, atol=1e-3), \
        (out.stats.weights[0], expect)
    uni = Engine(eng.target, eng.processor, draft=eng.draft, device="cpu", views=("M", "T"), policy="uniform",
                 gamma=2)
    out = uni.generate(text, images=imgs, sampling=SamplingParams(max_new_tokens=4, stop_at_eos=False))
    assert out.stats.weights[0] == [0.5, 0.5]


def test_c_view_needs_a_caption(engine):
    configure(engine, ("M", "C"), "kld", 3)
    text, imgs = prompt(1)
    with pytest.raises(ValueError, match="caption"):
        engine.generate(text, images=imgs, sampling=SamplingParams(max_new_tokens=4))
    assert engine.generate(text, images=imgs, sampling=SamplingParams(max_new_tokens=4), caption="w1").token_ids


def test_bad_engine_options():
    for kw in (dict(views=("X",)), dict(views=()), dict(policy="best"), dict(gamma=0), dict(window=-1),
               dict(grid_step=0.3)):
        with pytest.raises(ValueError):
            Engine.from_pretrained(target_dir(), draft_dir(), device="cpu", **kw)


# ---------------------------------------------------------------- sampling is lossless
def exact_first_tokens(eng, text, imgs, sp, n_tok):
    """Exact target distribution of the first n_tok tokens (enumerating the top-k support)."""
    from tabed_engine.engine.prompt import prepare
    from tabed_engine.speculation.sampling import target_probs

    prep = prepare(eng.processor, text, imgs, eng.target.image_token_id, eng.tokens_per_image)
    feats = eng.target.vision(prep.pixel_values)
    base = eng.runner.embed(eng.target, prep.ids, prep.image_spans, feats)
    dist = {(): 1.0}
    for _ in range(n_tok):
        nxt = {}
        for seq, pr in dist.items():
            x = torch.cat([base, eng.target.lm.embed_tokens(torch.tensor(seq, dtype=torch.long))]) \
                if seq else base
            cache = KVCache(eng.target.lm.cfg, 1, eng.max_len, eng.device, eng.dtype)
            pos = torch.arange(x.shape[0])[None]
            logits = eng.target.lm(cache, pos, embeds=x[None])[:, -1]
            p = target_probs(logits, sp)[0].detach()
            for t in torch.nonzero(p > 0).flatten().tolist():
                nxt[seq + (t,)] = pr * float(p[t])
        dist = nxt
    return dist


def _match_statistics(counts, probs, n: int):
    """`assert_matches`' statistics of counts [..., O] (numpy) against probabilities [O]: the
    largest |z| over the outcomes (an outcome expected fewer than 5 times: the z of the same
    upper-tail probability as its count's under the binomial, where the normal approximation
    would flag a count of 6 at an expectation of 1, 1 in 800 such outcomes), the chi-square over
    the outcomes expected >= 5 times and its degrees of freedom."""
    from scipy import stats

    big = n * probs >= 5
    se = np.sqrt(np.maximum(probs * (1 - probs), 1e-4) / n)
    z = np.abs(counts / n - probs) / se
    tail = stats.norm.isf(stats.binom.sf(counts - 1, n, probs))       # P[X >= count] as a z
    worst = np.where(big, z, np.where(counts > n * probs, tail, 0.0)).max(-1)
    chi2 = ((counts[..., big] - n * probs[big]) ** 2 / (n * probs[big])).sum(-1)
    return worst, chi2, int(big.sum()) - 1


def _chi2_limit(dof: int) -> float:
    # Wilson–Hilferty: chi2 > dof + 4.5 sqrt(2 dof) has probability < 1e-4 under the null
    return dof + 4.5 * math.sqrt(2 * dof)


def assert_matches(counts: Counter, dist: dict, n: int):
    """Every outcome's frequency within 4 standard errors of its probability (a rare outcome's
    count: its binomial tail as likely; Bonferroni over ~27 outcomes), and a chi-square test. `check_lossless` checks on the actual distribution
    that a sampler broken by a small shift of mass is caught."""
    assert set(counts) <= set(dist)
    keys = list(dist)
    worst, chi2, dof = _match_statistics(np.array([counts.get(k, 0) for k in keys], dtype=np.float64),
                                         np.array([dist[k] for k in keys]), n)
    assert chi2 < _chi2_limit(dof), (chi2, dof)
    assert worst < 4.0, worst
    return worst


def rejection_rate(dist: dict, broken: dict, n: int, trials: int = 20000) -> float:
    """The share of `trials` simulated runs of n samples from `broken` (a sampler's wrong
    distribution over the outcomes of `dist`) that `assert_matches(., dist, n)` rejects:
    the check's power against that sampler (fixed seed: the same number every run)."""
    keys = list(dist)
    q = np.array([broken[k] for k in keys])
    counts = np.random.default_rng(0).multinomial(n, q / q.sum(), size=trials).astype(np.float64)
    worst, chi2, dof = _match_statistics(counts, np.array([dist[k] for k in keys]), n)
    return float(np.mean((chi2 >= _chi2_limit(dof)) | (worst >= 4.0)))


# rejection sampling (unseeded, or seeded with reproducible=False). The seeded coupling's tokens
# do not depend on the draft (AR == chain == tree per seed: tests/test_coupling.py), and its
# distribution is checked there over 16,000 seeds per block kind: an engine-level run here would
# repeat that at ~4 CPU-minutes
# config -> (views, policy, rows of other requests in each call): MT-kld's calls hold 14 measured
# requests and 2 of another prompt (two images, another text), so its samples are also those of
# sampling among other requests in a batch (tests/test_batch.py's mixed settings are its own)
LOSSLESS = {"M-uniform": (("M",), "uniform", 0), "MT-kld": (("M", "T"), "kld", 2)}
# 11,200 samples: 99.7% power against a 2% shift (the likeliest outcome has p = 0.18; 16,000 had
# 99.99%, at 43% more CPU)
SAMPLES, SHARDS = 11200, 8
SAMPLING = SamplingParams(max_new_tokens=3, temperature=0.6, top_k=3, stop_at_eos=False)


BATCH = 16     # requests of one generate() call: ~14 ms of CPU a sample instead of ~34 ms alone (32: no faster)


@functools.lru_cache(maxsize=None)
def sampling_engine(views, policy, device="cpu"):
    return Engine.from_pretrained(target_dir(), model_dir("mha", perturb=0.25), device=device,
                                  dtype=torch.float32, views=views, policy=policy, gamma=2, adaptive=False,
                                  max_batch=BATCH)


def sample(eng, seeds, batch=BATCH, others=0):
    """Counts of the generated 3-token sequences over `seeds`, and the drafts accepted, by
    rejection sampling (seeded with reproducible=False: not the coupling). The requests run
    `batch` at a time as the rows of one generate() call, the last `others` rows of each call
    requests of another prompt (not counted): each row draws its first token from its own
    seed's generator and its blocks' noise from the batch's stream (the batch's first seed),
    at its own offset, so the rows are independent samples; the batches' first seeds differ,
    so are their streams."""
    text, imgs = word_prompt(1)
    other, other_imgs = word_prompt(2)
    counts, accepted = Counter(), 0
    seeds = list(seeds)
    for at in range(0, len(seeds), batch - others):
        chunk = seeds[at:at + batch - others]
        outs = eng.generate([text] * len(chunk) + [other] * others,
                            images=[imgs] * len(chunk) + [other_imgs] * others,
                            sampling=[dataclasses.replace(SAMPLING, seed=i, reproducible=False)
                                      for i in chunk + [(1 << 20) + chunk[0] * others + j for j in range(others)]])
        for out in outs[:len(chunk)]:
            counts[tuple(out.token_ids)] += 1
            accepted += sum(out.stats.accepted_lengths)
    return counts, accepted


def check_lossless(counts, dist, n, shift, power=0.995):
    """The counts match the exact distribution; the same check rejects the distribution with
    `shift` of mass moved between its two likeliest outcomes, on these counts, and a sampler
    broken that way in at least `power` of simulated runs of n samples (the power that decides
    n: a broken sampler passes a 4-SE test at 5 SE in 16% of runs)."""
    assert_matches(counts, dist, n)
    top = sorted(dist, key=dist.get, reverse=True)[:2]
    shifted = dict(dist)
    shifted[top[0]] -= shift
    shifted[top[1]] += shift
    with pytest.raises(AssertionError):
        assert_matches(counts, shifted, n)
    assert rejection_rate(dist, shifted, n) >= power, (rejection_rate(dist, shifted, n), n, shift)


@pytest.fixture(scope="module")
def exact_dist():
    """The target's exact distribution of the first 3 sampled tokens (same for every draft)."""
    eng = Engine.from_pretrained(target_dir(), device="cpu", dtype=torch.float32)
    text, imgs = word_prompt(1)
    return exact_first_tokens(eng, text, imgs, SAMPLING, 3)


@pytest.mark.slow
@pytest.mark.parametrize("shard", range(SHARDS))
@pytest.mark.parametrize("config", list(LOSSLESS))
def test_sampling_is_lossless(config, shard, exact_dist, tmp_path_factory):
    """SAMPLES sampled generations in SHARDS shards (xdist spreads them over workers); the
    shard that completes the set checks all SAMPLES against the exact distribution, with the
    power to catch a 2% error. MT-kld: the measured requests share each batch with two others."""
    n = SAMPLES // SHARDS
    views, policy, others = LOSSLESS[config]
    counts, accepted = sample(sampling_engine(views, policy), range(shard * n, (shard + 1) * n), others=others)
    assert accepted > n * 0.15  # drafts really were accepted (not a target-only path)
    assert set(counts) <= set(exact_dist)
    check_when_complete(tmp_path_factory, f"lossless-{config}", shard, SHARDS, counts, exact_dist, SAMPLES, 0.02)


def check_when_complete(tmp_path_factory, name, shard, shards, counts, dist, total, shift):
    """Merge this shard's counts with the other shards' (xdist workers); the shard completing
    the set runs `check_lossless` on all `total` samples."""
    merged = merge_when_complete(shared_dir(tmp_path_factory, name), shard, shards,
                                 Counter({",".join(map(str, k)): v for k, v in counts.items()}))
    if merged is not None:
        merged = Counter({tuple(int(t) for t in k.split(",")): v for k, v in merged.items()})
        assert sum(merged.values()) == total
        check_lossless(merged, dist, total, shift=shift)


@pytest.mark.gpu
def test_sampling_is_lossless_on_the_gpu(exact_dist):
    """The GPU path: the Triton ensemble mix's inverse-CDF draws, the chain verification
    kernel and the CUDA graphs, against the exact distribution from the CPU target."""
    n = 6000                                    # ~2 min budget
    counts, accepted = sample(sampling_engine(("M", "T"), "kld", device="cuda"), range(n), batch=1)
    assert accepted > n * 0.15
    check_lossless(counts, exact_dist, n, shift=0.035)


@pytest.mark.parametrize("window", [1, 3])
def test_history_window(twin, window):
    """A short history window still moves the weights to the matching view and stays lossless."""
    eng = configure(twin, ("T", "M"), "kld", 3, window=window)
    text, imgs = prompt(1)
    sp = SamplingParams(max_new_tokens=25, stop_at_eos=False)
    out = eng.generate(text, images=imgs, sampling=sp)
    assert out.token_ids == eng.generate(text, images=imgs, sampling=sp, speculative=False).token_ids
    assert all(w[1] >= 0.85 for w in out.stats.weights[3:]), out.stats.weights


def test_hedge_weights_exponentiate_clipped_kl_over_all_drafted_positions():
    """`hedge`: the first recorded position alone gives 1/KL weights; after a block every
    drafted position counts (also those after the first rejection) and the weights are
    softmax(-sum min(KL, 1)). Checked against KL computed here in float64."""
    from tabed_engine.speculation.ensemble import HEDGE_CLIP, EnsembleConfig, EnsembleState

    gen = torch.Generator().manual_seed(3)
    B, K, P, V = 2, 3, 4, 37
    st = EnsembleState(EnsembleConfig(policy="hedge", num_views=K), B, capacity=16, device="cpu")

    def kl(p, q):  # p [B, P, V], q [B, K, P, V] logits -> [B, K, P]
        lp, lq = torch.log_softmax(p.double(), -1)[:, None], torch.log_softmax(q.double(), -1)
        return (lp.exp() * (lp - lq)).sum(-1)

    p0, q0 = torch.randn(B, 1, V, generator=gen), torch.randn(B, K, 1, V, generator=gen)
    w, cur = st.step(p0, q0, torch.zeros(B, dtype=torch.long), st.cursor)
    st.cursor.copy_(cur)
    d0 = kl(p0, q0)[..., 0]
    assert torch.allclose(w.double(), (1 / d0) / (1 / d0).sum(-1, keepdim=True), atol=1e-5)

    p1, q1 = 3 * torch.randn(B, P, V, generator=gen), 3 * torch.randn(B, K, P, V, generator=gen)
    n_acc = torch.tensor([0, 2])          # early rejections: hedge still records all P positions
    w, cur = st.step(p1, q1, n_acc, st.cursor)
    loss = d0.clamp(max=HEDGE_CLIP) + kl(p1, q1).clamp(max=HEDGE_CLIP).sum(-1)
    assert torch.allclose(w.double(), torch.softmax(-loss, -1), atol=1e-5)
    assert cur.tolist() == [1 + P] * B and bool(st.valid[:, :1 + P].all())


def test_target_probs_writes_the_unrestricted_normaliser():
    """Sampling's verification takes the target normaliser for `tvd` from `target_probs`:
    logsumexp(logits / T) before top-k / top-p, the probabilities unchanged."""
    from tabed_engine.speculation.sampling import target_probs

    logits = 3 * torch.randn(2, 4, VOCAB, generator=torch.Generator().manual_seed(1))
    sp = SamplingParams(temperature=0.7, top_k=5, top_p=0.9)
    lse = torch.full((2, 4), float("nan"))
    probs = target_probs(logits, sp, lse)
    assert torch.equal(probs, target_probs(logits, sp))
    torch.testing.assert_close(lse, torch.logsumexp(logits / 0.7, -1))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_history_step_with_normalisers_matches_without(temperature):
    """`tvd` takes the rows' normalisers from the verification ([B, γ+1]) and the draft loop
    ([γ, B*K], one row per step): the same divergences and weights as computing them."""
    from tabed_engine.speculation.ensemble import EnsembleConfig, EnsembleState, history_step

    gen = torch.Generator().manual_seed(4)
    B, K, gamma, V = 2, 3, 4, 37
    tlogits = 2 * torch.randn(B, gamma + 1, V, generator=gen)
    q_logits = 2 * torch.randn(gamma, B * K, V, generator=gen)
    t_lse = torch.logsumexp(tlogits / temperature, -1)
    q_lse = torch.logsumexp(q_logits / temperature, -1)
    n_acc = torch.tensor([1, 3])
    out = []
    for norms in (False, True):
        st = EnsembleState(EnsembleConfig(policy="tvd", num_views=K), B, capacity=16, device="cpu")
        assert st.uses_normalisers
        extra = (t_lse, q_lse) if norms else ()
        w, cur = history_step(st, tlogits, q_logits, n_acc, st.cursor, *extra, temperature=temperature)
        out.append((w, cur, st.div.clone()))
    torch.testing.assert_close(out[0][0], out[1][0], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(out[0][2], out[1][2], atol=1e-6, rtol=1e-5)
    assert out[0][1].tolist() == out[1][1].tolist() == [gamma] * B and (out[1][2][:, :, :2] > 0.05).all()
    assert not EnsembleState(EnsembleConfig(policy="kld", num_views=K), B, 16, "cpu").uses_normalisers


@pytest.mark.parametrize("speculative", [False, True])
def test_stop_at_eos_mid_generation(engine, speculative):
    """A token of an unstopped greedy run made the EOS: AR (pipelined one step deep, so one
    queued step is discarded at the EOS) and SD stop right after its first occurrence, count
    one target forward per decode/verify step, and the engine's next generation is unaffected."""
    configure(engine, ("M", "T"), "hedge", 3)   # the module's engine is reconfigured by other tests
    text, imgs = prompt(1)
    full = engine.generate(text, images=imgs, sampling=SamplingParams(max_new_tokens=12, stop_at_eos=False),
                           speculative=False).token_ids
    stop = full[4]
    saved = engine.eos_ids
    try:
        engine.eos_ids = {stop}
        out = engine.generate(text, images=imgs, sampling=SamplingParams(max_new_tokens=12),
                              speculative=speculative)
    finally:
        engine.eos_ids = saved
    cut = full[: full.index(stop) + 1]
    assert out.token_ids == cut
    if not speculative:
        assert out.stats.target_forwards == len(cut) - 1
    again = engine.generate(text, images=imgs, sampling=SamplingParams(max_new_tokens=12, stop_at_eos=False),
                            speculative=speculative).token_ids
    assert again == full


@pytest.fixture(scope="module")
def bf16_engine():
    return Engine.from_pretrained(target_dir(), draft_dir(), device="cpu", dtype=torch.bfloat16)


@pytest.mark.parametrize("policy, temperature", [("hedge", 0.0), ("w-grid", 0.0), ("kld", 0.8)])
def test_draft_logits_in_bf16_change_no_result(bf16_engine, policy, temperature, monkeypatch):
    """The draft loop keeps a bf16 draft's logits in bf16 (no conversion per step); every
    consumer (mixing, weights, divergences, acceptance) upcasts them exactly, so the tokens,
    the acceptance record and the weights equal those of the same run on float32 logits."""
    from tabed_engine.models.decoder import LlamaLM

    eng = configure(bf16_engine, ("M", "T", "P", "C"), policy, 3)
    text, imgs = prompt(1)
    sp = SamplingParams(max_new_tokens=14, temperature=temperature, seed=5)

    def run():
        out = eng.generate(text, images=imgs, sampling=sp, speculative=True, caption="a b c")
        return out.token_ids, out.stats.accepted_lengths, out.stats.weights

    def block():  # one sampled draft block of 4 views straight from an empty cache
        from tabed_engine.models.decoder import KVCache
        from tabed_engine.speculation.chain import draft_block

        lm = eng.draft.lm
        cache = KVCache(lm.cfg, 4, 32, "cpu", torch.bfloat16)
        seed, offset = torch.tensor([3]), torch.tensor([0])
        return draft_block(lm, cache, torch.tensor([[5, 6], [7, 8], [9, 10], [11, 12]]), torch.zeros(4, dtype=torch.long),
                           torch.tensor([[0.1, 0.2, 0.3, 0.4]]), seed, offset, B=1, K=4, gamma=3, greedy=False,
                           temperature=0.8, confidence=False)

    kept, kept_block = run(), block()
    assert kept_block[1].dtype == torch.bfloat16
    forward = LlamaLM.forward
    monkeypatch.setattr(LlamaLM, "forward", lambda self, *a, **kw: forward(self, *a, **{**kw, "float_logits": True}))
    assert run() == kept
    drafted, q_logits, mixtures, _ = block()
    assert q_logits.dtype == torch.float32
    assert torch.equal(drafted, kept_block[0]) and torch.equal(q_logits, kept_block[1].float())
    assert torch.equal(mixtures, kept_block[2])


def test_view_trie_and_its_greedy_walk():
    """The views' chains merge their shared prefixes; verify_tree's walk over the merged tree
    finds the longest branch the target accepts, also when branches part late."""
    from tabed_engine.ops.verify_tree import verify_tree
    from tabed_engine.speculation.chain import view_trie

    drafted = torch.tensor([[5, 6, 7], [5, 6, 9], [3, 6, 9]])
    tokens, parents, node_of = view_trie(drafted)
    # root, 5, 6, 7 | 9 (under 6) | 3, 6, 9 (a second branch from the root)
    assert tokens[1:] == [5, 6, 7, 9, 3, 6, 9] and parents == [0, 0, 1, 2, 2, 0, 5, 6]
    assert node_of.tolist() == [[1, 2, 3], [1, 2, 4], [5, 6, 7]]

    def walk(argmax):   # target argmax per node -> (accepted path, count, next token)
        p = torch.nn.functional.one_hot(torch.tensor(argmax), 12).float()[None]
        path, n, nxt = verify_tree(torch.tensor([tokens]), torch.tensor([parents]), p, greedy=True)
        return path[0, : int(n) + 1].tolist(), int(n), int(nxt)

    # branch 1 parts from branch 0 at depth 3 and is the one accepted in full, bonus 4
    assert walk([5, 6, 9, 0, 4, 0, 0, 0]) == ([0, 1, 2, 4], 3, 4)
    assert walk([5, 6, 8, 0, 4, 0, 0, 0]) == ([0, 1, 2], 2, 8)     # neither 7 nor 9
    assert walk([3, 0, 0, 0, 0, 6, 9, 11]) == ([0, 5, 6, 7], 3, 11)  # the third view's chain
    assert walk([2, 0, 0, 0, 0, 0, 0, 0]) == ([0], 0, 2)           # nothing: the root's token
