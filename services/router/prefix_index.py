"""The router's view of which KV blocks each instance of one role holds, fed by its KV events
(kept exact by cache_view.CacheView).

Both ways round: the blocks of each instance, and the instances holding each block, so that
one walk down a prompt's hashes gives every instance's cached prefix at once (a fleet of a
hundred instances would otherwise walk it a hundred times per request)."""

from __future__ import annotations

from itertools import islice, takewhile

# Instances still holding a prompt's prefix below which each one's run is counted on its own
# (a set test per block for many of them at once costs less than one walk each).
FEW_LEFT = 3


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
                held_by = holders.get(h)
                if held_by is None:
                    holders[h] = {instance}
                else:
                    held_by.add(instance)
        gone = blocks.intersection(evicted) if evicted else ()
        if gone:
            blocks.difference_update(gone)
            self._drop_holder(instance, gone)

    def _drop_holder(self, instance: str, blocks: set[int]) -> None:
        """`instance` no longer holds `blocks`."""
        holders = self._holders
        for h in blocks:
            held_by = holders[h]
            held_by.discard(instance)
            if not held_by:
                del holders[h]

    def cached_prefix_blocks(self, instance: str, hashes: list[int]) -> int:
        """Length of the leading run of `hashes` this instance holds (hashes are chained)."""
        return _leading_run(self._blocks.get(instance, set()), hashes)

    def cached_prefix_blocks_all(self, hashes: list[int]) -> dict[str, int]:
        """cached_prefix_blocks of every instance holding at least the first block (absent: 0),
        in one walk down `hashes` that narrows the instances still holding the prefix; once
        few are left, each one's run is counted on at once."""
        out: dict[str, int] = {}
        if not hashes:
            return out
        live = self._holders.get(hashes[0])
        if not live:
            return out
        live = set(live)
        holders, everyone = self._holders, len(self._blocks)
        n = 1
        for h in islice(hashes, 1, None):
            if len(live) <= FEW_LEFT:
                break
            held = holders.get(h, ())
            # (no new set while every instance still holds the prefix; none to test when every
            # instance of the index holds the block, as a shared system prompt's blocks)
            if len(held) != everyone and not live.issubset(held):
                still = live.intersection(held)
                for instance in live.difference(still):
                    out[instance] = n
                if not still:
                    return out
                live = still
            n += 1
        rest = hashes[n:]
        for instance in live:
            out[instance] = n + _leading_run(self._blocks[instance], rest)
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


def _leading_run(blocks: set[int], hashes: list[int]) -> int:
    """How many of `hashes`, from the first, are in `blocks` (counted without a Python loop)."""
    return len(list(takewhile(blocks.__contains__, hashes)))
