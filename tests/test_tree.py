"""Dynamic draft trees: configuration, the draft's tree mask, greedy equality with AR through
the engine, and lossless sampling of one tree block against an exactly enumerable target."""
import itertools
import math
from types import SimpleNamespace

import pytest
import torch

import realistic
from models import model_dir
from tabed_engine import Engine, SamplingParams, TreeConfig
from tabed_engine.models.config import LMConfig
from tabed_engine.speculation.ensemble import POLICIES
from tabed_engine.models.decoder import KVCache, LlamaLM, bits_to_mask, mask_to_bits
from tabed_engine.models.tiny import random_image, words
from tabed_engine.ops.mix_topk import hash_uniform
from tabed_engine.speculation.tree import parse_tree, tree_bits_of, tree_draft, tree_verify

VOCAB = 173


# ---------------------------------------------------------------------------- config
def test_tree_config_shapes_and_parsing():
    cfg = TreeConfig(depth=5, width=4, branch=2)
    assert cfg.nodes == 1 + 4 + 4 * 4 * 2 == len(cfg.node_depths())
    assert cfg.node_depths()[:6] == [0, 1, 1, 1, 1, 2] and cfg.node_depths()[-1] == 5
    assert cfg.fed == 1 + 4 * 4
    assert parse_tree("3x2x2") == TreeConfig(3, 2, 2)
    assert parse_tree(True) == TreeConfig() and parse_tree(None) is None
    assert parse_tree({"depth": 2}) == TreeConfig(depth=2)
    with pytest.raises(ValueError, match="at most 64"):
        TreeConfig(depth=9, width=4, branch=2)
    for bad in (dict(depth=0), dict(width=2.5), dict(branch=True)):
        with pytest.raises(ValueError, match="positive int"):
            TreeConfig(**bad)
    with pytest.raises(ValueError, match="DEPTHxWIDTHxBRANCH"):
        parse_tree("deep")
    with pytest.raises(TypeError):
        parse_tree(3.5)


def test_hash_uniform_is_uniform_and_counter_based():
    seed, off = torch.tensor([12345]), torch.tensor([7])
    u = hash_uniform(seed, off, 200000)
    assert float(u.min()) > 0 and float(u.max()) < 1
    assert abs(float(u.mean()) - 0.5) < 0.005 and abs(float(u.var()) - 1 / 12) < 0.002
    # counter-based: a later offset gives the same numbers shifted; another seed others
    assert torch.equal(hash_uniform(seed, off + 5, 10), u[5:15])
    assert not torch.equal(hash_uniform(seed + 1, off, 10), u[:10])


@pytest.mark.parametrize("N,chain", [(23, False), (64, False), (64, True), (9, True), (1, False)])
def test_tree_bits_of_is_ancestor_or_self(N, chain):
    # random trees and a path (the deepest tree of N nodes), bit 63 included; `depth` is the
    # longest path's edge count, as the tree configs give it
    g = torch.Generator().manual_seed(N)
    B = 3
    parents = torch.full((B, N), -1, dtype=torch.long)
    for b in range(B):
        for i in range(1, N):
            parents[b, i] = i - 1 if chain else int(torch.randint(0, i, (1,), generator=g))
    depth = 0
    want = torch.zeros(B, N, N, dtype=torch.bool)
    for b in range(B):
        for i in range(N):
            j, d = i, 0
            while j >= 0:
                want[b, i, j] = True
                j = int(parents[b, j]) if j else -1
                d += 1
            depth = max(depth, d - 1)
    bits = tree_bits_of(parents, depth)
    assert bits.dtype == torch.int64 and torch.equal(bits_to_mask(bits), want)
    if depth > 1:   # one round short of the depth misses an ancestor
        assert not torch.equal(bits_to_mask(tree_bits_of(parents, (depth + 1) // 2 - 1)), want)


def test_bits_mask_round_trip():
    """The draft's packed tree rows and the dense mask convert both ways, bit 63 included."""
    g = torch.Generator().manual_seed(1)
    for T in (1, 5, 63, 64):
        mask = torch.rand(3, T, T, generator=g) < 0.4
        bits = mask_to_bits(mask)
        assert torch.equal(bits_to_mask(bits), mask)
        assert torch.equal(mask_to_bits(bits_to_mask(bits)), bits)
    assert int(mask_to_bits(torch.ones(1, 1, 64, dtype=torch.bool))[0, 0]) == -1


def _tiny_draft(K, seed=0):
    cfg = LMConfig(vocab_size=211, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                   head_dim=8)
    torch.manual_seed(seed)
    lm = LlamaLM(cfg)
    for p in lm.parameters():
        torch.nn.init.normal_(p, std=0.3)      # peaked distributions: well-separated top tokens
    return lm


def _draft_both(lm, cfg, B, K, device, greedy=True, confidence=False, temperature=0.8, seed=3):
    """tree_draft with the kernels (`_kernels=True`) and with the references, on the same inputs
    and copies of one random cache: both outputs and both caches."""
    g = torch.Generator().manual_seed(seed)
    V = lm.cfg.vocab_size
    cache = KVCache(lm.cfg, B * K, 128, device, torch.float32)
    cache.k.copy_(torch.randn(cache.k.shape, generator=g))
    cache.v.copy_(torch.randn(cache.v.shape, generator=g))
    lens = torch.randint(5, 30, (B * K,), generator=g).to(device)
    inp2 = torch.randint(0, V, (B * K, 2), generator=g).to(device)
    w = torch.rand(B, K, generator=g).to(device)
    w = w / w.sum(1, keepdim=True)
    out = []
    for kernels in (True, False):
        c = KVCache(lm.cfg, B * K, 128, device, torch.float32)
        c.k.copy_(cache.k)
        c.v.copy_(cache.v)
        with torch.inference_mode():
            res = tree_draft(lm, c, inp2, lens, w, torch.tensor([7], device=device), torch.tensor([11], device=device),
                             B=B, K=K, cfg=cfg, greedy=greedy, temperature=temperature, confidence=confidence,
                             _kernels=kernels)
        out.append((res, c))
    return out


@pytest.mark.parametrize("shape, K, greedy, confidence", [
    ("3x2x2", 1, True, False), ("3x2x2", 2, True, False), ("5x3x2", 1, True, False), ("5x3x2", 2, True, False),
    ("4x1x3", 2, True, False), ("4x1x3", 1, True, False), ("3x3x2", 2, False, False), ("3x2x2", 3, True, True),
    ("2x10x2", 1, True, False),     # the root's 10 children: more than the kernel takes, the reference's top k
])
def test_tree_draft_kernels_match_reference(shape, K, greedy, confidence):
    """The draft's kernel path (mix_topk and tree_grow per depth, run by the Triton interpreter
    here) builds the reference's tree: the same tokens (sampling: the same draws), parents, fed
    positions, fed logits and draft cache; node_q empty when greedy (the reference's too), else
    the same mixtures up to rounding."""
    lm = _tiny_draft(K)
    (fast, fast_cache), (ref, ref_cache) = _draft_both(lm, parse_tree(shape), 2, K, "cpu", greedy, confidence)
    for name, a, b in zip(("tokens", "parents", "node_q", "fed_logits", "fedpos"), fast, ref):
        if name == "node_q":        # the kernel sums the mixture in its own order
            torch.testing.assert_close(a, b, atol=1e-7, rtol=1e-5)
        else:
            assert torch.equal(a, b), name
    assert torch.equal(fast_cache.k, ref_cache.k) and torch.equal(fast_cache.v, ref_cache.v)
    node_q = fast[2]
    assert node_q.numel() == 0 if greedy else bool((node_q.sum(-1)[fast[4] >= 0] - 1).abs().max() < 1e-5)
    # a real tree: every non-root node hangs below an earlier one, siblings are distinct tokens
    tokens, parents = fast[0], fast[1]
    assert bool((parents[:, 1:] < torch.arange(1, tokens.shape[1])).all())
    for b in range(tokens.shape[0]):
        pairs = list(zip(parents[b, 1:].tolist(), tokens[b, 1:].tolist()))
        assert len(set(pairs)) == len(pairs)


# ---------------------------------------------------------------------------- greedy == AR
def prompt(n_images):
    """Tiny word-level checkpoints (GPU and CLI tests)."""
    return "".join(f"<image>\n{words(i, 2, VOCAB)} " for i in range(n_images)) + words(7, 6, VOCAB), \
        [random_image(100 + i) for i in range(n_images)]


@pytest.fixture(scope="module")
def engine():
    # the Llama-2-style fixture (SentencePiece, llava-hf processor files) with its close draft:
    # the trees accept several tokens per block
    target, draft = realistic.checkpoint("llama")
    return Engine.from_pretrained(target, draft, device="cpu", dtype=torch.float32, tree=TreeConfig(5, 4, 2))


@pytest.fixture(scope="module")
def ar_reference(engine):
    out = {}
    for n in (1, 2):
        text, imgs = realistic.prompt(n)
        out[n] = engine.generate(text, images=imgs, sampling=SamplingParams(max_new_tokens=24),
                                 speculative=False).token_ids
    return out


def configure(engine, views, policy, tree):
    engine.configure(views=views, policy=policy, tree=tree)


@pytest.mark.parametrize("views,policy,tree", list(itertools.product(
    [("M",), ("M", "T"), ("M", "T", "P", "C")], POLICIES, ["5x4x2", "3x2x3", "4x1x1"])))
def test_greedy_tree_equals_ar(engine, ar_reference, views, policy, tree):
    configure(engine, views, policy, tree)
    cfg = engine.tree
    for n in (1, 2):
        text, imgs = realistic.prompt(n)
        out = engine.generate(text, images=imgs, sampling=SamplingParams(max_new_tokens=24),
                              caption=["a red car on the street", "two people near 3 trees"][:n])
        assert out.token_ids == ar_reference[n]
        s = out.stats
        assert len(s.accepted_lengths) == s.target_forwards
        assert all(0 <= a <= cfg.depth for a in s.accepted_lengths)
        assert all(abs(sum(w) - 1) < 1e-3 and len(w) == len(views) for w in s.weights)


def test_default_tree_equals_ar(engine, ar_reference):
    # TreeConfig() / tree=True: the default shape, deeper than the others here
    configure(engine, ("M", "T"), "hedge", True)
    assert engine.tree == TreeConfig() and engine.tree.depth == 10
    text, imgs = realistic.prompt(1)
    out = engine.generate(text, images=imgs, sampling=SamplingParams(max_new_tokens=24))
    assert out.token_ids == ar_reference[1]
    assert max(out.stats.accepted_lengths) > 5      # deeper than a 5-chain could accept


def test_batched_trees_equal_ar(engine, ar_reference):
    """Requests as rows of one batch (one and two images, captions of their own), each decoded by
    trees with the views' own prompts: every request's tokens equal its AR decoding alone."""
    configure(engine, ("M", "T", "C"), "hedge", "4x3x2")
    prompts = [realistic.prompt(n) for n in (1, 2, 1)]
    sp = SamplingParams(max_new_tokens=24)
    outs = engine.generate([t for t, _ in prompts], images=[i for _, i in prompts], sampling=sp,
                           captions=[["a red car on the street"], ["two people", "near 3 trees"], ["a car"]])
    assert [o.token_ids for o in outs] == [ar_reference[1], ar_reference[2], ar_reference[1]]
    assert all(max(o.stats.accepted_lengths) > 0 for o in outs)


def test_trees_accept_more_than_chains(engine):
    """With the close draft, a 5-deep tree accepts more tokens per block than a 5-token chain
    of the same mixture (the tree holds the chain's path among its branches)."""
    text, imgs = realistic.prompt(1)
    sp = SamplingParams(max_new_tokens=48, stop_at_eos=False)
    configure(engine, ("M", "T"), "hedge", None)
    engine.configure(gamma=5)
    chain = engine.generate(text, images=imgs, sampling=sp).stats.block_efficiency
    configure(engine, ("M", "T"), "hedge", "5x4x2")
    tree = engine.generate(text, images=imgs, sampling=sp).stats.block_efficiency
    assert tree > chain > 1.0, (tree, chain)


# ---------------------------------------------------------------------------- lossless sampling
V, CTX = 5, (3, 1)


class TableLM:
    """A trigram language model behind the decoder's interface: the next-token logits of a
    node depend on its own token and its parent's (the visible slot one position earlier),
    from tables[view] [V, V, V] where row r is view r % K. The "KV cache" holds each slot's
    token and position, so the tree mask, the slots and `compact_kv` are exercised for real."""

    def __init__(self, tables):
        self.tables = tables                       # [K, V, V, V]
        self.cfg = SimpleNamespace(vocab_size=tables.shape[-1])

    def __call__(self, cache, pos, *, input_ids, lengths, tree_mask=None, tree_bits=None, kv_len=None,
                 float_logits=True, logits_index=None, tree_offset=0):
        R, T = input_ids.shape
        n = tree_offset + T                                                     # tree slots
        if tree_bits is not None:
            tree_mask = bits_to_mask(tree_bits, n)
        S = cache.k.shape[3]
        rows = torch.arange(R)[:, None]
        slots = lengths.long()[:, None] + tree_offset + torch.arange(T)
        cache.k[0, rows, 0, slots, 0] = input_ids.float()
        cache.k[0, rows, 0, slots, 1] = pos.float()
        tok_s, pos_s = cache.k[0, :, 0, :, 0], cache.k[0, :, 0, :, 1]           # [R, S]
        rel = torch.arange(S)[None] - lengths.long()[:, None]                   # [R, S]
        mask = tree_mask if tree_mask is not None else torch.ones(R, T, T, dtype=torch.bool).tril()
        own = torch.gather(mask, 2, rel.clamp(0, n - 1)[:, None].expand(R, T, S)) & (rel >= 0)[:, None] \
            & (rel < n)[:, None]
        visible = (rel < 0)[:, None] | own                                      # [R, T, S]
        before = visible & (pos_s[:, None] == pos[:, :, None].float() - 1)
        assert bool((before.sum(-1) <= 1).all()), "a node sees one slot one position before it at most"
        prev = (tok_s[:, None] * before).sum(-1).long()                          # [R, T]
        view = (torch.arange(R) % self.tables.shape[0])[:, None].expand(R, T)
        return self.tables[view, prev, input_ids]


def fake_cache(rows, slots):
    """A paged cache of one page of `slots` slots per row (page r is row r's), for `TableLM`."""
    return SimpleNamespace(k=torch.zeros(1, rows, 1, slots, 2), v=torch.zeros(1, rows, 1, slots, 2),
                           block_table=torch.arange(rows, dtype=torch.int32)[:, None])


def exact_three(target_table, temperature):
    """P(x1, x2, x3 | CTX) of the target trigram at `temperature`."""
    p = torch.softmax(target_table.double() / temperature, -1)
    out = {}
    for x1, x2, x3 in itertools.product(range(V), repeat=3):
        out[(x1, x2, x3)] = float(p[CTX[0], CTX[1], x1] * p[CTX[1], x1, x2] * p[x1, x2, x3])
    return out


def one_tree_block(cfg, draft_tables, target_table, w, temperature, n, seed, verify_weights=None, twice=False):
    """n requests (rows of one batch) each run one tree block from CTX and are completed to three
    tokens by sampling the target itself (exact). verify_weights: verify against a mixture with
    other weights than the one the children were drawn from (a broken variant)."""
    g = torch.Generator().manual_seed(seed)
    K = draft_tables.shape[0]
    draft, target = TableLM(draft_tables), TableLM(target_table[None])
    sp = SamplingParams(temperature=temperature)
    dcache, tcache = fake_cache(n * K, cfg.draft_rows + 4), fake_cache(n, cfg.nodes + 4)
    inp2 = torch.tensor([CTX] * (n * K))
    lens = torch.zeros(n * K, dtype=torch.long)
    wt = torch.tensor([w] * n)
    tokens, parents, node_q, fed_logits, fedpos = tree_draft(
        draft, dcache, inp2, lens, wt, torch.tensor([seed]), torch.tensor([0]), B=n, K=K, cfg=cfg, greedy=False,
        temperature=temperature, confidence=False)
    if verify_weights is not None:
        from tabed_engine.ops.mix_topk import mix_views

        at = fedpos.clamp_min(0).repeat_interleave(K, 0)                      # [n*K, N]
        logits = fed_logits.gather(1, at[:, :, None].expand(-1, -1, V))
        node_q = torch.where(fedpos[..., None] >= 0, mix_views(logits, torch.tensor([verify_weights] * n),
                                                                temperature), node_q)
    # the target: CTX[0] at slot 0, the root (CTX[1]) at slot 1
    tcache.k[0, :, 0, 0] = torch.tensor([float(CTX[0]), 0.0])
    tlens = torch.ones(n, dtype=torch.int32)
    uniforms = torch.rand(n, cfg.nodes + 1, generator=g)
    from tabed_engine.speculation.sampling import target_probs

    def verify():
        return tree_verify(target, tcache, dcache, tokens, parents, tlens, lens, fedpos, node_q, uniforms, sp=sp,
                           K=K, node_depth=torch.tensor(cfg.node_depths()), depth=cfg.depth,
                           probs_fn=lambda x: target_probs(x, sp))

    _, path, n_acc, nxt, packed = verify()
    if twice:   # a captured graph's warm-up runs the verification once more: same caches, same result
        caches = dcache.k.clone(), tcache.k.clone()
        again = verify()
        assert torch.equal(again[1], path) and torch.equal(again[4], packed)
        assert torch.equal(dcache.k, caches[0]) and torch.equal(tcache.k, caches[1])
    # the draft rows hold the accepted path after the root (slot 1) at slots 2 .. n (the last
    # accepted node may be a leaf the next block feeds), every view row alike
    for r in range(n):
        a = int(n_acc[r])
        for k in range(K):
            held = dcache.k[0, r * K + k, 0, 2:1 + a, 0].long().tolist()
            assert held == packed[r, 2:1 + a].tolist()
    p = torch.softmax(target_table.double() / temperature, -1)
    seqs, accepted = [], 0
    for r in range(n):
        a = int(n_acc[r])
        accepted += a
        s = [int(t) for t in packed[r, 2:2 + a]] + [int(nxt[r])]
        while len(s) < 3:
            ctx = ([CTX[0], CTX[1]] + s)[-2:]
            s.append(int(torch.multinomial(p[ctx[0], ctx[1]].float(), 1, generator=g)))
        seqs.append(tuple(s[:3]))
    return seqs, accepted / n


def chi2_ok(seqs, dist):
    """Chi-square of the sequence counts against dist (cells with >= 5 expected), and the
    largest standardized deviation of one cell."""
    n = len(seqs)
    counts = {}
    for s in seqs:
        counts[s] = counts.get(s, 0) + 1
    chi2 = sum((counts.get(s, 0) - n * q) ** 2 / (n * q) for s, q in dist.items() if n * q >= 5)
    dof = sum(1 for q in dist.values() if n * q >= 5) - 1
    worst = max(abs(counts.get(s, 0) / n - q) / math.sqrt(max(q * (1 - q), 1e-4) / n) for s, q in dist.items())
    # Wilson-Hilferty: chi2 > dof + 4.5 sqrt(2 dof) has probability < 1e-4 under the null
    return chi2 < dof + 4.5 * math.sqrt(2 * dof) and worst < 4.5, (chi2, dof, worst)


def tables(seed):
    g = torch.Generator().manual_seed(seed)
    target = 1.5 * torch.randn(V, V, V, generator=g)
    # two views: each the target plus its own noise, so each matches it in places
    views = torch.stack([target + 1.2 * torch.randn(V, V, V, generator=g) for _ in range(2)])
    return views, target


@pytest.mark.parametrize("shape", ["3x2x2", "2x4x1", "3x3x2", "1x1x1"])
def test_tree_sampling_is_lossless(shape):
    """16000 one-block generations through a K = 2 ensemble tree: the first three tokens follow
    the target's exact distribution; verifying against a mixture with other weights than the
    children were drawn from (q of a different view) is rejected by the same statistic."""
    cfg = parse_tree(shape)
    views, target = tables(11)
    dist = exact_three(target, 0.8)
    seqs, acc = one_tree_block(cfg, views, target, (0.6, 0.4), 0.8, 16000, seed=5, twice=True)
    ok, stat = chi2_ok(seqs, dist)
    assert ok, stat
    assert acc > 0.3 * min(cfg.depth, 2)          # the tree's drafts really were accepted
    bad, acc_bad = one_tree_block(cfg, views, target, (0.6, 0.4), 0.8, 16000, seed=6, verify_weights=(1.0, 0.0))
    ok_bad, stat_bad = chi2_ok(bad, dist)
    assert not ok_bad, stat_bad


# ---------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("views,policy", [(("M",), "uniform"), (("M", "T"), "hedge"), (("M", "T", "P"), "w-grid"),
                                          (("M", "T"), "confidence")])
@pytest.mark.parametrize("tree", ["5x4x2", "3x2x3"])
def test_graph_tree_equals_ar_fp32(views, policy, tree):
    """CUDA graphs (tree draft, tree verification with compaction, history), float32: the
    tree's tokens are the target's greedy tokens and the one-block CPU result's."""
    eng = Engine.from_pretrained(model_dir("mha"), model_dir("mha", perturb=0.25), device="cuda",
                                 dtype=torch.float32, views=views, policy=policy, tree=tree, adaptive=False)
    for n in (1, 2):
        text, imgs = prompt(n)
        sp = SamplingParams(max_new_tokens=40, stop_at_eos=False)
        ar = eng.generate(text, images=imgs, sampling=sp, speculative=False).token_ids
        sd = eng.generate(text, images=imgs, sampling=sp)
        assert sd.token_ids == ar
        assert sd.stats.target_forwards < len(ar) - 1
        assert eng.graphs is not None and len(eng.graphs) >= 3


@pytest.mark.gpu
@pytest.mark.parametrize("shape, K, greedy", [("5x3x2", 2, True), ("4x1x3", 1, True), ("3x2x2", 2, False),
                                             ("2x10x2", 2, True)])   # 10 root children: the reference's top k
def test_graph_tree_draft_kernels_match_reference_gpu(shape, K, greedy):
    """On the GPU, the draft with its kernels replayed as a CUDA graph builds the same tree as
    the PyTorch references run eagerly (float32, a vocabulary of several mix_topk chunks;
    sampling: the same draws)."""
    from graphs import replayed

    cfg = parse_tree(shape)
    lmcfg = LMConfig(vocab_size=5003, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                     num_kv_heads=2, head_dim=16)
    torch.manual_seed(0)
    lm = LlamaLM(lmcfg).cuda()
    for p in lm.parameters():
        torch.nn.init.normal_(p, std=0.3)
    B, dev = 2, torch.device("cuda")
    g = torch.Generator().manual_seed(5)
    lens = torch.randint(5, 30, (B * K,), generator=g).to(dev)
    inp2 = torch.randint(0, lmcfg.vocab_size, (B * K, 2), generator=g).to(dev)
    w = torch.rand(B, K, generator=g).to(dev)
    w = w / w.sum(1, keepdim=True)
    seed, offset = torch.tensor([7], device=dev), torch.tensor([11], device=dev)
    start = torch.randn(2, *KVCache(lmcfg, B * K, 128, "cpu", torch.float32).k.shape, generator=g).to(dev)
    out = {}
    for kernels in (True, False):
        cache = KVCache(lmcfg, B * K, 128, dev, torch.float32)
        cache.k.copy_(start[0])
        cache.v.copy_(start[1])

        def run():
            return tree_draft(lm, cache, inp2, lens, w, seed, offset, B=B, K=K, cfg=cfg, greedy=greedy,
                              temperature=0.8, confidence=False, kv_len=128, _kernels=kernels)

        with torch.inference_mode():
            res = run()                              # compiles outside the capture
            out[kernels] = replayed(run) if kernels else res
    for name, a, b in zip(("tokens", "parents", "node_q", "fed_logits", "fedpos"), out[True], out[False]):
        if name == "node_q":
            torch.testing.assert_close(a, b, atol=1e-7, rtol=1e-4)
        else:
            assert torch.equal(a, b), name


@pytest.mark.gpu
@pytest.mark.parametrize("views,policy", [(("M",), "uniform"), (("M", "T"), "hedge"), (("M", "T"), "confidence")])
def test_graph_tree_kernels_equal_ar_fp32(views, policy, monkeypatch):
    """The greedy tree engine on CUDA with graphs drafts through the kernels (mix_topk and
    tree_grow, counted) and its tokens are the target's greedy tokens."""
    from tabed_engine.kernels import mix_topk as mk, tree_grow as tg

    calls = {"mix_topk": 0, "tree_grow": 0}

    def counted(mod, name):
        fn = getattr(mod, name)

        def wrapper(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        monkeypatch.setattr(mod, name, wrapper)

    counted(mk, "mix_topk")
    counted(tg, "tree_grow")
    eng = Engine.from_pretrained(model_dir("mha"), model_dir("mha", perturb=0.25), device="cuda",
                                 dtype=torch.float32, views=views, policy=policy, tree="5x3x2", adaptive=False)
    text, imgs = prompt(1)
    sp = SamplingParams(max_new_tokens=40, stop_at_eos=False)
    ar = eng.generate(text, images=imgs, sampling=sp, speculative=False).token_ids
    sd = eng.generate(text, images=imgs, sampling=sp)
    assert sd.token_ids == ar
    assert sd.stats.target_forwards < len(ar) - 1
    assert calls["mix_topk"] >= 5 and calls["tree_grow"] >= 5, calls


@pytest.mark.gpu
def test_graph_tree_sampling_seeded():
    """Sampling through the tree graphs (Gumbel noise from the device seed and offset, the
    stochastic walk): seeded runs repeat exactly and drafts are accepted. Losslessness itself
    is checked on the CPU (test_tree_sampling_is_lossless), the same code."""
    eng = Engine.from_pretrained(model_dir("mha"), model_dir("mha", perturb=0.25), device="cuda",
                                 dtype=torch.float32, views=("M", "T"), policy="kld", tree="3x2x2", adaptive=False)
    text, imgs = prompt(1)
    sp = SamplingParams(max_new_tokens=12, temperature=0.8, seed=3, stop_at_eos=False)
    a, b = eng.generate(text, images=imgs, sampling=sp), eng.generate(text, images=imgs, sampling=sp)
    assert a.token_ids == b.token_ids and sum(a.stats.accepted_lengths) > 0


def test_cli_tree_equals_engine(tmp_path, capsys):
    """`--tree DxWxB` on the CLI: the same tokens as the engine's tree decoding (and as AR)."""
    import json

    from tabed_engine.serving.cli import main

    text, imgs = prompt(1)
    path = tmp_path / "image.png"
    imgs[0].save(path)
    rc = main(["generate", "--target", model_dir("mha"), "--draft", model_dir("mha", perturb=0.25), "--raw",
               "--image", str(path), "--prompt", text, "--tree", "3x2x2", "--max-new-tokens", "12",
               "--device", "cpu", "--json"])
    assert rc == 0
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    eng = Engine.from_pretrained(model_dir("mha"), model_dir("mha", perturb=0.25), device="cpu",
                                 dtype=torch.float32, tree="3x2x2")
    from PIL import Image

    ref = eng.generate(text, images=[Image.open(path)], sampling=SamplingParams(max_new_tokens=12))
    assert got["token_ids"] == ref.token_ids
    assert got["token_ids"] == eng.generate(text, images=[Image.open(path)],
                                            sampling=SamplingParams(max_new_tokens=12), speculative=False).token_ids
    assert main(["generate", "--target", model_dir("mha"), "--prompt", "w1", "--tree", "9x9x9",
                             "--device", "cpu"]) == 2
    assert "at most 64" in capsys.readouterr().err


def test_bad_tree_is_refused_before_loading(tmp_path):
    """A tree that cannot be built is refused by from_pretrained before any weight is read
    (the checkpoint directory does not even exist)."""
    with pytest.raises(ValueError, match="at most 64"):
        Engine.from_pretrained(str(tmp_path / "none"), tree="9x9x9")
    with pytest.raises(ValueError, match="DEPTHxWIDTHxBRANCH"):
        Engine.from_pretrained(str(tmp_path / "none"), tree="big")


def test_rope_table_outgrown_is_kept():
    # captured graphs gather from the table by address: a longer table for a longer cache
    # must not free the one they hold; the longer one starts with the same rows
    cfg = LMConfig(vocab_size=11, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2, num_kv_heads=2,
                   head_dim=8)
    lm = LlamaLM(cfg)
    short = lm.rope(300, torch.device("cpu"))
    ptr = short.data_ptr()
    long = lm.rope(1000, torch.device("cpu"))
    assert long.shape[0] >= 1000 and torch.equal(long[:short.shape[0]], short)
    assert any(t.data_ptr() == ptr for t in lm._ropes_outgrown)
    assert lm.rope(500, torch.device("cpu")) is long


@pytest.mark.parametrize("device,dtype", [("cpu", torch.float32),
                                          pytest.param("cuda", torch.float32, marks=pytest.mark.gpu),
                                          pytest.param("cuda", torch.bfloat16, marks=pytest.mark.gpu)])
def test_forward_tree_offset_continues_the_tree(device, dtype):
    # a tree's slots fed in two calls (the second with tree_offset: its tokens after the first
    # call's, their bits naming both) give the logits and the cache of one call over all of them
    cfg = LMConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                   head_dim=8)
    torch.manual_seed(3)
    lm = LlamaLM(cfg).to(device=device, dtype=dtype)
    R, M, S = 3, 21, 96
    g = torch.Generator().manual_seed(5)
    lens = torch.tensor([5, 0, 40], dtype=torch.int32, device=device)
    parents = [[-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, M)] for _ in range(R)]
    bits = tree_bits_of(torch.tensor(parents), M).to(device)
    ids = torch.randint(0, cfg.vocab_size, (R, M), generator=g).to(device)
    pos = lens.long()[:, None] + torch.randint(0, 6, (R, M), generator=g).to(device)
    one, two = KVCache(cfg, R, S, device, dtype), KVCache(cfg, R, S, device, dtype)
    prefix = torch.randn(one.k.shape, generator=g).to(device=device, dtype=dtype)
    for c in (one, two):
        c.k.copy_(prefix)
        c.v.copy_(prefix.flip(-1))
    with torch.inference_mode():
        want = lm(one, pos, input_ids=ids, lengths=lens, tree_bits=bits)
        for lo, hi in ((0, 8), (8, 11), (11, 12), (12, M)):   # one query alone too (not the one-query kernel)
            got = lm(two, pos[:, lo:hi], input_ids=ids[:, lo:hi], lengths=lens, tree_bits=bits[:, lo:hi],
                     tree_offset=lo)
            tol = 1e-5 if dtype == torch.float32 else 3e-2
            torch.testing.assert_close(got, want[:, lo:hi], atol=tol, rtol=tol)
    torch.testing.assert_close(two.k, one.k, atol=tol, rtol=tol)
    torch.testing.assert_close(two.v, one.v, atol=tol, rtol=tol)
    with pytest.raises(ValueError, match="tree_offset"):
        lm(two, pos[:, :2], input_ids=ids[:, :2], lengths=lens, tree_offset=3)
