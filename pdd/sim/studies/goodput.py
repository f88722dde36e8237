"""SLA goodput: the highest offered request rate at which a deployment still meets its SLA,
found by simulating the same workload at several rates; and what it costs (BCR).

A probe measures a steady state when it is given a `Window`: arrivals run through a warm-up
(excluded: the caches and the decoders' batches fill), a measuring window several request
lifetimes long, and a tail one SLA lifetime long (the measured requests finish under the same
load). Only requests arriving in the window count; one still running when the tail ends could
no longer meet the SLA and counts as missed. Each such probe checks Little's law over the
window: the mean number of requests in the system against the arrival rate times their mean
time in it, beside the decoders' slots (their batch caps, summed): a fleet whose requests in
the system reach its slots is at its decode capacity, whatever a shorter run would show.

Without a window a probe counts every request of the workload, each given `drain_s` after
the last arrival to finish (the short runs of `pdd sim run`'s sweep and `pdd sim plan`).

The search grows the rate by `growth` until the SLA fails (or shrinks it until it holds), then
bisects between the last rate that met it and the first that did not, down to `rel_tol`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from pdd.sim.fleet.deployment import Deployment
from pdd.sim.fleet.records import RequestRecord, SimResult
from pdd.sim.fleet.simulator import SimSettings, simulate
from pdd.sim.hardware.model_spec import ModelSpec
from pdd.sim.studies.sla import Sla
from pdd.sim.workloads.workload import Workload


@dataclass(frozen=True)
class Window:
    """A steady-state probe's phases, in seconds of arrivals."""

    warmup_s: float
    measure_s: float
    tail_s: float  # arrivals go on while the window's last requests finish (one SLA lifetime)

    @property
    def arrivals_s(self) -> float:
        """How long the workload's arrivals must run."""
        return self.warmup_s + self.measure_s + self.tail_s

    def measured(self, arrival_s: float) -> bool:
        return self.warmup_s <= arrival_s < self.warmup_s + self.measure_s

    @classmethod
    def for_sla(cls, sla: Sla, output_tokens: float, lifetimes: float = 4.0, warmup: float = 2.0) -> Window:
        """Windows in units of the longest lifetime a request meeting `sla` has (TTFT plus its
        mean output at the TPOT target): `warmup` of them, `lifetimes` measured, one of tail."""
        life = sla.ttft_s + output_tokens * sla.tpot_s
        return cls(warmup * life, lifetimes * life, life)


@dataclass(frozen=True)
class Little:
    """Little's law over a probe's window: L (mean requests in the system) against λW."""

    in_system: float  # time-average of requests arrived and not finished, over the window
    arrival_rps: float  # λ: arrivals in the window per second
    mean_time_s: float  # W: their mean time in the system (unfinished ones: to the run's end)
    slots: int  # the decoders' batch caps, summed (MD and RLD, or D)

    @property
    def lambda_w(self) -> float:
        return self.arrival_rps * self.mean_time_s

    @property
    def occupancy(self) -> float:
        """Requests in the system over decode slots (at or above 1: at decode capacity)."""
        return self.in_system / self.slots if self.slots else math.nan

    def describe(self) -> str:
        return (
            f"L {self.in_system:.0f} in system, λW {self.lambda_w:.0f}, "
            f"{self.slots} decode slots ({self.occupancy:.0%})"
        )


@dataclass
class Probe:
    rate_rps: float
    attainment: float
    result: SimResult
    measured: int = 0  # requests the attainment counts
    little: Little | None = None

    @property
    def row(self) -> dict:
        extra = {}
        if self.little is not None:
            lw = self.little
            extra = {"in_system": lw.in_system, "lambda_w": lw.lambda_w, "slots": lw.slots}
        return {
            "rate_rps": self.rate_rps,
            "attainment": self.attainment,
            "measured": self.measured,
            **extra,
            **self.result.summary(),
        }


@dataclass
class Goodput:
    rate_rps: float  # the highest probed rate that met the SLA (0.0: none did)
    probes: list[Probe] = field(default_factory=list)  # in the order they ran

    @property
    def at_goodput(self) -> Probe | None:
        met = [p for p in self.probes if p.rate_rps == self.rate_rps]
        return met[0] if met else None

    @property
    def resolution(self) -> float:
        """The first failing rate over the goodput, minus one (inf: none failed above it)."""
        above = [p.rate_rps for p in self.probes if p.rate_rps > self.rate_rps]
        return min(above) / self.rate_rps - 1.0 if above and self.rate_rps > 0 else math.inf


def decode_slots(deployment: Deployment, default: int) -> int:
    """The decoders' batch caps, summed (a chip's own cap, else `default`)."""
    roles = [deployment.decode] + ([deployment.relay] if deployment.relay else [])
    return sum(r.count * (r.chip.max_seqs or default) for r in roles)


def little(
    records: list[RequestRecord], window: Window, end_s: float, unfinished: list[float], slots: int
) -> Little:
    """Little's law over the window from the finished requests and the arrivals of unfinished
    ones (in the system until `end_s`)."""
    w0, w1 = window.warmup_s, window.warmup_s + window.measure_s
    spans = [(r.arrival_s, r.arrival_s + r.e2e_s) for r in records] + [(a, end_s) for a in unfinished]
    area = sum(max(0.0, min(b, w1) - max(a, w0)) for a, b in spans)
    inside = [(a, b) for a, b in spans if w0 <= a < w1]
    mean_time = sum(b - a for a, b in inside) / len(inside) if inside else 0.0
    return Little(area / (w1 - w0), len(inside) / (w1 - w0), mean_time, slots)


def probe(
    deployment: Deployment,
    workload: Workload,
    model: ModelSpec,
    sla: Sla,
    rate_rps: float,
    settings: SimSettings | None = None,
    drain_s: float = 120.0,
    window: Window | None = None,
) -> Probe:
    s = settings or SimSettings()
    if window is None:
        s = replace(s, time_limit_s=workload.duration_s + drain_s)
        result = simulate(deployment, workload, model, s)
        return Probe(
            rate_rps, sla.attained(result.records, len(workload.requests)), result, len(workload.requests)
        )
    s = replace(s, time_limit_s=window.arrivals_s)
    result = simulate(deployment, workload, model, s)
    measured = [r for r in result.records if window.measured(r.arrival_s)]
    done = {r.rid for r in result.records}
    unfinished = [q.arrival_s for q in workload.requests if q.rid not in done]
    offered = sum(window.measured(q.arrival_s) for q in workload.requests)
    lw = little(
        result.records, window, result.sim_time_s, unfinished, decode_slots(deployment, s.max_num_seqs)
    )
    return Probe(rate_rps, sla.attained(measured, offered), result, offered, lw)


def sla_goodput(
    deployment: Deployment,
    make_workload: Callable[[float], Workload],
    model: ModelSpec,
    sla: Sla,
    settings: SimSettings | None = None,
    *,
    start_rps: float = 1.0,
    rel_tol: float = 0.05,
    max_probes: int = 24,
    drain_s: float = 120.0,
    window: Window | None = None,
    growth: float = 2.0,
    on_probe: Callable[[Probe], None] | None = None,
) -> Goodput:
    """make_workload(rate) gives the workload offered at `rate` requests/s (with a window: its
    arrivals running window.arrivals_s)."""
    out = Goodput(0.0)

    def meets(rate: float) -> bool:
        p = probe(deployment, make_workload(rate), model, sla, rate, settings, drain_s, window)
        out.probes.append(p)
        if on_probe:
            on_probe(p)
        return p.attainment >= sla.attainment

    rate = start_rps
    step = growth if meets(rate) else 1.0 / growth
    ok, bad = (
        (rate, None) if step > 1 else (0.0, rate)
    )  # the best rate that met the SLA, the lowest that did not
    floor = start_rps / 1024
    while len(out.probes) < max_probes and (bad is None if step > 1 else ok == 0.0 and rate > floor):
        rate *= step
        if meets(rate):
            ok = rate
        else:
            bad = rate
    while bad is not None and ok > 0 and bad / ok - 1 > rel_tol and len(out.probes) < max_probes:
        mid = (ok * bad) ** 0.5
        ok, bad = (mid, bad) if meets(mid) else (ok, mid)
    out.rate_rps = ok
    return out


def bcr(goodput_rps: float, cost_per_hour: float) -> float:
    """Benefit-cost ratio: SLA-bounded requests per hour per dollar of fleet per hour."""
    return goodput_rps * 3600.0 / cost_per_hour if cost_per_hour > 0 else float("inf")
