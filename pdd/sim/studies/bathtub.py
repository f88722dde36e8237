"""The hit-rate bathtub: PDD's throughput benefit over a baseline as the prefix hit rate varies.

At each hit rate of a grid, every request of an open-loop workload reuses that share of its
prompt (fixed_hit_open_loop); the benefit is PDD's SLA goodput over the baseline's. The PDD
paper reports a bathtub: high at both ends, low in the middle, with dips where the uncached tail of
a prompt is a small chunk that cannot batch with other work.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pdd.sim.fleet.deployment import Deployment
from pdd.sim.fleet.simulator import SimSettings
from pdd.sim.hardware.model_spec import ModelSpec
from pdd.sim.studies.goodput import Goodput, sla_goodput
from pdd.sim.studies.sla import Sla
from pdd.sim.workloads.workload import Workload

GRID = (0.0, 0.2, 0.4, 0.6, 0.8, 0.9, 0.95, 0.99)


@dataclass
class BathtubPoint:
    hit: float
    pdd_rps: float  # SLA goodput of the PDD deployment at this hit rate
    base_rps: float  # ... and of the baseline
    probes: int  # simulations run for both searches

    @property
    def benefit(self) -> float:
        """PDD's goodput over the baseline's (inf when only PDD meets the SLA, nan when neither)."""
        if self.base_rps > 0:
            return self.pdd_rps / self.base_rps
        return float("inf") if self.pdd_rps > 0 else float("nan")

    @property
    def row(self) -> dict:
        return {
            "hit": self.hit,
            "pdd_rps": self.pdd_rps,
            "base_rps": self.base_rps,
            "benefit": self.benefit,
            "probes": self.probes,
        }


def bathtub(
    pdd_deployment: Deployment,
    baseline: Deployment,
    make_workload: Callable[[float, float], Workload],
    model: ModelSpec,
    sla: Sla,
    settings: SimSettings | None = None,
    *,
    hits: tuple[float, ...] = GRID,
    start_rps: float = 1.0,
    rel_tol: float = 0.1,
    drain_s: float = 30.0,
    on_point: Callable[[BathtubPoint], None] | None = None,
) -> list[BathtubPoint]:
    """make_workload(hit, rate) gives the fixed-hit workload offered at `rate` requests/s."""
    points = []
    for hit in hits:
        found: list[Goodput] = []
        for d in (pdd_deployment, baseline):
            found.append(
                sla_goodput(
                    d,
                    lambda rate, hit=hit: make_workload(hit, rate),
                    model,
                    sla,
                    settings,
                    start_rps=start_rps,
                    rel_tol=rel_tol,
                    drain_s=drain_s,
                )
            )
        point = BathtubPoint(hit, found[0].rate_rps, found[1].rate_rps, sum(len(g.probes) for g in found))
        points.append(point)
        if on_point:
            on_point(point)
    return points
