"""KV blocks in this process's memory, keyed by pdd chained hash: between a vLLM engine's
connector and the pdd service that drives the engine (shared/vllm/engine.py).

A block is one pdd block's group, [L, 2, 1, 16, kv_heads, head_dim] in pdd's layout. The store
is the decode-side prefix cache as pdd's roles see it: least recently used blocks make room,
except pinned ones (a request waiting for its KV, a prefill not yet exported), and every block
stored or evicted is an event for the routers' indexes. Both halves of vLLM's connector and
the engine's owner run in one process (vLLM's engine core in process, one worker): they find
the store by name (`lookup`).
"""

from __future__ import annotations

import threading
import uuid
from collections import Counter, OrderedDict
from collections.abc import Sequence

import torch

from shared.engine.errors import KVShortageError

_STORES: dict[str, MemoryStore] = {}


def lookup(name: str) -> MemoryStore:
    try:
        return _STORES[name]
    except KeyError:
        raise LookupError(
            f"no pdd block store {name!r} in this process: the connector's in-memory store needs "
            "vLLM's engine core and its one worker in the process that made it "
            "(VLLM_ENABLE_V1_MULTIPROCESSING=0, tensor parallel 1)"
        ) from None


class MemoryStore:
    def __init__(self, capacity_blocks: int) -> None:
        if capacity_blocks < 1:
            raise ValueError(f"a block store needs room for a block, got {capacity_blocks}")
        self.capacity = capacity_blocks
        self.name = f"pdd-{uuid.uuid4().hex[:12]}"
        self._blocks: OrderedDict[int, torch.Tensor] = OrderedDict()  # oldest use first
        self._pins: dict[str, set[int]] = {}
        self._pinned: Counter[int] = Counter()
        self._events: list[tuple[str, int]] = []
        self._lock = threading.Lock()  # vLLM's worker side may run off the engine thread
        _STORES[self.name] = self

    def __repr__(self) -> str:
        return f"memory store {self.name}"

    def close(self) -> None:
        _STORES.pop(self.name, None)

    def __len__(self) -> int:
        return len(self._blocks)

    @property
    def pinned_blocks(self) -> int:
        return len(self._pinned)

    @property
    def pin_owners(self) -> int:
        return len(self._pins)

    def has(self, block_hash: int) -> bool:
        return block_hash in self._blocks

    def get(self, block_hash: int) -> torch.Tensor:
        """The group stored under block_hash (KeyError if none), now the most recently used."""
        with self._lock:
            group = self._blocks[block_hash]
            self._blocks.move_to_end(block_hash)
            return group

    def held_run(self, block_hashes: Sequence[int]) -> int:
        """How many of the blocks, from the first, the store holds."""
        n = 0
        while n < len(block_hashes) and block_hashes[n] in self._blocks:
            n += 1
        return n

    def put(self, block_hash: int, group: torch.Tensor) -> None:
        """Store one group (copied; a block held already is left as it is); when full, evict
        what nothing pins, or drop the new block when everything is pinned."""
        try:
            self.put_all([block_hash], [group])
        except KVShortageError:
            pass  # a save beyond a full, pinned store: the block is recomputed where needed

    def put_all(self, hashes: Sequence[int], groups: Sequence[torch.Tensor]) -> int:
        """Store every block not held yet, all or none (KVShortageError when pins leave too
        little room); returns how many were new."""
        with self._lock:
            new = [(h, g) for h, g in zip(hashes, groups, strict=True) if h not in self._blocks]
            room = self.capacity - len(self._blocks) + self._evictable(len(new))
            if len(new) > room:
                raise KVShortageError(
                    f"{len(new)} KV blocks do not fit: {self.capacity} blocks, {len(self._pinned)} pinned"
                )
            self._evict(len(self._blocks) + len(new) - self.capacity)
            for h, g in new:
                self._blocks[h] = g.clone(memory_format=torch.contiguous_format)
                self._events.append(("stored", h))
            return len(new)

    def _evictable(self, enough: int) -> int:
        n = 0
        for h in self._blocks:
            if n >= enough:
                break
            n += h not in self._pinned
        return n

    def _evict(self, n: int) -> None:
        victims = [h for h in self._blocks if h not in self._pinned][: max(n, 0)]
        for h in victims:
            del self._blocks[h]
            self._events.append(("evicted", h))

    def pin(self, owner: str, hashes: Sequence[int]) -> list[int]:
        """Pin for owner those of hashes held now; returns them."""
        with self._lock:
            held = [h for h in hashes if h in self._blocks]
            mine = self._pins.setdefault(owner, set())
            for h in held:
                if h not in mine:
                    mine.add(h)
                    self._pinned[h] += 1
            if not mine:
                del self._pins[owner]
            return held

    def unpin(self, owner: str) -> None:
        with self._lock:
            for h in self._pins.pop(owner, ()):
                self._pinned[h] -= 1
                if self._pinned[h] <= 0:
                    del self._pinned[h]

    def clear(self) -> None:
        """Evict every block nothing pins."""
        with self._lock:
            self._evict(len(self._blocks))

    def drain_events(self) -> list[tuple[str, int]]:
        with self._lock:
            events, self._events = self._events, []
            return events

    def hashes(self) -> list[int]:
        with self._lock:
            return list(self._blocks)
