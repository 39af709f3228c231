"""Paged KV memory (`engine/pages.py`): the page allocator on its own, then engines whose page
pool is small and whose pages are handed out in a shuffled order (scattered block tables), so
that requests wait for pages, join as others leave, evict cached prefixes, and still decode
transformers' greedy tokens."""
import random

import pytest
import torch

from tabed_engine import SamplingParams
from tabed_engine.engine.pages import PagePool
from tabed_engine.models.config import LMConfig
from tabed_engine.models.decoder import KVCache
from test_batch import batch_inputs, engine, expected


def _to_device(values, dtype=torch.long):
    return torch.tensor(values, dtype=dtype)


def small_cache(pages=9, rows=3, max_len=16, page=4):
    cfg = LMConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=2, num_heads=2, num_kv_heads=1,
                   head_dim=4)
    return KVCache(cfg, rows, max_len, "cpu", torch.float32, pages, page)


def test_pool_shares_full_pages_and_copies_the_partial_one():
    cache = small_cache()
    pool = PagePool(cache, _to_device)
    assert pool.total == 8 and not cache.block_table.any()              # every row on scratch
    pool.assign([(0, None, 0, 10)])                                      # 3 pages of 4 slots
    a = pool.rows[0]
    assert len(a) == 3 and cache.block_table[0].tolist() == a + [0]
    for i, p in enumerate(a):
        cache.k[:, p], cache.v[:, p] = float(i + 1), -float(i + 1)
    # row 1 reuses 6 slots of row 0: page 0 shared, slots 4, 5 copied into a fresh page
    pool.assign([(1, 0, 6, 9)])
    b = pool.rows[1]
    assert b[0] == a[0] and b[1] not in a and pool.refs[a[0]] == 2
    assert (cache.k[:, b[1], :, :2] == 2).all() and (cache.v[:, b[1], :, :2] == -2).all()
    assert cache.block_table[1].tolist() == b + [0]
    assert pool.exclusive([1]) == 2 and pool.exclusive([0, 1]) == 5
    # a row reusing its own prefix (a new turn in its own slot): page kept, the partial one copied
    pool.assign([(0, 0, 5, 12)])
    assert pool.rows[0][0] == a[0] and (cache.k[:, pool.rows[0][1], :, :1] == 2).all()
    assert len(pool.free) + len({p for r in pool.rows for p in r}) == pool.total
    pool.truncate(0, 4)
    assert pool.rows[0] == [a[0]] and cache.block_table[0].tolist() == [a[0], 0, 0, 0]
    pool.release([0, 1])
    assert pool.refs == [0] * 9 and len(pool.free) == 8 and not cache.block_table.any()
    with pytest.raises(RuntimeError, match="pages needed"):
        pool.assign([(0, None, 0, 16), (1, None, 0, 16), (2, None, 0, 4)])
    assert not any(pool.rows) and len(pool.free) == 8                    # nothing half-done


def test_sources_are_read_before_rows_are_written():
    """Two view rows swapping prefixes (each the other's source): both read before either is
    written, as the view cache's plans may ask."""
    cache = small_cache()
    pool = PagePool(cache, _to_device)
    pool.assign([(0, None, 0, 6), (1, None, 0, 6)])
    for r, val in ((0, 1.0), (1, 2.0)):
        for p in pool.rows[r]:
            cache.k[:, p] = val
    pool.assign([(0, 1, 3, 6), (1, 0, 3, 6)])
    assert (cache.k[:, pool.rows[0][0], :, :3] == 2).all() and (cache.k[:, pool.rows[1][0], :, :3] == 1).all()


def scattered(eng, page=16, seed=0):
    """The engine's pools in pages of `page` slots, handed out in a shuffled order."""
    eng.runner.page_size = page
    eng.runner.allocate()
    rng = random.Random(seed)
    for pool in (eng.runner.pages.target, eng.runner.pages.draft):
        if pool is not None:
            rng.shuffle(pool.free)
    return eng


def drive(eng, prompts, imgs, sps, speculative):
    """Run the requests through `step` and return (outputs by id, the most running at once)."""
    ids = [eng.add_request(p, images=im, sampling=sp, speculative=speculative)
           for p, im, sp in zip(prompts, imgs, sps)]
    done, peak = {}, 0
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o.output
        peak = max(peak, sum(r is not None for r in eng.scheduler.slots))
    return [done[i] for i in ids], peak


@pytest.mark.parametrize("speculative,options", [
    (False, {}),
    (True, dict(policy="hedge")),
    (True, dict(tree="4x2x2")),
])
def test_small_scattered_pool_equals_transformers(speculative, options):
    """Six requests through six slots but a pool of 2.5 rows of max_len: requests wait for pages
    and join as others leave, more of them run at once than kv_cache_tokens / max_len (what an
    unpaged cache of that memory would hold), their tables are scattered, and every one equals
    transformers' greedy decoding of it alone."""
    eng = scattered(engine(max_batch=6, kv_cache_tokens=640, **options))
    names, prompts, imgs, sps = batch_inputs()
    outs, peak = drive(eng, prompts, imgs, sps, speculative)
    for name, out in zip(names, outs):
        assert out.token_ids == expected(name), name
    assert peak > 640 // 256
    tables = eng.runner.tcache.block_table
    assert (tables[:, 1:] != tables[:, :1] + torch.arange(1, tables.shape[1])).any()   # not in page order
    pages = eng.runner.pages
    # what the slots still hold (their cached prefixes) and the free pages account for the pool
    for pool in (pages.target, pages.draft):
        held = {p for r in pool.rows for p in r}
        assert len(held) + len(pool.free) == pool.total and all(pool.refs[p] > 0 for p in held)


def test_eviction_of_cached_prefixes():
    """A pool too small for every prompt's cached prefix at once: admissions evict the least
    recently used prefixes and the tokens stay right."""
    eng = scattered(engine(max_batch=4, kv_cache_tokens=320), seed=1)
    names, prompts, imgs, sps = batch_inputs()
    for name, p, im, sp in zip(names, prompts, imgs, sps):       # one at a time: each leaves its prefix
        assert eng.generate(p, images=im, sampling=sp, speculative=False).token_ids == expected(name), name
    assert sum(e is not None for e in eng.runner.prefix.entries) < len(names)      # some were evicted


def test_a_request_that_cannot_fit_the_pool():
    """A pool smaller than max_len: a request that needs more pages than it has is refused with a
    ValueError naming the pool, max_new_tokens=None is cut to the pool, and the engine goes on."""
    eng = scattered(engine(max_batch=2, kv_cache_tokens=200))
    names, prompts, imgs, sps = batch_inputs()
    with pytest.raises(ValueError, match="kv_cache_tokens=200"):
        eng.generate(prompts[0], images=imgs[0], sampling=SamplingParams(max_new_tokens=200), speculative=False)
    assert eng.generate(prompts[0], images=imgs[0], sampling=sps[0]).token_ids == expected(names[0])
    req = eng._request(prompts[0], imgs[0], SamplingParams(max_new_tokens=None), None, False)
    assert req.n_prompt + req.max_new + eng.lookahead + 2 <= 208           # 13 pages of 16


def test_option_is_checked():
    with pytest.raises(TypeError, match="kv_cache_tokens"):
        engine(kv_cache_tokens=1.5)
    with pytest.raises(ValueError, match="kv_cache_tokens"):
        engine(kv_cache_tokens=0)
    assert engine(max_batch=3).kv_cache_tokens == 3 * 256       # the default: an unpaged cache's memory
