"""The router in the simulation: the service's own route plan (services/router/route_plan.py)
over the instances' loads as reported, the two prefix indexes fed by the instances' cache
events, and the true figures of each MD's KV link."""

from __future__ import annotations

from collections.abc import Callable

from services.router.assignments import Assignments
from services.router.policy import InstanceLoad
from services.router.prefix_index import PrefixIndex
from services.router.route_plan import LinkView, RouteContext, RoutePlan, plan_route
from shared.bus.messages import Role
from shared.config import RouterSettings
from shared.sim.decoder import DecodeInstance
from shared.sim.events import EventLoop
from shared.sim.instance import Instance
from shared.sim.link import Link
from shared.sim.prefill import PrefillInstance
from shared.sim.workload import SimRequest


class SimRouter:
    def __init__(self, settings: RouterSettings, loop: EventLoop, block_size: int, kv_bytes_per_token: int,
                 instances: dict[Role, list[Instance]], kv_link: Callable[[str], Link], md_report_delay_s: float):  # fmt: skip
        self.settings, self.loop, self.instances, self.kv_link = settings, loop, instances, kv_link
        self.ctx = RouteContext(settings, PrefixIndex(), PrefixIndex(), block_size, kv_bytes_per_token)
        self.assignments = Assignments()
        self.md_report_delay_s = md_report_delay_s  # an MD's load report is this old when it arrives

    def plan(self, req: SimRequest) -> RoutePlan:
        now = self.loop.now
        self.assignments.expire(now - self.settings.lost_after_s)
        mds = self._loads(Role.MAIN_DECODE, self.md_report_delay_s)
        loads = (mds, self._loads(Role.RELAY, 0.0), self._loads(Role.PREFILL, 0.0))
        links = {}
        for m in mds:
            link = self.kv_link(m.instance)
            links[m.instance] = LinkView(link.spec.bandwidth_Bps, 2 * link.spec.one_way_s, link.backlog_to(m.instance))
        return plan_route(self.ctx, req.input_tokens, list(req.block_hashes), loads, links)

    def _loads(self, role: Role, report_delay_s: float) -> list[InstanceLoad]:
        now = self.loop.now
        return [self._load(role, i, now, report_delay_s) for i in self.instances.get(role, [])]

    def _load(self, role: Role, inst: Instance, now: float, report_delay_s: float) -> InstanceLoad:
        if isinstance(inst, PrefillInstance):
            running, waiting = len(inst.active), inst.queued
        else:
            assert isinstance(inst, DecodeInstance)
            running, waiting = inst.busy, inst.waiting
        key = (role.value, inst.name)
        return InstanceLoad(inst.name, running, waiting, inst.pool.num_free, inst.pool.num_blocks, inst.held,
                            pending=self.assignments.pending(key, now - report_delay_s),
                            recent=self.assignments.recent(key, now))  # fmt: skip

    def on_cache_events(self, role: Role, instance: str, stored: list[int], evicted: list[int]) -> None:
        index = self.ctx.index if role is Role.MAIN_DECODE else self.ctx.prefill_index
        index.apply(instance, stored, evicted)
