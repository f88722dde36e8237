"""Main decode's request life without a server: events in, actions out
(services/main_decode/core.py)."""

from __future__ import annotations

from opentelemetry.context import Context

from services.main_decode.core import (
    ApplyHandoffs,
    Decoding,
    ExtendPass,
    MainDecodeCore,
    Redelivered,
)
from services.main_decode.job import MainDecodeJob, MainDecodeState
from shared.bus.messages import (
    Abort,
    AbortReason,
    DecodeReport,
    HandoffAck,
    HandoffBatch,
    HandoffMode,
    KVReady,
    Outcome,
    Pipeline,
    PrepareRequest,
    ResumeRequest,
)
from shared.engine import SamplingParams
from shared.engine.outputs import FinishReason, StepOutput
from shared.kv.sink import CONNECTION_LOST
from shared.serving.actions import Deliver, Free, SendAbort, SendTokens, Unknown

CTX = Context()


def prepared(c: MainDecodeCore, rid: str = "r", relay: str = "") -> MainDecodeJob:
    pipeline = Pipeline.P_RLD_MD if relay else Pipeline.P_MD
    req = PrepareRequest(rid, [1, 2, 3, 4], SamplingParams(max_tokens=8), [9], pipeline, "router-0", relay)
    return c.prepared(req, [9], CTX)


def batch(seq: int, start: int, tokens: list[int], final: bool, rid: str = "r") -> HandoffBatch:
    return HandoffBatch(rid, seq, start, tokens, final, HandoffMode.CATCH_UP)


def extend_all(c: MainDecodeCore, job: MainDecodeJob) -> list:
    """What the service's loop does: each due extend pass runs, then the core hears of it."""
    done: list = []
    while actions := c.next_extend(job):
        for a in actions:
            done.append(a)
            if isinstance(a, ExtendPass):
                done += c.extended(job, a.step.batch)
            elif isinstance(a, Free):
                c.forget(a.job)
    return done


def test_a_relayed_request_tells_its_relay_once_the_kv_is_in_and_then_applies_what_is_due() -> None:
    c = MainDecodeCore({}, "md-1")
    job = prepared(c, relay="rld-0")
    assert c.handoff(batch(0, 0, [5, 6], final=False), CTX) == [ApplyHandoffs(job, spawn=True)]
    assert extend_all(c, job) == []  # RECEIVING: the batch waits for the KV
    ready, apply = c.kv_complete(job)
    assert job.state.is_in(MainDecodeState.READY)
    assert ready == Deliver("pdd.relay.rld-0.kv_ready", KVReady("r", "md-1", 0), CTX)
    assert apply == ApplyHandoffs(job)
    (extend,) = extend_all(c, job)
    assert isinstance(extend, ExtendPass) and extend.step.first and job.next_index == 2
    c.handoff(batch(1, 2, [7], final=True), CTX)
    extend, decoding = extend_all(c, job)
    assert not extend.step.first and decoding == Decoding(job, HandoffMode.CATCH_UP)
    assert job.state.is_in(MainDecodeState.DECODING)


def test_on_p_md_nobody_hears_of_the_kv_and_a_redelivered_batch_is_dropped() -> None:
    c = MainDecodeCore({}, "md-1")
    job = prepared(c)
    assert c.kv_complete(job) == [ApplyHandoffs(job)]
    c.handoff(batch(0, 0, [5], final=False), CTX)
    extend_all(c, job)
    assert c.handoff(batch(0, 0, [5], final=False), CTX) == [Redelivered(batch(0, 0, [5], False), "stale", 1)]
    assert c.handoff(batch(0, 0, [5], final=False, rid="gone"), CTX) == [Unknown("gone")]


def test_a_batch_that_does_not_continue_the_output_fails_the_request() -> None:
    c = MainDecodeCore({}, "md-1")
    job = prepared(c)
    c.kv_complete(job)
    c.handoff(batch(0, 3, [5], final=True), CTX)
    abort, drop = extend_all(c, job)
    assert abort == SendAbort("r", AbortReason.FAILED, "handoff batch 0 out of order or empty")
    assert drop == Free(job) and c.jobs == {} and job.state.is_in(MainDecodeState.DONE)


def test_a_request_dropped_during_its_extend_pass_goes_no_further() -> None:
    c = MainDecodeCore({}, "md-1")
    job = prepared(c)
    c.kv_complete(job)
    c.handoff(batch(0, 0, [5], final=True), CTX)
    (extend,) = c.next_extend(job)
    assert c.abort(Abort("r", AbortReason.RELAY_FINISHED)) == [Free(job)] and c.forget(job)
    assert c.extended(job, extend.step.batch) == [] and c.next_extend(job) == []
    assert not c.forget(job)  # once


def test_outputs_ack_a_computed_catch_up_batch_and_the_last_carries_mds_report() -> None:
    c = MainDecodeCore({}, "md-1")
    job = prepared(c, relay="rld-0")
    job.next_seq, job.next_index, job.wan_bytes = 1, 3, 100
    (ack,) = c.outputs(job, [StepOutput(rid="r", computed=True)])
    assert ack == Deliver("pdd.relay.rld-0.handoff_ack", HandoffAck("r", 0))
    (tokens,) = c.outputs(job, [StepOutput(rid="r", token_id=8, index=3)])
    assert tokens.event.tokens == [8] and tokens.event.index == 3 and tokens.router == "router-0"
    last = StepOutput(rid="r", token_id=9, index=4, finished=True, finish_reason=FinishReason.STOP)
    drop, tokens = c.outputs(job, [last])
    assert drop == Free(job) and tokens.event.outcome is Outcome.STOP
    assert tokens.event.decode == DecodeReport("md-1", 2, 100)


def test_a_failure_tells_the_router_only_while_md_decodes_the_request() -> None:
    c = MainDecodeCore({}, "md-1")
    receiving = prepared(c, "a")
    decoding = c.resumed(ResumeRequest("b", [1, 2], [3, 4], SamplingParams(), router="router-0"), CTX)
    c.jobs["b"] = decoding
    assert decoding.state.is_in(MainDecodeState.DECODING) and decoding.next_index == 2
    assert [type(a) for a in c.fail(receiving, "x")] == [SendAbort, Free]
    abort, tokens, drop = c.fail(decoding, "x")
    assert (
        isinstance(tokens, SendTokens) and tokens.event.outcome is Outcome.ERROR and tokens.event.index == 2
    )


def test_an_abandoned_transfer_fails_the_request_only_when_its_sender_vanished() -> None:
    c = MainDecodeCore({}, "md-1")
    job = prepared(c)
    assert c.kv_abandoned(job, "md_lost") == [Free(job)]
    abort, drop = c.kv_abandoned(job, CONNECTION_LOST)
    assert abort.reason is AbortReason.FAILED and "prompt KV transfer lost" in abort.detail


def test_only_requests_past_the_timeout_expire() -> None:
    c = MainDecodeCore({}, "md-1")
    old, new = prepared(c, "old"), prepared(c, "new")
    old.created = new.created - 100
    actions = c.expire(new.created + 50, timeout_s=60)
    assert actions == [SendAbort("old", AbortReason.FAILED, "request timed out on MD"), Free(old)]
