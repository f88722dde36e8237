"""Live instances, from their periodic load reports."""

from __future__ import annotations

import time

from shared.bus.messages import LoadReport

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

    def get(self, service: str, instance: str) -> LoadReport | None:
        entry = self._reports.get((service, instance))
        return entry[0] if entry else None

    def loads(self, service: str) -> list[InstanceLoad]:
        return [InstanceLoad(r.instance, r.running, r.waiting, r.free_blocks) for r in self.alive(service)]

    def link_to(self, address: str) -> tuple[float, float] | None:
        """Best current (bandwidth B/s, rtt s) estimate any prefill instance has toward address."""
        estimates = [
            r.links[address] for r in self.alive("prefill") if "bandwidth" in r.links.get(address, {})
        ]
        if not estimates:
            return None
        bw = sum(e["bandwidth"] for e in estimates) / len(estimates)
        rtt = sum(e["rtt"] for e in estimates) / len(estimates)
        return bw, rtt

    def wan_backlog(self, address: str) -> int:
        """KV bytes the prefill instances still have queued toward address."""
        return sum(int(r.links.get(address, {}).get("backlog", 0)) for r in self.alive("prefill"))
