"""The capacity search behind `pdd sim plan`: the cheapest fleet that meets an SLA.

Every evaluation is a simulation, so the search is a heuristic that spends few of them:
  1. start each role from analytic figures (prefill: a floor, the workload's uncached prompt
     work over one chip's; decode: output tokens/s over one chip's at the largest batch its KV
     and the TPOT target allow, an estimate that is high where prompts share prefixes in KV;
     the relay: a small share of decode);
  2. grow: while the SLA fails, add instances (a quarter more, at least one) to the role the
     misses point at (TTFT → P, TPOT/gap of relayed requests → RLD, of the others → MD/D,
     unfinished requests → the busiest role); a role whose growth did not raise attainment
     is passed over for the next-most pointed one until something helps; at the instance
     cap, roles nothing points at are first cut back to make room;
  3. shrink: role by role, dearest instance first, bisect the fewest instances that still meet
     (a fleet no bigger than one that missed is not simulated again: it misses too);
  4. do this for every choice of profile per role, cheapest start first, skipping a choice whose
     floor (a bound below any fleet of it) already costs at least the best fleet found; keep the
     cheapest fleet.
Evaluations are memoised and capped. Limits: the bisection assumes attainment never falls when
a role grows; the result is minimal one role at a time, not over trades between roles (fewer P
for more MD), so it is a good fleet, not a proven optimum; one WAN line is assumed.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace

from pdd.sim.hardware.step_cost import StepCost, chunk_load

ROLES = ("prefill", "relay", "decode")
GROWTH = 0.25  # a growth step adds this share of a role's instances (at least one)
RELAY_SHARE = 0.1  # the relay's starting count as a share of decode's


@dataclass(frozen=True)
class Shape:
    """The profile of each role; relay None: a same-DC PD fleet (P and D, no relay)."""

    prefill: str
    decode: str
    relay: str | None = None
    dc: str = "dc-a+dc-b"  # where it runs: one DC's name for a same-DC fleet

    @property
    def roles(self) -> tuple[str, ...]:
        return ROLES if self.relay else ("prefill", "decode")

    def profile(self, role: str) -> str | None:
        return getattr(self, role)


@dataclass(frozen=True)
class Counts:
    """Instances per role of one shape: a candidate fleet."""

    shape: Shape
    prefill: int
    decode: int
    relay: int = 0

    def count(self, role: str) -> int:
        return getattr(self, role)

    def with_count(self, role: str, n: int) -> Counts:
        return replace(self, **{role: n})

    @property
    def instances(self) -> int:
        return self.prefill + self.decode + self.relay


@dataclass(frozen=True)
class Outcome:
    """What one evaluation says of a fleet."""

    attainment: float  # share of offered requests that met the SLA
    pressure: dict[str, float]  # per role: share of offered requests whose miss points at it
    summary: dict = field(default_factory=dict)  # the simulated figures, for the report


Evaluate = Callable[[Counts], Outcome]
Cost = Callable[[Counts], float]


class Evaluations:
    """`evaluate` memoised and capped at max_evals distinct fleets; None once the cap is spent."""

    def __init__(
        self, evaluate: Evaluate, max_evals: int, on_eval: Callable[[Counts, Outcome], None] | None = None
    ) -> None:
        self.evaluate, self.max_evals, self.on_eval = evaluate, max_evals, on_eval
        self.seen: dict[Counts, Outcome] = {}

    @property
    def spent(self) -> int:
        return len(self.seen)

    def __call__(self, fleet: Counts) -> Outcome | None:
        if fleet in self.seen:
            return self.seen[fleet]
        if self.spent >= self.max_evals:
            return None
        out = self.seen[fleet] = self.evaluate(fleet)
        if self.on_eval:
            self.on_eval(fleet, out)
        return out


@dataclass
class Search:
    evaluations: Evaluations
    cost: Cost
    target: float  # the SLA's attainment
    max_instances: int
    shapes: dict[Shape, str] = field(default_factory=dict)  # what became of each shape, for the report

    def meets(self, fleet: Counts) -> bool | None:
        """Simulated unless a fleet already simulated implies the answer; None: evaluations spent."""
        known = self.implied(fleet)
        if known is not None:
            return known
        out = self.evaluations(fleet)
        return None if out is None else out.attainment >= self.target

    def implied(self, fleet: Counts) -> bool | None:
        """Met when a fleet of the same shape with no more of any role met; missed when one with
        no fewer missed (more instances never lower attainment: the search's assumption)."""
        for f, out in self.evaluations.seen.items():
            if f.shape != fleet.shape:
                continue
            met = out.attainment >= self.target
            below = [fleet.count(r) - f.count(r) for r in f.shape.roles]
            if met and min(below) >= 0 or not met and max(below) <= 0:
                return met
        return None


def cheapest(
    starts: Iterable[Counts], search: Search, floors: dict[Shape, Counts] | None = None
) -> Counts | None:
    """The cheapest fleet meeting the SLA over every shape, each searched from its start
    (fewer instances on a tie), the cheapest start first; a shape whose floor (no fleet of it
    below; its start when not given) costs at least the best fleet found is skipped. None when
    no fleet was found within the caps."""
    best: Counts | None = None
    for start in sorted(starts, key=lambda f: (search.cost(f), f.instances)):
        floor = (floors or {}).get(start.shape, start)
        if best is not None and search.cost(floor) >= search.cost(best):
            search.shapes[start.shape] = "skipped: its floor costs at least the best fleet's"
            continue
        if search.evaluations.spent >= search.evaluations.max_evals:
            search.shapes[start.shape] = "skipped: the evaluations were spent"
            continue
        met = grow(start, search)
        if met is None:
            spent = search.evaluations.spent >= search.evaluations.max_evals
            search.shapes[start.shape] = (
                "stopped: the evaluations ran out"
                if spent
                else "searched: no fleet met the SLA within max instances"
            )
            continue
        met = shrink(met, search)
        counts = ", ".join(f"{met.count(r)} {r}" for r in met.shape.roles)
        search.shapes[start.shape] = f"searched: {counts} met it"
        if best is None or (search.cost(met), met.instances) < (search.cost(best), best.instances):
            best = met
    return best


def grow(fleet: Counts, search: Search) -> Counts | None:
    """The first fleet on the way up from `fleet` that meets; None past max_instances or the cap."""
    if fleet.instances > search.max_instances:
        return None
    stale: set[str] = set()  # roles whose last growth raised nothing
    last, grown, seen = None, (), set()
    while fleet not in seen:  # at the instance cap, room made may be room spent before
        seen.add(fleet)
        out = search.evaluations(fleet)
        if out is None:
            return None
        if out.attainment >= search.target:
            return fleet
        if last is not None:
            stale = set() if out.attainment > last else stale | set(grown)
        last, grown = out.attainment, pointed_roles(out.pressure, fleet.shape.roles, stale)
        bigger = grow_roles(fleet, grown, search.max_instances)
        if bigger is None:
            bigger = grow_roles(make_room(fleet, out, search), grown, search.max_instances)
        if bigger is None:
            return None
        fleet = bigger
    return None


def make_room(fleet: Counts, out: Outcome, search: Search) -> Counts:
    """At the instance cap: each role no miss points at cut to the fewest instances that keep
    it so (an earlier growth step may have overshot it)."""
    for role in fleet.shape.roles:
        if out.pressure.get(role, 0.0) == 0:
            fleet = fewest(fleet, role, lambda f, r=role: _unpressed(search.evaluations(f), r))
    return fleet


def _unpressed(out: Outcome | None, role: str) -> bool | None:
    return None if out is None else out.pressure.get(role, 0.0) == 0


def pointed_roles(pressure: dict[str, float], roles: tuple[str, ...], stale: set[str]) -> tuple[str, ...]:
    """The most pointed-at role not stale; every role when all pointed ones are stale."""
    fresh = [r for r in roles if r not in stale and pressure.get(r, 0.0) > 0]
    if not fresh:
        return roles
    return (max(fresh, key=lambda r: pressure[r]),)


def grow_roles(fleet: Counts, roles: tuple[str, ...], max_instances: int) -> Counts | None:
    """Each of `roles` a step bigger, as far as max_instances lets; None when nothing fits."""
    room = max_instances - fleet.instances
    if room <= 0:
        return None
    for role in roles:
        n = fleet.count(role)
        step = min(max(1, math.ceil(n * GROWTH)), room)
        if step <= 0:
            break
        fleet, room = fleet.with_count(role, n + step), room - step
    return fleet


def shrink(fleet: Counts, search: Search) -> Counts:
    """Each role (dearest instance first) cut to the fewest instances that still meet."""
    for role in sorted(fleet.shape.roles, key=lambda r: -unit_cost(fleet, r, search.cost)):
        fleet = fewest(fleet, role, search.meets)
    return fleet


def fewest(fleet: Counts, role: str, holds: Callable[[Counts], bool | None]) -> Counts:
    """`fleet` with the fewest instances of `role` (bisected, at least one) for which `holds`,
    which it does for `fleet`; holds None (the evaluations are spent) stops at the best so far."""
    fails, ok = 0, fleet.count(role)  # no instance of a role never serves
    while ok - fails > 1:
        mid = (fails + ok) // 2
        verdict = holds(fleet.with_count(role, mid))
        if verdict is None:
            break
        fails, ok = (fails, mid) if verdict else (mid, ok)
    return fleet.with_count(role, ok)


def unit_cost(fleet: Counts, role: str, cost: Cost) -> float:
    return cost(fleet.with_count(role, fleet.count(role) + 1)) - cost(fleet)


# ---- analytic floors -------------------------------------------------------------------


def prefill_floor(prompts: Iterable[tuple[int, int]], duration_s: float, step: StepCost) -> int:
    """Chips that just keep up with computing the uncached prompts, given as (cached tokens,
    prompt tokens): each prompt's work over its context, without the per-step constants that
    batching shares (a floor, not a target: queues grow at 100% busy)."""
    work = 0.0
    for cached, total in prompts:
        load = chunk_load(total - cached, cached)
        work += max(step.compute(load), step.memory(load) - step.memory.const)
    return max(1, math.ceil(work / duration_s)) if duration_s > 0 else 1


def decode_batch(step: StepCost, context: float, kv_tokens: int, tpot_s: float, max_seqs: int) -> int:
    """The largest batch of sequences of mean `context` that fits the KV room and whose
    decode step keeps within the TPOT target (at least one)."""
    fits = min(max_seqs, int(kv_tokens // max(context, 1.0)))
    lo, hi = 1, max(1, fits)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if step.decode_step_s(mid, int(mid * context)) <= tpot_s:
            lo = mid
        else:
            hi = mid - 1
    return lo


def decode_floor(output_tokens_per_s: float, step: StepCost, batch: int, context: float) -> int:
    """Chips that decode `output_tokens_per_s` at `batch` sequences each."""
    per_chip = batch / step.decode_step_s(batch, int(batch * context))
    return max(1, math.ceil(output_tokens_per_s / per_chip))


def relay_floor(decode: int) -> int:
    return max(1, math.ceil(decode * RELAY_SHARE))
