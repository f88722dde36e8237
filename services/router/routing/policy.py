"""Routing policy: which pipeline and which instances serve a request. Pure functions.

Every instance choice is a cost in seconds, lowest wins, among the instances within the load
bound (see `within_bound`):

    MD cost = overlap_weight × WAN seconds to send the KV blocks this MD lacks
              + load_weight × load
    P cost  = prefill_weight × prompt tokens this P must compute (those it has not cached)
              + load_weight × load

load (`load_of`) counts requests; load_weight is the seconds of WAN transfer (or of prefill)
one request of load is worth. The relay is the least loaded one with room (`relays_for`).

The pipeline follows from the chosen MD's WAN time: the KV it lacks behind everything queued
on the line toward it (`queued_ahead`, the same queue its cost counts). Admission to the line
(`line_admission`): a request whose missing KV would reach MD later than line_budget_s goes
by a relay with room; when every relay is full it is held at the router (`line_wait`) and
planned again, and refused past a bound, instead of growing the line's queue.

A route is planned (`plan_route`) from what the router knows at that moment: the loads of the
live instances, the two prefix indexes, and the link figures toward each MD. The router service
and the fleet simulator (pdd/sim) both route through `plan_route`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from operator import attrgetter
from typing import NamedTuple

from shared.bus.messages import Pipeline, Role
from shared.config import RouterSettings
from shared.kv.link_estimator import estimate_wan_seconds

from .prefix_index import PrefixIndex


@dataclass(frozen=True)
class RouteDecision:
    pipeline: Pipeline
    hit_rate: float  # fraction of prompt tokens whose KV MD already holds
    missing_bytes: int  # KV bytes that must cross the WAN
    est_wan_s: float  # estimated time for them to cross


def choose_pipeline(
    prompt_tokens: int,
    cached_tokens: int,
    kv_bytes_per_token: int,
    bandwidth: float,
    rtt: float,
    threshold_s: float,
    relay_available: bool,
    backlog_bytes: int = 0,
) -> RouteDecision:
    """P→MD when the missing KV crosses the WAN fast enough, else P→RLD→MD.

    KV already queued toward MD (`backlog_bytes`) shares the link, so a request that has
    blocks to send counts it too (conservatively, as if it went first).
    P→RLD alone is not an option: finishing requests locally would let MD's cache fall
    behind P's and push ever more traffic onto the relay.
    """
    cached_tokens = max(0, min(cached_tokens, prompt_tokens))
    missing_bytes = missing_kv_bytes(prompt_tokens, cached_tokens, kv_bytes_per_token)
    on_wire = missing_bytes + backlog_bytes if missing_bytes else 0
    est = estimate_wan_seconds(on_wire, bandwidth, rtt)
    hit_rate = cached_tokens / prompt_tokens if prompt_tokens else 0.0
    pipeline = Pipeline.P_RLD_MD if est > threshold_s and relay_available else Pipeline.P_MD
    return RouteDecision(pipeline, hit_rate, missing_bytes, est)


def missing_kv_bytes(prompt_tokens: int, cached_tokens: int, kv_bytes_per_token: int) -> int:
    """KV bytes of the prompt tokens MD has not cached, which must cross the WAN."""
    return (prompt_tokens - max(0, min(cached_tokens, prompt_tokens))) * kv_bytes_per_token


@dataclass(frozen=True)
class InstanceLoad:
    instance: str
    running: int = 0
    waiting: int = 0
    free_blocks: int = 0
    num_blocks: int = 0  # the KV pool's size (0: not known)
    held: int = 0  # requests the instance holds (MD: also those whose KV is still arriving)
    pending: int = 0  # requests this router sent it that its last report could not show yet
    recent: float = 0.0  # requests this router sent it lately (a decaying count: its share over time)

    def __post_init__(self) -> None:
        object.__setattr__(self, "load", _load(self))  # once: a route weighs each candidate several times


class RouteWeights(NamedTuple):  # (a tuple: several are made per route, cheaper than a frozen dataclass)
    """The cost's weights (RouterSettings documents their units)."""

    overlap: float  # per second of WAN transfer to MD
    load: float  # seconds per request of load
    prefill: float  # seconds per prompt token P computes
    balance_factor: float  # load bound: this many times the mean load (plus BOUND_SLACK)


# Requests an instance may always take above balance_factor × the mean, like the ceiling in
# consistent hashing with bounded loads. Without it a lightly loaded fleet is over-constrained:
# loads fluctuate by a request or two as requests end, and a tight bound moves sessions off
# the MD holding their prefix for nothing (with 1 the agentic bench moved 1 follow-up in 8;
# with 2 its MD hit rate is 0.98 of an oracle's). The price: at mean load L the busiest
# instance may reach balance_factor × L + 2.
BOUND_SLACK = 2.0


def load_of(c: InstanceLoad) -> float:
    """Load in requests: those the instance holds or runs (whichever its report shows more
    of), those sent since its report, plus the share of its KV pool in use (0..1, so that
    between equally busy instances the one with more room wins)."""
    return c.load


def _load(c: InstanceLoad) -> float:
    """load_of(c), as the InstanceLoad computes it when made."""
    return load_from(c.running, c.waiting, c.free_blocks, c.num_blocks, c.held, c.pending)


def load_from(
    running: int, waiting: int, free_blocks: int, num_blocks: int, held: int, pending: int
) -> float:
    """load_of() of an instance with these figures (InstanceLoad's fields of the same names):
    for a caller that keeps its own candidates, such as the fleet simulator's."""
    used = 1.0 - free_blocks / num_blocks if num_blocks else 0.0
    busy = running + waiting
    return (busy if busy >= held else held) + pending + used  # max(), without the call


def _bound(total: float, count: int, balance_factor: float) -> float:
    """balance_factor × the mean of `count` values summing to `total` (one more request
    included) + BOUND_SLACK: a value fits when it stays within this with one more."""
    return balance_factor * (total + 1) / count + BOUND_SLACK


_load_attr, _recent_attr = (
    attrgetter("load"),
    attrgetter("recent"),
)  # (sums over candidates without a Python step each)


def within_bound(candidates: list[InstanceLoad], balance_factor: float) -> list[InstanceLoad]:
    """The candidates within the bound both by the load of this moment and by the requests
    sent to them lately; all of them if none is (balance alone never refuses a request).
    The load of a moment catches a hot spot; the recent count catches sessions that settled
    unevenly while short requests left every moment nearly idle."""
    if not candidates:
        return []
    n = len(candidates)
    now = _bound(sum(map(_load_attr, candidates)), n, balance_factor)  # (load_of, without the call)
    lately = _bound(sum(map(_recent_attr, candidates)), n, balance_factor)
    return [c for c in candidates if c.load + 1 <= now and c.recent + 1 <= lately] or candidates


def _rank_key(costs: dict[str, float], eligible: set[str]):
    """Those within the load bound (`eligible`) first, then the rest; each by cost, then load, then name."""
    return lambda c: (c.instance not in eligible, costs[c.instance], c.load, c.instance)


def _cheapest(pool: list[InstanceLoad], costs: dict[str, float]) -> InstanceLoad:
    """min(pool, key=cost, then load, then name) without a key per candidate (`pool`: those
    within the load bound, within_bound; `costs`: of each of them)."""
    low = min(costs.values())
    tied = [c for c in pool if costs[c.instance] == low]
    return tied[0] if len(tied) == 1 else min(tied, key=lambda c: (c.load, c.instance))


def _ranked(
    candidates: list[InstanceLoad], costs: dict[str, float], eligible: set[str]
) -> list[InstanceLoad]:
    return sorted(candidates, key=_rank_key(costs, eligible))


def _eligible(candidates: list[InstanceLoad], balance_factor: float) -> set[str]:
    return {c.instance for c in within_bound(candidates, balance_factor)}


def _by_load(c: InstanceLoad) -> tuple:
    return c.load, -c.free_blocks, c.instance


def request_weights(w: RouteWeights, request_s: float) -> RouteWeights:
    """The weights for one request. RouterSettings.load_weight is a fraction of the request's
    own cost (`request_s`: its whole prompt's KV over the WAN for MD, its whole prefill for P),
    so one request of load weighs the same against a prefix hit whatever the model's KV size:
    with the tiny preset's 512 B/token a prefix saves microseconds of WAN, and so does a
    request of load."""
    return RouteWeights(
        w.overlap, w.load * request_s, w.prefill, w.balance_factor
    )  # (replace(), made faster)


def wan_cost_s(missing_bytes: int, backlog_bytes: int, bandwidth: float) -> float:
    """The WAN seconds the choice of MD changes: what it lacks, behind what is already queued
    toward it. Not the RTT: every MD that lacks a block pays one, and comparing measured RTTs
    of MDs behind the same link would compare their noise."""
    return (missing_bytes + (backlog_bytes if missing_bytes else 0)) / max(bandwidth, 1.0)


# Estimates of one WAN line taken over different transfers scatter (a short transfer's is
# mostly latency) by more than a few blocks are worth: links within this factor of the best
# count as equally fast when MDs are compared.
SAME_LINK_WITHIN = 2.0


def comparable_bandwidths(bandwidths: dict[str, float]) -> dict[str, float]:
    """Each MD's bandwidth for comparing costs: the best one for every MD whose estimate is
    within SAME_LINK_WITHIN of it, its own only when its link is clearly slower."""
    best = max(bandwidths.values(), default=0.0)
    if bandwidths and min(bandwidths.values()) * SAME_LINK_WITHIN >= best:
        return dict.fromkeys(bandwidths, best)  # (all of them: one line, most often)
    return {m: best if bw * SAME_LINK_WITHIN >= best else bw for m, bw in bandwidths.items()}


def queued_ahead(compared: dict[str, float], backlogs: dict[str, int]) -> dict[str, int]:
    """KV bytes a transfer to each MD waits behind. The MDs that compare as behind the fastest
    line (comparable_bandwidths) share its queue, so each waits behind all of it: a per-MD
    split of one line's queue would only be noise between them. An MD on a slower line waits
    behind its own."""
    best = max(compared.values(), default=0.0)
    if compared and min(compared.values()) == best:  # every MD behind the fastest line
        return dict.fromkeys(compared, sum(backlogs.values()))
    shared = sum(b for m, b in backlogs.items() if compared[m] == best)
    return {m: shared if bw == best else backlogs[m] for m, bw in compared.items()}


def md_costs(candidates: list[InstanceLoad], wan_s: dict[str, float], w: RouteWeights) -> dict[str, float]:
    """`wan_s`: each MD's WAN seconds for the blocks it lacks (wan_cost_s)."""
    overlap, per_load = w.overlap, w.load
    return {c.instance: overlap * wan_s[c.instance] + per_load * c.load for c in candidates}


def choose_main_decode(
    candidates: list[InstanceLoad], wan_s: dict[str, float], w: RouteWeights, spread_key: int = 0
) -> str | None:
    """The cheapest MD within the load bound. MDs within one request of load of the cheapest
    count as equally good, and `spread_key` (the prompt's first block hash) picks among them:
    new sessions that reach different routers at once (each router sees only its own latest
    choices) spread over the MDs instead of all taking the same one, and a session's retry
    lands where it first did."""
    if not candidates:
        return None
    pool = within_bound(candidates, w.balance_factor)  # (only these are ranked: the rest come after)
    costs = md_costs(pool, wan_s, w)
    low, margin = min(costs.values()), w.load * (1 + 1e-9)
    near = [c for c in pool if costs[c.instance] - low <= margin]  # only the near ones need ranking
    if len(near) > 1:
        near.sort(key=lambda c: (costs[c.instance], c.load, c.instance))
    return near[spread_key % len(near)].instance


def choose_prefill(
    candidates: list[InstanceLoad], prompt_tokens: int, cached_tokens: dict[str, int], w: RouteWeights
) -> str | None:
    """The cheapest P within the load bound: prefill compute for what it has not cached, plus load."""
    if not candidates:
        return None
    pool = within_bound(candidates, w.balance_factor)
    per_token, per_load, cached = w.prefill, w.load, cached_tokens.get
    costs = {
        c.instance: per_token * max(prompt_tokens - cached(c.instance, 0), 0) + per_load * c.load
        for c in pool
    }
    return _cheapest(pool, costs).instance


def choose_least_loaded(candidates: list[InstanceLoad]) -> str | None:
    if not candidates:
        return None
    return min(candidates, key=_by_load).instance


def resume_candidates(
    mds: list[InstanceLoad],
    relays: list[InstanceLoad],
    wan_s: dict[str, float],
    w: RouteWeights,
    recompute: Mapping[tuple[Role, str], int] | None = None,
    queued: Mapping[tuple[Role, str], int] | None = None,
) -> list[tuple[Role, str]]:
    """Where a request whose instance was lost may continue, best first: by the tokens each
    decoder must compute before the request's next token, its own (`recompute`: the prompt
    and the tokens so far, less the prefix it holds) behind those of the moves still
    recomputing there (`queued`); among equals the MDs (decode is their job) by the MD cost,
    those within the load bound first, then the relays by load (an RLD-only finish). An
    instance lost with many streams thus spreads them over every decoder left, and each goes
    where its first token comes soonest."""
    by_md = _ranked(mds, md_costs(mds, wan_s, w), _eligible(mds, w.balance_factor))
    by_relay = sorted(relays, key=_by_load)
    order = [(Role.MAIN_DECODE, c.instance) for c in by_md] + [(Role.RELAY, c.instance) for c in by_relay]
    own, ahead = recompute or {}, queued or {}
    order.sort(key=lambda key: own.get(key, 0) + ahead.get(key, 0))  # (stable: equals keep the order above)
    return order


# ---- one request's route ---------------------------------------------------------------
class LinkView(
    NamedTuple
):  # (a tuple: made per route and MD with bytes queued, cheaper than a frozen dataclass)
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
    held: bool = False  # the line cannot take it now and no relay has room: wait, plan again


def line_queues(links: dict[str, LinkView]) -> tuple[dict[str, float], dict[str, int]]:
    """Per MD: the bandwidth its costs compare (comparable_bandwidths) and the KV bytes a
    transfer to it waits behind (queued_ahead): with many MDs behind one line, the whole
    line's queue, not the share queued toward that MD."""
    compared = comparable_bandwidths({md: link.bandwidth for md, link in links.items()})
    return compared, queued_ahead(compared, {md: link.backlog for md, link in links.items()})


def md_options(
    ctx: RouteContext,
    prompt_tokens: int,
    hashes: list[int],
    links: dict[str, LinkView],
    relay_available: bool,
) -> dict[str, tuple[RouteDecision, float]]:
    """Per MD: the pipeline if the request went there, and the WAN seconds its cost counts."""
    cached = ctx.index.cached_prefix_blocks_all(hashes)
    queued = line_queues(links)
    wan_s = md_wan_costs(ctx, prompt_tokens, cached, links, queued)
    return {
        md: (
            md_pipeline(ctx, prompt_tokens, cached.get(md, 0), link, queued[1][md], relay_available),
            wan_s[md],
        )
        for md, link in links.items()
    }


def md_wan_costs(
    ctx: RouteContext,
    prompt_tokens: int,
    cached: dict[str, int],
    links: dict[str, LinkView],
    queues: tuple[dict[str, float], dict[str, int]] | None = None,
) -> dict[str, float]:
    """Per MD: the WAN seconds its cost counts (wan_cost_s), from each MD's cached prefix in
    blocks (`cached`: PrefixIndex.cached_prefix_blocks_all); `queues`: line_queues(links),
    if the caller has it."""
    compared, queued = queues or line_queues(links)
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


def md_pipeline(
    ctx: RouteContext,
    prompt_tokens: int,
    cached_blocks: int,
    link: LinkView,
    queued: int,
    relay_available: bool,
) -> RouteDecision:
    """The pipeline if the request went to an MD holding `cached_blocks` of its prefix, its
    KV waiting behind `queued` bytes (line_queues: the line's whole queue, as the MD choice
    counts it)."""
    return choose_pipeline(
        prompt_tokens,
        cached_blocks * ctx.block_size,
        ctx.kv_bytes_per_token,
        link.bandwidth,
        link.rtt,
        ctx.settings.wan_time_threshold_s,
        relay_available,
        backlog_bytes=queued,
    )


def md_weights(ctx: RouteContext, prompt_tokens: int) -> RouteWeights:
    """Load weighed against this request's whole KV crossing the WAN (at the prior bandwidth)."""
    request_s = prompt_tokens * ctx.kv_bytes_per_token / ctx.settings.default_bandwidth_bps
    return request_weights(ctx.weights, request_s)


def plan_prefill(
    ctx: RouteContext, prompt_tokens: int, hashes: list[int], prefills: list[InstanceLoad]
) -> str | None:
    blocks = ctx.prefill_index.cached_prefix_blocks_all(hashes)
    cached = {p: n * ctx.block_size for p, n in blocks.items()}  # (absent: 0 tokens)
    # Load weighed against this request's whole prefill.
    weights = request_weights(ctx.weights, ctx.settings.prefill_weight * prompt_tokens)
    return choose_prefill(prefills, prompt_tokens, cached, weights)


# ---- admission to the line -------------------------------------------------------------
def relays_for(
    relays: list[InstanceLoad], prompt_tokens: int, block_size: int, max_requests: int
) -> tuple[list[InstanceLoad], list[InstanceLoad]]:
    """(the relays that could take this request at all, those with room for it now). A relay
    whose KV pool is smaller than the prompt can never take it; one is full while it runs or
    holds `max_requests` (counting those sent since its report) or lacks the free blocks for
    the whole prompt (a relay imports all of it: the router does not index relays' caches)."""
    need = -(-prompt_tokens // block_size)
    able = [r for r in relays if not r.num_blocks or r.num_blocks >= need]
    room = [r for r in able if int(r.load) < max_requests and (not r.num_blocks or r.free_blocks >= need)]
    return able, room


def line_admission(
    decision: RouteDecision, threshold_s: float, budget_s: float, relays_alive: bool, relay_room: bool
) -> bool:
    """Whether the request may be dispatched now (else it is held at the router). Held only
    when its missing KV, behind the line's queue, would reach MD past both the threshold
    (it wants a relay) and the gap budget (P→MD is no option either), relays exist that could
    take it, and none has room. A fleet without such relays (none deployed, all lost, or too
    small for the prompt) is never held: the hold is the relays' overflow, not a second
    admission control."""
    over = decision.est_wan_s > threshold_s and decision.est_wan_s > budget_s
    return not (over and relays_alive and not relay_room)


class LineWait(Enum):
    GO = "go"  # dispatch it now
    WAIT = "wait"  # hold it and plan it again later
    REFUSE = "refuse"  # 429: held too long, or too many held already


def line_wait(
    admitted: bool, waited_s: float, held: int, settings: RouterSettings, newcomer: bool = False
) -> LineWait:
    """What becomes of a request the line admits now (`admitted`: its plan is not held) or
    not, after `waited_s` held, with `held` others held now; a `newcomer` is planned for the
    first time."""
    if admitted:
        return LineWait.GO
    if (newcomer and held >= settings.line_wait_max) or waited_s >= settings.line_wait_s:
        return LineWait.REFUSE
    return LineWait.WAIT


def plan_route(
    ctx: RouteContext,
    prompt_tokens: int,
    hashes: list[int],
    loads: tuple[list[InstanceLoad], list[InstanceLoad], list[InstanceLoad]],  # (MDs, relays, prefills)
    links: dict[str, LinkView],  # per MD in loads[0]
    forced: Pipeline | None = None,
    waiters_ahead: bool = False,
) -> RoutePlan:
    """The MD is the cheapest by the WAN time of what it lacks and its load; the pipeline
    follows from that MD's WAN time behind the line's queue, and the relay is the least loaded
    one with room. A request the line cannot admit (line_admission) gets a plan with `held`
    set and no prefill. `waiters_ahead`: requests held earlier wait for relay room, so this
    one (newly come) sees none: the room that frees is theirs first. A forced pipeline is
    never held."""
    mds, relays, prefills = loads
    s = ctx.settings
    able, room = relays_for(relays, prompt_tokens, ctx.block_size, s.relay_max_requests)
    room = [] if waiters_ahead else room
    relay = choose_least_loaded(room)
    cached = ctx.index.cached_prefix_blocks_all(hashes)
    queues = line_queues(links)
    wan_s = md_wan_costs(ctx, prompt_tokens, cached, links, queues)
    md = choose_main_decode(mds, wan_s, md_weights(ctx, prompt_tokens), hashes[0] if hashes else 0)
    if md is None:
        return RoutePlan(RouteDecision(Pipeline.RLD_ONLY, 0.0, 0, 0.0), "", None, None)
    decision = md_pipeline(ctx, prompt_tokens, cached.get(md, 0), links[md], queues[1][md], relay is not None)
    if forced is None:
        if not line_admission(
            decision, s.wan_time_threshold_s, s.line_budget_s, bool(able), relay is not None
        ):
            return RoutePlan(decision, md, None, None, held=True)
    else:
        # A forced pipeline is honoured when it can be: on the least loaded relay, full or not;
        # with no relay alive P→RLD→MD runs as P→MD (x-pdd-pipeline says which ran).
        relay = relay or (choose_least_loaded(relays) if forced is Pipeline.P_RLD_MD else None)
        if forced is not decision.pipeline and (forced is Pipeline.P_MD or relay):
            decision = RouteDecision(forced, decision.hit_rate, decision.missing_bytes, decision.est_wan_s)
    relay = relay if decision.pipeline is Pipeline.P_RLD_MD else None
    return RoutePlan(decision, md, relay, plan_prefill(ctx, prompt_tokens, hashes, prefills))
