"""The service-level objective a deployment is held to, per request and over a run."""

from __future__ import annotations

import math
from dataclasses import dataclass

from pdd.sim.fleet.records import RequestRecord


@dataclass(frozen=True)
class Sla:
    ttft_s: float = 2.0  # time to the first token
    tpot_s: float = 0.1  # mean time per output token after the first
    max_gap_s: float | None = None  # longest stall between two tokens (None: not held)
    attainment: float = 0.9  # share of the offered requests that must meet all of the above

    def met_by(self, r: RequestRecord) -> bool:
        """A request with one output token has no TPOT or gap to miss."""
        if r.ttft_s > self.ttft_s:
            return False
        if not math.isnan(r.tpot_s) and r.tpot_s > self.tpot_s:
            return False
        return self.max_gap_s is None or math.isnan(r.max_gap_s) or r.max_gap_s <= self.max_gap_s

    def attained(self, records: list[RequestRecord], offered: int) -> float:
        """Share of `offered` requests that finished within the SLA (unfinished ones miss it)."""
        return sum(self.met_by(r) for r in records) / offered if offered else 1.0

    def describe(self) -> str:
        gap = f", max gap ≤ {self.max_gap_s:g} s" if self.max_gap_s is not None else ""
        return f"{self.attainment:.0%} of requests with TTFT ≤ {self.ttft_s:g} s, TPOT ≤ {self.tpot_s * 1000:g} ms{gap}"
