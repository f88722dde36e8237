"""BlockExchange: KV blocks in and out of the pool by block hash, and pins on cached blocks.

A pin is a reference on cached blocks held for an owner (a request id) until unpin(owner),
so they cannot be evicted while, say, the rest of a prompt's KV is on its way. Pins are
their own namespace: aborting or releasing a request never touches them.

A reservation (reserve) is an owner's promise of blocks for its whole life, kept in a ledger
that never promises more than the pool: free blocks set aside now for the KV it will
import, plus a count for the KV it will compute. unpin(owner) ends the pins and the promise.
"""

from __future__ import annotations

import torch

from shared.engine.block_pool import BlockPool
from shared.engine.errors import EngineError, KVShortageError
from shared.engine.kv_admission import Verdict, admission_verdict


class BlockExchange:
    def __init__(self, pool: BlockPool, kv_cache: torch.Tensor) -> None:
        self.pool = pool
        self.kv_cache = kv_cache  # [layers, 2, blocks, block_size, kv_heads, head_dim]
        self.pins: dict[str, list[int]] = {}  # owner -> referenced block ids
        self.spare: dict[str, list[int]] = {}  # owner -> blocks set aside for its imports
        self.promised: dict[str, int] = {}  # owner -> blocks promised for its life (the ledger)

    @property
    def num_pinned_blocks(self) -> int:
        return sum(len(bids) for bids in self.pins.values())

    def num_cached_prefix_blocks(self, hashes: list[int]) -> int:
        return len(self.pool.lookup(hashes))

    def pin_blocks(self, owner: str, hashes: list[int]) -> int:
        """Pin the leading run of `hashes` that is cached; returns how many blocks that is."""
        bids = self.pool.lookup(hashes)
        for bid in bids:
            self.pool.touch(bid)
        if bids:
            self.pins.setdefault(owner, []).extend(bids)
        return len(bids)

    def unpin(self, owner: str) -> None:
        """Drop the owner's pins, its unused spare blocks and its reservation."""
        for bid in [*reversed(self.pins.pop(owner, [])), *self.spare.pop(owner, [])]:
            self.pool.release(bid)
        self.promised.pop(owner, None)

    @property
    def promised_blocks(self) -> int:
        return sum(self.promised.values())

    def reserve(self, owner: str, hashes: list[int], blocks: int) -> tuple[Verdict, int]:
        """Promise `blocks` to owner if the ledger allows it and the blocks its imports need
        are free now: pin the cached leading run of `hashes` and set aside one free block per
        missing hash. Returns (verdict, blocks already cached); nothing changes unless ADMIT."""
        if owner in self.promised:
            raise EngineError(f"{owner!r} already holds a reservation")
        hit = self.pool.lookup(hashes)
        missing = len(set(hashes[len(hit) :]))
        verdict = admission_verdict(
            blocks,
            self.promised_blocks,
            self.pool.num_blocks,
            missing + self.pool.cost_of(hit),
            self.pool.num_free,
        )
        if verdict is not Verdict.ADMIT:
            return verdict, len(hit)
        self.promised[owner] = blocks
        self.pin_blocks(owner, hashes)
        self.spare[owner] = [self.pool.allocate() for _ in range(missing)]
        return verdict, len(hit)

    def share(self, owner: str, landed: list[int], lost: list[int] = ()) -> list[int]:
        """Blocks owner waited for while another request's transfer brought them: pin those of
        `landed` that are cached, and give back the spare block set aside for each block it no
        longer imports (landed, or `lost`: computed instead). Returns the hashes pinned; an
        owner that is gone gets nothing."""
        if owner not in self.promised:
            return []
        pinned = [h for h in landed if self.pool.block_of(h) is not None]
        bids = [self.pool.block_of(h) for h in pinned]
        for bid in bids:
            self.pool.touch(bid)
        if bids:
            self.pins.setdefault(owner, []).extend(bids)
        self._release_spare(owner, len(landed) + len(lost))
        return pinned

    def take_spare(self, owner: str, n: int) -> list[int]:
        """Up to n of owner's spare blocks, now the caller's to fill in place (one-sided writes).
        Each goes back with adopt() (filled), return_spare() or release_blocks()."""
        spare = self.spare.get(owner, [])
        taken = spare[len(spare) - min(n, len(spare)) :]
        del spare[len(spare) - len(taken) :]
        return taken

    def adopt(self, owner: str, h: int, bid: int) -> None:
        """A taken block now holds h's KV: cache it, pinned for owner as import_blocks(pin=owner)
        would (a twin already cached is used instead). An owner that is gone gets nothing."""
        if owner not in self.promised:
            self.pool.release(bid)
            return
        self.pins.setdefault(owner, []).append(self.pool.register_or_share(bid, h))

    def return_spare(self, owner: str, bid: int) -> None:
        """A taken block, unfilled (or refused): owner's spare again, or freed if owner is gone."""
        if owner in self.promised:
            self.spare.setdefault(owner, []).append(bid)
        else:
            self.pool.release(bid)

    def release_blocks(self, bids: list[int]) -> None:
        self.pool.release_many(bids)

    def export_blocks(self, hashes: list[int]) -> torch.Tensor:
        """The KV of cached blocks, on the CPU: [layers, 2, len(hashes), block_size, kv_heads, head_dim]."""
        bids = []
        for h in hashes:
            bid = self.pool.block_of(h)
            if bid is None:
                raise EngineError(f"block {h} is not cached")
            bids.append(bid)
        index = torch.tensor(bids, dtype=torch.long, device=self.kv_cache.device)
        return self.kv_cache.index_select(2, index).cpu().contiguous()

    @torch.inference_mode()
    def import_blocks(self, hashes: list[int], kv: torch.Tensor, *, pin: str | None = None) -> int:
        """Copy in the blocks not cached yet, all or nothing; returns how many were new.
        With pin, every block of `hashes` stays pinned for that owner."""
        self._check_kv(kv, len(hashes))
        present = [bid for h in dict.fromkeys(hashes) if (bid := self.pool.block_of(h)) is not None]
        new: dict[int, int] = {}  # hash -> position in kv, first occurrence
        for i, h in enumerate(hashes):
            if self.pool.block_of(h) is None:
                new.setdefault(h, i)
        self._release_spare(pin, len(new) + len(present))
        if len(new) + self.pool.cost_of(present) > self.pool.num_free:
            raise KVShortageError(
                f"no free KV block for import: {len(new)} new blocks, {self.pool.num_free} free"
            )
        for bid in present:  # hold them, so allocating the new ones cannot evict them
            self.pool.touch(bid)
        bids = [self.pool.allocate() for _ in new]
        if bids:
            device = self.kv_cache.device
            src = kv[:, :, list(new.values())].to(device)
            self.kv_cache.index_copy_(2, torch.tensor(bids, dtype=torch.long, device=device), src)
            for bid, h in zip(bids, new, strict=True):
                self.pool.register(bid, h)
        held = present + bids
        if pin is not None:
            self.pins.setdefault(pin, []).extend(held)  # our references become the pin's
        else:
            for bid in reversed(held):
                self.pool.release(bid)
        return len(bids)

    def _release_spare(self, owner: str | None, n: int) -> None:
        """Give back up to n of owner's spare blocks, so they are what the import allocates."""
        spare = self.spare.get(owner or "", [])
        for _ in range(min(n, len(spare))):
            self.pool.release(spare.pop())

    def _check_kv(self, kv: torch.Tensor, num_blocks: int) -> None:
        layers, two, _, block_size, kv_heads, head_dim = self.kv_cache.shape
        shape = (layers, two, num_blocks, block_size, kv_heads, head_dim)
        if not isinstance(kv, torch.Tensor) or tuple(kv.shape) != shape:
            got = tuple(kv.shape) if isinstance(kv, torch.Tensor) else type(kv).__name__
            raise EngineError(f"KV shape {got} does not match the expected {shape}")
        if kv.dtype != self.kv_cache.dtype:
            raise EngineError(f"KV dtype {kv.dtype} does not match the engine dtype {self.kv_cache.dtype}")

    def reset_prefix_cache(self) -> int:
        """Forget every cached block nobody references (benchmarks, operators); returns how many."""
        return self.pool.evict_unreferenced()

    def drain_events(self) -> list[tuple[str, int]]:
        """("stored" | "evicted", hash) since the last drain, in order."""
        return self.pool.drain_events()

    def cached_hashes(self) -> list[int]:
        """Every block hash in the prefix cache now (a snapshot for peers that lost events)."""
        return self.pool.cached_hashes()
