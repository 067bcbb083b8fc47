"""Property tests for the block pool: reference counts, prefix-cache reuse and eviction stay consistent."""

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from outrider.engine.kv_cache import BlockPool, chain_hash
from outrider.engine.request import Request
from outrider.params import SamplingParams


def check_invariants(pool: BlockPool, live: list[Request]) -> None:
    refs = Counter(b for r in live for b in r.block_ids)
    for block in pool.blocks[1:]:
        assert block.ref_count == refs.get(block.block_id, 0)
        assert (block.ref_count == 0) == (block.block_id in pool.free)
    for h, bid in pool.cached.items():
        assert pool.blocks[bid].block_hash == h
    assert 0 not in refs  # the reserved padding block is never handed out


prompts = st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=40), min_size=1, max_size=12)


@settings(max_examples=150, deadline=None)
@given(prompts=prompts, num_blocks=st.integers(3, 24), grow=st.lists(st.integers(0, 9), max_size=12))
def test_pool_invariants_under_random_traffic(prompts, num_blocks, grow):
    pool = BlockPool(num_blocks, block_size=4)
    live: list[Request] = []
    for i, ids in enumerate(prompts):
        req = Request(list(ids), SamplingParams())
        if pool.admit(req, req.num_tokens):
            assert req.num_computed <= req.num_tokens - 1  # at least one token is always computed
            req.num_computed = req.num_tokens
            pool.commit_full_blocks(req, req.num_computed)
            live.append(req)
        check_invariants(pool, live)
        if live and i < len(grow) and pool.ensure(live[0], live[0].num_tokens + grow[i]):
            assert len(live[0].block_ids) * 4 >= live[0].num_tokens + grow[i]
        check_invariants(pool, live)
        if live and i % 3 == 2:
            pool.free_request(live.pop(0))
            check_invariants(pool, live)
    for req in live:
        pool.free_request(req)
    assert pool.num_used == 0


def test_prefix_reuse_shares_blocks_and_leaves_one_token():
    pool = BlockPool(16, block_size=4)
    a = Request(list(range(10)), SamplingParams())
    assert pool.admit(a, 10)
    a.num_computed = 10
    pool.commit_full_blocks(a, 10)
    b = Request(list(range(10)) + [99], SamplingParams())
    assert pool.admit(b, 100) == 3  # the rest of its prompt, past the cached blocks
    assert b.num_computed == 8 and b.block_ids[:2] == a.block_ids[:2]
    c = Request(list(range(8)), SamplingParams())  # exact two-block prompt: the last block must be recomputed
    assert pool.admit(c, 4)
    assert c.num_computed == 4
    for r in (a, b, c):
        pool.free_request(r)
    assert pool.num_used == 0
    # Freed cached blocks still serve hits until evicted.
    d = Request(list(range(10)), SamplingParams())
    assert pool.admit(d, 2) and d.num_computed == 8


def test_eviction_reuses_cached_blocks_when_full():
    pool = BlockPool(5, block_size=2)  # 4 usable blocks
    a = Request([1, 2, 3, 4, 5], SamplingParams())
    assert pool.admit(a, 5)
    a.num_computed = 5
    pool.commit_full_blocks(a, 5)
    pool.free_request(a)
    b = Request([7, 8, 9, 10, 11, 12, 13], SamplingParams())
    assert pool.admit(b, 7)  # needs all 4 blocks: the cached ones are evicted
    assert pool.match_prefix(Request([1, 2, 3, 4, 5], SamplingParams())) == []
    assert not pool.ensure(b, 9)


def full_walk_commit(pool: BlockPool, req: Request, num_committed: int) -> None:
    """Reference: publish by re-walking every full block from the first, as a from-scratch implementation would."""
    ids, bs, prev = req.all_ids, pool.block_size, None
    for i in range(min(num_committed, len(ids)) // bs):
        block = pool.blocks[req.block_ids[i]]
        if block.block_hash is not None:
            prev = block.block_hash
            continue
        toks = tuple(ids[i * bs : (i + 1) * bs])
        h = chain_hash(prev, toks)
        if h not in pool.cached:
            block.block_hash, block.tokens = h, toks
            pool.cached[h] = block.block_id
        prev = h


@settings(max_examples=100, deadline=None)
@given(prompts=st.lists(st.lists(st.integers(0, 1), min_size=1, max_size=14), min_size=1, max_size=6),
       outputs=st.lists(st.integers(0, 1), min_size=1, max_size=20), frees=st.lists(st.integers(0, 30), max_size=4))
def test_incremental_commit_publishes_as_a_full_walk(prompts, outputs, frees):
    """Same traffic through two pools (small alphabet: duplicate blocks, evictions, re-publishing): the
    incremental commit leaves exactly the hashes a full walk of every request's blocks would."""
    pools = [BlockPool(12, block_size=2), BlockPool(12, block_size=2)]
    commits = [BlockPool.commit_full_blocks, full_walk_commit]
    live: list[list[Request]] = [[], []]
    step = 0
    for ids in prompts + [[]] * len(outputs):  # admit one request per step, then keep decoding
        for pool, reqs, commit in zip(pools, live, commits):
            if ids:
                req = Request(list(ids), SamplingParams())
                if pool.admit(req, req.num_tokens):
                    req.num_computed = req.num_tokens - 1
                    reqs.append(req)
            for req in list(reqs):
                req.output_ids.append(outputs[step % len(outputs)])
                if not pool.ensure(req, req.num_tokens):
                    pool.free_request(req)
                    reqs.remove(req)
                    continue
                req.num_computed = req.num_tokens - 1
                commit(pool, req, req.num_computed)
            if reqs and step in frees:
                pool.free_request(reqs.pop(0))
        a, b = pools
        assert a.cached == b.cached
        assert [(x.block_hash, x.tokens) for x in a.blocks] == [(x.block_hash, x.tokens) for x in b.blocks]
        assert [r.block_ids for r in live[0]] == [r.block_ids for r in live[1]]
        step += 1
