"""The in-memory block store between a vLLM engine's connector and pdd's service: LRU room,
pins that hold blocks, all-or-none imports, events, and lookup by name."""

from __future__ import annotations

import pytest
import torch

from shared.engine.errors import KVShortageError
from shared.vllm.memory_store import MemoryStore, lookup


def _group(x: float) -> torch.Tensor:
    return torch.full((2, 2, 1, 16, 1, 4), x)


def test_blocks_round_trip_as_copies_and_lookup_by_name() -> None:
    store = MemoryStore(4)
    g = _group(1.0)
    store.put(7, g)
    g.fill_(5.0)  # the store kept a copy
    assert torch.equal(store.get(7), _group(1.0))
    assert store.held_run([7, 8]) == 1 and store.has(7) and not store.has(8)
    assert lookup(store.name) is store
    store.close()
    with pytest.raises(LookupError, match="VLLM_ENABLE_V1_MULTIPROCESSING=0"):
        lookup(store.name)


def test_least_recently_used_unpinned_blocks_make_room() -> None:
    store = MemoryStore(3)
    for h in (1, 2, 3):
        store.put(h, _group(h))
    store.get(1)  # 2 is now the oldest use
    store.pin("r", [3])
    store.put(4, _group(4))
    assert store.hashes() == [3, 1, 4]
    store.put(5, _group(5))  # 3 is pinned: 1 goes
    assert sorted(store.hashes()) == [3, 4, 5]
    assert store.drain_events() == [
        ("stored", 1),
        ("stored", 2),
        ("stored", 3),
        ("evicted", 2),
        ("stored", 4),
        ("evicted", 1),
        ("stored", 5),
    ]
    assert store.drain_events() == []


def test_imports_are_all_or_none_and_pins_are_per_owner() -> None:
    store = MemoryStore(3)
    assert store.put_all([1, 2], [_group(1), _group(2)]) == 2
    assert store.pin("a", [1, 2, 9]) == [1, 2]
    assert store.pin("b", [2]) == [2]
    with pytest.raises(KVShortageError):
        store.put_all([3, 4], [_group(3), _group(4)])
    assert sorted(store.hashes()) == [1, 2]  # nothing of the refused import stayed
    assert store.put_all([1, 3], [_group(1), _group(3)]) == 1
    store.pin("c", [3])
    store.put(4, _group(4))  # a save into a pinned, full store is dropped, never raised
    assert not store.has(4) and store.pinned_blocks == 3 and store.pin_owners == 3
    store.unpin("a")
    assert store.pinned_blocks == 2  # 2 and 3 are still b's and c's
    store.put(4, _group(4))
    assert store.has(4) and store.has(2) and not store.has(1)
    store.unpin("b")
    store.unpin("c")
    store.unpin("nobody")
    assert store.pinned_blocks == 0 and store.pin_owners == 0
