"""The router's view of which KV blocks each instance of one role holds, fed by its KV events
(kept exact by cache_view.CacheView).

Both ways round: the blocks of each instance, and the instances holding each block, so that
one walk down a prompt's hashes gives every instance's cached prefix at once (a fleet of a
hundred instances would otherwise walk it a hundred times per request)."""

from __future__ import annotations

from itertools import islice, takewhile
from operator import eq, truth

# Instances still holding a prompt's prefix below which each one's run is counted on its own
# (a set test per block for many of them at once costs less than one walk each).
FEW_LEFT = 3
MAX_COMMON = 1024  # first blocks whose common run is remembered (beyond: forget them all)


class PrefixIndex:
    def __init__(self) -> None:
        self._blocks: dict[str, set[int]] = {}
        # block hash -> instances holding it. Most blocks have one holder: theirs is that
        # instance's one shared frozenset (_alone), not a set each; a second holder makes it a set.
        self._holders: dict[int, set[str] | frozenset[str]] = {}
        self._alone: dict[str, frozenset[str]] = {}
        # Per first block: a run of blocks from it that every instance holding it holds too (a
        # shared system prompt's); forgotten when who holds one of them changes.
        self._common: dict[int, tuple[int, ...]] = {}
        self._common_on: set[int] = set()  # the blocks of those runs

    def apply(self, instance: str, stored: list[int], evicted: list[int], reset: bool = False) -> None:
        blocks = self._blocks.get(instance)
        if blocks is None:  # (not setdefault: that makes a set on every call)
            blocks = self._blocks[instance] = set()
        if reset:
            self._drop_holder(instance, blocks)
            blocks.clear()
        new = set(stored).difference(blocks)
        if new:
            blocks.update(new)
            self._add_holder(instance, new)
            if self._common_on and not self._common_on.isdisjoint(new):
                self._forget_common()
        gone = blocks.intersection(evicted) if evicted else ()
        if gone:
            blocks.difference_update(gone)
            self._drop_holder(instance, gone)

    def _add_holder(self, instance: str, blocks: set[int]) -> None:
        """`instance` holds `blocks` now (it did not before)."""
        holders = self._holders
        alone = self._alone.get(instance)
        if alone is None:
            alone = self._alone[instance] = frozenset((instance,))
        shared = holders.keys() & blocks
        holders.update(dict.fromkeys(blocks.difference(shared) if shared else blocks, alone))
        for h in shared:
            held_by = holders[h]
            if type(held_by) is frozenset:
                holders[h] = {*held_by, instance}
            else:
                held_by.add(instance)

    def _drop_holder(self, instance: str, blocks: set[int]) -> None:
        """`instance` no longer holds `blocks`."""
        holders, alone = self._holders, self._alone.get(instance)
        for h in blocks:
            held_by = holders[h]
            if held_by is alone:
                del holders[h]
                continue
            held_by.discard(instance)
            if not held_by:
                del holders[h]
        if self._common_on and not self._common_on.isdisjoint(blocks):
            self._forget_common()

    def _forget_common(self) -> None:
        self._common.clear()
        self._common_on.clear()

    def cached_prefix_blocks(self, instance: str, hashes: list[int]) -> int:
        """Length of the leading run of `hashes` this instance holds (hashes are chained)."""
        return _leading_run(self._blocks.get(instance, set()), hashes)

    def cached_prefix_blocks_all(self, hashes: list[int]) -> dict[str, int]:
        """cached_prefix_blocks of every instance holding at least the first block (absent: 0),
        in one walk down `hashes` that narrows the instances still holding the prefix (from
        the end of the run they all hold); once few are left, each one's run is counted on."""
        out: dict[str, int] = {}
        if not hashes:
            return out
        live = self._holders.get(hashes[0])
        if not live:
            return out
        holders = self._holders
        n = self._common_run(hashes, live)
        for h in islice(hashes, n, None):
            if len(live) <= FEW_LEFT:
                break
            held = holders.get(h, ())
            if not live.issubset(held):  # (no new set while every instance still holds the prefix)
                still = live.intersection(held)
                out.update(dict.fromkeys(live.difference(still), n))
                if not still:
                    return out
                live = still
            n += 1
        rest = hashes[n:]
        for instance in live:
            out[instance] = n + _leading_run(self._blocks[instance], rest)
        return out

    def _common_run(self, hashes: list[int], live: set[str]) -> int:
        """How many blocks from the start of `hashes` every instance of `live` (the holders of
        the first) holds: as far as the prompt runs along the run remembered for this first
        block, and further (and remembered, if longer)."""
        known = self._common.get(hashes[0], ())
        n = max(len(list(takewhile(truth, map(eq, hashes, known)))), 1)  # (the prompt's length along it)
        holders = self._holders
        for h in islice(hashes, n, None):
            if not live.issubset(holders.get(h, ())):
                break
            n += 1
        if n > 1 and n > len(known):
            if len(self._common) >= MAX_COMMON:
                self._forget_common()
            run = self._common[hashes[0]] = tuple(hashes[:n])
            self._common_on.update(run)
        return n

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
