"""Block pool, chained hashes, prefix reuse, LRU eviction and preemption."""

from __future__ import annotations

import random

import pytest

from shared.engine import EngineError, block_hashes
from shared.engine.block_pool import BlockPool
from shared.engine.hashing import hash_block
from tests.engine_util import dense_greedy, greedy, make_engine, random_prompt, run_all, tokens_of

# 256 blocks of 16 tokens at 512 B/token for the tiny preset; 12 blocks for the pressure tests.
TIGHT_MB = 12 * 16 * 512 / 2**20


def test_block_hashes_are_chained_pure_and_stable():
    ids = list(range(40))
    hs = block_hashes(ids, 16, "tiny-s0")
    assert len(hs) == 2  # the partial third block has no hash
    assert hs == block_hashes(ids[:32], 16, "tiny-s0")
    assert hs[1] == hash_block(hs[0], ids[16:32], "tiny-s0")
    assert block_hashes(ids, 16, "tiny-s1") != hs  # model id is part of the identity
    assert block_hashes([99] + ids[1:], 16, "tiny-s0")[1] != hs[1]  # so is every earlier token
    assert all(0 <= h < 2**63 for h in hs)
    # Golden value: blake2b-64 of (root, model id, uint32 LE tokens), masked to 63 bits. Changing
    # the format breaks cache identity between processes and versions: do it on purpose only.
    assert hs[0] == hash_block(None, list(range(16)), "tiny-s0") == 1436024632117672033


def test_pool_lru_eviction_and_events():
    pool = BlockPool(4)
    a, b, c = pool.allocate(), pool.allocate(), pool.allocate()
    for bid, h in ((a, 10), (b, 11), (c, 12)):
        assert pool.register(bid, h)
    assert not pool.register(pool.allocate(), 10)  # a twin: the first one keeps the hash
    for bid in (c, b, a):  # freed tail first, like a finished sequence
        pool.release(bid)
    assert pool.num_free == 3 and pool.num_cached == 3
    pool.touch(pool.lookup([11])[0])  # a hit takes b out of the free queue
    assert pool.lookup([10, 11, 12, 99]) == [a, b, c]
    pool.allocate()  # evicts the least recently freed hashed block: c (12)
    assert pool.drain_events() == [("stored", 10), ("stored", 11), ("stored", 12), ("evicted", 12)]
    assert pool.lookup([10, 11, 12]) == [a, b]
    pool.allocate()
    with pytest.raises(EngineError):
        pool.allocate()


def test_pool_shares_a_twin_instead_of_registering_it_twice():
    pool = BlockPool(4)
    a, b = pool.allocate(), pool.allocate()
    assert pool.register_or_share(a, 10) == a
    assert pool.register_or_share(b, 10) == a  # b computed the same block: use a, free b
    assert pool.block_of(10) == a and pool.block_of(11) is None
    assert pool.blocks[a].ref_count == 2 and pool.blocks[b].ref_count == 0 and pool.num_free == 3
    assert pool.register_or_share(a, 10) == a and pool.blocks[a].ref_count == 2  # already its own
    assert pool.cached_hashes() == [10] and pool.num_cached == 1


def test_second_request_reuses_prefix_blocks():
    rng = random.Random(10)
    prefix = random_prompt(rng, 64)  # 4 full blocks
    p1, p2 = prefix + random_prompt(rng, 10), prefix + random_prompt(rng, 7)
    engine = make_engine()
    engine.add_request("a", p1, greedy(20))
    first = tokens_of(run_all(engine)["a"])
    assert engine.exchange.num_cached_prefix_blocks(engine.block_hashes(p2)) == 4
    before = engine.stats()
    engine.add_request("b", p2, greedy(20))
    second = tokens_of(run_all(engine)["b"])
    after = engine.stats()
    assert after.prefix_hit_tokens - before.prefix_hit_tokens == 64
    # computed: the 7-token suffix, then 19 single decode steps
    assert after.computed_tokens - before.computed_tokens == 7 + 19
    fresh = make_engine()
    fresh.add_request("b", p2, greedy(20))
    assert second == tokens_of(run_all(fresh)["b"]) == dense_greedy(engine, p2, 20)
    assert first == dense_greedy(engine, p1, 20)


def test_fully_cached_prompt_recomputes_only_its_last_block():
    prompt = random_prompt(random.Random(11), 48)  # block-aligned
    engine = make_engine()
    engine.add_request("a", prompt, greedy(5))
    ref = tokens_of(run_all(engine)["a"])
    engine.add_request("b", prompt, greedy(5))
    hit = engine.stats().prefix_hit_tokens
    assert tokens_of(run_all(engine)["b"]) == ref
    assert engine.stats().prefix_hit_tokens - hit == 32  # the last block gives the logits


def test_eviction_under_memory_pressure_keeps_outputs_correct():
    engine = make_engine(TIGHT_MB)
    assert engine.pool.num_blocks == 12
    rng = random.Random(12)
    prompts = [random_prompt(rng, n) for n in (40, 60, 35, 70, 50, 45)]
    for round_ in range(2):  # the second round finds some prefixes cached, others evicted
        for i, p in enumerate(prompts):
            engine.add_request(f"{round_}-{i}", p, greedy(16))
            got = tokens_of(run_all(engine)[f"{round_}-{i}"])
            assert got == dense_greedy(engine, p, 16)
    events = engine.exchange.drain_events()
    assert any(kind == "evicted" for kind, _ in events)
    assert engine.stats().cached_blocks <= 12


def test_preemption_recomputes_and_keeps_outputs_correct():
    engine = make_engine(TIGHT_MB)
    rng = random.Random(13)
    prompts = [random_prompt(rng, n) for n in (30, 50, 20, 40)]
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, greedy(60))  # 4 x up to 7 blocks > 12
    outs = run_all(engine)
    assert engine.stats().preemptions > 0
    for i, p in enumerate(prompts):
        assert [o.index for o in outs[f"r{i}"]] == list(range(60))
        assert tokens_of(outs[f"r{i}"]) == dense_greedy(engine, p, 60)
    assert engine.stats().used_blocks == 0
