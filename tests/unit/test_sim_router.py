"""The simulator's router keeps one load per instance and updates it in place where the
instance's figures moved: at every route each must equal the load made afresh."""

import pytest

from pdd.sim.fleet.deployment import LinkSpec, RoleSpec, pdd, same_dc
from pdd.sim.fleet.router import SimRouter
from pdd.sim.fleet.simulator import simulate
from pdd.sim.hardware.chip import Chip
from pdd.sim.workloads.agentic import BENCH, agentic_open_loop
from services.router.routing.policy import InstanceLoad, load_of
from shared.bus.messages import Role
from tests.sim_util import BLOCK, FLAT, TINY

SMALL = Chip(
    "small", FLAT.step, kv_capacity_bytes=16 * 16 * 600, price_per_hour=1.0
)  # 600 blocks: requests wait
WAN = LinkSpec(2e6, 0.02, 0.005)


def _afresh(router: SimRouter, role: Role, inst) -> InstanceLoad:
    """The load the router service would make of the instance's report and its own sends now."""
    key, now = (role.value, inst.name), router.loop.now
    reported_at = now - router.md_report_delay_s if role is Role.MAIN_DECODE else now
    pending = router.assignments.pending(key, reported_at) if key in router.assignments.unreported() else 0
    pending += router.on_the_way(inst.name) if role is Role.RELAY else 0  # sent, its KV not landed yet
    running, waiting = inst.load_counts()
    return InstanceLoad(
        inst.name,
        running,
        waiting,
        len(inst.pool.free),
        inst.pool.num_blocks,
        inst.held,
        pending,
        router.assignments.recent_all(now).get(key, 0.0),
    )


def _checked_routes(monkeypatch, fleet) -> tuple[int, int]:
    """Simulate with every route's loads compared to loads made afresh: (routes, loads that
    moved between two routes of the same instance)."""
    plan, counts, last = SimRouter.plan, [0, 0], {}

    def checked(router: SimRouter, req):
        out = plan(router, req)
        for role, members in router._members.items():
            for m in members:
                fresh = _afresh(router, role, m.inst)
                fields = ("running", "waiting", "free_blocks", "num_blocks", "held", "pending", "recent")
                assert tuple(getattr(m, f) for f in fields) == tuple(getattr(fresh, f) for f in fields), (
                    m.instance
                )
                assert m.load == load_of(fresh)
                counts[1] += last.get(m.instance, m.load) != m.load
                last[m.instance] = m.load
        counts[0] += 1
        return out

    monkeypatch.setattr(SimRouter, "plan", checked)
    traffic = agentic_open_loop(BENCH, 12.0, 20.0, BLOCK, seed=1)
    result = simulate(fleet, traffic, TINY)
    assert len(result.records) == len(traffic.requests)
    return counts[0], counts[1]


@pytest.mark.parametrize(
    "fleet",
    [
        pdd(RoleSpec(3, SMALL), RoleSpec(2, SMALL), RoleSpec(3, SMALL), WAN),
        same_dc(RoleSpec(3, SMALL), RoleSpec(3, SMALL)),
    ],
    ids=["pdd", "same-dc"],
)
def test_the_loads_kept_in_place_equal_loads_made_afresh_at_every_route(monkeypatch, fleet):
    routes, moved = _checked_routes(monkeypatch, fleet)
    assert routes > 200 and moved > routes  # loads moved often between routes: the check had work to do
