"""Requests this router sent to each instance that the instance's load report cannot show yet.

Instances report their load every HEARTBEAT_S; without this, every request of a burst within
one interval would see the same reports and land on the same instance. A request counts
toward its instance's load from when it is sent until the instance's next report (which
counts it itself). Times are the caller's clock (time.monotonic in the router)."""

from __future__ import annotations

from collections import deque

Key = tuple[str, str]  # (role, instance)


class Assignments:
    def __init__(self) -> None:
        self._sent: dict[Key, deque[float]] = {}  # send times, oldest first

    def record(self, key: Key, at: float) -> None:
        self._sent.setdefault(key, deque()).append(at)

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

    def __len__(self) -> int:
        return len(self._sent)
