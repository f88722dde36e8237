"""Fixed-size KV blocks with reference counts, and the prefix cache over them.

A block with ref_count 0 sits in the free queue. If it holds a full, hashed block it also
stays in the prefix cache until the allocator reuses it: that is LRU eviction (the queue's
front is reused first). Blocks without a hash go to the front, so cached KV is reused last.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import partial
from itertools import takewhile
from operator import is_not

from shared.engine.errors import EngineError

NO_HASH = -1
_is_block = partial(is_not, None)  # a cache lookup that found a block


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks that hold num_tokens tokens (the last one possibly partly filled)."""
    return -(-num_tokens // block_size)


@dataclass(slots=True)  # (a pool holds thousands: smaller, and read faster, without a __dict__ each)
class Block:
    block_id: int
    ref_count: int = 0
    hash: int = NO_HASH


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise EngineError(
                "the KV pool has no block: raise kv_memory_mb (or kv_cache_space_gib) or lower block_size"
            )
        self.num_blocks = num_blocks
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[int, int] = {}  # block hash -> block id
        self.events: list[tuple[str, int]] = []

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def block_of(self, h: int) -> int | None:
        """The block holding hash h, or None if it is not cached."""
        return self._cached.get(h)

    def cached_hashes(self) -> list[int]:
        return list(self._cached)

    def lookup(self, hashes: Iterable[int]) -> list[int]:
        """Block ids of the leading run of `hashes` present in the cache."""
        return list(takewhile(_is_block, map(self._cached.get, hashes)))

    def allocate(self) -> int:
        """Take the least recently freed block (evicting its cached hash), with ref_count 1."""
        return self.allocate_many(1)[0]

    def allocate_many(self, n: int) -> list[int]:
        """n blocks, as n calls of allocate() would take them (none if they do not all fit)."""
        if n > len(self.free):
            raise EngineError("no free KV block")
        blocks, cached, events, take = self.blocks, self._cached, self.events, self.free.popitem
        bids = [take(False)[0] for _ in range(n)]  # the queue's front, oldest first
        for bid in bids:
            block = blocks[bid]
            h = block.hash
            if h != NO_HASH:
                del cached[h]
                events.append(("evicted", h))
                block.hash = NO_HASH
            block.ref_count = 1
        return bids

    def touch(self, bid: int) -> None:
        """Take one more reference (a prefix hit or a pin); a free block leaves the free queue."""
        self.touch_many((bid,))

    def touch_many(self, bids: Iterable[int]) -> None:
        free, blocks = self.free, self.blocks
        for bid in bids:
            block = blocks[bid]
            count = block.ref_count
            if count == 0:
                del free[bid]
            block.ref_count = count + 1

    def release_many(self, bids: Iterable[int]) -> None:
        """release() each of `bids`, in order."""
        free, blocks = self.free, self.blocks
        for bid in bids:
            block = blocks[bid]
            count = block.ref_count
            if count <= 0:
                raise EngineError(f"block {bid} released more often than referenced")
            block.ref_count = count - 1
            if count == 1:
                free[bid] = None
                if block.hash == NO_HASH:
                    free.move_to_end(bid, last=False)  # nothing worth keeping: reuse first

    def release(self, bid: int) -> None:
        self.release_many((bid,))

    def register(self, bid: int, h: int) -> bool:
        """Give a computed full block its hash. False if another block already holds it."""
        if h in self._cached:
            return False
        self._store(bid, h)
        return True

    def _store(self, bid: int, h: int) -> None:
        self.blocks[bid].hash = h
        self._cached[h] = bid
        self.events.append(("stored", h))

    def register_or_share(self, bid: int, h: int) -> int:
        """Register computed block bid under h; if another block already holds h (a twin
        computed concurrently, or imported), take a reference on that one and release bid.
        Returns the block to use from now on."""
        return self.register_or_share_many([bid], [h])[0]

    def register_or_share_many(self, bids: list[int], hashes: Sequence[int]) -> list[int]:
        """register_or_share of each (bid, hash) pair, in order: the blocks to use from now on."""
        cached, blocks, events, out = self._cached, self.blocks, self.events, []
        for bid, h in zip(bids, hashes, strict=True):
            other = cached.get(h)
            if other is None:  # (_store, inline)
                blocks[bid].hash = h
                cached[h] = bid
                events.append(("stored", h))
                out.append(bid)
                continue
            if other != bid:
                self.touch(other)
                self.release(bid)
            out.append(other)
        return out

    def cost_of(self, bids: list[int]) -> int:
        """Free blocks that referencing `bids` would take out of the free queue."""
        blocks = self.blocks
        return len([b for b in bids if blocks[b].ref_count == 0])

    def evict_unreferenced(self) -> int:
        """Drop every cached hash no one references (reset of the prefix cache)."""
        n = 0
        for bid in self.free:
            block = self.blocks[bid]
            if block.hash != NO_HASH:
                del self._cached[block.hash]
                self.events.append(("evicted", block.hash))
                block.hash = NO_HASH
                n += 1
        return n

    def drain_events(self) -> list[tuple[str, int]]:
        events, self.events = self.events, []
        return events
