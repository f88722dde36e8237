"""The router's view of which KV blocks each instance of one role holds, fed by its KV events
(kept exact by cache_view.CacheView)."""

from __future__ import annotations


class PrefixIndex:
    def __init__(self) -> None:
        self._blocks: dict[str, set[int]] = {}

    def apply(self, instance: str, stored: list[int], evicted: list[int], reset: bool = False) -> None:
        blocks = self._blocks.setdefault(instance, set())
        if reset:
            blocks.clear()
        blocks.update(stored)
        blocks.difference_update(evicted)

    def cached_prefix_blocks(self, instance: str, hashes: list[int]) -> int:
        """Length of the leading run of `hashes` this instance holds (hashes are chained)."""
        blocks = self._blocks.get(instance, set())
        n = 0
        for h in hashes:
            if h not in blocks:
                break
            n += 1
        return n

    def forget(self, instance: str) -> None:
        """The instance left: drop what it held (if it returns, the router fetches a snapshot)."""
        self._blocks.pop(instance, None)

    def __len__(self) -> int:
        return len(self._blocks)

    def size(self, instance: str) -> int:
        return len(self._blocks.get(instance, ()))

    def blocks(self, instance: str) -> frozenset[int]:
        """Every block the instance is known to hold."""
        return frozenset(self._blocks.get(instance, ()))
