"""What came early for a request the relay cannot start yet, kept for a bounded time: the
other half either follows within seconds or never comes."""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Generic, TypeVar

T = TypeVar("T")


class Kept(Generic[T]):
    """rid -> value, each for ttl_s; past `cap` entries the oldest goes first (None: no cap,
    for entries bounded otherwise)."""

    def __init__(self, ttl_s: float, cap: int | None = None):
        self.ttl_s, self.cap = ttl_s, cap
        self._items: OrderedDict[str, tuple[float, T]] = OrderedDict()

    def put(self, rid: str, value: T) -> None:
        self._items[rid] = (time.monotonic(), value)
        self._items.move_to_end(rid)
        if self.cap is not None and len(self._items) > self.cap:
            self._items.popitem(last=False)

    def pop(self, rid: str) -> T | None:
        item = self._items.pop(rid, None)
        return item[1] if item is not None else None

    def expire(self, now: float) -> list[str]:
        """Drop what was kept past ttl_s; their rids."""
        gone = []
        while self._items and next(iter(self._items.values()))[0] < now - self.ttl_s:
            gone.append(self._items.popitem(last=False)[0])
        return gone

    def __contains__(self, rid: str) -> bool:
        return rid in self._items

    def __len__(self) -> int:
        return len(self._items)
