"""Requests this router sent to each instance that the instance's load report cannot show yet.

Instances report their load every HEARTBEAT_S; without this, every request of a burst within
one interval would see the same reports and land on the same instance. A request counts
toward its instance's load from when it is sent until the instance's next report (which
counts it itself). Times are the caller's clock (time.monotonic in the router)."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Collection

Key = tuple[str, str]  # (role, instance)


RECENT_HALF_LIFE_S = 20.0  # how long a send keeps weighing in an instance's recent count
QUIET = 0.01  # a recent count below this is dropped


class Assignments:
    def __init__(self) -> None:
        self._sent: dict[Key, deque[float]] = {}  # send times, oldest first
        self._recent: dict[Key, tuple[float, float]] = {}  # (decaying count, as of)
        self._no_quiet_before = math.inf  # no recent count falls below QUIET before this time

    def record(self, key: Key, at: float) -> None:
        self._sent.setdefault(key, deque()).append(at)
        count = self.recent(key, at) + 1.0
        self._recent[key] = (count, at)
        self._no_quiet_before = min(self._no_quiet_before, _quiet_from(count, at))

    def recent(self, key: Key, now: float) -> float:
        """Requests sent to `key` lately, each weighing half as much every RECENT_HALF_LIFE_S."""
        count, at = self._recent.get(key, (0.0, now))
        return count * 0.5 ** (max(now - at, 0.0) / RECENT_HALF_LIFE_S)

    def recent_all(self, now: float) -> dict[Key, float]:
        """recent() of every key with a count (absent: 0.0), at once."""
        return {
            key: count * 0.5 ** ((now - at if now >= at else 0.0) / RECENT_HALF_LIFE_S)
            for key, (count, at) in self._recent.items()
        }

    def pending(self, key: Key, reported_at: float) -> int:
        """Requests sent to `key` after its last report (received at reported_at); those sent
        before are dropped: that report counts them."""
        sent = self._sent.get(key)
        if sent is None:
            return 0
        while sent and sent[0] <= reported_at:
            sent.popleft()
        if not sent:
            del self._sent[key]
        return len(sent)

    def unreported(self) -> Collection[Key]:
        """The keys pending() may count anything for (for every other key it is 0)."""
        return self._sent.keys()

    def finished(self, key: Key, at: float) -> None:
        """The request sent to `key` at `at` ended before a report counted it: it no longer
        loads the instance (a burst of short requests would otherwise count many times over)."""
        sent = self._sent.get(key)
        if sent is not None and at in sent:
            sent.remove(at)

    def expire(self, before: float) -> None:
        """Drop what was sent before `before` everywhere: an instance that reported since has
        counted it, and one that did not is no longer alive (so an instance that left leaves
        nothing behind)."""
        for key in list(self._sent):
            self.pending(key, before)
        if before < self._no_quiet_before:
            return  # no count can have decayed below QUIET yet: skip the scan
        for key in [k for k in self._recent if self.recent(k, before) < QUIET]:
            del self._recent[key]  # long quiet (or gone): nothing left to weigh
        self._no_quiet_before = min((_quiet_from(c, at) for c, at in self._recent.values()), default=math.inf)

    def __len__(self) -> int:
        return len(self._sent)


def _quiet_from(count: float, at: float) -> float:
    """A time before which `count` sent at `at` stays at or above QUIET, with a second to
    spare for rounding (the scan itself decides exactly)."""
    return at + RECENT_HALF_LIFE_S * math.log2(count / QUIET) - 1.0
