"""MD's wait for KV memory: prepares that cannot reserve their blocks now queue, first come
first served, and the oldest tries again each time blocks are freed. The queue and each wait are bounded:
past either bound the prepare is answered busy instead of holding up the router."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")


class KVBusy(Exception):
    """No KV memory within the bounds: the queue is full or the wait ran out."""


class KVAdmissionQueue:
    def __init__(self, max_waiting: int, max_wait_s: float, freed: Callable[[], Awaitable[None]]):
        """`freed()` returns once blocks may have been freed (the engine service's signal), or
        after a short bound without one (so a cancel is noticed)."""
        self.max_waiting = max_waiting
        self.max_wait_s = max_wait_s
        self.freed = freed
        self.waiting: dict[str, None] = {}  # request ids queued or trying, in arrival order
        self._turn = asyncio.Lock()  # fair: waiters get it in arrival order
        self._cancelled: set[str] = set()

    async def admit(
        self, rid: str, attempt: Callable[[], Awaitable[T | None]], undo: Callable[[], Awaitable[None]]
    ) -> T | None:
        """attempt()'s first result that is not None, tried by one request at a time in
        arrival order; None if rid was cancelled meanwhile (undo() then takes back an attempt
        that succeeded as the cancel came). Raises KVBusy past the bounds."""
        if len(self.waiting) >= self.max_waiting:
            raise KVBusy(f"{len(self.waiting)} requests already wait for KV memory")
        self.waiting[rid] = None
        tried = False
        try:
            async with asyncio.timeout(self.max_wait_s), self._turn:
                while rid not in self._cancelled:
                    if (got := await attempt()) is not None:
                        if rid in self._cancelled:
                            await undo()
                            return None
                        return got
                    if not tried:
                        tried = True
                        log.info("request %s waits for KV memory (%d in line)", rid, len(self.waiting))
                    await self.freed()
                return None
        except TimeoutError:
            raise KVBusy(f"no KV memory became free within {self.max_wait_s:g} s") from None
        finally:
            del self.waiting[rid]
            self._cancelled.discard(rid)

    def cancel(self, rid: str) -> None:
        """The request is gone: stop its wait (a no-op unless it is waiting)."""
        if rid in self.waiting:
            self._cancelled.add(rid)
