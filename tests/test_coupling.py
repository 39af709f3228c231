"""Seeded sampling by the Gumbel coupling (speculation/coupling.py): the hash's noise is Gumbel
and keyed by seed and position; one coupled block (chain or tree, rows of one batch with their
own seeds) emits tokens distributed exactly as the target's, a broken hash is caught; a draft
equal to the target is always accepted under shared noise and not under unshared noise; through
the engine, a seeded request's tokens equal alone, in mixed batches, AR, chain and tree."""
import dataclasses
import math

import pytest
import torch

from tabed_engine import Engine, SamplingParams, TreeConfig
from tabed_engine.speculation import coupling
from tabed_engine.speculation.coupling import gumbel
from tabed_engine.speculation.sampling import RowSampling, draft_filter, pick_tokens, target_probs
from test_tree import CTX, V, TableLM, chi2_ok, exact_three, fake_cache, tables


# ---------------------------------------------------------------------------- the noise
def ks_gumbel(g: torch.Tensor) -> float:
    """Kolmogorov-Smirnov distance of samples g to Gumbel(0, 1) (CDF exp(-exp(-x)))."""
    x = g.double().flatten().sort().values
    n = x.numel()
    cdf = torch.exp(-torch.exp(-x))
    i = torch.arange(1, n + 1, dtype=torch.float64)
    return float(torch.maximum(i / n - cdf, cdf - (i - 1) / n).max())


def test_gumbel_noise_is_gumbel_and_keyed_by_seed_and_position():
    seeds = torch.tensor([0, 1, 2 ** 62, -5])
    pos = torch.tensor([[0, 1, 2], [0, 1, 2], [7, 8, 9], [100000, 3, 4]])
    g = gumbel(seeds[:, None], pos, 4001)                                   # [4, 3, 4001]
    # KS at 48k samples: the 0.1% critical distance is 1.95 / sqrt(n) ~ 0.0089
    assert ks_gumbel(g) < 1.95 / math.sqrt(g.numel())
    # a Gumbel-distributed but wrongly scaled noise fails the same check
    assert ks_gumbel(1.1 * g) > 1.95 / math.sqrt(g.numel())
    # positions and seeds change every token's noise; a pure function of (seed, position, id)
    assert (g[0, 0] != g[0, 1]).float().mean() > 0.999 and (g[0, 0] != g[1, 0]).float().mean() > 0.999
    assert abs(float(torch.corrcoef(torch.stack([g[0, 0], g[0, 1]]))[0, 1])) < 0.06
    assert abs(float(torch.corrcoef(torch.stack([g[0, 0], g[1, 0]]))[0, 1])) < 0.06
    assert torch.equal(gumbel(torch.tensor([1]), torch.tensor([1]), 4001)[0], g[1, 1])
    assert torch.equal(gumbel(torch.tensor(1), torch.tensor(1), 50), g[1, 1, :50])     # prefix of the vocab
    assert torch.isfinite(g).all()


def row_sampling(sps, seeds):
    """RowSampling of requests sps, coupled with their seeds where seeded."""
    return RowSampling(torch.tensor([1.0 if s.greedy else s.temperature for s in sps]),
                       torch.tensor([s.top_k for s in sps]), torch.tensor([s.top_p for s in sps]),
                       torch.tensor([s.greedy for s in sps]), use_top_k=True, use_top_p=True, any_greedy=True,
                       seed=torch.tensor(seeds), coupled=torch.tensor([s.coupled for s in sps]), any_coupled=True)


def test_coupled_picks_follow_each_rows_filtered_distribution():
    """The coupled token over many seeds: each row's own temperature / top-k / top-p
    distribution (the filtered ids never drawn), greedy rows the argmax; the same token through
    a seeded SamplingParams alone as through RowSampling in a batch."""
    g = torch.Generator().manual_seed(0)
    sps = [SamplingParams(temperature=0.7, top_k=3, seed=1), SamplingParams(seed=1),
           SamplingParams(temperature=1.3, top_p=0.6, seed=1), SamplingParams(temperature=1.0, seed=1)]
    logits = torch.randn(len(sps), 9, generator=g) * 2
    n = 20000
    seeds = torch.arange(n)
    for i, sp in enumerate(sps):
        rows = row_sampling([sp] * n, seeds.tolist())
        tok = pick_tokens(logits[i].expand(n, -1), rows, None, torch.full((n,), 5))
        freq = torch.bincount(tok, minlength=9).double() / n
        want = torch.zeros(9, dtype=torch.float64).scatter_(0, logits[i].argmax(0, keepdim=True), 1.0) \
            if sp.greedy else target_probs(logits[i:i + 1], sp)[0].double()
        assert torch.all((freq - want).abs() <= 4.5 * (want * (1 - want) / n).sqrt() + 1e-12), (sp, freq, want)
        alone = [int(pick_tokens(logits[i:i + 1], dataclasses.replace(sp, seed=s), None, torch.tensor([5])))
                 for s in range(20)]
        assert alone == tok[:20].tolist()


# ---------------------------------------------------------------------------- one coupled block
def coupled_block(kind, draft_tables, target_table, w, temperature, n, *, position_blind=False,
                  draft_seed_shift=0, monkeypatch=None, top_k=0, top_p=1.0, filter_draft=True):
    """n requests with seeds 0..n-1 (rows of one batch) each run one coupled block from CTX (a
    chain of 2 or a tree `kind`) and are completed to three tokens by coupled AR steps of the
    target. position_blind: a hash that ignores the position (broken); draft_seed_shift: the
    draft's noise under other seeds than the target's (broken). top_k / top_p: the requests'
    filters, which the draft applies to its proposals unless filter_draft is False (the draft
    before it knew them). Returns (sequences, mean accepted drafts)."""
    from tabed_engine.speculation.chain import draft_block, verify_block
    from tabed_engine.speculation.tree import parse_tree, tree_draft, tree_verify

    if position_blind:
        real = coupling.gumbel
        monkeypatch.setattr(coupling, "gumbel", lambda seed, pos, V: real(seed, pos * 0, V))
    K = draft_tables.shape[0]
    draft, target = TableLM(draft_tables), TableLM(target_table[None])
    sp = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=0)
    rs = row_sampling([sp] * n, list(range(n)))
    inp2 = torch.tensor([CTX] * (n * K))
    lens = torch.zeros(n * K, dtype=torch.long)
    wt = torch.tensor([w] * n)
    tlens = torch.ones(n, dtype=torch.int32)             # the root (CTX[1]) sits at slot / position 1
    noise = dict(row_seed=rs.seed + draft_seed_shift, coupled=rs.coupled, tlens=tlens,
                 **(draft_filter(rs) if filter_draft else {}))
    unused = dict(seed=torch.tensor([123]), offset=torch.tensor([0]))   # the rejection path's noise
    if kind == "chain":
        gamma = 2
        dcache, tcache = fake_cache(n * K, gamma + 4), fake_cache(n, gamma + 4)
        drafted, _, mixtures, _ = draft_block(draft, dcache, inp2, lens, wt, **unused, **noise, B=n, K=K,
                                              gamma=gamma, greedy=False, temperature=temperature, confidence=False)
        tcache.k[0, :, 0, 0] = torch.tensor([float(CTX[0]), 0.0])
        vin = torch.cat([torch.full((n, 1), CTX[1]), drafted], 1)
        _, n_acc, nxt, packed, _ = verify_block(target, tcache, vin, tlens, mixtures, torch.rand(n, gamma + 1),
                                                sp=rs)
    else:
        cfg = parse_tree(kind)
        dcache, tcache = fake_cache(n * K, cfg.draft_rows + 4), fake_cache(n, cfg.nodes + 4)
        tokens, parents, node_q, _, fedpos = tree_draft(draft, dcache, inp2, lens, wt, **unused, **noise, B=n, K=K,
                                                        cfg=cfg, greedy=False, temperature=temperature,
                                                        confidence=False)
        tcache.k[0, :, 0, 0] = torch.tensor([float(CTX[0]), 0.0])
        _, _, n_acc, nxt, packed = tree_verify(target, tcache, dcache, tokens, parents, tlens, lens, fedpos, node_q,
                                               torch.rand(n, cfg.nodes + 1), sp=rs, K=K,
                                               node_depth=torch.tensor(cfg.node_depths()), depth=cfg.depth,
                                               probs_fn=lambda x: target_probs(x, rs))
    seqs = [[int(t) for t in packed[r, 2:2 + int(n_acc[r])]] + [int(nxt[r])] for r in range(n)]
    # complete every row to three tokens by the target's coupled AR picks (position 2 + i)
    for i in range(1, 3):
        todo = [r for r in range(n) if len(seqs[r]) == i]
        if todo:
            ctx = torch.tensor([([CTX[0], CTX[1]] + seqs[r])[-2:] for r in todo])
            logits = target_table[ctx[:, 0], ctx[:, 1]]
            sub = row_sampling([sp] * len(todo), todo)
            for r, t in zip(todo, pick_tokens(logits, sub, None, torch.full((len(todo),), 2 + i)).tolist()):
                seqs[r].append(t)
    return [tuple(s[:3]) for s in seqs], float(n_acc.double().mean())


@pytest.mark.parametrize("kind", ["chain", "3x2x2"])
def test_coupled_block_is_lossless(kind, monkeypatch):
    """16000 coupled generations through a K = 2 ensemble (a chain of 2, a 3x2x2 tree): the first
    three tokens follow the target's exact distribution and drafts are accepted; the same
    statistic rejects a hash that ignores the position (every position's draw shares one noise)."""
    views, target = tables(11)
    dist = exact_three(target, 0.8)
    seqs, acc = coupled_block(kind, views, target, (0.6, 0.4), 0.8, 16000)
    ok, stat = chi2_ok(seqs, dist)
    assert ok, stat
    assert acc > 0.3
    bad, _ = coupled_block(kind, views, target, (0.6, 0.4), 0.8, 16000, position_blind=True, monkeypatch=monkeypatch)
    ok_bad, stat_bad = chi2_ok(bad, dist)
    assert not ok_bad, stat_bad


@pytest.mark.parametrize("kind", ["chain", "3x2x2"])
def test_draft_equal_to_target_is_always_accepted_under_shared_noise(kind):
    """A draft equal to the target (one view) proposes the target's own coupled token: every
    drafted token is accepted. Under noise of other seeds (not shared) it is not, and the tokens
    are still the target's (the verification decides them)."""
    _, target = tables(11)
    one = target[None]
    seqs, acc = coupled_block(kind, one, target, (1.0,), 0.8, 400)
    depth = 2 if kind == "chain" else 3
    assert acc == depth
    unshared, acc_bad = coupled_block(kind, one, target, (1.0,), 0.8, 400, draft_seed_shift=1000)
    assert acc_bad < 0.8 * depth
    assert unshared == seqs


@pytest.mark.parametrize("kind", ["chain", "3x2x2"])
@pytest.mark.parametrize("filt", [dict(top_k=2), dict(top_p=0.6), dict(top_k=3, top_p=0.7)])
def test_draft_equal_to_target_is_always_accepted_with_top_k_and_top_p(kind, filt):
    """With the request's top-k / top-p (V = 5), a draft equal to the target still proposes the
    target's coupled token every time: it applies the same filter to its proposals. A draft
    that ignores the filter proposes tokens the target removed and loses accepted drafts (so
    the setting tests the filter), and the tokens are the target's either way."""
    _, target = tables(11)
    one = target[None]
    seqs, acc = coupled_block(kind, one, target, (1.0,), 0.8, 400, **filt)
    depth = 2 if kind == "chain" else 3
    assert acc == depth
    blind, acc_blind = coupled_block(kind, one, target, (1.0,), 0.8, 400, filter_draft=False, **filt)
    assert acc_blind < depth - 0.1        # measured: chain 1.28-1.55 of 2, tree 2.59-2.83 of 3
    assert blind == seqs
    # every row's first token is one the target's filter keeps
    rs = row_sampling([SamplingParams(temperature=0.8, seed=0, **filt)], [0])
    kept = target_probs(target[CTX[0], CTX[1]][None], rs)[0] > 0
    assert all(kept[s[0]] for s in seqs) and not kept.all()


def test_coupled_proposals_rank_kept_tokens_first_then_the_best_of_the_rest():
    """With a keep mask, the proposals are the kept tokens by log q + G, then the filtered ones
    by the same score (not arbitrary ids), whatever the mask's size against k."""
    g = torch.Generator().manual_seed(2)
    q = torch.softmax(3 * torch.randn(6, 50, generator=g), -1)
    keep = torch.rand(6, 50, generator=g) < 0.1
    keep[:, 0] = True                                             # at least one kept token a row
    seed, pos = torch.arange(6), torch.full((6,), 9)
    ids, _ = coupling.coupled_proposals(q, seed, pos, 8, keep)
    score = torch.log(q) + gumbel(seed, pos, 50)
    for r in range(6):
        kept = [int(i) for i in score[r].argsort(descending=True) if keep[r, i]]
        rest = [int(i) for i in score[r].argsort(descending=True) if not keep[r, i]]
        assert ids[r].tolist() == (kept + rest)[:8]


# ---------------------------------------------------------------------------- through the engine
@pytest.fixture(scope="module")
def engine():
    from models import model_dir
    return Engine.from_pretrained(model_dir("mha"), model_dir("mha", perturb=0.25), device="cpu",
                                  dtype=torch.float32, views=("M", "T"), policy="kld", gamma=3, max_batch=4)


# filters that change this fixture's tokens yet leave its perturbed draft drafts to accept: the
# tiny model's distributions are flat (top-p 0.95 and top-k 120 gave the same tokens at T = 1),
# and under top-k 40 the target's kept set and the draft's own top 40 overlap too little for
# the coupled argmaxes to meet (0 of 13 blocks accepted a draft, with or without the filter)
@pytest.mark.parametrize("filt", [dict(), dict(top_k=120), dict(top_p=0.95)], ids=["plain", "top_k", "top_p"])
def test_seeded_request_is_the_same_alone_batched_ar_chain_and_tree(engine, filt):
    """A seeded sampled request (plain, top-k or top-p, which its draft applies too) gives the
    same tokens: AR alone, a chain alone, a tree alone, in a batch of 4 with seeded (top-p) /
    unseeded, greedy / sampled others (AR and chains), and in two identical batches; drafts are
    accepted; another seed gives other tokens."""
    from test_speculative import word_prompt

    text, imgs = word_prompt(1)
    other, o_imgs = word_prompt(2)
    sp = SamplingParams(max_new_tokens=14, temperature=0.9, seed=7, stop_at_eos=False, **filt)
    engine.configure(tree=None)
    ar = engine.generate(text, images=imgs, sampling=sp, speculative=False).token_ids
    chain = engine.generate(text, images=imgs, sampling=sp)
    assert chain.token_ids == ar and sum(chain.stats.accepted_lengths) > 0
    mates = [SamplingParams(max_new_tokens=10, temperature=1.0, stop_at_eos=False),
             SamplingParams(max_new_tokens=16, stop_at_eos=False),
             SamplingParams(max_new_tokens=12, temperature=0.6, top_p=0.8, seed=3, stop_at_eos=False)]
    prompts, images = [other, text, other, text], [o_imgs, imgs, o_imgs, imgs]
    mate_alone = engine.generate(text, images=imgs, sampling=mates[2]).token_ids
    sps = [mates[0], sp, mates[1], mates[2]]
    for speculative in (False, True):
        first = engine.generate(prompts, images=images, sampling=sps, speculative=speculative)
        second = engine.generate(prompts, images=images, sampling=sps, speculative=speculative)
        assert first[1].token_ids == second[1].token_ids == ar, speculative
        assert first[3].token_ids == second[3].token_ids == mate_alone   # the other seeded request too
    try:
        engine.configure(tree=TreeConfig(3, 2, 2))
        tree = engine.generate(text, images=imgs, sampling=sp)
        assert tree.token_ids == ar and sum(tree.stats.accepted_lengths) > 0
        batched = engine.generate(prompts, images=images, sampling=sps)
        assert batched[1].token_ids == ar
    finally:
        engine.configure(tree=None)
    assert engine.generate(text, images=imgs, sampling=dataclasses.replace(sp, seed=8),
                           speculative=False).token_ids != ar


@pytest.mark.parametrize("tree", [None, TreeConfig(3, 2, 2)])
def test_draft_equal_to_target_accepts_every_draft_with_top_k_and_top_p(tree):
    """Through the engine, a draft equal to the target (view M) under the coupling accepts every
    drafted token of seeded requests with top-k 40 or top-p 0.8 (of 173 tokens), alone and as two
    rows of one batch with different filters (each row's own), chains and trees, and the tokens
    are AR's. A draft blind to the filters accepted 0-2 of 3 in most blocks here."""
    from models import model_dir
    from test_speculative import word_prompt

    eng = Engine.from_pretrained(model_dir("mha"), model_dir("mha"), device="cpu", dtype=torch.float32,
                                 views=("M",), gamma=3, max_batch=2, tree=tree)
    text, imgs = word_prompt(1)
    other, o_imgs = word_prompt(2)
    sps = [SamplingParams(max_new_tokens=16, temperature=1.0, seed=5, stop_at_eos=False, top_k=40),
           SamplingParams(max_new_tokens=16, temperature=1.0, seed=6, stop_at_eos=False, top_p=0.8)]
    ar = [eng.generate(p, images=im, sampling=sp, speculative=False).token_ids
          for p, im, sp in zip((text, other), (imgs, o_imgs), sps)]
    alone = [eng.generate(p, images=im, sampling=sp) for p, im, sp in zip((text, other), (imgs, o_imgs), sps)]
    batched = eng.generate([text, other], images=[imgs, o_imgs], sampling=sps)
    depth = 3 if tree is None else tree.depth
    for out, want in zip(alone + batched, ar + ar):
        full = out.stats.accepted_lengths[:-1]                     # the last block may be cut
        assert out.token_ids == want
        assert full and all(a == depth for a in full), out.stats.accepted_lengths


def test_reproducible_false_keeps_rejection_sampling(engine):
    """reproducible=False: a seeded request samples by rejection sampling (not the coupling's
    tokens), still reproducible alone; bad values are refused."""
    from test_speculative import word_prompt

    text, imgs = word_prompt(1)
    sp = SamplingParams(max_new_tokens=14, temperature=0.9, seed=7, stop_at_eos=False)
    coupled = engine.generate(text, images=imgs, sampling=sp, speculative=False).token_ids
    rej = dataclasses.replace(sp, reproducible=False)
    assert not rej.coupled and sp.coupled
    once = engine.generate(text, images=imgs, sampling=rej, speculative=False).token_ids
    assert once == engine.generate(text, images=imgs, sampling=rej, speculative=False).token_ids
    assert once != coupled
    with pytest.raises(TypeError, match="reproducible"):
        SamplingParams(reproducible=1)
