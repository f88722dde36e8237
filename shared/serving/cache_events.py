"""An instance's prefix cache as the routers see it: numbered KVEvents on its own subject, and
its whole cache (a KVSnapshot) to any router that asks.

Messages are numbered on the engine thread, where the cache changes, and a snapshot is taken
there too: it holds exactly the changes of the messages up to its seq. A later message may
repeat changes the snapshot already shows; applying them again is harmless, since a message
carries each hash's last change only (whether it ended in the cache or out of it).
"""

from __future__ import annotations

import math
import secrets
import time

from shared.bus import subjects
from shared.bus.connection import publish, respond
from shared.bus.messages import KVEvents, KVSnapshot, KVSnapshotRequest, Role
from shared.engine import Engine
from shared.serving.engine_loop import EngineLoop
from shared.serving.runtime import Lifecycle

EVENTS_EVERY_S = 0.05  # how often the cache's changes go out
IDLE_TICK_S = 1.0  # with no change for this long an empty message goes out: a lost last one shows


def last_changes(events: list[tuple[str, int]]) -> tuple[list[int], list[int]]:
    """(stored, evicted): each hash once, in the list of its last change."""
    last = {h: kind for kind, h in events}
    return [h for h, k in last.items() if k == "stored"], [h for h, k in last.items() if k == "evicted"]


class CacheEvents:
    def __init__(self, role: Role, instance: str, nc, engine_loop: EngineLoop, engine: Engine) -> None:
        self.role, self.instance, self.nc = role, instance, nc
        self.engine_loop, self.engine = engine_loop, engine
        self.epoch = secrets.token_hex(8)  # this process: a router sees a restart by its change
        self.seq = 0  # the last message's number (engine thread)
        self._sent_at = -math.inf

    def start(self, life: Lifecycle) -> None:
        """Publish the changes periodically (the snapshot requests are routed to `answer`)."""
        life.every(EVENTS_EVERY_S, self.publish)

    # ---- engine thread -------------------------------------------------------------------
    def _take(self, tick: bool) -> tuple[int, list[tuple[str, int]]] | None:
        events = self.engine.drain_block_events()
        if not events and not tick:
            return None
        self.seq += 1
        return self.seq, events

    def _snapshot(self) -> tuple[int, list[int]]:
        return self.seq, self.engine.cached_hashes()

    # ---- event loop ----------------------------------------------------------------------
    async def publish(self) -> None:
        """The changes since the last message, if any (or a tick, after IDLE_TICK_S)."""
        taken = await self.engine_loop.call(self._take, time.monotonic() - self._sent_at >= IDLE_TICK_S)
        if taken is None:
            return
        seq, events = taken
        stored, evicted = last_changes(events)
        msg = KVEvents(self.role, self.instance, self.epoch, seq, stored, evicted)
        await publish(self.nc, subjects.kv_events(self.role.value, self.instance), msg)
        self._sent_at = time.monotonic()

    async def drop(self) -> None:
        """Let the events go unsent (a cache nobody follows: they would only pile up)."""
        await self.engine_loop.call(self.engine.drain_block_events)

    async def answer(self, msg: KVSnapshotRequest, raw) -> None:
        seq, stored = await self.engine_loop.call(self._snapshot)
        await respond(raw, KVSnapshot(self.role, self.instance, self.epoch, seq, stored))
