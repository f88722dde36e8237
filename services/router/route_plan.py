"""One request's route from what the router knows at that moment (pure): the loads of the live
instances, the two prefix indexes, and the link figures toward each MD. The router service
and the fleet simulator (pdd/sim) both route through `plan_route`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from shared.bus.messages import Pipeline
from shared.config import RouterSettings

from .policy import (
    InstanceLoad,
    RouteDecision,
    RouteWeights,
    choose_least_loaded,
    choose_main_decode,
    choose_pipeline,
    choose_prefill,
    comparable_bandwidths,
    missing_kv_bytes,
    queued_ahead,
    request_weights,
    wan_cost_s,
)
from .prefix_index import PrefixIndex


class LinkView(NamedTuple):  # (a tuple: made per route and MD with bytes queued, cheaper than a frozen dataclass)
    """What the router knows of the KV path toward one MD."""

    bandwidth: float  # bytes/s
    rtt: float  # seconds
    backlog: int = 0  # KV bytes queued toward it now


@dataclass
class RouteContext:
    """The parts of a route that stay between requests."""

    settings: RouterSettings
    index: PrefixIndex  # MDs' blocks
    prefill_index: PrefixIndex  # prefills' blocks
    block_size: int
    kv_bytes_per_token: int

    @property
    def weights(self) -> RouteWeights:
        s = self.settings
        return RouteWeights(s.overlap_weight, s.load_weight, s.prefill_weight, s.balance_factor)


@dataclass(frozen=True)
class RoutePlan:
    decision: RouteDecision
    md: str  # "" when no MD is alive (RLD-only, a fault fallback)
    relay: str | None  # on P→RLD→MD only
    prefill: str | None


def md_options(
    ctx: RouteContext, prompt_tokens: int, hashes: list[int], links: dict[str, LinkView], relay_available: bool
) -> dict[str, tuple[RouteDecision, float]]:
    """Per MD: the pipeline if the request went there, and the WAN seconds its cost counts."""
    cached = ctx.index.cached_prefix_blocks_all(hashes)
    wan_s = md_wan_costs(ctx, prompt_tokens, cached, links)
    return {md: (md_pipeline(ctx, prompt_tokens, cached.get(md, 0), link, relay_available), wan_s[md])
            for md, link in links.items()}  # fmt: skip


def md_wan_costs(ctx: RouteContext, prompt_tokens: int, cached: dict[str, int], links: dict[str, LinkView]) -> dict[str, float]:
    """Per MD: the WAN seconds its cost counts (wan_cost_s), from each MD's cached prefix in
    blocks (`cached`: PrefixIndex.cached_prefix_blocks_all)."""
    compared = comparable_bandwidths({md: link.bandwidth for md, link in links.items()})
    queued = queued_ahead(compared, {md: link.backlog for md, link in links.items()})
    seen: dict[tuple[int, int, float], float] = {}  # most MDs of a fleet share a few (prefix, queue, line)
    out = {}
    for md in links:
        figures = (cached.get(md, 0), queued[md], compared[md])
        if figures not in seen:
            n, ahead, bandwidth = figures
            lacks = missing_kv_bytes(prompt_tokens, n * ctx.block_size, ctx.kv_bytes_per_token)
            seen[figures] = wan_cost_s(lacks, ahead, bandwidth)
        out[md] = seen[figures]
    return out


def md_pipeline(ctx: RouteContext, prompt_tokens: int, cached_blocks: int, link: LinkView, relay_available: bool) -> RouteDecision:
    """The pipeline if the request went to an MD holding `cached_blocks` of its prefix."""
    return choose_pipeline(
        prompt_tokens, cached_blocks * ctx.block_size, ctx.kv_bytes_per_token, link.bandwidth, link.rtt,
        ctx.settings.wan_time_threshold_s, relay_available, backlog_bytes=link.backlog,
    )  # fmt: skip


def md_weights(ctx: RouteContext, prompt_tokens: int) -> RouteWeights:
    """Load weighed against this request's whole KV crossing the WAN (at the prior bandwidth)."""
    request_s = prompt_tokens * ctx.kv_bytes_per_token / ctx.settings.default_bandwidth_bps
    return request_weights(ctx.weights, request_s)


def plan_prefill(ctx: RouteContext, prompt_tokens: int, hashes: list[int], prefills: list[InstanceLoad]) -> str | None:
    blocks = ctx.prefill_index.cached_prefix_blocks_all(hashes)
    cached = {p: n * ctx.block_size for p, n in blocks.items()}  # (absent: 0 tokens)
    # Load weighed against this request's whole prefill.
    weights = request_weights(ctx.weights, ctx.settings.prefill_weight * prompt_tokens)
    return choose_prefill(prefills, prompt_tokens, cached, weights)


def plan_route(
    ctx: RouteContext,
    prompt_tokens: int,
    hashes: list[int],
    loads: tuple[list[InstanceLoad], list[InstanceLoad], list[InstanceLoad]],  # (MDs, relays, prefills)
    links: dict[str, LinkView],  # per MD in loads[0]
    forced: Pipeline | None = None,
) -> RoutePlan:
    """The MD is the cheapest by the WAN time of what it lacks and its load; the pipeline
    follows from that MD's WAN time."""
    mds, relays, prefills = loads
    relay = choose_least_loaded(relays)
    cached = ctx.index.cached_prefix_blocks_all(hashes)
    wan_s = md_wan_costs(ctx, prompt_tokens, cached, links)
    md = choose_main_decode(mds, wan_s, md_weights(ctx, prompt_tokens), hashes[0] if hashes else 0)
    if md is None:
        return RoutePlan(RouteDecision(Pipeline.RLD_ONLY, 0.0, 0, 0.0), "", None, None)
    decision = md_pipeline(ctx, prompt_tokens, cached.get(md, 0), links[md], relay is not None)
    # A forced pipeline is honoured when it can be: with no relay alive, P→RLD→MD runs as P→MD
    # (x-pdd-pipeline says which ran).
    if forced is not None and forced is not decision.pipeline and (forced is Pipeline.P_MD or relay):
        decision = RouteDecision(forced, decision.hit_rate, decision.missing_bytes, decision.est_wan_s)
    relay = relay if decision.pipeline is Pipeline.P_RLD_MD else None
    return RoutePlan(decision, md, relay, plan_prefill(ctx, prompt_tokens, hashes, prefills))
