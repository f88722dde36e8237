"""The router's view of which KV blocks each instance of one role holds, fed by its KV events
(kept exact by cache_view.CacheView).

Both ways round: the blocks of each instance, and the instances holding each block, so that
one walk down a prompt's hashes gives every instance's cached prefix at once (a fleet of a
hundred instances would otherwise walk it a hundred times per request)."""

from __future__ import annotations


class PrefixIndex:
    def __init__(self) -> None:
        self._blocks: dict[str, set[int]] = {}
        self._holders: dict[int, set[str]] = {}  # block hash -> instances holding it

    def apply(self, instance: str, stored: list[int], evicted: list[int], reset: bool = False) -> None:
        blocks = self._blocks.setdefault(instance, set())
        if reset:
            self._drop_holder(instance, blocks)
            blocks.clear()
        new = set(stored).difference(blocks)
        if new:
            blocks.update(new)
            holders = self._holders
            for h in new:
                holders.setdefault(h, set()).add(instance)
        gone = blocks.intersection(evicted) if evicted else ()
        if gone:
            blocks.difference_update(gone)
            self._drop_holder(instance, gone)

    def _release(self, h: int, instance: str) -> None:
        held_by = self._holders[h]
        held_by.discard(instance)
        if not held_by:
            del self._holders[h]

    def _drop_holder(self, instance: str, blocks: set[int]) -> None:
        """`instance` no longer holds `blocks`."""
        for h in blocks:
            self._release(h, instance)

    def cached_prefix_blocks(self, instance: str, hashes: list[int]) -> int:
        """Length of the leading run of `hashes` this instance holds (hashes are chained)."""
        blocks = self._blocks.get(instance, set())
        n = 0
        for h in hashes:
            if h not in blocks:
                break
            n += 1
        return n

    def cached_prefix_blocks_all(self, hashes: list[int]) -> dict[str, int]:
        """cached_prefix_blocks of every instance holding at least the first block (absent: 0),
        in one walk down `hashes` that narrows the instances still holding the prefix."""
        out: dict[str, int] = {}
        if not hashes:
            return out
        live = self._holders.get(hashes[0])
        if not live:
            return out
        live = set(live)
        holders = self._holders
        n = 1
        for h in hashes[1:]:
            held = holders.get(h, ())
            if not live.issubset(held):  # (no new set while every instance still holds the prefix)
                still = live.intersection(held)
                for instance in live.difference(still):
                    out[instance] = n
                if not still:
                    return out
                live = still
            n += 1
        for instance in live:
            out[instance] = n
        return out

    def forget(self, instance: str) -> None:
        """The instance left: drop what it held (if it returns, the router fetches a snapshot)."""
        blocks = self._blocks.pop(instance, None)
        if blocks is not None:
            self._drop_holder(instance, blocks)

    def __len__(self) -> int:
        return len(self._blocks)

    def size(self, instance: str) -> int:
        return len(self._blocks.get(instance, ()))

    def blocks(self, instance: str) -> frozenset[int]:
        """Every block the instance is known to hold."""
        return frozenset(self._blocks.get(instance, ()))
