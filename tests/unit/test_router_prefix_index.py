"""The router's view of the KV blocks each MD holds, fed by MD's KV events."""

import random

from services.router.routing.prefix_index import PrefixIndex


def test_prefix_index_leading_run():
    idx = PrefixIndex()
    idx.apply("md0", stored=[1, 2, 3, 9], evicted=[])
    assert idx.cached_prefix_blocks("md0", [1, 2, 3, 4]) == 3
    idx.apply("md0", stored=[], evicted=[2])
    assert idx.cached_prefix_blocks("md0", [1, 2, 3, 4]) == 1
    idx.apply("md0", stored=[7], evicted=[], reset=True)
    assert idx.cached_prefix_blocks("md0", [1]) == 0 and idx.size("md0") == 1
    assert idx.cached_prefix_blocks("other", [1]) == 0


def test_all_instances_at_once_agree_with_one_at_a_time():
    """cached_prefix_blocks_all against cached_prefix_blocks over random stores, evictions,
    resets and departures of a small fleet (absent from the answer: nothing cached)."""
    rng = random.Random(7)
    idx = PrefixIndex()
    names = [f"md{i}" for i in range(5)]
    for _ in range(400):
        name = rng.choice(names)
        action = rng.random()
        if action < 0.03:
            idx.forget(name)
        else:
            stored = [rng.randrange(12) for _ in range(rng.randrange(8))]
            evicted = [rng.randrange(12) for _ in range(rng.randrange(3))]
            idx.apply(name, stored, evicted, reset=action < 0.08)
        hashes = rng.sample(range(12), rng.randrange(1, 8))
        every = idx.cached_prefix_blocks_all(hashes)
        assert all(n > 0 for n in every.values())
        assert {m: every.get(m, 0) for m in names} == {m: idx.cached_prefix_blocks(m, hashes) for m in names}
    assert idx.cached_prefix_blocks_all([]) == {}


def test_all_instances_walk_the_chain_once():
    idx = PrefixIndex()
    idx.apply("a", stored=[1, 2, 3], evicted=[])
    idx.apply("b", stored=[1, 2, 4], evicted=[])
    idx.apply("c", stored=[2, 3], evicted=[])  # holds later blocks, not the first
    assert idx.cached_prefix_blocks_all([1, 2, 3, 4]) == {"a": 3, "b": 2}
    idx.apply("a", stored=[], evicted=[1])
    idx.forget("b")
    assert idx.cached_prefix_blocks_all([1, 2, 3]) == {}
    idx.apply("a", stored=[1], evicted=[], reset=True)
    assert idx.cached_prefix_blocks_all([1, 2]) == {"a": 1}


def test_the_run_every_holder_shares_follows_each_change():
    """A shared system prompt's run (every holder of its first block holds it) is remembered
    between routes; a store of its first block elsewhere, an eviction, a reset or a departure
    each shows in the next answer."""
    idx = PrefixIndex()
    system = [1, 2, 3, 4]
    for name, own in (("a", 10), ("b", 20), ("c", 30), ("d", 40), ("e", 50)):
        idx.apply(name, stored=system + [own], evicted=[])
    assert idx.cached_prefix_blocks_all(system + [10]) == {"a": 5, "b": 4, "c": 4, "d": 4, "e": 4}
    idx.apply("b", stored=[], evicted=[3])
    assert idx.cached_prefix_blocks_all(system + [20]) == {"a": 4, "b": 2, "c": 4, "d": 4, "e": 4}
    idx.apply("f", stored=[1, 2], evicted=[])  # a new holder of the first block, not of the rest
    assert idx.cached_prefix_blocks_all(system + [30])["f"] == 2
    idx.apply("c", stored=[1], evicted=[], reset=True)
    assert idx.cached_prefix_blocks_all(system + [30])["c"] == 1
    idx.forget("a")
    assert "a" not in idx.cached_prefix_blocks_all(system + [10])
    assert idx.cached_prefix_blocks_all([1, 2, 9]) == {
        "b": 2,
        "c": 1,
        "d": 2,
        "e": 2,
        "f": 2,
    }  # another prompt, same first block
