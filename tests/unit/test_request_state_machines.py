"""Each service's per-request state machine: the tables, and the router's transitions."""

import pytest

from services.main_decode.job import MOVES as MD_MOVES
from services.main_decode.job import MainDecodeState
from services.prefill.job import MOVES as P_MOVES
from services.prefill.job import PrefillState
from services.relay.job import MOVES as RLD_MOVES
from services.relay.job import RelayState
from services.router.core.merger import TokenMerger
from services.router.core.request_stream import MOVES as ROUTER_MOVES
from services.router.core.request_stream import RequestStream, StreamState
from services.router.routing.policy import RouteDecision
from shared.bus.messages import DecodeReport, HandoffMode, Pipeline, RelayReport, Role, TokenEvent
from shared.serving.state_machine import IllegalTransition

TABLES = [
    (P_MOVES, PrefillState.PREFILLING, {PrefillState.RELEASED}),
    (RLD_MOVES, RelayState.RELAYING, {RelayState.DONE}),
    (MD_MOVES, MainDecodeState.RECEIVING, {MainDecodeState.DONE}),
    (ROUTER_MOVES, StreamState.DISPATCHING, {StreamState.FINISHED, StreamState.FAILED}),
]


@pytest.mark.parametrize("moves, start, ends", TABLES, ids=["prefill", "relay", "main_decode", "router"])
def test_every_state_is_reachable_and_every_request_can_end(moves, start, ends) -> None:
    states = set(type(start))
    assert set(moves) == states  # every state has a row
    assert _reachable(moves, start) == states
    for state in states - ends:  # from anywhere, a request can still end: nothing hangs by design
        assert _reachable(moves, state) & ends, state
    assert all(moves[e] == frozenset() for e in ends)


def _reachable(moves, start) -> set:
    reach, todo = {start}, [start]
    while todo:
        for nxt in moves[todo.pop()] - reach:
            reach.add(nxt)
            todo.append(nxt)
    return reach


def _stream(pipeline: Pipeline) -> RequestStream:
    return RequestStream("r", [1, 2, 3], RouteDecision(pipeline, 0.0, 0, 0.0), "md0")


def test_md_lost_before_the_handoff_leaves_the_relay_to_finish() -> None:
    s = _stream(Pipeline.P_RLD_MD)
    s.dispatched("p0")
    s.md_lost()
    assert s.state.state is StreamState.RELAY_SOLO
    s.observe(TokenEvent("r", Role.RELAY, 1, [5], relay=RelayReport(handed_over=False, rld_tokens=3)))
    s.finish()
    assert s.done and s.pipeline is Pipeline.RLD_ONLY and s.summary()["rld_tokens"] == 3


def test_the_producer_follows_the_request_from_prefill_to_relay_to_md() -> None:
    s = _stream(Pipeline.P_RLD_MD)
    s.relay_instance = "r0"
    s.dispatched("p0")
    assert s.producer == (Role.PREFILL, "p0")
    s.observe(TokenEvent("r", Role.PREFILL, 0, [4]))
    assert s.producer == (Role.RELAY, "r0")
    report = RelayReport(handed_over=True, rld_tokens=9, handoff_mode=HandoffMode.CATCH_UP, handoff_batches=2)
    s.observe(TokenEvent("r", Role.RELAY, 10, [], relay=report))
    assert s.state.state is StreamState.WITH_MD and s.producer == (Role.MAIN_DECODE, "md0")
    assert s.summary()["handoff_mode"] == "catch-up" and s.summary()["handoff_batches"] == 2


def test_a_stream_must_move_when_its_producer_stops_holding_it() -> None:
    s = _stream(Pipeline.P_MD)
    s.dispatched("p0")
    now = s.last_held
    assert s.stall(now + 1.9, lost_after_s=2.0, gap_after_s=1.0, stall_after_s=9.0) is None
    why, cause = s.stall(now + 2.1, lost_after_s=2.0, gap_after_s=1.0, stall_after_s=9.0)
    assert cause == "lost" and "prefill p0" in why


def test_once_tokens_flow_a_silent_producer_is_lost_sooner() -> None:
    """Before its first token a producer is judged on its heartbeats alone; once tokens flow,
    silence in both for the shorter time is enough."""
    s = _stream(Pipeline.P_MD)
    s.dispatched("p0")
    quiet = {"lost_after_s": 1.0, "gap_after_s": 1.0, "stall_after_s": 9.0, "streaming_lost_after_s": 0.6}
    now = s.last_held
    assert s.stall(now + 0.7, **quiet) is None  # prefill computing: no token yet
    s.observe(TokenEvent("r", Role.PREFILL, 0, [4]))
    assert s.producer == (Role.MAIN_DECODE, "md0")
    now = s.last_held
    assert s.stall(now + 0.5, **quiet) is None
    why, cause = s.stall(now + 0.7, **quiet)
    assert cause == "lost" and "main_decode md0" in why


def test_a_token_missing_in_transit_makes_the_stream_move_after_the_gap_timeout() -> None:
    s = _stream(Pipeline.P_MD)
    s.merger = TokenMerger(max_tokens=10)
    s.dispatched("p0")
    s.merger.add(0, [1])
    s.merger.add(2, [3])  # index 1 never came
    t = s.last_held
    assert s.stall(t, 2.0, 1.0, 9.0) is None  # the gap is noticed
    assert s.stall(t + 0.5, 2.0, 1.0, 9.0) is None
    assert s.stall(t + 1.1, 2.0, 1.0, 9.0) == ("token 1 was lost in transit", "gap")


def test_a_stream_whose_tokens_stop_while_it_is_held_moves_after_the_stall_timeout() -> None:
    s = _stream(Pipeline.P_MD)
    s.merger = TokenMerger(max_tokens=10)
    s.dispatched("p0")
    assert s.stall(s.last_held + 30, 99.0, 1.0, 9.0) is None  # no token yet: prefill may take long
    s.observe(TokenEvent("r", Role.PREFILL, 0, [4]))
    s.merger.add(0, [4])
    t = s.last_token_at
    assert s.stall(t + 8.9, 99.0, 1.0, 9.0) is None
    assert s.stall(t + 9.1, 99.0, 1.0, 9.0) == ("no token for 9 s", "stall")
    s.migrating()
    assert s.last_token_at is None  # the new attempt gets its own window


def test_a_move_restarts_the_merger_at_the_tokens_sent_and_names_a_new_attempt() -> None:
    s = _stream(Pipeline.P_MD)
    s.merger = TokenMerger(max_tokens=10)
    s.dispatched("p0")
    s.merger.add(0, [1, 2])
    s.merger.add(3, [4], finished=True, finish_reason="stop")
    new = s.migrating()
    assert new == "r-m1" and s.attempt_rid == "r-m1" and s.producer is None
    assert s.merger.released == [1, 2] and not s.merger.has_gap and s.merger.end_index is None
    s.resumed(Role.RELAY, "r0")
    out = s.merger.add(2, [3, 4], finished=True, finish_reason="stop")  # the new attempt resends from 2
    assert out.tokens == [3, 4] and out.finished and s.merger.released == [1, 2, 3, 4]
    assert s.summary()["migrations"] == 1


def test_p_md_is_with_md_from_dispatch_and_reports_md_figures() -> None:
    s = _stream(Pipeline.P_MD)
    s.dispatched("p0")
    assert s.state.state is StreamState.WITH_MD
    s.observe(
        TokenEvent("r", Role.MAIN_DECODE, 1, [7], decode=DecodeReport("md0", md_tokens=4, wan_bytes=4096))
    )
    s.finish()
    summary = s.summary()
    assert (summary["pipeline"], summary["md_tokens"], summary["wan_bytes"]) == ("p-md", 4, 4096)


def test_an_ended_stream_cannot_move_again() -> None:
    s = _stream(Pipeline.P_MD)
    with pytest.raises(IllegalTransition):
        s.finish()  # still dispatching
    s.dispatched("p0")
    s.finish()
    s.fail("late")  # a failure after the finish changes nothing
    assert s.done and s.failure is None
    with pytest.raises(IllegalTransition):
        s.dispatched("p0")


def test_a_first_token_that_beats_mds_answer_still_hands_the_request_on() -> None:
    s = _stream(Pipeline.P_MD)
    s.observe(TokenEvent("r", Role.PREFILL, 0, [4]))  # prefill answered before MD's prepare reply came
    assert s.producer is None
    s.dispatched("p0")
    assert s.producer == (Role.MAIN_DECODE, "md0")  # not prefill, which lets go once its KV is sent


def test_the_summary_names_the_instances_the_request_ran_on_also_after_a_move() -> None:
    s = _stream(Pipeline.P_RLD_MD)
    s.relay_instance = "r0"
    assert s.summary()["instances"] == {
        "prefill": None,
        "relay": "r0",
        "main_decode": "md0",
    }  # not dispatched yet
    s.dispatched("p1")
    assert s.summary()["instances"] == {"prefill": "p1", "relay": "r0", "main_decode": "md0"}
    s.migrating()
    s.resumed(Role.MAIN_DECODE, "md2")  # md0 was lost: md2 produces the rest
    assert s.summary()["instances"] == {"prefill": "p1", "relay": "r0", "main_decode": "md2"}
    s.migrating()
    s.resumed(Role.RELAY, "r3")
    assert s.summary()["instances"]["relay"] == "r3"
    no_md = RequestStream("q", [1], RouteDecision(Pipeline.RLD_ONLY, 0.0, 0, 0.0), "")  # no MD was alive
    assert no_md.summary()["instances"] == {"prefill": None, "relay": None, "main_decode": None}
