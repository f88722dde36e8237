"""An engine instance's KV block pool for the simulator: the engine's BlockPool
(shared/engine/block_pool.py) block for block, its prefix cache and LRU exactly, in fewer
steps per block: a request takes and returns tens of blocks at a time, a fleet does so
millions of times an hour.

Per-block state is two flat lists (reference count and hash by block id) instead of an object
per block, and the cache events are two lists of hashes (stored, evicted: what the router's
prefix index takes) instead of a (kind, hash) pair each. tests/unit/test_sim_instance.py drives it
and the engine's pool with the same random operations and compares them."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from functools import partial
from itertools import islice, takewhile
from operator import is_not

from shared.engine.block_pool import NO_HASH
from shared.engine.errors import EngineError

_is_block = partial(is_not, None)  # a cache lookup that found a block


class SimBlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise EngineError("the KV pool has no block")
        self.num_blocks = num_blocks
        self.refs = [0] * num_blocks  # per block id: its reference count
        self.hash_of = [NO_HASH] * num_blocks  # per block id: the hash of the KV it holds
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(
            range(num_blocks)
        )  # LRU: the front is reused first
        self._cached: dict[int, int] = {}  # block hash -> block id
        self._stored: list[int] = []  # cache events since the last drain, of each kind in order
        self._evicted: list[int] = []

    @property
    def num_free(self) -> int:
        return len(self.free)

    def lookup(self, hashes: Sequence[int]) -> list[int]:
        """Block ids of the leading run of `hashes` present in the cache."""
        return list(takewhile(_is_block, map(self._cached.get, hashes)))

    def cost_of(self, bids: list[int]) -> int:
        """Free blocks that referencing `bids` would take out of the free queue."""
        return list(map(self.refs.__getitem__, bids)).count(0)

    def allocate_many(self, n: int) -> list[int]:
        """The n least recently freed blocks (their cached hashes evicted), each with one reference."""
        free = self.free
        if n > len(free):
            raise EngineError("no free KV block")
        bids = list(islice(free, n))  # the queue's front, oldest first
        refs, hash_of, cached, evicted = self.refs, self.hash_of, self._cached, self._evicted
        for bid in bids:
            del free[bid]
            h = hash_of[bid]
            if h != NO_HASH:
                del cached[h]
                evicted.append(h)
                hash_of[bid] = NO_HASH
            refs[bid] = 1
        return bids

    def touch_many(self, bids: list[int]) -> None:
        """One more reference on each; a free one leaves the free queue."""
        refs, free = self.refs, self.free
        for bid in bids:
            count = refs[bid]
            if count == 0:
                del free[bid]
            refs[bid] = count + 1

    def release_many(self, bids: list[int]) -> None:
        """One reference fewer on each, in order. A block no one references joins the free
        queue: at the back if it holds a hash (cached until reused), at the front if not."""
        refs, hash_of, free = self.refs, self.hash_of, self.free
        for bid in bids:
            count = refs[bid]
            if count <= 0:
                raise EngineError(f"block {bid} released more often than referenced")
            refs[bid] = count - 1
            if count == 1:
                free[bid] = None
                if hash_of[bid] == NO_HASH:
                    free.move_to_end(bid, last=False)  # nothing worth keeping: reuse first

    def register_or_share_many(self, bids: list[int], hashes: Sequence[int]) -> list[int]:
        """Register each computed block under its hash; where another block already holds
        that hash (a twin computed concurrently, or imported), take a reference on that one
        and release this one. Returns the blocks to use from now on."""
        cached, hash_of, stored, out = self._cached, self.hash_of, self._stored, []
        if cached.keys().isdisjoint(hashes) and len(set(hashes)) == len(hashes) == len(bids):
            # Hashes new to the cache, each once (the common case): all stored, in order.
            for bid, h in zip(bids, hashes, strict=True):
                hash_of[bid] = h
            cached.update(zip(hashes, bids, strict=True))
            stored += hashes
            return list(bids)
        for bid, h in zip(bids, hashes, strict=True):
            other = cached.get(h)
            if other is None:
                hash_of[bid] = h
                cached[h] = bid
                stored.append(h)
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
