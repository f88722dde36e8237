"""The router's request life without NATS: events in, (new state, actions) out. The real
RequestLife, RequestStream and TokenMerger, fed the messages instances send."""

from __future__ import annotations

import time

import pytest

from services.router.core.actions import (
    Closed,
    CountReports,
    Deliver,
    Forget,
    Move,
    Publish,
    Resume,
    SendAbort,
    UnknownMessage,
)
from services.router.core.merger import TokenMerger
from services.router.core.request_life import STALE_ABORT_EVERY_S, RequestLife
from services.router.core.request_stream import Delta, Failure, RequestStream, StreamState
from services.router.routing.policy import RouteDecision
from shared.bus import subjects
from shared.bus.messages import (
    AbortReason,
    DecodeReport,
    HandoffMode,
    LoadReport,
    MainDecodeLost,
    MainDecodeTarget,
    Outcome,
    Pipeline,
    RelayReport,
    Role,
    TokenEvent,
)
from shared.bus.subjects import Req
from shared.config import RouterSettings

S = RouterSettings()
PREFIX = "cmpl-r0-abcd-"
RID = PREFIX + "1"


def _life() -> RequestLife:
    return RequestLife(S, PREFIX)


def _opened(life: RequestLife, pipeline: Pipeline = Pipeline.P_RLD_MD, rid: str = RID) -> RequestStream:
    relay = "rld0" if pipeline is Pipeline.P_RLD_MD else None
    stream = RequestStream(
        rid,
        [1, 2, 3],
        RouteDecision(pipeline, 0.0, 0, 0.0),
        "md0",
        [7],
        relay,
        merger=TokenMerger(max_tokens=16),
    )
    life.opened(stream)
    return stream


def _dispatched(life: RequestLife, stream: RequestStream) -> list:
    return life.dispatched(stream, "p0", MainDecodeTarget(stream.rid, "tcp://md0:1", [7], "md0"))


def _tok(rid: str, source: Role, index: int, tokens: list[int], **kw) -> TokenEvent:
    return TokenEvent(rid, source, index, tokens, **kw)


def _delivered(actions: list) -> list[Delta | Failure]:
    return [a.item for a in actions if isinstance(a, Deliver)]


def _tokens(actions: list) -> list[int]:
    return [t for item in _delivered(actions) if isinstance(item, Delta) for t in item.tokens]


def test_a_request_lives_from_open_through_the_handoff_to_its_finish() -> None:
    life = _life()
    stream = _opened(life)
    assert life.streams == {RID: stream} and life.attempts == {RID: stream}

    # Dispatched: P learns where MD is; prefill produces until its first token.
    assert _dispatched(life, stream) == [
        Publish(
            subjects.to_instance("prefill", "p0", Req.MD_TARGET),
            MainDecodeTarget(RID, "tcp://md0:1", [7], "md0"),
        )
    ]
    assert stream.state.is_in(StreamState.RELAYED) and stream.producer == (Role.PREFILL, "p0")

    first = life.on_tokens(_tok(RID, Role.PREFILL, 0, [10]), now=stream.created + 0.25)
    assert _tokens(first) == [10] and first[0].ttft_s == pytest.approx(0.25)  # the first token is timed
    assert stream.producer == (Role.RELAY, "rld0")  # the relay decodes next

    rld = life.on_tokens(_tok(RID, Role.RELAY, 1, [11, 12]), now=time.monotonic())
    assert _tokens(rld) == [11, 12] and rld[0].ttft_s is None

    handoff = RelayReport(
        handed_over=True, rld_tokens=3, handoff_mode=HandoffMode.ONE_SHOT, handoff_batches=1
    )
    handed = life.on_tokens(_tok(RID, Role.RELAY, 3, [13], relay=handoff), now=time.monotonic())
    assert handed[0] == CountReports(handoff, None) and _tokens(handed) == [13]
    assert stream.state.is_in(StreamState.WITH_MD) and stream.producer == (Role.MAIN_DECODE, "md0")

    report = DecodeReport("md0", 2, 4096)
    last = life.on_tokens(
        _tok(RID, Role.MAIN_DECODE, 4, [14, 15], outcome=Outcome.STOP, decode=report), now=time.monotonic()
    )
    assert last[0] == CountReports(None, report)
    (delta,) = _delivered(last)
    assert delta == Delta([14, 15], True, "stop", [None, None])
    assert stream.done and stream.merger.released == [10, 11, 12, 13, 14, 15]
    assert stream.summary()["rld_tokens"] == 3 and stream.summary()["md_tokens"] == 2

    # A late copy of the last message changes nothing and counts nothing twice.
    assert (
        life.on_tokens(_tok(RID, Role.MAIN_DECODE, 4, [14, 15], outcome=Outcome.STOP, decode=report), 0.0)
        == []
    )

    closed = life.close(stream)
    assert closed == [Closed(stream), SendAbort(RID, AbortReason.FINISHED, stream)]
    assert life.streams == {} and life.attempts == {}
    assert life.release(stream) == []  # closed once only


def test_prefill_s_first_token_before_md_answers_hands_the_request_on_at_dispatch() -> None:
    life = _life()
    stream = _opened(life, Pipeline.P_MD)
    assert _tokens(life.on_tokens(_tok(RID, Role.PREFILL, 0, [10]), 0.0)) == [10]
    _dispatched(life, stream)
    assert stream.state.is_in(StreamState.WITH_MD) and stream.producer == (Role.MAIN_DECODE, "md0")


def test_a_request_that_prefill_finishes_before_md_answers_ends_once_dispatched() -> None:
    life = _life()
    stream = _opened(life, Pipeline.P_MD)
    only = _tok(RID, Role.PREFILL, 0, [10], outcome=Outcome.LENGTH)  # max_tokens 1
    assert _delivered(life.on_tokens(only, 0.0)) == [Delta([10], True, "length", [None])]
    assert life.on_tokens(only, 0.0) == []  # its copy finishes nothing twice
    assert stream.state.is_in(StreamState.DISPATCHING)
    assert len(_dispatched(life, stream)) == 1 and stream.done


def test_a_p_md_request_whose_prefill_is_lost_before_md_started_moves() -> None:
    """Prefill's first token is out, but MD may never get its KV or first handoff: it moves
    when prefill is lost (or restarted under its name), not when its stream stalls; once MD
    produced, a lost prefill is moot."""
    life = _life()
    stream = _opened(life, Pipeline.P_MD)
    _dispatched(life, stream)
    life.on_tokens(_tok(RID, Role.PREFILL, 0, [10]), 0.0)
    now = time.monotonic()
    life.on_held(LoadReport(Role.MAIN_DECODE, "md0", held=[RID]), now)
    stream.prefill_epoch = "e1"
    assert life.tick(now, {"md0"}, {stream.prefill_instance: "e1"}) == []
    lost = Move(stream, f"prefill {stream.prefill_instance} was lost before main decode started", "lost")
    assert life.tick(now, {"md0"}, {}) == [lost]
    assert life.tick(now, {"md0"}, {stream.prefill_instance: "e2"}) == [lost]  # restarted: holds nothing
    life.on_tokens(_tok(RID, Role.MAIN_DECODE, 1, [11]), now)
    assert life.tick(now, {"md0"}, {}) == []


def test_a_request_whose_instance_is_lost_moves_and_continues_from_the_tokens_sent() -> None:
    life = _life()
    stream = _opened(life, Pipeline.P_MD)
    _dispatched(life, stream)
    life.on_tokens(_tok(RID, Role.PREFILL, 0, [10]), 0.0)
    life.on_tokens(_tok(RID, Role.MAIN_DECODE, 1, [11, 12]), 0.0)
    life.on_tokens(_tok(RID, Role.MAIN_DECODE, 4, [14]), 0.0)  # 3 is still on its way

    now = time.monotonic()
    life.on_held(LoadReport(Role.MAIN_DECODE, "md0", held=[RID]), now)
    assert life.tick(now + S.lost_after_s / 2, {"md0"}) == []  # held, and no gap yet for long
    (move,) = life.tick(now + S.lost_after_s + 0.5, set())
    assert move == Move(stream, "main_decode md0 no longer holds it", "lost")

    actions = life.move(stream, move.why, move.cause)
    assert actions == [SendAbort(RID, AbortReason.MIGRATED, stream), Resume(stream, move.why, "lost")]
    assert stream.state.is_in(StreamState.MIGRATING) and stream.attempt_rid == RID + "-m1"
    assert life.attempts == {RID + "-m1": stream} and list(life.streams) == [RID]
    assert life.move(stream, "again", "lost") == []  # one move at a time

    # The old attempt's late token is not the stream's; it is told (once) to stop.
    late = life.on_tokens(_tok(RID, Role.MAIN_DECODE, 3, [13]), now)
    assert late == [UnknownMessage(RID), SendAbort(RID, AbortReason.STALE)]
    assert life.on_tokens(_tok(RID, Role.MAIN_DECODE, 5, [15]), now) == [UnknownMessage(RID)]

    life.resumed(stream, Role.MAIN_DECODE, "md1")
    assert stream.state.is_in(StreamState.RESUMED) and stream.md_instance == "md1"
    assert stream.producer == (Role.MAIN_DECODE, "md1")
    # The new instance continues after the released tokens (index 3): nothing is sent twice.
    new = RID + "-m1"
    assert _tokens(life.on_tokens(_tok(new, Role.MAIN_DECODE, 3, [23, 24]), now)) == [23, 24]
    done = life.on_tokens(_tok(new, Role.MAIN_DECODE, 5, [25], outcome=Outcome.LENGTH), now)
    assert _delivered(done) == [Delta([25], True, "length", [None])]
    assert stream.merger.released == [10, 11, 12, 23, 24, 25]
    assert life.close(stream)[1] == SendAbort(new, AbortReason.FINISHED, stream)


def test_moved_requests_count_their_recompute_where_they_went_until_their_first_new_token() -> None:
    life = _life()
    a, b = _opened(life, Pipeline.P_MD, RID), _opened(life, Pipeline.P_MD, PREFIX + "2")
    for stream in (a, b):
        _dispatched(life, stream)
        life.on_tokens(_tok(stream.rid, Role.PREFILL, 0, [10]), 0.0)
    assert life.recomputing() == {}  # first attempts are not moves
    for stream in (a, b):
        life.move(stream, "lost", "lost")
    assert life.recomputing() == {}  # not offered yet
    a.offered_to = b.offered_to = (Role.MAIN_DECODE, "md1")
    a.recompute_tokens, b.recompute_tokens = 4, 2
    assert life.recomputing() == {(Role.MAIN_DECODE, "md1"): 6}
    life.resumed(a, Role.RELAY, "rld1")  # took it elsewhere after md1 refused
    assert life.recomputing() == {(Role.MAIN_DECODE, "md1"): 2, (Role.RELAY, "rld1"): 4}
    life.on_tokens(_tok(a.attempt_rid, Role.RELAY, 1, [11]), 0.0)
    assert life.recomputing() == {(Role.MAIN_DECODE, "md1"): 2}
    life.resumed(b, Role.MAIN_DECODE, "md1")
    assert life.recomputing() == {(Role.MAIN_DECODE, "md1"): 2}
    life.move(b, "lost again", "lost")  # a new move: not offered anywhere yet
    assert life.recomputing() == {}


def test_an_instance_that_fails_the_request_moves_it_and_out_of_moves_it_fails() -> None:
    life = _life()
    stream = _opened(life, Pipeline.P_MD)
    _dispatched(life, stream)
    error = _tok(RID, Role.MAIN_DECODE, 0, [], outcome=Outcome.ERROR, error="transfer cut")
    assert life.on_tokens(error, 0.0) == [Move(stream, "main_decode failed it: transfer cut", "error")]
    for attempt in range(S.migration_limit):
        assert isinstance(life.move(stream, "lost", "lost")[-1], Resume)
        life.resumed(stream, Role.RELAY, f"rld{attempt}")
    (failed,) = life.move(stream, "lost", "lost")
    assert failed == Deliver(stream, Failure(f"lost; migration limit ({S.migration_limit}) reached"))
    assert stream.state.is_in(StreamState.FAILED)


def test_no_instance_takes_a_moved_request_and_its_consumer_hears_why() -> None:
    life = _life()
    stream = _opened(life, Pipeline.P_MD)
    life.move(stream, "no prefill", "dispatch")
    assert life.give_up(stream, "no live instance took it") == [
        Deliver(stream, Failure("no live instance took it"))
    ]
    error = _tok(stream.attempt_rid, Role.MAIN_DECODE, 0, [], outcome=Outcome.ERROR, error="boom")
    assert life.on_tokens(error, 0.0) == []  # failed already: nothing more reaches the client


def test_md_lost_before_the_handoff_leaves_the_relay_to_finish_alone() -> None:
    life = _life()
    stream = _opened(life)
    _dispatched(life, stream)
    now = time.monotonic()
    assert life.tick(now, {"md0"}) == []
    lost = MainDecodeLost(RID, "md0")  # P stops its WAN stream, the relay goes on alone
    assert life.tick(now, set()) == [
        Publish(subjects.to_instance("prefill", "p0", Req.MD_LOST), lost),
        Publish(subjects.to_instance("relay", "rld0", Req.MD_LOST), lost),
    ]
    assert stream.state.is_in(StreamState.RELAY_SOLO)
    assert life.tick(now, set()) == []  # told once
    solo = RelayReport(handed_over=False, rld_tokens=2)
    life.on_tokens(_tok(RID, Role.PREFILL, 0, [10]), now)
    assert _delivered(life.on_tokens(_tok(RID, Role.RELAY, 1, [11], outcome=Outcome.STOP, relay=solo), now))[
        0
    ].finished
    assert stream.pipeline is Pipeline.RLD_ONLY


def test_an_aborted_request_is_forgotten_and_its_late_messages_are_stopped_once() -> None:
    life = _life()
    stream = _opened(life, Pipeline.P_MD)
    _dispatched(life, stream)
    assert life.abort(RID, AbortReason.CLIENT_GONE) == [Forget(RID), SendAbort(RID, AbortReason.CLIENT_GONE)]
    assert stream.state.is_in(StreamState.FAILED) and stream.failure == "client_gone"
    assert life.streams == {} and life.attempts == {}
    assert life.abort(RID, AbortReason.CLIENT_GONE) == [
        SendAbort(RID, AbortReason.CLIENT_GONE)
    ]  # unknown: told anyway

    assert life.on_tokens(_tok(RID, Role.MAIN_DECODE, 0, [10]), 100.0) == [
        UnknownMessage(RID),
        SendAbort(RID, AbortReason.STALE),
    ]
    assert life.on_tokens(_tok(RID, Role.MAIN_DECODE, 1, [11]), 101.0) == [UnknownMessage(RID)]
    life.tick(100.0 + STALE_ABORT_EVERY_S + 1, set())  # the rate limit's memory is bounded in time
    assert life.stale_aborted == {}


def test_messages_for_unknown_request_ids() -> None:
    life = _life()
    assert life.on_tokens(_tok("cmpl-other-router-1", Role.RELAY, 0, [1]), 0.0) == []  # another router's
    finished = _tok(PREFIX + "gone", Role.MAIN_DECODE, 0, [1], outcome=Outcome.STOP)
    assert life.on_tokens(finished, 0.0) == [UnknownMessage(PREFIX + "gone")]  # it stops by itself
    assert life.stale_aborted == {}
    assert life.on_held(LoadReport(Role.MAIN_DECODE, "md0", held=["cmpl-other-router-1"]), 0.0) == []
    assert life.streams == {} and life.strays == {}  # another router's: its own router follows it


def test_an_ended_attempt_still_held_is_told_again_once_per_rate_limit() -> None:
    """Its abort was lost (a NATS server restarted): the instance would hold it while this
    router lives. A heartbeat that lists it just after the end is given one more."""
    life = _life()
    stream = _opened(life, Pipeline.P_MD)
    _dispatched(life, stream)
    life.abort(RID, AbortReason.CLIENT_GONE)
    held = LoadReport(Role.MAIN_DECODE, "md0", held=[RID])
    assert life.on_held(held, 100.0) == []
    assert life.on_held(held, 100.25) == []
    assert life.on_held(held, 100.5) == [SendAbort(RID, AbortReason.STALE)]
    assert life.on_held(held, 101.0) == []  # told; not on every heartbeat
    life.tick(100.5 + STALE_ABORT_EVERY_S + 1, set())
    assert life.stale_aborted == {} and life.strays == {}
    assert life.on_held(held, 112.0) == []  # still held after the rate limit: the same again
    assert life.on_held(held, 112.5) == [SendAbort(RID, AbortReason.STALE)]


def test_duplicate_and_out_of_order_tokens_reach_the_client_exactly_once_in_order() -> None:
    life = _life()
    stream = _opened(life)
    _dispatched(life, stream)
    out: list = []
    handed = RelayReport(handed_over=True, rld_tokens=4, handoff_mode=HandoffMode.CATCH_UP, handoff_batches=2)
    for ev in (
        _tok(RID, Role.RELAY, 2, [12, 13]),  # ahead of a missing 0 and 1
        _tok(RID, Role.PREFILL, 0, [10]),
        _tok(RID, Role.RELAY, 1, [11, 12, 13], relay=handed),  # overlaps what is held
        _tok(RID, Role.MAIN_DECODE, 3, [13, 14]),  # MD's first token repeats the relay's last
        _tok(RID, Role.RELAY, 1, [11, 12, 13], relay=handed),  # redelivered
        _tok(RID, Role.MAIN_DECODE, 6, [16], outcome=Outcome.STOP),  # the finish before 5
        _tok(RID, Role.MAIN_DECODE, 5, [15]),
        _tok(RID, Role.MAIN_DECODE, 5, [15, 16, 17]),  # past the finish: dropped
    ):
        out += life.on_tokens(ev, time.monotonic())
    deltas = _delivered(out)
    assert [t for d in deltas for t in d.tokens] == [10, 11, 12, 13, 14, 15, 16]
    assert [d.finished for d in deltas] == [False] * (len(deltas) - 1) + [True]
    assert sum(isinstance(a, CountReports) for a in out) == 1  # the repeated report counts once
    assert stream.done and stream.merger.duplicates > 0


def test_a_token_lost_in_transit_moves_the_request() -> None:
    life = _life()
    stream = _opened(life, Pipeline.P_MD)
    _dispatched(life, stream)
    now = time.monotonic()
    life.on_tokens(_tok(RID, Role.PREFILL, 0, [10]), now)
    life.on_tokens(_tok(RID, Role.MAIN_DECODE, 2, [12]), now)  # 1 never comes
    assert life.tick(now, {"md0"}) == []  # the gap is seen from now
    later = now + S.gap_timeout_s + 0.1
    life.on_held(LoadReport(Role.MAIN_DECODE, "md0", held=[RID]), later)  # MD is alive and holds it
    (move,) = life.tick(later, {"md0"})
    assert move == Move(stream, "token 1 was lost in transit", "gap")


def test_a_refused_dispatch_ends_the_request_and_a_moved_one_ignores_the_late_answer() -> None:
    life = _life()
    stream = _opened(life, Pipeline.P_MD)
    assert life.refused(stream, "main decode refused the request") == [
        Forget(RID),
        SendAbort(RID, AbortReason.DISPATCH_FAILED),
    ]
    assert stream.failure == "main decode refused the request"

    moved = _opened(_life(), Pipeline.P_MD, rid=PREFIX + "2")
    life.opened(moved)
    life.move(moved, "prefill failed it", "error")
    assert _dispatched(life, moved) == [] and moved.state.is_in(StreamState.MIGRATING)
