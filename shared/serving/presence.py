"""An engine service as the others see it: the load report it heartbeats (listing the requests
it holds) and the routers it follows. A router that stopped heartbeating cannot stream its
requests to anyone: `orphans` names the jobs to drop."""

from __future__ import annotations

import secrets
from collections.abc import Iterable
from typing import Any

from shared.bus.messages import LinkReport, LoadReport, Role
from shared.engine import EngineStats
from shared.serving.liveness import ConnectionWatch, Heartbeats

ROUTERS_KEPT_S = 600.0  # a router silent this long is forgotten


class Presence:
    def __init__(self, role: Role, instance: str, nc: Any, orphan_after_s: float) -> None:
        self.role, self.instance = role, instance
        self.epoch = secrets.token_hex(8)  # this process (LoadReport.epoch)
        self.routers = Heartbeats(orphan_after_s)
        self.conn = ConnectionWatch(nc)

    def report(
        self,
        stats: EngineStats,
        held: Iterable[str],
        *,
        address: str | None,
        links: list[LinkReport],
        model_id: str,
        draining: bool,
    ) -> LoadReport:
        return LoadReport(
            service=self.role,
            instance=self.instance,
            running=stats.running,
            waiting=stats.waiting,
            num_blocks=stats.num_blocks,
            used_blocks=stats.used_blocks,
            free_blocks=stats.free_blocks,
            address=address,
            links=links,
            model_id=model_id,
            held=list(held),
            draining=draining,
            epoch=self.epoch,
        )

    def orphans(self, jobs: Iterable[Any]) -> list[Any]:
        """The jobs whose router stopped heartbeating (not while this side could not hear)."""
        jobs = list(jobs)
        lost = self.routers.lost({job.router for job in jobs if job.router}, self.conn.up_for())
        self.routers.prune(keep_s=ROUTERS_KEPT_S)
        return [job for job in jobs if job.router in lost]
