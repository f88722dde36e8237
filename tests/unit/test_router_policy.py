"""The router's pure routing policy: which pipeline, which MD, which relay."""

import pytest

from services.router.routing.policy import (
    BOUND_SLACK,
    InstanceLoad,
    LinkView,
    RouteContext,
    RouteWeights,
    choose_least_loaded,
    choose_main_decode,
    choose_pipeline,
    choose_prefill,
    comparable_bandwidths,
    estimate_wan_seconds,
    load_from,
    load_of,
    md_wan_costs,
    missing_kv_bytes,
    queued_ahead,
    resume_candidates,
    wan_cost_s,
    within_bound,
)
from services.router.routing.prefix_index import PrefixIndex
from shared.bus.messages import Pipeline, Role
from shared.config import RouterSettings

P_MD, P_RLD_MD = Pipeline.P_MD, Pipeline.P_RLD_MD
S = RouterSettings()
W = RouteWeights(overlap=1.0, load=0.1, prefill=1e-4, balance_factor=S.balance_factor)  # seconds per request


def test_low_hit_long_prompt_takes_the_relay():
    # 4000 tokens × 50 KB over 1 Gbit/s ≈ 1.6 s > 0.5 s threshold
    d = choose_pipeline(4000, 0, 50_000, 125e6, 0.03, 0.5, relay_available=True)
    assert d.pipeline == P_RLD_MD
    assert d.missing_bytes == 4000 * 50_000
    assert d.hit_rate == 0.0
    assert abs(d.est_wan_s - (0.015 + 4000 * 50_000 / 125e6)) < 1e-9


def test_high_hit_goes_straight_to_md():
    d = choose_pipeline(4000, 3968, 50_000, 125e6, 0.03, 0.5, relay_available=True)
    assert d.pipeline == P_MD
    assert d.missing_bytes == 32 * 50_000
    assert abs(d.hit_rate - 0.992) < 1e-9


def test_no_relay_means_p_md_never_relay_only():
    d = choose_pipeline(4000, 0, 50_000, 1e6, 0.03, 0.5, relay_available=False)
    assert d.pipeline == P_MD


def test_threshold_boundary_and_bandwidth_drop():
    fast = choose_pipeline(1000, 0, 1000, 10e6, 0.0, 0.1, True)  # exactly 0.1 s: not above the threshold
    assert fast.pipeline == P_MD
    slow = choose_pipeline(1000, 0, 1000, 5e6, 0.0, 0.1, True)  # bandwidth halves → 0.2 s
    assert slow.pipeline == P_RLD_MD


def test_cached_tokens_are_clamped():
    d = choose_pipeline(100, 500, 10, 1e6, 0.0, 1.0, True)
    assert d.missing_bytes == 0 and d.hit_rate == 1.0
    assert estimate_wan_seconds(0, 1e6, 0.04) == 0.02


def test_kv_queued_toward_md_pushes_a_request_onto_the_relay():
    # 200 × 1 KB alone: 0.2 s at 1 MB/s, under 0.5 s; behind 1 MB already queued: 1.2 s
    alone = choose_pipeline(200, 0, 1000, 1e6, 0.0, 0.5, True)
    queued = choose_pipeline(200, 0, 1000, 1e6, 0.0, 0.5, True, backlog_bytes=1_000_000)
    assert alone.pipeline == P_MD and queued.pipeline == P_RLD_MD
    # nothing to send: the backlog does not matter
    hit = choose_pipeline(200, 200, 1000, 1e6, 0.0, 0.5, True, backlog_bytes=10_000_000)
    assert hit.pipeline == P_MD


def test_load_counts_requests_held_or_running_those_sent_since_and_the_kv_in_use():
    assert load_of(InstanceLoad("a")) == 0.0
    assert load_of(InstanceLoad("a", running=2, waiting=1)) == 3.0
    assert load_of(InstanceLoad("a", running=1, held=4)) == 4.0  # MD: also those whose KV is arriving
    assert load_of(InstanceLoad("a", running=1, pending=2)) == 3.0
    assert load_of(InstanceLoad("a", running=1, free_blocks=25, num_blocks=100)) == 1.75
    assert load_of(InstanceLoad("a", free_blocks=0, num_blocks=0)) == 0.0  # pool size unknown


def test_least_loaded_relay():
    loads = [
        InstanceLoad("x", running=3),
        InstanceLoad("y", running=1, waiting=1),
        InstanceLoad("z", running=5),
    ]
    assert choose_least_loaded(loads) == "y"
    assert choose_least_loaded(loads + [InstanceLoad("w", pending=1)]) == "w"
    assert choose_least_loaded([InstanceLoad("x", running=2), InstanceLoad("y", held=1, pending=2)]) == "x"
    assert choose_least_loaded([]) is None


def test_the_bound_is_the_factor_times_the_mean_with_the_request_plus_two():
    fleet = [InstanceLoad("a", running=6), InstanceLoad("b", running=1), InstanceLoad("c", running=0)]
    # mean with the request: 8/3; bound 1.5 × 8/3 + 2 = 6: a (6 + 1) is over, b (2) and c (1) are not
    assert [c.instance for c in within_bound(fleet, 1.5)] == ["b", "c"]
    assert [c.instance for c in within_bound(fleet, 3.0)] == ["a", "b", "c"]  # 3 × 8/3 + 2 = 10
    assert BOUND_SLACK == 2.0


def test_an_idle_fleet_is_not_over_constrained():
    idle = [InstanceLoad(m) for m in ("a", "b", "c")]
    assert within_bound(idle, 1.5) == idle
    # one request in flight: the MD serving it may take the session's next turn (2 ≤ 1.5 × 2/3 + 2)
    one = [InstanceLoad("a", running=1), InstanceLoad("b"), InstanceLoad("c")]
    assert within_bound(one, 1.5) == one
    assert choose_main_decode(one, {"a": 0.0, "b": 1.0, "c": 1.0}, W) == "a"


def test_the_md_holding_the_prefix_wins_within_the_bound_and_loses_over_it():
    wan_s = {"a": 0.015, "b": 2.0}  # a holds the prompt; b would need 2 s of transfer
    within = [InstanceLoad("a", running=4), InstanceLoad("b", running=2)]  # bound 1.5 × 7/2 + 2 = 7.25
    assert choose_main_decode(within, wan_s, W) == "a"
    edge = [InstanceLoad("a", running=10), InstanceLoad("b", running=1)]  # bound 1.5 × 12/2 + 2 = 11: a at it
    assert choose_main_decode(edge, wan_s, W) == "a"
    over = [InstanceLoad("a", running=11), InstanceLoad("b", running=1)]  # bound 1.5 × 13/2 + 2 = 11.75
    assert choose_main_decode(over, wan_s, W) == "b"
    # requests sent since a's report count: they push it over the bound as well
    assert (
        choose_main_decode([InstanceLoad("a", running=4, pending=10), InstanceLoad("b", running=2)], wan_s, W)
        == "b"
    )


def test_one_candidate_is_chosen_however_loaded():
    assert choose_main_decode([InstanceLoad("a", running=100)], {"a": 9.0}, W) == "a"
    assert choose_prefill([InstanceLoad("p", waiting=50)], 100, {}, W) == "p"
    assert choose_main_decode([], {}, W) is None and choose_prefill([], 100, {}, W) is None
    # a factor under 1 may leave no instance within the bound: balance alone never refuses a request
    strict = RouteWeights(W.overlap, W.load, W.prefill, balance_factor=0.5)
    assert choose_main_decode([InstanceLoad("a", running=100)], {"a": 9.0}, strict) == "a"
    assert within_bound([InstanceLoad("a", running=100)], 0.5) == [InstanceLoad("a", running=100)]


def test_with_no_prefix_anywhere_the_least_loaded_md_wins():
    mds = [InstanceLoad("a", running=3), InstanceLoad("b", running=1), InstanceLoad("c", running=2)]
    assert choose_main_decode(mds, {"a": 1.0, "b": 1.0, "c": 1.0}, W) == "b"
    idle = [InstanceLoad("b"), InstanceLoad("a")]
    assert choose_main_decode(idle, {"a": 1.0, "b": 1.0}, W) == "a"  # all equal: by name, stable
    # equally busy: the one with more free KV
    room = [
        InstanceLoad("a", running=1, free_blocks=10, num_blocks=100),
        InstanceLoad("b", running=1, free_blocks=90, num_blocks=100),
    ]
    assert choose_main_decode(room, {"a": 1.0, "b": 1.0}, W) == "b"


def test_weights_at_zero():
    mds = [InstanceLoad("a", running=3), InstanceLoad("b", running=2)]  # both within the bound (8.5)
    wan_s = {"a": 0.0, "b": 1.0}
    only_load = RouteWeights(overlap=0.0, load=1.0, prefill=0.0, balance_factor=1.5)
    only_wan = RouteWeights(overlap=1.0, load=0.0, prefill=0.0, balance_factor=1.5)
    nothing = RouteWeights(overlap=0.0, load=0.0, prefill=0.0, balance_factor=1.5)
    assert choose_main_decode(mds, wan_s, only_load) == "b"
    assert choose_main_decode(mds, wan_s, only_wan) == "a"
    assert choose_main_decode(mds, wan_s, nothing) == "b"  # every cost 0: the least loaded
    # the bound holds whatever the weights
    hot = [InstanceLoad("a", running=9), InstanceLoad("b")]
    assert choose_main_decode(hot, wan_s, only_wan) == "b"


def test_a_far_md_with_a_longer_prefix_against_a_near_one():
    def wan_s(prompt: int, cached: int, bandwidth: float, rtt: float) -> float:
        return choose_pipeline(prompt, cached, 16_384, bandwidth, rtt, 0.5, True).est_wan_s

    mds = [InstanceLoad("far"), InstanceLoad("near")]
    # far: 1 MB/s, 200 ms; near: 100 MB/s, 10 ms
    half = {"far": wan_s(2000, 1000, 1e6, 0.2), "near": wan_s(2000, 0, 100e6, 0.01)}  # 16.5 s vs 0.33 s
    assert choose_main_decode(mds, half, W) == "near"
    whole = {"far": wan_s(2000, 2000, 1e6, 0.2), "near": wan_s(2000, 0, 100e6, 0.01)}  # 0.1 s vs 0.33 s
    assert choose_main_decode(mds, whole, W) == "far"
    # a backlog queued toward the near one weighs as much as its own blocks
    jammed = {
        "far": whole["far"],
        "near": choose_pipeline(2000, 0, 16_384, 100e6, 0.01, 0.5, True, backlog_bytes=10**9).est_wan_s,
    }
    assert choose_main_decode([InstanceLoad("far", running=3), InstanceLoad("near")], jammed, W) == "far"


def test_prefill_by_its_cached_prefix_against_its_load():
    ps = [InstanceLoad("p0", running=1), InstanceLoad("p1", running=0)]
    # 4000 tokens at 1e-4 s each: 0.4 s of compute saved outweighs one request of load (0.1 s)
    assert choose_prefill(ps, 4000, {"p0": 4000}, W) == "p0"
    assert choose_prefill(ps, 4000, {"p0": 512}, W) == "p1"  # 0.05 s saved: less than the load
    assert choose_prefill(ps, 4000, {}, W) == "p1"
    busy = [InstanceLoad("p0", running=8), InstanceLoad("p1", running=0)]  # over the bound (1.5 × 9/2 + 2)
    assert choose_prefill(busy, 100_000, {"p0": 100_000}, W) == "p1"


@pytest.mark.parametrize("cached", [{"m1": 0.0}, {}])
def test_a_lost_request_resumes_on_the_cheapest_md_then_a_relay(cached):
    mds = [InstanceLoad("m0", running=1), InstanceLoad("m1", running=2), InstanceLoad("m2", running=0)]
    relays = [InstanceLoad("r0", running=4), InstanceLoad("r1", running=2)]
    wan_s = {"m0": 1.0, "m1": 1.0, "m2": 1.0} | cached  # m1 holds the prompt (when it is in `cached`)
    order = resume_candidates(mds, relays, wan_s, W)
    first = ["m1", "m2", "m0"] if cached else ["m2", "m0", "m1"]
    assert order == [(Role.MAIN_DECODE, m) for m in first] + [(Role.RELAY, "r1"), (Role.RELAY, "r0")]
    assert resume_candidates([], relays, {}, W)[0] == (Role.RELAY, "r1")
    assert resume_candidates([], [], {}, W) == []


def test_an_md_over_the_bound_comes_last_among_the_mds():
    mds = [InstanceLoad("hot", running=9), InstanceLoad("cold")]
    order = resume_candidates(mds, [InstanceLoad("r")], {"hot": 0.0, "cold": 5.0}, W)
    assert order == [(Role.MAIN_DECODE, "cold"), (Role.MAIN_DECODE, "hot"), (Role.RELAY, "r")]


def test_a_move_goes_where_its_first_token_comes_soonest_and_a_burst_spreads():
    mds = [InstanceLoad("m0", running=6)]
    relays = [InstanceLoad("r0", running=1), InstanceLoad("r1", running=0)]
    md, r0, r1 = (Role.MAIN_DECODE, "m0"), (Role.RELAY, "r0"), (Role.RELAY, "r1")
    own = {md: 300, r0: 300, r1: 300}  # the prompt and the tokens so far, none cached
    assert resume_candidates(mds, relays, {"m0": 0.0}, W, own, {}) == [md, r1, r0]  # equals: MD first
    assert resume_candidates(mds, relays, {"m0": 0.0}, W, own, {md: 300}) == [r1, r0, md]
    assert resume_candidates(mds, relays, {"m0": 0.0}, W, own, {md: 300, r1: 300}) == [r0, md, r1]
    # MD holds the prompt: it recomputes only the tokens so far, even behind another move.
    assert resume_candidates(mds, relays, {"m0": 0.0}, W, own | {md: 40}, {md: 200}) == [md, r1, r0]


def test_bandwidth_estimates_of_one_line_compare_as_equal_and_a_slow_link_stays_slow() -> None:
    # Two MDs behind one line measured at 40 and 70 MB/s (short transfers scatter): equal. A
    # third behind a line a quarter as fast keeps its own estimate.
    bws = comparable_bandwidths({"a": 40e6, "b": 70e6, "far": 17e6})
    assert bws == {"a": 70e6, "b": 70e6, "far": 17e6}
    assert comparable_bandwidths({}) == {}


def test_near_equal_mds_are_picked_by_the_prompt_so_simultaneous_new_sessions_spread():
    idle = [InstanceLoad("a"), InstanceLoad("b", pending=1)]  # b: one request this router just sent
    wan_s = {"a": 1.0, "b": 1.0}
    picks = {choose_main_decode(idle, wan_s, W, spread_key=k) for k in range(8)}
    assert picks == {"a", "b"}  # within one request of load: the prompt's hash decides
    assert all(
        choose_main_decode(idle, wan_s, W, spread_key=k) == choose_main_decode(idle, wan_s, W, spread_key=k)
        for k in range(8)
    )
    busier = [InstanceLoad("a"), InstanceLoad("b", pending=2)]
    assert {choose_main_decode(busier, wan_s, W, spread_key=k) for k in range(8)} == {"a"}
    holder = {"a": 0.1, "b": 1.0}  # a prefix: far more than one request of load
    assert {choose_main_decode(idle, holder, W, spread_key=k) for k in range(8)} == {"a"}


def test_mds_behind_one_line_wait_behind_all_of_its_queue():
    compared = comparable_bandwidths({"a": 30e6, "b": 28e6, "far": 5e6})
    queued = queued_ahead(compared, {"a": 4096, "b": 0, "far": 100})
    assert queued == {"a": 4096, "b": 4096, "far": 100}  # a's queue delays b's transfer just as much
    assert queued_ahead({}, {}) == {}
    one_line = {"a": 50e6, "b": 50e6}
    assert queued_ahead(one_line, {"a": 4096, "b": 100}) == {"a": 4196, "b": 4196}  # each behind all of it


def test_sessions_that_settled_unevenly_are_caught_by_the_recent_count():
    # Both idle at this moment (short requests), but a got 20 of the last 22 requests: over the
    # bound by its recent share (1.5 × 23/2 + 2 = 19.25 < 21), so a session's next turn goes to b.
    settled = [InstanceLoad("a", recent=20.0), InstanceLoad("b", recent=2.0)]
    assert [c.instance for c in within_bound(settled, 1.5)] == ["b"]
    assert choose_main_decode(settled, {"a": 0.0, "b": 1.0}, W) == "b"
    even = [InstanceLoad("a", recent=12.0), InstanceLoad("b", recent=10.0)]  # 13 ≤ 1.5 × 23/2 + 2
    assert choose_main_decode(even, {"a": 0.0, "b": 1.0}, W) == "a"


def test_a_load_from_its_figures_equals_the_dataclasss():
    fields = ("md0", 3, 1, 100, 400, 5, 2, 1.5)
    assert load_from(*fields[1:7]) == load_of(InstanceLoad(*fields)) == 5 + 2 + 0.75
    assert load_from(4, 3, 10, 40, 5, 0) == load_of(InstanceLoad("d0", 4, 3, 10, 40, 5)) == 7 + 0.75
    assert load_from(0, 0, 0, 0, 0, 0) == 0.0  # pool size unknown


@pytest.mark.parametrize("slow_b", [False, True], ids=["one line", "b on a slower line"])
def test_md_wan_costs_are_each_mds_wan_cost(slow_b):
    """Per MD: wan_cost_s of what it lacks, behind the queue it waits behind (queued_ahead) at
    its comparable bandwidth, whether every MD shares one line or not."""
    ctx = RouteContext(S, PrefixIndex(), PrefixIndex(), 16, 1000)
    line = LinkView(1e6, 0.01)
    links = {
        "a": line,
        "b": LinkView(0.2e6, 0.05) if slow_b else line,
        "c": LinkView(1e6, 0.01, 5000),
        "d": line,
    }
    cached = {"a": 3, "c": 1, "d": 3, "gone": 2}  # (blocks; "gone" is no MD any more)
    compared = comparable_bandwidths({m: link.bandwidth for m, link in links.items()})
    queued = queued_ahead(compared, {m: link.backlog for m, link in links.items()})
    expected = {
        m: wan_cost_s(missing_kv_bytes(100, cached.get(m, 0) * 16, 1000), queued[m], compared[m])
        for m in links
    }
    assert md_wan_costs(ctx, 100, cached, links) == expected
    assert len(set(expected.values())) == 3  # (a and d alike, b, c)
