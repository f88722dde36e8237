"""The request life's NATS side: subscribes, turns what arrives and the clock into events for
the life, and has their actions performed."""

from __future__ import annotations

import logging
import time

from shared.bus import subjects
from shared.bus.connection import publish
from shared.bus.contract import TABLES, At
from shared.bus.messages import IdentityFault, LoadReport, Role, TokenBatch, TokenEvent
from shared.config import RouterSettings
from shared.serving.liveness import HEARTBEAT_S, ConnectionWatch
from shared.serving.runtime import Lifecycle
from shared.serving.subscriptions import serve

from ..core.request_life import RequestLife
from ..core.set_aside import SetAside
from ..routing.fleet_view import FleetView
from .cache_sync import CacheSync
from .effects import Effects

log = logging.getLogger(__name__)

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
        self.set_aside = SetAside()  # the router's own, given by RouterCore

    async def start(self) -> None:
        await serve(self, TABLES[Role.ROUTER.value], At(self.identity), self.life, self.nc)
        self.life.every(HEARTBEAT_S, self._heartbeat)
        self.life.every(WATCH_EVERY_S, self._watch_streams)
        self.life.every(self.settings.kv_snapshot_every_s, self.cache_sync.resync)

    async def _on_tokens(self, ev: TokenEvent, raw) -> None:
        await self.effects.perform_in_order(self.requests.on_tokens(ev, time.monotonic()))

    async def on_token_batch(self, batch: TokenBatch, raw) -> None:
        """One engine step's events for this router's requests, from one instance."""
        for ev in batch.events:
            await self._on_tokens(ev, raw)

    async def on_load(self, report: LoadReport, raw) -> None:
        """A heartbeat: the instance is alive, and holds the requests it lists."""
        if report.service is Role.ROUTER:
            return
        self.fleet.registry.update(report)
        if (left := self.set_aside.reported(report.service, report.instance, report.epoch)) is not None:
            log.warning(
                "%s %s returns: a new process (it was set aside: %s)",
                report.service.value,
                report.instance,
                left.reason,
            )
        await self.effects.perform_in_order(self.requests.on_held(report, time.monotonic()))

    async def on_identity_fault(self, fault: IdentityFault, raw) -> None:
        """A peer refused an instance's identity on the KV channel: it is set aside (no new
        work, its requests move) until it restarts. The reporter's role is the subject's last
        token (each role may publish only its own)."""
        reporter = raw.subject.rsplit(".", 1)[-1]
        report = self.fleet.registry.get(fault.role, fault.instance) if fault.instance else None
        aside = self.set_aside.fault(fault, reporter, report.epoch if report else "", time.monotonic())
        if aside is None:
            if not fault.instance:
                log.warning(
                    "%s %s refused a KV peer at %s: %s", reporter, fault.reporter, fault.peer, fault.reason
                )
            return
        moves = self.set_aside.moves(self.requests.streams.values())
        log.warning(
            "%s %s set aside: %s refused it on the KV channel: %s; %d requests move elsewhere",
            fault.role.value,
            fault.instance,
            aside.reporter,
            fault.reason,
            len(moves),
        )
        await self.effects.perform_in_order(moves)

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
        aside_md = self.set_aside.of(Role.MAIN_DECODE)  # one set aside is lost to its requests
        alive_md = {r.instance for r in self.fleet.registry.alive(Role.MAIN_DECODE)} - aside_md
        alive_p = {r.instance: r.epoch for r in self.fleet.registry.alive(Role.PREFILL)}
        await self.effects.perform_in_order(self.requests.tick(time.monotonic(), alive_md, alive_p))
        if self.set_aside.instances:
            await self.effects.perform_in_order(self.set_aside.moves(self.requests.streams.values()))
        self.fleet.prune()
