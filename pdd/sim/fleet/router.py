"""The router in the simulation: the service's own route plan (services/router/routing/policy.py)
over the instances' loads as reported, the two prefix indexes fed by the instances' cache
events, and the true figures of each MD's KV link. A request the line cannot admit is held
and planned again every line_replan_s, and refused (the service's 429) past the bounds, as
the service does (services/router/adapter/dispatch.py)."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from pdd.sim.fleet.events import EventLoop
from pdd.sim.fleet.instance import Instance
from pdd.sim.fleet.job import Job
from pdd.sim.fleet.link import Link
from pdd.sim.workloads.workload import SimRequest
from services.router.routing.assignments import Assignments
from services.router.routing.policy import (
    LineWait,
    LinkView,
    RouteContext,
    RoutePlan,
    line_wait,
    load_from,
    plan_route,
)
from services.router.routing.prefix_index import PrefixIndex
from shared.bus.messages import Role
from shared.config import RouterSettings


class SimRouter:
    def __init__(
        self,
        settings: RouterSettings,
        loop: EventLoop,
        block_size: int,
        kv_bytes_per_token: int,
        instances: dict[Role, list[Instance]],
        kv_link: Callable[[str], Link],
        md_report_delay_s: float,
    ):
        self.settings, self.loop, self.instances, self.kv_link = settings, loop, instances, kv_link
        self.ctx = RouteContext(settings, PrefixIndex(), PrefixIndex(), block_size, kv_bytes_per_token)
        self.assignments = Assignments()
        self.md_report_delay_s = md_report_delay_s  # an MD's load report is this old when it arrives
        self._members: dict[Role, list[_Member]] = {}
        self._link_views: dict[str, LinkView] | None = None  # per MD, nothing queued (the MDs never change)
        self._kv_links: list[Link] = []
        self._backlog_views: dict[str, LinkView] = {}  # per MD: its last view with bytes queued
        self._held: deque[tuple[SimRequest, float]] = deque()  # waiting for the line: (request, since)
        self._admitted: tuple[SimRequest, RoutePlan] | None = None  # planned by admit, for plan()
        # Per relay: the requests sent to it whose KV it has not taken yet (its load cannot show
        # them while their prefill runs: they count as sent since its report).
        self._to_relays: dict[str, list[Job]] = {}
        self.go: Callable[[SimRequest, float], Job | None] = lambda req, arrived: None  # dispatch it
        self.refuse: Callable[[SimRequest], None] = lambda req: None  # a 429
        self.refused = 0  # requests refused (429) after waiting for the line, or at once
        self.held_total = 0  # requests that waited for the line at all

    def admit(self, req: SimRequest) -> None:
        """A request arrives: dispatched now (self.go) if the line admits it, else held."""
        if not self._decide(req, self.loop.now, len(self._held), newcomer=True):
            self._hold(req, self.loop.now)

    def _decide(self, req: SimRequest, since: float, held: int, newcomer: bool = False) -> bool:
        """Plan `req` (waiting since `since`, `held` others waiting): go, refuse, or (False) wait."""
        plan = self._plan(req, waiters_ahead=newcomer and held > 0)
        verdict = line_wait(not plan.held, self.loop.now - since, held, self.settings, newcomer)
        if verdict is LineWait.WAIT:
            return False
        if verdict is LineWait.GO:
            self._admitted = req, plan  # (the fleet's plan() call takes it: one plan per dispatch)
            job = self.go(req, since)
            self._admitted = None
            if job is not None and plan.relay:
                self._to_relays.setdefault(plan.relay, []).append(job)
        else:
            self.refused += 1
            self.refuse(req)
        return True

    def _hold(self, req: SimRequest, since: float) -> None:
        if not self._held:
            self.loop.at(self.loop.now + self.settings.line_replan_s, self._replan)
        self._held.append((req, since))
        self.held_total += 1

    def _replan(self) -> None:
        """Plan every held request again, oldest first (each one dispatched counts toward the
        loads the next one sees): they leave in their arrival order, as far as the line allows."""
        still: deque[tuple[SimRequest, float]] = deque()
        while self._held:
            req, since = self._held.popleft()
            if not self._decide(req, since, held=len(still) + len(self._held)):
                still.append((req, since))
        self._held = still
        if still:
            self.loop.at(self.loop.now + self.settings.line_replan_s, self._replan)

    def plan(self, req: SimRequest) -> RoutePlan:
        """The route of a request the line admitted (as admit planned it, this instant)."""
        if self._admitted is not None and self._admitted[0] is req:
            plan, self._admitted = self._admitted[1], None
            return plan
        return self._plan(req)

    def _plan(self, req: SimRequest, waiters_ahead: bool = False) -> RoutePlan:
        now = self.loop.now
        self.assignments.expire(now - self.settings.lost_after_s)
        recent = self.assignments.recent_all(now)
        mds = self._loads(Role.MAIN_DECODE, now - self.md_report_delay_s, recent)
        loads = (mds, self._loads(Role.RELAY, now, recent), self._loads(Role.PREFILL, now, recent))
        hashes, links = list(req.block_hashes), self._links(mds)
        return plan_route(self.ctx, req.input_tokens, hashes, loads, links, None, waiters_ahead)

    def _links(self, mds: list[_Member]) -> dict[str, LinkView]:
        """Each MD's link as the router sees it (MDs behind one line share its view but for
        what is queued toward each)."""
        if self._link_views is None:
            self._link_views = self._idle_links(mds)
        links, last = self._link_views.copy(), self._backlog_views
        for link in self._kv_links:
            if not link.queue:
                continue  # (nothing queued toward any MD: most of a same-DC fleet's paths)
            for md, backlog in link.backlogs().items():
                if backlog and md in links:
                    view = last.get(md)
                    if view is None or view.backlog != backlog:  # (most stay as they were)
                        view = last[md] = LinkView(links[md].bandwidth, links[md].rtt, backlog)
                    links[md] = view
        return links

    def _idle_links(self, mds: list[_Member]) -> dict[str, LinkView]:
        """Each MD's link with nothing queued (one view per link), in the order of `mds`; the
        distinct links into self._kv_links."""
        views: dict[Link, LinkView] = {}
        for m in mds:
            link = self.kv_link(m.instance)
            if link not in views:
                views[link] = LinkView(link.spec.bandwidth_Bps, 2 * link.spec.one_way_s, 0)
        self._kv_links = list(views)
        return {m.instance: views[self.kv_link(m.instance)] for m in mds}

    def _loads(self, role: Role, reported_at: float, recent: dict[tuple[str, str], float]) -> list[_Member]:
        """Each instance's load as its last report (received at reported_at) and this router's
        own sends show it (`recent`: Assignments.recent_all), kept one object per instance and
        updated in place: remade where the instance's figures may have moved or sends are
        pending (the router service makes InstanceLoads from its reports; the policy reads
        both alike)."""
        members = self._members.get(role)
        if members is None:
            members = self._members[role] = [
                _Member(i, (role.value, i.name)) for i in self.instances.get(role, [])
            ]
        pending, unreported = self.assignments.pending, self.assignments.unreported()
        to_relays = self._to_relays if role is Role.RELAY else {}
        for m in members:
            inst, key = m.inst, m.key
            on_the_way = self.on_the_way(m.instance) if m.instance in to_relays else 0
            if key in unreported:
                m.update(pending(key, reported_at) + on_the_way)
            elif inst.load_changed or m.pending or on_the_way:
                m.update(on_the_way)
            m.recent = recent.get(key, 0.0)
        return members

    def on_the_way(self, relay: str) -> int:
        """Requests sent to `relay` that it has not taken yet (its KV not landed there)."""
        jobs = self._to_relays.get(relay)
        if not jobs:
            return 0
        jobs[:] = [j for j in jobs if j.rld_blocks is None and not j.done and not j.filtered]
        return len(jobs)

    def on_cache_events(self, role: Role, instance: str, stored: list[int], evicted: list[int]) -> None:
        index = self.ctx.index if role is Role.MAIN_DECODE else self.ctx.prefill_index
        index.apply(instance, stored, evicted)


class _Member:
    """One instance as the router weighs it: an InstanceLoad (the fields the policy reads, and
    its load_of) that the router updates in place instead of making one per route."""

    __slots__ = (
        "inst",
        "key",
        "instance",
        "running",
        "waiting",
        "free_blocks",
        "num_blocks",
        "held",
        "pending",
        "recent",
        "load",
    )

    def __init__(self, inst: Instance, key: tuple[str, str]) -> None:
        self.inst, self.key, self.instance = inst, key, inst.name  # key: its Assignments key
        self.num_blocks, self.recent = inst.pool.num_blocks, 0.0
        self.update(0)

    def update(self, pending: int) -> None:
        """The instance's figures now, with `pending` requests sent since its report."""
        inst = self.inst
        inst.load_changed = False
        self.running, self.waiting = inst.load_counts()
        self.free_blocks, self.held, self.pending = len(inst.pool.free), inst.held, pending
        self.load = load_from(
            self.running, self.waiting, self.free_blocks, self.num_blocks, self.held, pending
        )
