"""Main decode's request life as plain decisions: an event goes in (a request prepared or
resumed, its prompt KV complete or abandoned, a handoff batch, an extend pass done, a step's
outputs, an abort, a failure, the timeout), the job's new state and the actions it calls for
come out. No NATS, no engine and no clock of its own here; the service (service.py) feeds the
events in and performs the actions.

A prepared request is RECEIVING until its prompt KV is in (prompt_kv.py says when); then, READY,
it applies its handoff batches strictly in order, one extend pass each (job.py holds the
protocol), and after the final one it DECODES until it finishes, fails or is dropped."""

from __future__ import annotations

from dataclasses import dataclass

from opentelemetry.context import Context

from shared.bus import subjects
from shared.bus.messages import (
    Abort,
    AbortReason,
    DecodeReport,
    HandoffAck,
    HandoffBatch,
    HandoffMode,
    KVReady,
    Pipeline,
    PrepareRequest,
    ResumeRequest,
    Role,
)
from shared.bus.subjects import Req
from shared.engine.outputs import StepOutput
from shared.kv.sink import CONNECTION_LOST
from shared.serving.actions import Deliver, Free, SendAbort, SendTokens, Unknown
from shared.serving.state_machine import StateMachine
from shared.serving.token_events import error_event, outcome_of, token_event

from .job import MOVES, Extend, MainDecodeJob, MainDecodeState


@dataclass(frozen=True)
class ApplyHandoffs:
    """Apply the handoff batches now due, one extend pass each (`spawn`: in a task of their own,
    keeping the subscription free for other requests)."""

    job: MainDecodeJob
    spawn: bool = False


@dataclass(frozen=True)
class ExtendPass:
    """Engine thread: add the request with its first batch, or extend it by the next one."""

    job: MainDecodeJob
    step: Extend


@dataclass(frozen=True)
class Decoding:
    """The final batch is applied: MD decodes the request on its own (its decode span starts)."""

    job: MainDecodeJob
    mode: HandoffMode


@dataclass(frozen=True)
class Redelivered:
    """A handoff batch came again (`why`: stale or duplicate): the first copy stands."""

    batch: HandoffBatch
    why: str
    next_seq: int


Action = (
    ApplyHandoffs | ExtendPass | Decoding | Redelivered | Free | Deliver | SendAbort | SendTokens | Unknown
)


class MainDecodeCore:
    def __init__(self, jobs: dict[str, MainDecodeJob], instance: str) -> None:
        self.jobs = jobs  # rid -> job, shared with the service's admission, heartbeats and KV intake
        self.instance = instance

    # ---- a request comes -------------------------------------------------------------
    def prepared(self, req: PrepareRequest, missing: list[int], ctx: Context | None) -> MainDecodeJob:
        """Its KV is reserved: the blocks in `missing` are to come over the WAN."""
        job = self.jobs[req.rid] = MainDecodeJob(req, set(missing), ctx=ctx)
        return job

    @staticmethod
    def resumed(msg: ResumeRequest, ctx: Context | None) -> MainDecodeJob:
        """A request moved here by its token IDs: no KV comes, it decodes from what the client
        has (the service admits it)."""
        req = PrepareRequest(msg.rid, msg.prompt_ids, msg.params, [], Pipeline.P_MD, router=msg.router)
        state = StateMachine(MainDecodeState.DECODING, MOVES)
        return MainDecodeJob(req, set(), state=state, next_index=len(msg.generated), ctx=ctx)

    # ---- prompt KV ---------------------------------------------------------------------
    def kv_complete(self, job: MainDecodeJob) -> list[Action]:
        """All of its prompt KV is in: READY for the handoff batches; a relay waiting for MD
        hears of it."""
        job.state.to(MainDecodeState.READY)
        actions: list[Action] = []
        if job.req.pipeline is Pipeline.P_RLD_MD and job.req.relay:  # only a relay waits for it
            ready = KVReady(job.rid, self.instance, job.wan_bytes)
            to_relay = subjects.to_instance(Role.RELAY, job.req.relay, Req.KV_READY)
            actions.append(Deliver(to_relay, ready, job.ctx))  # in the request's trace, not the connection's
        return [*actions, ApplyHandoffs(job)]

    def kv_abandoned(self, job: MainDecodeJob, reason: str) -> list[Action]:
        """Its KV transfer ended unfinished. A sender that aborted it knows why; one that vanished
        (prefill died) does not tell the router: fail it, so the router moves it now rather than
        when its stream stalls."""
        if reason == CONNECTION_LOST:
            return self.fail(job, f"prompt KV transfer lost: {reason}")
        return [Free(job)]

    # ---- handoff: extend by token IDs --------------------------------------------------
    def handoff(self, batch: HandoffBatch, ctx: Context) -> list[Action]:
        job = self.jobs.get(batch.rid)
        if job is None:
            return [Unknown(batch.rid)]
        why = job.hold(batch, ctx)
        if why is not None:
            return [Redelivered(batch, why, job.next_seq)]
        return [ApplyHandoffs(job, spawn=True)]

    def next_extend(self, job: MainDecodeJob) -> list[Action]:
        """The next batch's extend pass, or the request's failure; [] when none is due."""
        step = job.next_extend()
        if step is None:
            return []
        if isinstance(step, str):
            return self.fail(job, step)
        return [ExtendPass(job, step)]

    def extended(self, job: MainDecodeJob, batch: HandoffBatch) -> list[Action]:
        """A batch's extend pass ran (the request may have been dropped meanwhile)."""
        if job.state.is_in(MainDecodeState.DONE):
            return []
        job.extended(batch)
        return [Decoding(job, batch.mode)] if batch.final else []

    # ---- decoding ----------------------------------------------------------------------
    def outputs(self, job: MainDecodeJob, outs: list[StepOutput]) -> list[Action]:
        """One step's outputs of the request: a catch-up batch computed asks the relay for the
        next one; tokens go to the router, the last with MD's report."""
        actions: list[Action] = []
        if job.req.relay and any(o.computed for o in outs):
            ack = HandoffAck(job.rid, job.next_seq - 1)
            actions.append(Deliver(subjects.to_instance(Role.RELAY, job.req.relay, Req.HANDOFF_ACK), ack))
        first = next((o.index for o in outs if o.index is not None), job.next_index)
        event = token_event(job.rid, Role.MAIN_DECODE, first, outs)
        last = outs[-1]
        if not event.tokens and not last.finished:
            return actions
        job.md_tokens += len(event.tokens)
        if last.finished:
            event.outcome = outcome_of(last.finish_reason)
            event.error = last.error
            event.decode = DecodeReport(self.instance, job.md_tokens, job.wan_bytes)
            actions.append(Free(job))
        return [*actions, SendTokens(job.router, event)]

    # ---- endings -----------------------------------------------------------------------
    def abort(self, msg: Abort) -> list[Action]:
        """Another role gave up on the request."""
        job = self.jobs.get(msg.rid)
        return [] if job is None else [Free(job)]

    def fail(self, job: MainDecodeJob, error: str) -> list[Action]:
        """Give the request up: the others drop it; while MD decodes it (nobody else can finish
        it) the router gets the error and moves it."""
        actions: list[Action] = [SendAbort(job.rid, AbortReason.FAILED, error)]
        if job.state.is_in(MainDecodeState.DECODING):
            actions.append(
                SendTokens(job.router, error_event(job.rid, Role.MAIN_DECODE, error, job.next_index))
            )
        return [*actions, Free(job)]

    def expire(self, now: float, timeout_s: float) -> list[Action]:
        """No request outlives the timeout, whatever its peers did."""
        actions: list[Action] = []
        for job in list(self.jobs.values()):
            if now - job.created > timeout_s:
                actions += self.fail(job, "request timed out on MD")
        return actions

    def forget(self, job: MainDecodeJob) -> bool:
        """MD holds nothing more of the request; False if it had ended already."""
        ended = job.state.finish(MainDecodeState.DONE)
        if ended:
            self.jobs.pop(job.rid, None)
        return ended
