"""The router's count of requests it sent that the instances' load reports cannot show yet."""

import math
from dataclasses import replace

from services.router.routing.assignments import QUIET, RECENT_HALF_LIFE_S, Assignments
from services.router.routing.policy import InstanceLoad, RouteWeights, choose_main_decode

MD = "main_decode"
W = RouteWeights(overlap=1.0, load=0.1, prefill=1e-4, balance_factor=1.5)


def test_a_request_counts_from_when_it_is_sent_until_the_next_report():
    a = Assignments()
    a.record((MD, "a"), at=10.0)
    a.record((MD, "a"), at=10.2)
    a.record((MD, "b"), at=10.1)
    assert a.pending((MD, "a"), reported_at=9.9) == 2  # the last report predates both
    assert a.pending((MD, "b"), reported_at=9.9) == 1
    assert a.pending((MD, "a"), reported_at=10.1) == 1  # a report after the first counts it itself
    assert a.pending((MD, "a"), reported_at=10.3) == 0
    assert a.pending((MD, "a"), reported_at=9.9) == 0  # dropped for good: the report counted them
    assert a.pending(("relay", "a"), reported_at=0.0) == 0  # per role
    assert len(a) == 1  # only b still has one pending


def test_a_request_that_ended_before_the_next_report_no_longer_counts():
    a = Assignments()
    for at in (1.0, 1.1, 1.2):  # three short requests, all done within one report interval
        a.record((MD, "a"), at)
    a.finished((MD, "a"), 1.1)
    a.finished((MD, "a"), 1.0)
    assert a.pending((MD, "a"), reported_at=0.5) == 1  # only the one still running
    a.finished((MD, "a"), 1.0)  # already gone (or counted by a report): nothing happens
    a.finished((MD, "b"), 1.0)
    assert a.pending((MD, "a"), reported_at=0.5) == 1


def test_the_recent_count_halves_every_half_life_and_is_forgotten_when_quiet():
    a = Assignments()
    a.record((MD, "a"), at=0.0)
    a.record((MD, "a"), at=0.0)
    assert a.recent((MD, "a"), now=0.0) == 2.0
    assert abs(a.recent((MD, "a"), now=RECENT_HALF_LIFE_S) - 1.0) < 1e-9
    a.record((MD, "a"), at=RECENT_HALF_LIFE_S)  # decays first, then counts the new one
    assert abs(a.recent((MD, "a"), now=RECENT_HALF_LIFE_S) - 2.0) < 1e-9
    assert a.recent((MD, "b"), now=5.0) == 0.0
    a.expire(before=100 * RECENT_HALF_LIFE_S)
    assert a.recent((MD, "a"), now=100 * RECENT_HALF_LIFE_S) == 0.0 and not a._recent


def test_an_instance_that_left_leaves_nothing_behind():
    a = Assignments()
    a.record((MD, "gone"), at=1.0)
    a.record((MD, "live"), at=1.0)
    a.record((MD, "live"), at=5.0)
    a.expire(before=3.0)
    assert len(a) == 1 and a.pending((MD, "live"), reported_at=0.0) == 1
    a.expire(before=6.0)
    assert len(a) == 0


def _burst(n: int, count_pending: bool) -> list[str]:
    """n requests within one heartbeat interval over three idle MDs with no prefix cached."""
    reports = [InstanceLoad(m) for m in ("a", "b", "c")]
    sent = Assignments()
    chosen = []
    for i in range(n):
        now = 1.01 + i * 0.01  # all after the reports, received at t=1
        loads = [
            replace(r, pending=sent.pending((MD, r.instance), 1.0) if count_pending else 0) for r in reports
        ]
        md = choose_main_decode(loads, {"a": 0.5, "b": 0.5, "c": 0.5}, W)
        sent.record((MD, md), now)
        chosen.append(md)
    return chosen


def test_a_burst_between_two_reports_spreads_over_the_instances():
    chosen = _burst(9, count_pending=True)
    assert sorted(chosen.count(m) for m in "abc") == [3, 3, 3]
    # without the count every one sees the same reports and the same instance wins
    assert set(_burst(9, count_pending=False)) == {"a"}


def test_a_quiet_count_is_dropped_exactly_when_it_falls_below_the_floor():
    """However often expire ran before (it skips its scan while no count can be quiet yet), a
    count goes once it is below QUIET and not a moment before: 1 → 0.01 takes
    log2(100) half-lives."""
    quiet_at = RECENT_HALF_LIFE_S * math.log2(1 / QUIET)
    a = Assignments()
    a.record((MD, "a"), at=0.0)
    a.record((MD, "b"), at=50.0)
    for t in range(0, int(quiet_at)):
        a.expire(before=float(t))
    a.expire(before=quiet_at - 1e-6)
    assert a.recent_all(quiet_at - 1e-6)[(MD, "a")] >= QUIET
    a.expire(before=quiet_at + 1e-6)
    assert set(a.recent_all(quiet_at)) == {(MD, "b")}
    a.expire(before=50.0 + quiet_at + 1e-6)
    assert a.recent_all(200.0) == {}
    a.record((MD, "a"), at=300.0)  # counted afresh
    assert a.recent_all(300.0) == {(MD, "a"): 1.0} and a.recent((MD, "a"), 300.0) == 1.0
