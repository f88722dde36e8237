"""Who is alive, judged from heartbeats, without false alarms.

Every instance heartbeats (its LoadReport, every 0.25 s). An observer declares a peer lost
only when the peer has been silent longer than `lost_after_s` *and* the observer has been
able to hear for at least as long: while its own NATS connection is down or was just
re-established (its server restarting), or while the observer itself was frozen (a stopped
process, a long pause), silence proves nothing, so nobody is declared lost.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Iterable
from typing import Any

HEARTBEAT_S = 0.25  # how often every instance reports its load (its heartbeat)


def is_lost(last_heard: float, now: float, lost_after_s: float, observer_up_for: float) -> bool:
    """A peer last heard at `last_heard` is lost: silent too long while the observer was up."""
    return now - last_heard > lost_after_s and observer_up_for > lost_after_s


class ConnectionWatch:
    """How long this process has been able to hear: its NATS connection up without a break,
    and the process itself running (polled every HEARTBEAT_S, so a longer gap between two
    polls means it was frozen and missed what was said meanwhile).

    Polled (cheaply) rather than hooked: nats-py counts reconnects, so even a blip shorter
    than the polling interval shows up as a changed count."""

    def __init__(
        self, nc: Any, clock: Callable[[], float] = time.monotonic, frozen_after_s: float = 3 * HEARTBEAT_S
    ) -> None:
        self.nc = nc
        self.clock = clock
        self.frozen_after_s = frozen_after_s
        self._reconnects = self._count()
        self._last_poll = clock()
        self._up_since: float | None = self._last_poll if nc.is_connected else None

    def _count(self) -> int:
        return int(self.nc.stats.get("reconnects", 0))

    def up_for(self) -> float:
        """Seconds since the connection last came (back) up; 0 while it is down."""
        now = self.clock()
        count, frozen = self._count(), now - self._last_poll > self.frozen_after_s
        if not self.nc.is_connected:
            self._up_since = None
        elif self._up_since is None or count != self._reconnects or frozen:
            self._up_since = now
        self._reconnects, self._last_poll = count, now
        return 0.0 if self._up_since is None else now - self._up_since


class Heartbeats:
    """When each peer was last heard. A peer first seen by this observer counts as heard at
    the observer's start, so one that never speaks is still noticed."""

    def __init__(self, lost_after_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.lost_after_s = lost_after_s
        self.clock = clock
        self.started = clock()
        self._last: dict[Hashable, float] = {}

    def heard(self, peer: Hashable) -> None:
        self._last[peer] = self.clock()

    def last_heard(self, peer: Hashable) -> float:
        return self._last.get(peer, self.started)

    def lost(self, peers: Iterable[Hashable], observer_up_for: float) -> set[Hashable]:
        """Those of `peers` that are lost now."""
        now = self.clock()
        return {p for p in peers if is_lost(self.last_heard(p), now, self.lost_after_s, observer_up_for)}

    def forget(self, peer: Hashable) -> None:
        self._last.pop(peer, None)

    def prune(self, keep_s: float) -> None:
        """Drop peers silent for longer than keep_s (keys come from the network: keep them bounded)."""
        now = self.clock()
        for peer in [p for p, t in self._last.items() if now - t > keep_s]:
            del self._last[peer]

    def __len__(self) -> int:
        return len(self._last)
