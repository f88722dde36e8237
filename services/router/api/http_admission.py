"""HTTP admission: a bounded number of requests in flight and a bounded, time-limited
wait for a slot. Whoever cannot get one is turned away (a 429), so an overload costs
neither unbounded memory nor a failed request that was already admitted."""

from __future__ import annotations

import asyncio
from collections import deque


class Overloaded(Exception):
    """No slot: the wait queue is full, or the wait for a slot ran out."""


class Admission:
    def __init__(self, max_in_flight: int, max_waiting: int, max_wait_s: float):
        self.max_in_flight = max_in_flight
        self.max_waiting = max_waiting
        self.max_wait_s = max_wait_s
        self.in_flight = 0
        self._waiters: deque[asyncio.Future[None]] = deque()  # in arrival order

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    async def acquire(self) -> None:
        """A slot (release it with `release`), else Overloaded."""
        if self.in_flight < self.max_in_flight and not self._waiters:
            self.in_flight += 1
            return
        if len(self._waiters) >= self.max_waiting:
            raise Overloaded("too many requests are waiting")
        slot = asyncio.get_running_loop().create_future()
        self._waiters.append(slot)
        try:
            async with asyncio.timeout(self.max_wait_s):
                await slot
        except BaseException as e:
            if slot.done() and not slot.cancelled():
                self.release()  # handed a slot just as the wait ended: pass it on
            elif slot in self._waiters:  # (a release may already have skipped past it)
                self._waiters.remove(slot)
            if isinstance(e, TimeoutError):
                raise Overloaded("no request slot became free in time") from None
            raise

    def release(self) -> None:
        """A request ended: its slot goes to the longest waiter, else back to the pool."""
        while self._waiters:
            slot = self._waiters.popleft()
            if not slot.done():
                slot.set_result(None)
                return
        self.in_flight -= 1
