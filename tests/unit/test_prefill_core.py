"""Prefill's request life without a server: events in, actions out (services/prefill/core.py)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from services.prefill.core import (
    CancelStream,
    ExportTarget,
    PrefillCore,
    ReportRefused,
    StartStream,
    submit_error,
)
from services.prefill.exporter import BlockExport
from services.prefill.job import END, KVPath, PrefillJob, PrefillState
from shared.bus.messages import (
    Abort,
    AbortReason,
    HandoffBatch,
    HandoffMode,
    MainDecodeLost,
    MainDecodeTarget,
    Outcome,
    Pipeline,
    PrefillSubmit,
    RelayStart,
)
from shared.engine import SamplingParams
from shared.engine.outputs import FinishReason, StepOutput
from shared.kv.refusal import PeerRefused
from shared.serving.actions import Deliver, Free, SendAbort, SendTokens, Unknown


def submit(rid: str = "r", relayed: bool = False) -> PrefillSubmit:
    pipeline = Pipeline.P_RLD_MD if relayed else Pipeline.P_MD
    relay = {"relay_address": "unix:///tmp/rld", "relay": "rld-0"} if relayed else {}
    return PrefillSubmit(rid, [1, 2, 3], SamplingParams(max_tokens=8), pipeline, router="router-0", **relay)


def admitted(c: PrefillCore, rid: str = "r", relayed: bool = False) -> tuple[PrefillJob, list]:
    job = PrefillJob(submit(rid, relayed), local_queue=asyncio.Queue() if relayed else None)
    c.admit(job)
    return job, c.admitted(job)


def target(rid: str = "r", missing: list[int] | None = None) -> MainDecodeTarget:
    return MainDecodeTarget(
        rid, "tcp://md-1:9000", [11, 12] if missing is None else missing, md_instance="md-1"
    )


def token(rid: str = "r", ends: FinishReason | None = None) -> StepOutput:
    return StepOutput(
        rid=rid, token_id=7, index=0, finished=True, finish_reason=FinishReason.PREFILLED, ends=ends
    )


def test_a_submit_names_both_or_neither_of_the_relays_address_and_instance() -> None:
    assert submit_error(submit(relayed=True)) is None and submit_error(submit()) is None
    half = PrefillSubmit("r", [1], SamplingParams(), Pipeline.P_RLD_MD, relay_address="unix:///x")
    assert submit_error(half) == "relay_address and relay must be given together"


def test_the_local_stream_starts_on_admission_only_on_the_relayed_pipeline() -> None:
    c = PrefillCore({})
    job, actions = admitted(c, "md", relayed=False)
    assert actions == [] and c.jobs["md"] is job
    job, actions = admitted(c, "rld", relayed=True)
    assert actions == [StartStream(job, KVPath.LOCAL, "unix:///tmp/rld")] and job.streaming == {KVPath.LOCAL}


def test_a_refused_prompt_leaves_no_job() -> None:
    c = PrefillCore({})
    job, _ = admitted(c)
    c.refused(job)
    assert c.jobs == {}


@pytest.mark.parametrize("target_first", [True, False])
def test_on_p_md_prefill_hands_its_one_token_over_once_both_target_and_token_are_in(
    target_first: bool,
) -> None:
    c = PrefillCore({})
    job, _ = admitted(c)
    first = c.md_target(target()) if target_first else c.first_token(job, token())
    second = c.first_token(job, token()) if target_first else c.md_target(target())
    assert job.state.is_in(PrefillState.DRAINING)
    tokens = first[0] if not target_first else second[0]
    assert isinstance(tokens, SendTokens) and tokens.router == "router-0" and tokens.event.tokens == [7]
    handoffs = [a for a in first + second if isinstance(a, Deliver)]
    batch = HandoffBatch("r", 0, 0, [7], final=True, mode=HandoffMode.PREFILL)
    assert handoffs == [Deliver("pdd.md.md-1.handoff", batch)]
    starts = [a for a in first + second if isinstance(a, StartStream)]
    assert starts == [StartStream(job, KVPath.WAN, "tcp://md-1:9000")]
    assert ExportTarget(job, [11, 12]) in (first if target_first else second)
    assert not any(isinstance(a, Free) for a in first + second)  # the WAN stream is still open
    assert c.stream_ended(job, KVPath.WAN) == [Free(job)]
    assert c.release(job) and not c.release(job) and c.jobs == {}


def test_a_target_asking_for_nothing_ends_the_wan_queue_and_a_duplicate_changes_nothing() -> None:
    c = PrefillCore({})
    job, _ = admitted(c)
    c.md_target(target(missing=[]))
    assert job.md_queue.get_nowait() is END
    assert c.md_target(target()) == []
    assert c.md_target(target(rid="gone")) == [Unknown("gone")]


def test_on_the_relayed_pipeline_the_first_token_ends_the_local_stream_and_the_ack_starts_the_relay() -> None:
    c = PrefillCore({})
    job, _ = admitted(c, relayed=True)
    actions = c.first_token(job, token())
    assert [type(a) for a in actions] == [SendTokens] and job.local_queue.get_nowait() is END
    assert job.state.is_in(PrefillState.AWAITING_TARGET)
    (start,) = c.stream_acked(job, KVPath.LOCAL, "00-tp")
    assert isinstance(start, Deliver) and start.subject == "pdd.relay.rld-0.relay_start"
    assert start.msg == RelayStart("r", [1, 2, 3], 7, job.submit.params, None, "00-tp", router="router-0")
    assert c.stream_acked(job, KVPath.WAN, "00-tp") == []
    # The relayed pipeline hands nothing to MD; it drains once both streams are done.
    actions = c.md_target(target())
    assert not any(isinstance(a, Deliver) for a in actions) and job.state.is_in(PrefillState.DRAINING)
    assert c.stream_ended(job, KVPath.LOCAL) == [] and c.stream_ended(job, KVPath.WAN) == [Free(job)]


def test_a_first_token_that_ends_the_request_tells_the_router_and_drops_it_everywhere() -> None:
    c = PrefillCore({})
    job, _ = admitted(c, relayed=True)
    tokens, abort, cancel, release = c.first_token(job, token(ends=FinishReason.LENGTH))
    assert isinstance(tokens, SendTokens) and tokens.event.outcome is Outcome.LENGTH
    assert abort == SendAbort("r", AbortReason.FINISHED_AT_PREFILL)
    assert cancel == CancelStream(job, KVPath.LOCAL, "finished_at_prefill") and release == Free(job)


def test_the_step_queues_exported_blocks_and_fails_a_request_the_engine_gave_up() -> None:
    c = PrefillCore({})
    job, _ = admitted(c, relayed=True)
    kv = torch.zeros(1, 2, 1, 4)
    export = BlockExport("r", local=([5], kv), wan=None)
    failed = StepOutput(rid="r", finished=True, finish_reason=FinishReason.ERROR, error="boom")
    actions = c.outputs([failed, StepOutput(rid="other", token_id=1)], [export, BlockExport("other")])
    assert job.local_queue.get_nowait() == ([5], kv)
    tokens, abort, cancel, release = actions
    assert tokens.event.outcome is Outcome.ERROR and tokens.event.error == "boom"
    assert abort == SendAbort("r", AbortReason.FAILED, "boom") and release == Free(job)


def test_a_failed_local_stream_fails_the_request_but_a_failed_wan_stream_is_the_relays_to_absorb() -> None:
    c = PrefillCore({})
    relayed, _ = admitted(c, "rld", relayed=True)
    direct, _ = admitted(c, "md")
    refused = PeerRefused("md-1:9000", "its certificate names relay", "relay")
    assert c.stream_failed(relayed, KVPath.WAN, refused) == [ReportRefused(relayed, refused)]
    actions = c.stream_failed(relayed, KVPath.LOCAL, OSError("reset"))
    assert actions[1] == SendAbort("rld", AbortReason.FAILED, "KV transfer to local peer failed: reset")
    actions = c.stream_failed(direct, KVPath.WAN, OSError("cut"))
    assert isinstance(actions[0], SendTokens) and actions[-1] == Free(direct)


def test_a_request_fails_once_and_its_timeout_finds_nothing_after_it_ended() -> None:
    c = PrefillCore({})
    job, _ = admitted(c)
    assert c.timed_out(job)[-1] == Free(job)
    assert c.release(job)
    assert c.timed_out(job) == [] and c.fail(job, "again") == []


def test_md_lost_cancels_only_the_wan_stream_and_an_abort_cancels_both() -> None:
    c = PrefillCore({})
    job, _ = admitted(c, relayed=True)
    assert c.md_lost(MainDecodeLost("r", "md-1")) == []  # no WAN stream yet
    c.md_target(target())
    assert c.md_lost(MainDecodeLost("r", "md-1")) == [CancelStream(job, KVPath.WAN, "md_lost")]
    actions = c.abort(Abort("r", AbortReason.RELAY_FINISHED))
    assert actions == [
        CancelStream(job, KVPath.LOCAL, "relay_finished"),
        CancelStream(job, KVPath.WAN, "relay_finished"),
        Free(job),
    ]
    assert c.abort(Abort("gone", AbortReason.FAILED)) == []
