"""The router's views of the instances' caches, kept whole: each instance's numbered cache
events apply in order; when the numbering breaks (first contact, a restart, a lost message)
the instance's whole cache is fetched; now and then every cache is fetched anyway."""

from __future__ import annotations

import asyncio
import logging

from shared.bus import subjects
from shared.bus.connection import request
from shared.bus.messages import KVEvents, KVSnapshot, KVSnapshotRequest, Role
from shared.config import RouterSettings
from shared.serving.runtime import Lifecycle

from ..routing.cache_view import CacheView

log = logging.getLogger(__name__)


class CacheSync:
    def __init__(
        self, settings: RouterSettings, nc, identity: str, caches: dict[Role, CacheView], life: Lifecycle
    ) -> None:
        self.settings, self.nc, self.identity, self.caches, self.life = settings, nc, identity, caches, life

    async def on_kv_events(self, ev: KVEvents, raw) -> None:
        if subjects.kv_events_source(raw.subject) != (ev.role.value, ev.instance):
            return  # the subject (which permissions vouch for) names someone else
        view = self.caches.get(ev.role)
        if view is not None and view.on_events(ev):
            self.life.spawn(self._sync(ev.role, ev.instance))

    async def resync(self) -> None:
        """The safety net: now and then every instance's whole cache, whatever its numbering says."""
        for role, view in self.caches.items():
            for instance in view.resync():
                self.life.spawn(self._sync(role, instance))

    async def _sync(self, role: Role, instance: str) -> None:
        """Ask the instance for its cache until the view is whole again (one at a time: only
        the call that started the sync runs this); stops if the instance is forgotten."""
        view = self.caches[role]
        subject = subjects.kv_snapshot(role.value, instance)
        timeout = self.settings.kv_snapshot_timeout_s
        while view.syncing(instance):
            try:
                snap = await request(
                    self.nc, subject, KVSnapshotRequest(self.identity), KVSnapshot, timeout=timeout
                )
                if (snap.role, snap.instance) != (role, instance):
                    raise ValueError(f"the snapshot is {snap.role.value} {snap.instance}'s")
            except Exception as e:  # gone, busy, or NATS trouble: ask again
                log.info("no cache snapshot from %s %s: %s", role.value, instance, e or type(e).__name__)
                await asyncio.sleep(timeout)
                continue
            view.on_snapshot(snap)
