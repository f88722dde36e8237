"""Block arithmetic of prompt KV shared in flight (shared/engine/in_flight.py's rule, as the
simulated main decoder keeps it): which of a prompt's tokens P still sends when other
requests' transfers carry some of its blocks, and how far its blocks hold their KV."""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Sequence


def tokens_to_send(start: int, upto: int, waited: Sequence[int], block_size: int) -> int:
    """Prompt tokens in [start, upto) outside the blocks `waited` (sorted block indices that
    another request's transfer carries): those P puts on the line."""
    if upto <= start:
        return 0
    n = upto - start
    for j in waited[bisect_left(waited, start // block_size) :]:
        lo, hi = j * block_size, (j + 1) * block_size
        if lo >= upto:
            break
        n -= max(0, min(hi, upto) - max(lo, start))
    return n


def present_upto(first: int, blocks: int, present: Callable[[int], bool]) -> int:
    """The end of the leading run of blocks from `first` on (of `blocks` in all) that hold
    their KV: a block is cached only once those before it are (a chained prefix)."""
    j = first
    while j < blocks and present(j):
        j += 1
    return j
