"""The fleet as routing sees it at one moment: the live instances' loads (their reports plus
the requests this router sent since), the link figures toward each MD, and the route
(policy.plan_route) or the move targets (policy.resume_candidates) they give."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace

from shared.bus.messages import Pipeline, Role
from shared.config import RouterSettings
from shared.engine import block_hashes
from shared.telemetry import metrics

from .assignments import Assignments
from .cache_view import CacheView
from .policy import (
    InstanceLoad,
    LinkView,
    RouteContext,
    RouteDecision,
    RoutePlan,
    md_options,
    md_weights,
    plan_route,
    resume_candidates,
)
from .prefix_index import PrefixIndex
from .registry import Registry


class FleetView:
    def __init__(
        self, settings: RouterSettings, *, model_id: str, block_size: int, kv_bytes_per_token: int
    ) -> None:
        self.settings = settings
        self.model_id = model_id
        self.block_size = block_size
        self.index = PrefixIndex()  # MDs' blocks
        self.prefill_index = PrefixIndex()  # prefills' blocks
        self.assignments = Assignments()
        self.route_ctx = RouteContext(
            settings, self.index, self.prefill_index, block_size, kv_bytes_per_token
        )
        self.caches = {Role.MAIN_DECODE: CacheView(self.index), Role.PREFILL: CacheView(self.prefill_index)}
        self.registry = Registry(stale_after_s=settings.lost_after_s)
        # Per relay: this router's requests routed to it and not handed over yet (the request
        # life's RequestLife.bound_for_relays): a prefill still running keeps a request out of
        # the relay's reports for longer than one report interval.
        self.bound_for_relays: Callable[[], dict[str, list[str]]] = dict
        # Per role: the instances set aside (a peer refused their identity): never chosen.
        self.set_aside: Callable[[Role], set[str]] = lambda role: set()

    def route(
        self, prompt_ids: list[int], forced: Pipeline | None
    ) -> tuple[RouteDecision, str, str | None, str | None, list[int]]:
        """(decision, MD instance, relay instance on P→RLD→MD, prefill instance, the prompt's
        block hashes) of a plan that is not held; see policy.plan_route. With no MD alive (lost, or its datacenter
        unreachable) the MD is "" and the request goes to a relay (RLD-only: a fault
        fallback, never a policy)."""
        plan, hashes = self.plan(prompt_ids, forced)
        return plan.decision, plan.md, plan.relay, plan.prefill, hashes

    def plan(
        self,
        prompt_ids: list[int],
        forced: Pipeline | None,
        hashes: list[int] | None = None,
        waiters_ahead: bool = False,
    ) -> tuple[RoutePlan, list[int]]:
        """The route plan (held, when the line cannot take the request now) and the prompt's
        block hashes (`hashes`: as an earlier plan of the same prompt gave them); see
        policy.plan_route for `waiters_ahead`."""
        if hashes is None:
            hashes = block_hashes(prompt_ids, self.block_size, self.model_id)
        self.assignments.expire(time.monotonic() - self.settings.lost_after_s)
        mds = self.loads(Role.MAIN_DECODE)
        loads = (mds, self.loads(Role.RELAY), self.loads(Role.PREFILL))
        links = self.links([m.instance for m in mds])
        plan = plan_route(self.route_ctx, len(prompt_ids), hashes, loads, links, forced, waiters_ahead)
        return plan, hashes

    def move_targets(
        self,
        prompt_ids: list[int],
        hashes: list[int],
        tokens_so_far: int,
        avoid: set[tuple[Role, str]],
        queued: dict[tuple[Role, str], int] | None = None,
    ) -> list[tuple[Role, str, int]]:
        """Where a request whose instance was lost may continue, best first, each with the
        tokens it would compute first (see policy.resume_candidates for `queued`). What an MD
        holds of the prompt is known from its cache events; a relay's is taken as nothing.
        An instance unheard for streaming_lost_after_s is left out: a stream that moves now
        should not wait to learn that its new instance is gone or cut off too."""
        mds, relays = (self._heard_lately(role, avoid) for role in (Role.MAIN_DECODE, Role.RELAY))
        links = self.links([m.instance for m in mds])
        options = md_options(self.route_ctx, len(prompt_ids), hashes, links, False)
        wan_s = {m: cost_s for m, (_, cost_s) in options.items()}
        total = len(prompt_ids) + tokens_so_far
        cached = self.index.cached_prefix_blocks_all(hashes)
        recompute = {
            (Role.MAIN_DECODE, m.instance): total - cached.get(m.instance, 0) * self.block_size for m in mds
        }
        recompute |= {(Role.RELAY, r.instance): total for r in relays}
        weights = md_weights(self.route_ctx, len(prompt_ids))
        order = resume_candidates(mds, relays, wan_s, weights, recompute, queued)
        return [(role, instance, recompute[(role, instance)]) for role, instance in order]

    def _heard_lately(self, role: Role, avoid: set[tuple[Role, str]]) -> list[InstanceLoad]:
        quiet_s = self.settings.streaming_lost_after_s
        return [
            c
            for c in self.loads(role)
            if (role, c.instance) not in avoid and self.registry.silent_for(role, c.instance) <= quiet_s
        ]

    def loads(self, role: Role) -> list[InstanceLoad]:
        """The live instances of a role, asked anew each time (instances that join or leave
        count at once), with what their last report adds and the requests sent since."""
        now = time.monotonic()
        loads = []
        bound = self.bound_for_relays() if role is Role.RELAY else {}
        aside = self.set_aside(role)
        for load in self.registry.loads(role):
            if load.instance in aside:
                continue
            report = self.registry.get(role, load.instance)
            reported_at = now - self.registry.silent_for(role, load.instance)
            pending = self.assignments.pending((role, load.instance), reported_at)
            if load.instance in bound:  # sent to the relay, but not in its report: not arrived yet
                shown = set(report.held) if report else set()
                pending = max(pending, sum(rid not in shown for rid in bound[load.instance]))
            loads.append(
                replace(
                    load,
                    num_blocks=report.num_blocks if report else 0,
                    held=len(report.held) if report else 0,
                    pending=pending,
                    recent=self.assignments.recent((role, load.instance), now),
                )
            )
        return loads

    def links(self, mds: list[str]) -> dict[str, LinkView]:
        """Per MD: the link figures as prefill measured them, and the KV queued toward it."""
        links = self._links_to_mds(mds)
        return {
            md: LinkView(bandwidth, rtt, self.registry.wan_backlog(address) if address else 0)
            for md, (address, bandwidth, rtt) in links.items()
        }

    def _links_to_mds(self, mds: list[str]) -> dict[str, tuple[str | None, float, float]]:
        """Per MD: (its bulk address, bandwidth B/s, RTT s) as prefill measured them. An MD no
        transfer went to yet gets the mean of the others' (MDs of one DC are usually behind one
        line; the configured prior only when nothing was measured)."""
        addresses = {
            md: (r.address if (r := self.registry.get(Role.MAIN_DECODE, md)) else None) for md in mds
        }
        measured = {md: link for md, a in addresses.items() if a and (link := self.registry.link_to(a))}
        if measured:
            fallback = tuple(sum(x) / len(measured) for x in zip(*measured.values(), strict=True))
        else:
            fallback = (self.settings.default_bandwidth_bps, self.settings.default_rtt_s)
        links = {}
        for md, address in addresses.items():
            bandwidth, rtt = measured.get(md, fallback)
            metrics.WAN_BANDWIDTH.labels(peer=md).set(bandwidth)
            links[md] = address, bandwidth, rtt
        return links

    def prune(self) -> None:
        """Instances silent for long are forgotten, with their cache views and link gauges:
        maps keyed by what the network told us stay bounded."""
        for service, instance in self.registry.prune(self.settings.forget_after_s):
            if service in self.caches:
                self.caches[Role(service)].forget(instance)
            if service == Role.MAIN_DECODE:
                metrics.forget_peer(instance)
