"""An engine instance's KV block pool for the simulator: the engine's BlockPool
(shared/engine/block_pool.py) block for block, its prefix cache and LRU exactly, with each
request's work on its blocks done in passes over them instead of a Python step per block.

A request takes and returns tens of blocks at a time, and a fleet does so millions of times
an hour, so per-block state lives in two flat lists (reference count and hash by block id),
and each operation reads or writes them with map() over the request's block ids. The ids
one call names are distinct (a request holds each of its blocks once). tests/test_sim_instance.py
drives it and the engine's pool with the same random operations and compares them."""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence
from functools import partial
from itertools import compress, islice, repeat, takewhile
from operator import add, countOf, is_not, ne, sub

from shared.engine.block_pool import NO_HASH
from shared.engine.errors import EngineError

_is_block = partial(is_not, None)  # a cache lookup that found a block
_is_hash = partial(ne, NO_HASH)
_run = deque(maxlen=0).extend  # runs an iterator of calls to its end (the itertools "consume" recipe)


class SimBlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise EngineError("the KV pool has no block")
        self.num_blocks = num_blocks
        self.refs = [0] * num_blocks  # per block id: its reference count
        self.hash_of = [NO_HASH] * num_blocks  # per block id: the hash of the KV it holds
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # LRU: the front is reused first
        self._cached: dict[int, int] = {}  # block hash -> block id
        self._stored: list[int] = []  # cache events since the last drain, of each kind in order
        self._evicted: list[int] = []

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def lookup(self, hashes: Sequence[int]) -> list[int]:
        """Block ids of the leading run of `hashes` present in the cache."""
        return list(takewhile(_is_block, map(self._cached.get, hashes)))

    def cost_of(self, bids: list[int]) -> int:
        """Free blocks that referencing `bids` would take out of the free queue."""
        return countOf(map(self.refs.__getitem__, bids), 0)

    def allocate_many(self, n: int) -> list[int]:
        """The n least recently freed blocks (their cached hashes evicted), each with one reference."""
        free = self.free
        if n > len(free):
            raise EngineError("no free KV block")
        bids = list(islice(free, n))  # the queue's front, oldest first
        _run(map(free.__delitem__, bids))
        evicted = list(filter(_is_hash, map(self.hash_of.__getitem__, bids)))
        if evicted:
            _run(map(self._cached.__delitem__, evicted))
            self._evicted += evicted
            _run(map(self.hash_of.__setitem__, bids, repeat(NO_HASH)))
        _run(map(self.refs.__setitem__, bids, repeat(1)))
        return bids

    def touch_many(self, bids: list[int]) -> None:
        """One more reference on each; a free one leaves the free queue."""
        refs = self.refs
        counts = list(map(refs.__getitem__, bids))
        if 0 in counts:
            _run(map(self.free.__delitem__, compress(bids, map((0).__eq__, counts))))
        _run(map(refs.__setitem__, bids, map(add, counts, repeat(1))))

    def release_many(self, bids: list[int]) -> None:
        """One reference fewer on each. A block no one references joins the free queue: at
        the back if it holds a hash (cached until reused), at the front if not (as the
        engine's pool, which takes them one by one, leaves them: the last one first)."""
        refs = self.refs
        counts = list(map(refs.__getitem__, bids))
        if 0 in counts:
            raise EngineError(f"block {bids[counts.index(0)]} released more often than referenced")
        _run(map(refs.__setitem__, bids, map(sub, counts, repeat(1))))
        freed = list(compress(bids, map((1).__eq__, counts)))
        if freed:
            free = self.free
            _run(map(free.__setitem__, freed, repeat(None)))
            hashes = map(self.hash_of.__getitem__, freed)
            for bid in compress(freed, map((NO_HASH).__eq__, hashes)):
                free.move_to_end(bid, last=False)  # nothing worth keeping: reuse first

    def register_or_share_many(self, bids: list[int], hashes: Sequence[int]) -> list[int]:
        """Register each computed block under its hash; where another block already holds
        that hash (a twin computed concurrently, or imported), take a reference on that one
        and release this one. Returns the blocks to use from now on."""
        if len(bids) != len(hashes):
            raise ValueError("one hash per block")
        cached = self._cached
        if not any(map(cached.__contains__, hashes)) and len(set(hashes)) == len(hashes):
            _run(map(self.hash_of.__setitem__, bids, hashes))  # (none held yet: all stored)
            cached.update(zip(hashes, bids, strict=True))
            self._stored += hashes
            return list(bids)
        out = []
        for bid, h in zip(bids, hashes, strict=True):
            other = cached.get(h)
            if other is None:
                self.hash_of[bid] = h
                cached[h] = bid
                self._stored.append(h)
                other = bid
            elif other != bid:
                self.touch_many([other])
                self.release_many([bid])
            out.append(other)
        return out

    def drain_events(self) -> tuple[list[int], list[int]]:
        """(stored, evicted): the hashes cached and dropped since the last drain, each in order."""
        stored, evicted = self._stored, self._evicted
        self._stored, self._evicted = [], []
        return stored, evicted
