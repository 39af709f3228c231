"""Drafts whose vocabulary differs from the target's only in padding rows (models/vocab.py):
the draft's head fitted to the target's vocabulary (rows cut, or missing rows at a finite logit
whose probability is exactly 0), divergences finite where the target has mass on an id the draft
lacks, greedy chain and tree SD token-identical to transformers, sampled SD lossless, and pairs
whose tokenizers differ in the shared range refused.

Fixtures: the word-level "mha" checkpoint (173 tokens) re-padded to other row counts with
random rows (the target puts real mass on its padding ids, so it emits them)."""
import dataclasses
import json
import os
import shutil
from collections import Counter

import pytest
import torch

from models import model_dir
from tabed_engine import Engine, SamplingParams
from tabed_engine.models.config import LMConfig
from tabed_engine.models.decoder import KVCache, LlamaLM
from tabed_engine.models.vocab import MISSING_LOGIT, fit_vocab
from tabed_engine.ops.window_divergence import window_divergence_reference
from tabed_engine.speculation.tree import TreeConfig
from test_speculative import SAMPLING, check_when_complete, exact_first_tokens, word_prompt

TOKENS = 173          # the fixture's tokenizer
HOT_SEED, HOT_SCALE = 3, 2.0    # padding rows the sampling test's target emits often
N_NEW = 24


def repad(src: str, dst: str, rows: int, seed: int = 0, scale: float = 1.0) -> str:
    """A copy of checkpoint `src` whose embedding and head have `rows` rows: cut, or extended
    with random rows of `scale` times the real rows' scale (padding the target gives real mass)."""
    from safetensors.torch import load_file, save_file

    if os.path.isfile(os.path.join(dst, "config.json")):
        return dst
    tmp = dst + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp)
    sd = load_file(os.path.join(tmp, "model.safetensors"))
    g = torch.Generator().manual_seed(seed)
    for key in ("model.language_model.embed_tokens.weight", "lm_head.weight"):
        w = sd[key]
        sd[key] = (w[:rows].clone() if rows <= w.shape[0] else
                   torch.cat([w, torch.randn(rows - w.shape[0], w.shape[1], generator=g) * w.std() * scale]))
    save_file(sd, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(tmp, "config.json")) as f:
        cfg = json.load(f)
    cfg["text_config"]["vocab_size"] = rows
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(cfg, f)
    os.rename(tmp, dst)
    return dst


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """{(target rows, draft rows): (target dir, draft dir)}: the draft short of the target's
    rows, and longer than them."""
    root = tmp_path_factory.mktemp("vocab")
    target, draft = model_dir("mha"), model_dir("mha", perturb=0.25)
    out = {}
    for t_rows, d_rows in ((180, 176), (176, 184)):
        out[t_rows, d_rows] = (repad(target, str(root / f"t{t_rows}"), t_rows, seed=1),
                               repad(draft, str(root / f"d{d_rows}"), d_rows, seed=2))
    return out


def small_lm(vocab, tie, seed=0):
    torch.manual_seed(seed)
    lm = LlamaLM(LMConfig(vocab_size=vocab, hidden_size=16, intermediate_size=24, num_layers=1, num_heads=2,
                          num_kv_heads=1, head_dim=8, tie_word_embeddings=tie))
    for p in lm.parameters():
        torch.nn.init.normal_(p, std=0.5)
    if tie:
        lm.lm_head.weight = lm.embed_tokens.weight
    return lm.eval()


def logits_of(lm, ids):
    cache = KVCache(lm.cfg, 1, 16, "cpu", torch.float32)
    return lm(cache, torch.arange(len(ids))[None], input_ids=torch.tensor([ids]), fresh=True)[0]


@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("own,vocab", [(40, 47), (47, 40)])
def test_fit_vocab_cuts_or_pads_the_head(own, vocab, tie):
    """The fitted head's logits equal the draft's on the shared range; ids the draft lacks get
    MISSING_LOGIT, probability exactly 0 (not NaN); ids up to `vocab` embed (zero rows)."""
    lm = small_lm(own, tie)
    ids = [3, 1, 4, 1, 5]
    before = logits_of(lm, ids)
    fit_vocab(lm, vocab)
    assert lm.cfg.vocab_size == vocab and lm.lm_head.out_features == vocab
    after = logits_of(lm, ids)
    n = min(own, vocab)
    assert after.shape[-1] == vocab
    torch.testing.assert_close(after[:, :n], before[:, :n], rtol=0, atol=1e-6)
    if vocab > own:
        assert torch.equal(after[:, own:], torch.full_like(after[:, own:], MISSING_LOGIT))
        q = torch.softmax(after, -1)
        assert torch.equal(q[:, own:], torch.zeros_like(q[:, own:])) and torch.isfinite(q).all()
        assert torch.isfinite(logits_of(lm, [vocab - 1, 2])).all()      # a padding id the draft lacked embeds
        assert torch.equal(lm.embed_tokens.weight[own:], torch.zeros_like(lm.embed_tokens.weight[own:]))
    else:
        assert lm.lm_head.bias is None
    fit_vocab(lm, vocab)                                                # idempotent
    assert torch.equal(logits_of(lm, ids), after)


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_divergences_stay_finite_where_the_draft_has_no_mass(temperature):
    """Target mass on ids the draft lacks: KL(p || q_k) and the w-grid mixtures' KL are large but
    finite, and TV counts the missing mass."""
    g = torch.Generator().manual_seed(0)
    B, K, P, V, own = 2, 3, 4, 50, 44
    p = torch.randn(B, P, V, generator=g) * 2
    q = p[:, None] + torch.randn(B, K, P, V, generator=g)
    q[..., own:] = MISSING_LOGIT
    grid = torch.tensor([[1.0, 0, 0], [0, 1.0, 0], [0, 0, 1.0], [0.5, 0.5, 0]])
    kl, tv, match, gkl = window_divergence_reference(p, q, temperature=temperature, grid=grid)
    for x in (kl, tv, gkl):
        assert torch.isfinite(x).all()
    pm = torch.softmax(p / temperature, -1)[..., own:].sum(-1)          # the missing mass
    assert (tv >= pm[:, None] - 1e-6).all()
    assert (kl > 0).all() and (gkl > 0).all()
    # a grid vector equal to view k: view k's KL, with log q on the missing ids at the float32
    # floor (-103) instead of MISSING_LOGIT's (-1e4 / T): a term common to every view
    assert (gkl[:, :K] <= kl + 1e-3).all()


@pytest.fixture(scope="module")
def reference(pairs):
    """transformers' greedy tokens of each target (float32)."""
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    from realistic import greedy_new_tokens

    out = {}
    for key, (target, _) in pairs.items():
        proc = AutoProcessor.from_pretrained(target, local_files_only=True)
        hf = LlavaForConditionalGeneration.from_pretrained(target, local_files_only=True, dtype=torch.float32)
        for n_img in (0, 1):
            text, imgs = word_prompt(n_img)
            enc = proc(text=text, images=imgs or None, return_tensors="pt")
            out[key, n_img] = greedy_new_tokens(hf.eval(), enc, N_NEW)
    return out


@pytest.mark.parametrize("key", [(180, 176), (176, 184)], ids=["draft-short", "draft-long"])
@pytest.mark.parametrize("spec", [dict(views=("M", "T"), policy="hedge", gamma=4),
                                  dict(views=("M", "T", "P"), policy="w-grid", gamma=3),
                                  dict(views=("M", "T"), policy="hedge", tree=TreeConfig(depth=4, width=3, branch=2))],
                         ids=["chain-hedge", "chain-wgrid", "tree"])
def test_greedy_sd_equals_transformers(pairs, reference, key, spec):
    target, draft = pairs[key]
    eng = Engine.from_pretrained(target, draft, device="cpu", dtype=torch.float32, max_len=512, **spec)
    assert eng.draft.lm.cfg.vocab_size == key[0]
    emitted_padding = False
    for n_img in (0, 1):
        text, imgs = word_prompt(n_img)
        out = eng.generate(text, images=imgs, sampling=SamplingParams(max_new_tokens=N_NEW))
        assert out.token_ids == reference[key, n_img], (n_img, out.token_ids, reference[key, n_img])
        assert sum(out.stats.accepted_lengths) > 0
        emitted_padding |= any(t >= min(key) for t in out.token_ids)
    if key == (180, 176):
        assert emitted_padding          # the target chose an id the draft has no row for


def test_a_tokenizer_differing_in_the_shared_range_is_refused(pairs, tmp_path):
    target, draft = pairs[180, 176]
    bad = str(tmp_path / "draft")
    shutil.copytree(draft, bad)
    with open(os.path.join(bad, "tokenizer.json")) as f:
        tok = json.load(f)
    vocab = tok["model"]["vocab"]
    vocab["w0"], vocab["w1"] = vocab["w1"], vocab["w0"]                 # two ids swapped
    with open(os.path.join(bad, "tokenizer.json"), "w") as f:
        json.dump(tok, f)
    with pytest.raises(ValueError, match=r"tokenizer differs from the target's in the shared token range"):
        Engine.from_pretrained(target, bad, device="cpu", dtype=torch.float32)
    short = repad(draft, str(tmp_path / "short"), TOKENS - 3)            # a real token's row missing
    with pytest.raises(ValueError, match="does not cover the"):
        Engine.from_pretrained(target, short, device="cpu", dtype=torch.float32)


def test_in_memory_pair_needs_the_draft_processor(pairs):
    from tabed_engine.models.loader import load_lvlm, load_processor

    target, draft = pairs[180, 176]
    t, d = load_lvlm(target, "cpu", torch.float32), load_lvlm(draft, "cpu", torch.float32)
    with pytest.raises(ValueError, match="draft_processor="):
        Engine(t, load_processor(target), draft=d, device="cpu", dtype=torch.float32)
    eng = Engine(t, load_processor(target), draft=d, draft_processor=load_processor(draft), device="cpu",
                 dtype=torch.float32)
    assert eng.draft_processor is None and d.lm.cfg.vocab_size == 180   # same layout: the target's pixels


@pytest.fixture(scope="module")
def short_draft_case(pairs, tmp_path_factory):
    """(engine, sampling params, exact distribution) of the sampling test: a draft lacking 4 of
    the target's padding ids (rows of a larger scale: the target's top-k support holds them)."""
    _, draft = pairs[180, 176]
    target = repad(model_dir("mha"), str(tmp_path_factory.mktemp("hot") / "t180"), 180, seed=HOT_SEED,
                   scale=HOT_SCALE)
    sp = dataclasses.replace(SAMPLING, top_k=5)
    ref = Engine.from_pretrained(target, device="cpu", dtype=torch.float32)
    text, imgs = word_prompt(1)
    dist = exact_first_tokens(ref, text, imgs, sp, 3)
    missing = sum(p for seq, p in dist.items() if any(t >= 176 for t in seq))
    assert missing > 0.05, missing      # the test exercises ids the draft cannot propose
    eng = Engine.from_pretrained(target, draft, device="cpu", dtype=torch.float32, views=("M", "T"),
                                 policy="kld", gamma=2, adaptive=False, max_batch=16)
    return eng, sp, dist


SHORT_SAMPLES, SHORT_SHARDS = 6000, 4


@pytest.mark.slow
@pytest.mark.parametrize("shard", range(SHORT_SHARDS))
def test_sampled_sd_is_lossless_with_a_draft_short_of_the_target_vocab(short_draft_case, shard,
                                                                       tmp_path_factory):
    """Sampled SD of a draft lacking 4 of the target's padding ids: the 3-token sequences
    follow the target's exact distribution. SHORT_SAMPLES seeds in SHORT_SHARDS shards
    (xdist spreads them over workers); the shard completing the set checks them all."""
    eng, sp, dist = short_draft_case
    text, imgs = word_prompt(1)
    # 16 requests a generate() call (~2.5x less CPU than one each): seeded requests take the
    # coupling, whose tokens are each seed's alone in any batch (tests/test_coupling.py)
    n, batch, counts, accepted = SHORT_SAMPLES // SHORT_SHARDS, 16, Counter(), 0
    for start in range(shard * n, (shard + 1) * n, batch):
        seeds = range(start, min(start + batch, (shard + 1) * n))
        for out in eng.generate([text] * len(seeds), images=[imgs] * len(seeds),
                                sampling=[dataclasses.replace(sp, seed=i) for i in seeds]):
            counts[tuple(out.token_ids)] += 1
            accepted += sum(out.stats.accepted_lengths)
    assert accepted > n * 0.15
    assert set(counts) <= set(dist)
    check_when_complete(tmp_path_factory, "lossless-short-vocab", shard, SHORT_SHARDS, counts, dist,
                        SHORT_SAMPLES, 0.035)
