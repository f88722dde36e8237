"""SLA goodput: the highest offered request rate at which a deployment still meets its SLA,
found by simulating the same workload at increasing rates; and what it costs (BCR).

The search doubles the rate until the SLA fails, then bisects between the last rate that met
it and the first that did not, down to `rel_tol`. Each probe runs the workload for its own
duration plus `drain_s`; requests still unfinished then count as missing the SLA, so an
overloaded probe ends in bounded time instead of simulating an ever-growing queue.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from pdd.sim.deployment import Deployment
from pdd.sim.model_spec import ModelSpec
from pdd.sim.records import SimResult
from pdd.sim.simulator import SimSettings, simulate
from pdd.sim.sla import Sla
from pdd.sim.workload import Workload


@dataclass
class Probe:
    rate_rps: float
    attainment: float
    result: SimResult

    @property
    def row(self) -> dict:
        return {"rate_rps": self.rate_rps, "attainment": self.attainment, **self.result.summary()}


@dataclass
class Goodput:
    rate_rps: float  # the highest probed rate that met the SLA (0.0: none did)
    probes: list[Probe] = field(default_factory=list)  # in the order they ran

    @property
    def at_goodput(self) -> Probe | None:
        met = [p for p in self.probes if p.rate_rps == self.rate_rps]
        return met[0] if met else None


def probe(
    deployment: Deployment,
    workload: Workload,
    model: ModelSpec,
    sla: Sla,
    rate_rps: float,
    settings: SimSettings | None = None,
    drain_s: float = 120.0,
) -> Probe:
    s = replace(settings or SimSettings(), time_limit_s=workload.duration_s + drain_s)
    result = simulate(deployment, workload, model, s)
    return Probe(rate_rps, sla.attained(result.records, len(workload.requests)), result)


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
    on_probe: Callable[[Probe], None] | None = None,
) -> Goodput:
    """make_workload(rate) gives the workload offered at `rate` requests/s."""
    out = Goodput(0.0)

    def meets(rate: float) -> bool:
        p = probe(deployment, make_workload(rate), model, sla, rate, settings, drain_s)
        out.probes.append(p)
        if on_probe:
            on_probe(p)
        return p.attainment >= sla.attainment

    rate = start_rps
    step = 2.0 if meets(rate) else 0.5
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
