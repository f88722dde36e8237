"""The router's view of which KV blocks each MD holds, fed by MD's KV events."""

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
        """The instance left: drop what it held (it re-announces a snapshot if it returns)."""
        self._blocks.pop(instance, None)

    def __len__(self) -> int:
        return len(self._blocks)

    def size(self, instance: str) -> int:
        return len(self._blocks.get(instance, ()))
