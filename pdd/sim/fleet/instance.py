"""What every simulated engine instance has: a chip, a KV block pool with its prefix cache
(the engine's BlockPool as block_pool.py keeps it), and the seconds it spent computing."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from pdd.sim.fleet.block_pool import SimBlockPool
from pdd.sim.fleet.events import EventLoop
from pdd.sim.hardware.chip import Chip
from shared.engine.block_pool import blocks_for


@dataclass(eq=False, slots=True)
class Blocks:
    """One request's blocks on one instance."""

    ids: list[int] = field(default_factory=list)
    hits: int = 0  # leading prompt blocks found in the prefix cache
    registered: int = 0  # leading prompt blocks that hold their KV here (the hits, then more)


@dataclass(eq=False, slots=True)
class _Waiter:
    hashes: tuple[int, ...]
    tokens: int
    on_blocks: Callable[[Blocks], None]
    hits: list[int] | None = (
        None  # its prefix cache hits when it last tried, valid until a block is registered
    )
    hits_after: int = -1  # ... the instance's registrations then


class Instance:
    def __init__(self, name: str, chip: Chip, loop: EventLoop, num_blocks: int, block_size: int):
        self.name, self.chip, self.loop, self.block_size = name, chip, loop, block_size
        self.pool = SimBlockPool(num_blocks)
        self.busy_s = 0.0
        self.busy_spells: list[tuple[float, float]] | None = (
            None  # (start, end) of each step or run, if asked for
        )
        self.held = 0  # requests holding blocks here
        self.block_waiters: deque[_Waiter] = deque()  # first come, first served
        # Its load figures (load_counts, free blocks, held) may have moved since the router
        # last read them: set by whatever moves them, cleared by the router.
        self.load_changed = True
        # Blocks registered so far: only a registration adds to a waiter's hits (blocks are
        # evicted only as one is admitted, which takes the next waiter's turn anyway).
        self.registrations = 0

    def load_counts(self) -> tuple[int, int]:
        """(running, waiting) as the instance reports them."""
        raise NotImplementedError

    def reserve(self, hashes: tuple[int, ...], tokens: int, on_blocks: Callable[[Blocks], None]) -> None:
        """Blocks for `tokens` tokens whose full prompt blocks are `hashes`: cached ones are
        shared, the rest allocated. Waits (in order) while they do not fit."""
        self.block_waiters.append(_Waiter(hashes, tokens, on_blocks))
        self.load_changed = True
        if len(self.block_waiters) == 1:
            self._admit_waiters()

    def _admit_waiters(self) -> None:
        while self.block_waiters:
            w = self.block_waiters[0]
            hits = w.hits
            if hits is None or w.hits_after != self.registrations:
                hits = w.hits = self.pool.lookup(w.hashes)
                w.hits_after = self.registrations
            fresh = blocks_for(w.tokens, self.block_size) - len(hits)
            room = len(self.pool.free)
            # (cost_of(hits) ≤ len(hits): it need not be counted when even that fits)
            if fresh + len(hits) > room and fresh + self.pool.cost_of(hits) > room:
                if fresh > self.pool.num_blocks:
                    raise ValueError(f"{self.name}: a request of {w.tokens} tokens never fits its KV pool")
                return
            self.block_waiters.popleft()
            self.pool.touch_many(hits)
            self.held += 1
            self.load_changed = True
            w.on_blocks(Blocks(hits + self.pool.allocate_many(fresh), len(hits), len(hits)))

    def register(self, blocks: Blocks, hashes: tuple[int, ...], upto: int) -> None:
        """The prompt's full blocks before `upto` hold computed (or received) KV now."""
        lo, hi = blocks.registered, min(upto, len(hashes))
        if hi > lo:
            blocks.ids[lo:hi] = self.pool.register_or_share_many(blocks.ids[lo:hi], hashes[lo:hi])
            blocks.registered = hi
            self.load_changed = True  # (a twin's block shared frees this one)
            self.registrations += 1

    def free(self, blocks: Blocks) -> None:
        """The request is done here: its blocks return to the pool (hashed ones stay cached)."""
        self.pool.release_many(blocks.ids)
        blocks.ids = []
        self.held -= 1
        self.load_changed = True
        self._admit_waiters()

    def drain_events(self) -> tuple[list[int], list[int]]:
        """(stored, evicted): the prefix cache's events since the last drain."""
        return self.pool.drain_events()
