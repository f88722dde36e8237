"""Live instances, from their periodic load reports."""

from __future__ import annotations

import time

from shared.bus.messages import LinkReport, LoadReport, Role

from .policy import InstanceLoad


class Registry:
    def __init__(self, stale_after_s: float = 3.0):
        self.stale_after_s = stale_after_s
        self._reports: dict[tuple[str, str], tuple[LoadReport, float]] = {}

    def update(self, report: LoadReport) -> None:
        self._reports[(report.service, report.instance)] = (report, time.monotonic())

    def alive(self, service: str) -> list[LoadReport]:
        now = time.monotonic()
        return [
            r
            for (svc, _), (r, seen) in self._reports.items()
            if svc == service and now - seen < self.stale_after_s
        ]

    def silent_for(self, service: str, instance: str) -> float:
        """Seconds since the instance's last report (inf if never heard)."""
        entry = self._reports.get((service, instance))
        return time.monotonic() - entry[1] if entry else float("inf")

    def prune(self, forget_after_s: float) -> list[tuple[str, str]]:
        """Forget instances silent longer than forget_after_s (they left): the keys removed."""
        now = time.monotonic()
        gone = [key for key, (_, seen) in self._reports.items() if now - seen > forget_after_s]
        for key in gone:
            del self._reports[key]
        return gone

    def __len__(self) -> int:
        return len(self._reports)

    def get(self, service: str, instance: str) -> LoadReport | None:
        entry = self._reports.get((service, instance))
        return entry[0] if entry else None

    def loads(self, service: str) -> list[InstanceLoad]:
        """The instances that may be chosen for new work: alive and not leaving (a draining one
        stays alive() until it exits, so the requests it still runs are not taken for lost)."""
        return [
            InstanceLoad(r.instance, r.running, r.waiting, r.free_blocks)
            for r in self.alive(service)
            if not r.draining
        ]

    def _links_to(self, address: str) -> list[LinkReport]:
        return [link for r in self.alive(Role.PREFILL) for link in r.links if link.peer == address]

    def link_to(self, address: str) -> tuple[float, float] | None:
        """Mean measured (bandwidth B/s, rtt s) of the prefill instances' links toward address."""
        measured = [(k.bandwidth, k.rtt) for k in self._links_to(address) if k.bandwidth is not None]
        if not measured:
            return None
        bw = sum(b for b, _ in measured) / len(measured)
        rtt = sum(r or 0.0 for _, r in measured) / len(measured)
        return bw, rtt

    def wan_backlog(self, address: str) -> int:
        """KV bytes the prefill instances still have queued toward address."""
        return sum(link.backlog for link in self._links_to(address))
