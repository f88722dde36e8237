"""Keeps a PrefixIndex exact for one role's instances, from their numbered cache events.

An instance numbers its KVEvents messages (`seq`, one more each time, within an `epoch` that
changes when it restarts). A message that continues the numbering is applied; one that repeats
an old number is dropped; anything else (an instance met for the first time, a new epoch, a
number skipped: a message was lost) means the view cannot be trusted, and the caller must fetch
the instance's whole cache (a KVSnapshot). While that is under way the instance's messages wait
in a buffer; the snapshot replaces the view, then the buffered messages after its seq apply.

Pure bookkeeping: the caller does the asking (one fetch at a time per instance, while
`syncing(instance)`), this class only says when.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from shared.bus.messages import KVEvents, KVSnapshot

from .prefix_index import PrefixIndex

BUFFER_MAX = 4096  # messages kept while a snapshot is pending; losing older ones only costs another


@dataclass
class Feed:
    """What the router knows of one instance's numbering."""

    epoch: str | None = None  # None: never synced
    seq: int = 0  # the last message applied (or the snapshot's)
    syncing: bool = False  # a snapshot is wanted: messages wait in `buffer`
    buffer: deque[KVEvents] = field(default_factory=lambda: deque(maxlen=BUFFER_MAX))


class CacheView:
    def __init__(self, index: PrefixIndex) -> None:
        self.index = index
        self.feeds: dict[str, Feed] = {}

    def on_events(self, ev: KVEvents) -> bool:
        """Apply `ev` if it is the instance's next message. True if the instance must be asked
        for a snapshot now (its feed just broke); False while one is pending already."""
        feed = self.feeds.setdefault(ev.instance, Feed())
        if feed.syncing:
            feed.buffer.append(ev)
            return False
        if self._follows(feed, ev):
            return False
        feed.syncing = True
        feed.buffer.append(ev)  # applied after the snapshot, should that be older
        return True

    def on_snapshot(self, snap: KVSnapshot) -> bool:
        """Replace the instance's view with `snap`, then apply the buffered messages after it.
        True if the feed broke again among them: ask for another snapshot."""
        feed = self.feeds.get(snap.instance)
        if feed is None or not feed.syncing:
            return False  # forgotten meanwhile, or not asked for
        self.index.apply(snap.instance, snap.stored, [], reset=True)
        feed.epoch, feed.seq = snap.epoch, snap.seq
        while feed.buffer:
            if not self._follows(feed, feed.buffer.popleft()):
                # Everything buffered was sent before the next snapshot is asked for: it covers them.
                feed.buffer.clear()
                return True
        feed.syncing = False
        return False

    def resync(self) -> list[str]:
        """Mark every instance not syncing yet as wanting a snapshot (a periodic safety net);
        the instances to ask."""
        due = [inst for inst, feed in self.feeds.items() if not feed.syncing]
        for inst in due:
            self.feeds[inst].syncing = True
        return due

    def syncing(self, instance: str) -> bool:
        feed = self.feeds.get(instance)
        return feed is not None and feed.syncing

    def forget(self, instance: str) -> None:
        """The instance left: drop its feed and what it held."""
        self.feeds.pop(instance, None)
        self.index.forget(instance)

    def _follows(self, feed: Feed, ev: KVEvents) -> bool:
        """Apply ev if it is the next message, drop it if it is an old one; False if the feed
        broke (another epoch, or a message missing before this one)."""
        if ev.epoch != feed.epoch or ev.seq > feed.seq + 1:
            return False
        if ev.seq == feed.seq + 1:
            self.index.apply(ev.instance, ev.stored, ev.evicted)
            feed.seq = ev.seq
        return True
