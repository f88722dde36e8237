"""Routing that sees the line: the pipeline choice counts the whole queue of the line a
transfer waits behind, and admission to the line sends a request whose KV cannot arrive
within the gap budget by a relay, holds it while every relay is full, and refuses it past
the bound. Pure functions, and the fleet simulator that routes through them."""

import pytest

from pdd.sim.fleet.deployment import LinkSpec, RoleSpec, pdd
from pdd.sim.fleet.simulator import SimSettings, simulate
from services.router.routing.policy import (
    InstanceLoad,
    LineWait,
    LinkView,
    RouteContext,
    RouteDecision,
    line_admission,
    line_queues,
    line_wait,
    md_options,
    plan_route,
    relays_for,
)
from services.router.routing.prefix_index import PrefixIndex
from shared.bus.messages import Pipeline
from shared.config import RouterSettings
from tests.sim_util import FLAT, TINY, request, workload

P_MD, P_RLD_MD = Pipeline.P_MD, Pipeline.P_RLD_MD
BLOCK, KV = 16, 1000  # tokens per block, KV bytes per token
LINE = 1e6  # bytes/s of the one line every MD is behind
# Relay wanted past 0.5 s of WAN time, P→MD acceptable up to 2 s of it; relays take 2 requests.
S = RouterSettings(
    wan_time_threshold_s=0.5, line_budget_s=2.0, relay_max_requests=2, line_wait_s=1.0, line_wait_max=3
)


def _ctx(settings: RouterSettings = S) -> RouteContext:
    return RouteContext(settings, PrefixIndex(), PrefixIndex(), BLOCK, KV)


def _links(backlog_each: int, n: int = 32) -> dict[str, LinkView]:
    return {f"md{i}": LinkView(LINE, 0.0, backlog_each) for i in range(n)}


def _plan(prompt_tokens: int, links: dict[str, LinkView], relays: list[InstanceLoad], forced=None):
    mds = [InstanceLoad(md) for md in links]
    hashes = list(range(prompt_tokens // BLOCK))
    return plan_route(_ctx(), prompt_tokens, hashes, (mds, relays, [InstanceLoad("p0")]), links, forced)


def test_the_pipeline_sees_the_whole_lines_queue_not_one_mds_share():
    # 32 MDs behind one line, 40 KB queued toward each: 1.28 MB on the line. The request's own
    # 0.32 s of KV alone is under the threshold; behind the line's queue it is 1.6 s.
    links = _links(40_000)
    assert set(line_queues(links)[1].values()) == {32 * 40_000}
    plan = _plan(320, links, [InstanceLoad("rld0")])
    assert plan.decision.pipeline is P_RLD_MD and plan.relay == "rld0"
    assert plan.decision.est_wan_s == pytest.approx((320 * KV + 32 * 40_000) / LINE)
    # md_options (the move targets' view) sees it the same way.
    options = md_options(_ctx(), 320, list(range(20)), links, True)
    assert {d.pipeline for d, _ in options.values()} == {P_RLD_MD}
    # With the line empty the same request goes straight to MD.
    assert _plan(320, _links(0), [InstanceLoad("rld0")]).decision.pipeline is P_MD


def test_over_the_budget_the_request_takes_a_relay_with_room():
    links = _links(100_000)  # 3.2 MB queued: 3.5 s for 320 tokens more, past the 2 s budget
    full, free = InstanceLoad("rld0", running=2), InstanceLoad("rld1", running=1)
    plan = _plan(320, links, [full, free])
    assert (plan.held, plan.decision.pipeline, plan.relay) == (False, P_RLD_MD, "rld1")


def test_with_every_relay_full_over_the_budget_it_is_held_within_it_it_goes_to_md():
    full = [InstanceLoad("rld0", running=2), InstanceLoad("rld1", running=1, pending=1)]
    over = _plan(320, _links(100_000), full)
    assert over.held and over.prefill is None and over.relay is None
    within = _plan(320, _links(30_000), full)  # 1.28 s: wants a relay, but P→MD is within budget
    assert (within.held, within.decision.pipeline, within.relay) == (False, P_MD, None)
    hit = _plan(0, _links(100_000), full)  # nothing to send: the line's queue does not matter
    assert not hit.held and hit.decision.pipeline is P_MD


def test_a_forced_pipeline_is_never_held():
    full = [InstanceLoad("rld0", running=2)]
    assert _plan(320, _links(100_000), full, forced=P_MD).decision.pipeline is P_MD
    forced = _plan(320, _links(100_000), full, forced=P_RLD_MD)
    assert (forced.held, forced.relay, forced.decision.pipeline) == (False, "rld0", P_RLD_MD)


def test_a_fleet_with_no_relay_that_could_take_it_is_not_held():
    assert not _plan(320, _links(100_000), []).held  # none deployed, or all lost
    tiny = InstanceLoad("rld0", free_blocks=5, num_blocks=10)  # a pool smaller than the prompt's 20 blocks
    plan = _plan(320, _links(100_000), [tiny])
    assert not plan.held and plan.decision.pipeline is P_MD


def test_a_relay_is_full_at_its_request_limit_or_without_free_blocks_for_the_prompt():
    relays = [
        InstanceLoad("busy", running=1, held=2),  # holds 2: at the limit
        InstanceLoad("sent", running=1, pending=1),  # 1 + 1 sent since its report
        InstanceLoad("tight", free_blocks=19, num_blocks=100),  # the prompt needs 20
        InstanceLoad("ok", running=1, free_blocks=20, num_blocks=100),
        InstanceLoad("small", num_blocks=19),  # could never take it
        InstanceLoad("unknown"),  # no pool reported yet: room
    ]
    able, room = relays_for(relays, 320, BLOCK, max_requests=2)
    assert [r.instance for r in able] == ["busy", "sent", "tight", "ok", "unknown"]
    assert [r.instance for r in room] == ["ok", "unknown"]
    assert relays_for(relays, 321, BLOCK, 2)[1][0].instance == "unknown"  # 321 tokens: 21 blocks


def test_admission_needs_past_threshold_and_budget_and_full_relays():
    def d(est: float) -> RouteDecision:
        return RouteDecision(P_MD, 0.0, 1, est)

    assert not line_admission(d(2.5), 0.5, 2.0, relays_alive=True, relay_room=False)
    assert line_admission(d(2.0), 0.5, 2.0, True, False)  # exactly at the budget: admitted
    assert line_admission(d(2.5), 0.5, 2.0, True, True)  # a relay has room
    assert line_admission(d(2.5), 0.5, 2.0, False, False)  # no relay at all
    assert line_admission(d(2.5), 3.0, 2.0, True, False)  # under the threshold: P→MD is the choice


def test_a_held_request_waits_then_is_refused_past_the_bound():
    assert line_wait(True, 0.0, 99, S, newcomer=True) is LineWait.GO  # admitted: goes, however many wait
    assert line_wait(False, 0.0, 2, S, newcomer=True) is LineWait.WAIT
    assert line_wait(False, 0.99, 2, S) is LineWait.WAIT
    assert line_wait(False, 1.0, 0, S) is LineWait.REFUSE  # held line_wait_s
    assert line_wait(False, 0.0, 3, S, newcomer=True) is LineWait.REFUSE  # line_wait_max wait already
    assert line_wait(False, 0.5, 3, S) is LineWait.WAIT  # one already held keeps its place
    assert line_wait(True, 5.0, 0, S) is LineWait.GO  # room came: goes, however long it waited


def test_a_newcomer_sees_no_relay_room_while_others_wait_for_it():
    """The room that frees belongs to those held first: a newcomer plans as if every relay
    were full (waiters_ahead)."""
    relays, mds = [InstanceLoad("rld0")], [InstanceLoad(f"md{i}") for i in range(32)]

    def plan(prompt_tokens: int, backlog_each: int, waiters_ahead: bool):
        links, hashes = _links(backlog_each), list(range(prompt_tokens // BLOCK))
        loads = (mds, relays, [InstanceLoad("p0")])
        return plan_route(_ctx(), prompt_tokens, hashes, loads, links, None, waiters_ahead)

    assert plan(320, 100_000, False).relay == "rld0"
    assert plan(320, 100_000, True).held  # over the budget: joins the wait
    within = plan(320, 30_000, True)  # within the budget: P→MD rather than wait
    assert (within.held, within.decision.pipeline) == (False, P_MD)
    assert not plan(0, 100_000, True).held  # a hit needs no relay


def test_the_simulator_holds_and_refuses_as_the_router_does():
    """One relay taking one request at a time, a slow line, a burst of low-hit requests: the
    first takes the relay, the rest wait at the router for it; those still waiting past
    line_wait_s are refused. Every request is either recorded or refused, and a held one's
    latencies count from its arrival at the router."""
    settings = RouterSettings(
        wan_time_threshold_s=0.1,
        line_budget_s=0.2,
        relay_max_requests=1,
        line_wait_s=0.5,
        line_replan_s=0.05,
    )
    fleet = pdd(RoleSpec(1, FLAT), RoleSpec(1, FLAT), RoleSpec(2, FLAT), LinkSpec(1e5, 0.01))
    # 128 blocks × 16 tokens × 16 B = 32 KB: 0.33 s on the line, past the 0.2 s budget.
    reqs = [request(i, 0.001 * i, 128, 8) for i in range(12)]  # (a relay shows none before prefill)
    result = simulate(fleet, workload(*reqs), TINY, SimSettings(router=settings))
    assert result.held > 0 and result.refused > 0
    assert len(result.records) + result.refused == len(reqs)
    assert all(r.pipeline != P_MD.value for r in result.records)  # never P→MD past the budget
    arrival = {r.rid: r.arrival_s for r in reqs}
    assert all(r.arrival_s == arrival[r.rid] for r in result.records)
    assert max(r.ttft_s for r in result.records) > 0.1  # (a held one waited before its prefill)
