"""The request life's NATS side: subscribes, turns what arrives and the clock into events for
the life, and has their actions performed."""

from __future__ import annotations

import time

from shared.bus import subjects
from shared.bus.connection import publish
from shared.bus.messages import KVEvents, LoadReport, Role, TokenBatch, TokenEvent
from shared.config import RouterSettings
from shared.serving.liveness import HEARTBEAT_S, ConnectionWatch
from shared.serving.runtime import Lifecycle

from ..core.request_life import RequestLife
from ..routing.fleet_view import FleetView
from .cache_sync import CacheSync
from .effects import Effects

WATCH_EVERY_S = 0.1  # how often streams are checked for a lost producer (a loss is acted on within this)


class BusAdapter:
    def __init__(
        self,
        settings: RouterSettings,
        nc,
        identity: str,
        requests: RequestLife,
        fleet: FleetView,
        effects: Effects,
        life: Lifecycle,
    ) -> None:
        self.settings, self.nc, self.identity, self.life = settings, nc, identity, life
        self.requests, self.fleet, self.effects = requests, fleet, effects
        self.conn = ConnectionWatch(nc)
        self.cache_sync = CacheSync(settings, nc, identity, fleet.caches, life)

    async def start(self) -> None:
        # One batch per engine step, addressed to this router alone.
        await self.life.subscribe(
            self.nc, subjects.router_tokens(self.identity), TokenBatch, self._on_token_batch
        )
        await self.life.subscribe(self.nc, subjects.all_kv_events(), KVEvents, self.cache_sync.on_kv_events)
        await self.life.subscribe(self.nc, subjects.all_load(), LoadReport, self._on_load)
        self.life.every(HEARTBEAT_S, self._heartbeat)
        self.life.every(WATCH_EVERY_S, self._watch_streams)
        self.life.every(self.settings.kv_snapshot_every_s, self.cache_sync.resync)

    async def _on_tokens(self, ev: TokenEvent, raw) -> None:
        await self.effects.perform_in_order(self.requests.on_tokens(ev, time.monotonic()))

    async def _on_token_batch(self, batch: TokenBatch, raw) -> None:
        """One engine step's events for this router's requests, from one instance."""
        for ev in batch.events:
            await self._on_tokens(ev, raw)

    async def _on_load(self, report: LoadReport, raw) -> None:
        """A heartbeat: the instance is alive, and holds the requests it lists."""
        if report.service is Role.ROUTER:
            return
        self.fleet.registry.update(report)
        await self.effects.perform_in_order(self.requests.on_held(report, time.monotonic()))

    async def _heartbeat(self) -> None:
        """Backends drop the requests of a router that stops heartbeating."""
        report = LoadReport(service=Role.ROUTER, instance=self.identity, running=len(self.requests.streams))
        await publish(self.nc, subjects.load(Role.ROUTER.value, self.identity), report)

    async def _watch_streams(self) -> None:
        """Act on lost instances. Not while this router's own NATS link was just down: then
        every silence is its own, and the heartbeats need a moment to come back (two of them:
        a stream whose producer is still unheard then lost tokens in the outage anyway)."""
        if self.conn.up_for() <= 2 * HEARTBEAT_S:
            return
        alive_md = {r.instance for r in self.fleet.registry.alive(Role.MAIN_DECODE)}
        alive_p = {r.instance: r.epoch for r in self.fleet.registry.alive(Role.PREFILL)}
        await self.effects.perform_in_order(self.requests.tick(time.monotonic(), alive_md, alive_p))
        self.fleet.prune()
