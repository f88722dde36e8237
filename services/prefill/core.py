"""Prefill's request life as plain decisions: an event goes in (admitted, MD's target, the
first token, a stream acked, failed or ended, an abort, MD lost, the timeout), the job's new
state and the actions it calls for come out. No NATS, no engine and no clock here; the service
(service.py) feeds the events in and performs the actions.

A request drains once both MD's target and the first token are in, in either order (job.py);
it is released when it drains and no KV stream of it is still open, or when it ends early
(an abort, a failure, the first token ending it)."""

from __future__ import annotations

from dataclasses import dataclass

from shared.bus import subjects
from shared.bus.messages import (
    Abort,
    AbortReason,
    HandoffBatch,
    HandoffMode,
    MainDecodeLost,
    MainDecodeTarget,
    Pipeline,
    PrefillSubmit,
    Role,
)
from shared.bus.subjects import Req
from shared.engine.outputs import StepOutput
from shared.kv.refusal import PeerRefused
from shared.serving.actions import Deliver, Free, SendAbort, SendTokens, Unknown
from shared.serving.token_events import error_event, outcome_of, token_event

from .exporter import BlockExport
from .job import KVPath, PrefillJob, PrefillState, after_first_token, after_target


@dataclass(frozen=True)
class StartStream:
    """Open the KV stream of one path toward `address` (its blocks come from the job's queue)."""

    job: PrefillJob
    path: KVPath
    address: str


@dataclass(frozen=True)
class CancelStream:
    """Stop a stream and tell its peer to drop what it got (`reason` on the wire)."""

    job: PrefillJob
    path: KVPath
    reason: str


@dataclass(frozen=True)
class ExportTarget:
    """Engine thread: the blocks MD lacks among those already computed go on the WAN queue."""

    job: PrefillJob
    missing: list[int]


@dataclass(frozen=True)
class ReportRefused:
    """MD's KV listener refused this prefill's identity: the routers hear of it."""

    job: PrefillJob
    refused: PeerRefused


Action = (
    StartStream
    | CancelStream
    | ExportTarget
    | ReportRefused
    | Free
    | Deliver
    | SendAbort
    | SendTokens
    | Unknown
)


def submit_error(msg: PrefillSubmit) -> str | None:
    """Why a submit is refused before anything is reserved for it; None if it is well formed."""
    if bool(msg.relay_address) != bool(msg.relay):  # RelayStart goes to the relay by its instance
        return "relay_address and relay must be given together"
    return None


class PrefillCore:
    def __init__(self, jobs: dict[str, PrefillJob]) -> None:
        self.jobs = jobs  # rid -> job, shared with the service's admission and heartbeats

    # ---- admission -------------------------------------------------------------------
    def admit(self, job: PrefillJob) -> None:
        """The job exists before the engine takes its prompt (an abort may find it meanwhile)."""
        self.jobs[job.rid] = job

    def refused(self, job: PrefillJob) -> None:
        """The engine refused the prompt: the job never was."""
        if self.jobs.get(job.rid) is job:
            del self.jobs[job.rid]

    def admitted(self, job: PrefillJob) -> list[Action]:
        """The engine took the prompt: on P→RLD→MD the local stream starts at once."""
        if job.local_queue is None or not job.submit.relay_address:
            return []
        return [self._stream(job, KVPath.LOCAL, job.submit.relay_address)]

    def _stream(self, job: PrefillJob, path: KVPath, address: str) -> StartStream:
        job.streaming.add(path)  # open from now: draining waits for it
        return StartStream(job, path, address)

    # ---- MD's target and the first token: the two events that start draining ----------
    def md_target(self, msg: MainDecodeTarget) -> list[Action]:
        job = self.jobs.get(msg.rid)
        if job is None:
            return [Unknown(msg.rid)]
        moved = after_target(job.state.state)
        if moved is None:
            return []  # a duplicate target, or the request is gone
        job.state.to(moved)
        job.md_instance = msg.md_instance
        job.md_address, job.md_missing, job.md_pending = (
            msg.md_bulk_address,
            msg.md_missing,
            set(msg.md_missing),
        )
        # The WAN stream is open before any action runs, so draining cannot see "every
        # stream done" while MD's blocks are still to come.
        actions: list[Action] = [self._stream(job, KVPath.WAN, msg.md_bulk_address)]
        job.close_wan_if_complete()
        if moved is PrefillState.DRAINING:
            # The handoff goes before the export: a WAN stream with nothing to send (MD holds,
            # or awaits, every block) may end meanwhile and release the request, and MD would
            # then never get the first token.
            actions += self._draining(job)
        return [*actions, ExportTarget(job, msg.md_missing)]

    def first_token(self, job: PrefillJob, out: StepOutput) -> list[Action]:
        assert out.token_id is not None
        job.first_token = out.token_id
        event = token_event(job.rid, Role.PREFILL, 0, [out])
        if out.ends is not None:
            # Nothing left to decode: stop the transfers and tell MD / RLD to drop the request.
            event.outcome = outcome_of(out.ends)
            reason = AbortReason.FINISHED_AT_PREFILL
            return [SendTokens(job.router, event), SendAbort(job.rid, reason), *self.drop(job, reason)]
        actions: list[Action] = [SendTokens(job.router, event)]
        job.end_local_stream()  # the relay's stream ends with the first token
        moved = after_first_token(job.state.state)
        if moved is not None:
            job.state.to(moved)
        if moved is PrefillState.DRAINING:
            actions += self._draining(job)
        return actions

    def _draining(self, job: PrefillJob) -> list[Action]:
        """The first token is out and MD holds the request: on P→MD prefill is the relay and
        hands its one token over; the request is released once its streams are done."""
        actions: list[Action] = []
        if job.submit.pipeline is Pipeline.P_MD:
            assert job.first_token is not None
            batch = HandoffBatch(job.rid, 0, 0, [job.first_token], final=True, mode=HandoffMode.PREFILL)
            actions.append(
                Deliver(subjects.to_instance(Role.MAIN_DECODE, job.md_instance, Req.HANDOFF), batch)
            )
        return actions + self._release_if_drained(job)

    # ---- the engine's step ------------------------------------------------------------
    def outputs(self, outputs: list[StepOutput], exports: list[BlockExport] | None) -> list[Action]:
        """A step's exported blocks go on their streams' queues; its outputs are first tokens
        (or failures inside the engine)."""
        for export in exports or []:
            job = self.jobs.get(export.rid)
            if job is not None:
                job.queue_blocks(export)
        actions: list[Action] = []
        for out in outputs:
            job = self.jobs.get(out.rid)
            if job is None:
                continue
            if out.token_id is not None:
                actions += self.first_token(job, out)
            elif out.finished:  # error or abort inside the engine
                actions += self.fail(job, out.error or "prefill failed")
        return actions

    # ---- the KV streams ---------------------------------------------------------------
    def stream_acked(self, job: PrefillJob, path: KVPath, traceparent: str | None) -> list[Action]:
        if path is not KVPath.LOCAL:
            return []
        # The relay holds the prompt KV: it decodes once told from where.
        start = subjects.to_instance(Role.RELAY, job.submit.relay, Req.RELAY_START)
        return [Deliver(start, job.relay_start(traceparent))]

    def stream_failed(self, job: PrefillJob, path: KVPath, e: Exception) -> list[Action]:
        actions: list[Action] = []
        if isinstance(e, PeerRefused) and path is KVPath.WAN:  # before the request's failure
            actions.append(ReportRefused(job, e))
        if path is KVPath.LOCAL or job.submit.pipeline is Pipeline.P_MD:
            actions += self.fail(job, f"KV transfer to {path.value} peer failed: {e}")
        # On P→RLD→MD a WAN failure is the relay's to absorb (it finishes the request).
        return actions

    def stream_ended(self, job: PrefillJob, path: KVPath) -> list[Action]:
        """A stream is done (acked, failed or cancelled): a draining request may be released."""
        job.streaming.discard(path)
        return self._release_if_drained(job)

    def _release_if_drained(self, job: PrefillJob) -> list[Action]:
        if job.state.is_in(PrefillState.DRAINING) and not job.streaming:
            return [Free(job)]
        return []

    # ---- endings ---------------------------------------------------------------------
    def timed_out(self, job: PrefillJob) -> list[Action]:
        """The request's timeout passed: whatever happened, it is freed now."""
        return self.fail(job, "prefill timed out")

    def fail(self, job: PrefillJob, error: str) -> list[Action]:
        if self.jobs.get(job.rid) is not job:
            return []
        events = [SendTokens(job.router, error_event(job.rid, Role.PREFILL, error))]
        return [*events, SendAbort(job.rid, AbortReason.FAILED, error), *self.drop(job, AbortReason.FAILED)]

    def abort(self, msg: Abort) -> list[Action]:
        """Another role gave up on the request."""
        job = self.jobs.get(msg.rid)
        return [] if job is None else self.drop(job, msg.reason)

    def md_lost(self, msg: MainDecodeLost) -> list[Action]:
        """Only the WAN stream goes: the relay's local stream must go on."""
        job = self.jobs.get(msg.rid)
        if job is None or KVPath.WAN not in job.streaming:
            return []
        return [CancelStream(job, KVPath.WAN, "md_lost")]

    def drop(self, job: PrefillJob, reason: AbortReason) -> list[Action]:
        """Cancel the open streams (peers are told to drop what they got), then release."""
        cancels: list[Action] = [CancelStream(job, path, reason.value) for path in sorted(job.streaming)]
        return [*cancels, Free(job)]

    def release(self, job: PrefillJob) -> bool:
        """The request holds nothing more here; False if it was released already."""
        released = job.state.finish(PrefillState.RELEASED)
        if released:
            self.jobs.pop(job.rid, None)
        return released
