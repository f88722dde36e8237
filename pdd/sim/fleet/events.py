"""The simulator's clock: a heap of (time, insertion order, callback)."""

from __future__ import annotations

import heapq
from collections.abc import Callable


class EventLoop:
    def __init__(self) -> None:
        self.now = 0.0
        self.events = 0  # callbacks run so far
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = 0
        self._cancelled: set[int] = set()

    def at(self, t: float, fn: Callable[[], None]) -> int:
        """Run fn at time t (not before now); same-time events run in the order they were set.
        Returns a handle for cancel()."""
        self._seq += 1
        now = self.now
        heapq.heappush(self._heap, (now if now > t else t, self._seq, fn))  # (max(t, now) without the call)
        return self._seq

    def after(self, dt: float, fn: Callable[[], None]) -> int:
        return self.at(self.now + dt, fn)

    def cancel(self, handle: int) -> None:
        self._cancelled.add(handle)

    def run(self, until: float | None = None) -> None:
        """Run events until none is left, or until the next one is later than `until` (the
        clock then stops at `until`)."""
        heap, cancelled, pop = self._heap, self._cancelled, heapq.heappop
        while heap:
            if until is not None and heap[0][0] > until:
                self.now = until
                return
            t, seq, fn = pop(heap)
            if seq in cancelled:
                cancelled.discard(seq)
                continue
            self.now = t
            self.events += 1
            fn()
