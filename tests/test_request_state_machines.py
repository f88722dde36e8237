"""Each service's per-request state machine: the tables, and the router's transitions."""

import pytest

from services.main_decode.service import MOVES as MD_MOVES
from services.main_decode.service import DecodeState
from services.prefill.service import MOVES as P_MOVES
from services.prefill.service import PrefillState
from services.relay.service import MOVES as RLD_MOVES
from services.relay.service import RelayState
from services.router.policy import RouteDecision
from services.router.request_stream import MOVES as ROUTER_MOVES
from services.router.request_stream import RequestStream, StreamState
from shared.bus.messages import DecodeReport, HandoffMode, Pipeline, RelayReport, Role, TokenEvent
from shared.state_machine import IllegalTransition

TABLES = [
    (P_MOVES, PrefillState.PREFILLING, {PrefillState.RELEASED}),
    (RLD_MOVES, RelayState.RELAYING, {RelayState.DONE}),
    (MD_MOVES, DecodeState.RECEIVING, {DecodeState.DONE}),
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
    s.dispatched()
    assert s.md_lost() and s.state.state is StreamState.RELAY_SOLO and s.queue.empty()
    s.observe(TokenEvent("r", Role.RELAY, 1, [5], relay=RelayReport(handed_over=False, rld_tokens=3)))
    s.finish()
    assert s.done and s.pipeline is Pipeline.RLD_ONLY and s.summary()["rld_tokens"] == 3


def test_md_lost_after_the_handoff_fails_the_request_at_once() -> None:
    s = _stream(Pipeline.P_RLD_MD)
    s.dispatched()
    report = RelayReport(handed_over=True, rld_tokens=9, handoff_mode=HandoffMode.CATCH_UP, handoff_batches=2)
    s.observe(TokenEvent("r", Role.RELAY, 10, [], relay=report))
    assert s.state.state is StreamState.WITH_MD
    assert not s.md_lost()
    assert s.state.state is StreamState.FAILED and s.queue.get_nowait() is None and "md0" in s.failure
    assert s.summary()["handoff_mode"] == "catch-up" and s.summary()["handoff_batches"] == 2


def test_p_md_is_with_md_from_dispatch_and_reports_md_figures() -> None:
    s = _stream(Pipeline.P_MD)
    s.dispatched()
    assert s.state.state is StreamState.WITH_MD
    s.observe(TokenEvent("r", Role.MAIN_DECODE, 1, [7], decode=DecodeReport("md0", md_tokens=4, wan_bytes=4096)))
    s.finish()
    summary = s.summary()
    assert (summary["pipeline"], summary["md_tokens"], summary["wan_bytes"]) == ("p-md", 4, 4096)


def test_an_ended_stream_cannot_move_again() -> None:
    s = _stream(Pipeline.P_MD)
    with pytest.raises(IllegalTransition):
        s.finish()  # still dispatching
    s.dispatched()
    s.finish()
    s.fail("late")  # a failure after the finish changes nothing
    assert s.done and s.failure is None
    with pytest.raises(IllegalTransition):
        s.dispatched()
