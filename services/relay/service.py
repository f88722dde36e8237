"""Relay decode (RLD): decodes as soon as its local KV copy lands and prefill's RelayStart
is in (on the bus, either may come first), and streams eager tokens while MD's copy crosses the WAN; on MD's kv_ready it hands over by token IDs
(one-shot or catch-up) and frees the request. If MD never gets ready, or the request
ends first (the anomalous-traffic filter), it finishes the request itself and stops the
WAN transfer."""

from __future__ import annotations

import asyncio
import logging
import time

import torch

from shared.advertise import check_advertised
from shared.bus import subjects
from shared.bus.messages import (
    Abort,
    AbortReason,
    HandoffAck,
    KVReady,
    MainDecodeLost,
    Outcome,
    RelayReport,
    RelayStart,
    ResumeReply,
    ResumeRequest,
    Role,
    TokenEvent,
)
from shared.bus.subjects import Req
from shared.config import RelaySettings
from shared.engine import EngineError, EngineStats, LLMEngine, StepOutput
from shared.serving.engine_service import EngineService, advertised, outcome_of, token_event
from shared.serving.state_machine import StateMachine
from shared.telemetry import metrics
from shared.telemetry.span_store import REQUEST_ID_ATTR
from shared.telemetry.tracing import context_from_traceparent

from .early import EARLY_TTL_S, Early
from .handoff import HandoffSender
from .job import HOLDS_REQUEST, MOVES, RelayJob, RelayState
from .kv_import import import_when_room

log = logging.getLogger(__name__)


class RelayService(EngineService):
    role = Role.RELAY
    jobs: dict[str, RelayJob]

    def __init__(self, settings: RelaySettings, nc, engine: LLMEngine | None = None):
        super().__init__(settings, nc, engine or LLMEngine(settings.model, settings.engine))
        self.early = Early()
        self.handoff = HandoffSender(self.settings, nc, self.tracer, self.life.spawn, self.jobs, self)

    @classmethod
    async def preflight(cls, settings: RelaySettings) -> None:
        """Exit 2 when the local path's address prefill would get is loopback while its listener
        expects prefill on another host (shared/advertise.py); a unix socket always passes."""
        bound = settings.local_address
        address = await advertised(settings, bound)
        fix, force = "PDD_RELAY_ADVERTISE", "PDD_RELAY_ADVERTISE_LOOPBACK_OK"
        check_advertised(
            "relay", "the local path's address", address, bound, settings.advertise_loopback_ok, fix, force
        )

    async def start(self) -> None:
        await self.serve_kv(self.settings.local_address)
        await super().start()
        self.track("early_ready", lambda: len(self.early.ready))
        self.track("early_start", lambda: len(self.early.start))
        self.track("landed", lambda: len(self.early.landed))
        self.life.every(1.0, self._expire)

    async def subscribe(self) -> None:
        for kind, cls, handler in [
            (Req.RELAY_START, RelayStart, self._on_relay_start),
            (Req.KV_READY, KVReady, self._on_kv_ready),
            (Req.HANDOFF_ACK, HandoffAck, self._on_ack),
            (Req.MD_LOST, MainDecodeLost, self._on_md_lost),
        ]:
            subject = subjects.to_instance(self.role, self.settings.instance, kind)
            await self.life.subscribe(self.nc, subject, cls, handler, ack=True)
        inst = self.settings.instance
        await self.admission.subscribe(
            subjects.resume(self.role, inst), ResumeRequest, ResumeReply, self._resume
        )

    async def report_load(self) -> EngineStats:
        stats = await super().report_load()
        metrics.RELAY_RUNNING.set(stats.running)
        return stats

    # ---- KV sink (local fast path from prefill) ----------------------------------------
    async def on_blocks(self, rid: str, hashes: list[int], kv: torch.Tensor, traceparent: str | None) -> None:
        exchange, wait_s = self.engine.exchange, self.settings.kv_import_wait_s
        await import_when_room(self.engine_loop, exchange, self.blocks_freed, wait_s, rid, hashes, kv)

    async def on_done(self, rid: str, payload: bytes) -> None:
        """All prompt blocks are here: decode once prefill's RelayStart is in too."""
        if self.was_aborted(rid):
            raise ValueError(f"request {rid} was aborted")
        if rid in self.jobs:
            return  # resent after the connection dropped before its ack: it is running already
        if (start := self.early.kv_landed(rid)) is not None:
            await self._begin(start)

    async def _on_relay_start(self, msg: RelayStart, raw) -> None:
        """Prefill's first token and the request's parameters, once the local KV is acked."""
        if msg.rid in self.jobs or self.was_aborted(msg.rid) or not self.early.start_came(msg):
            return
        try:
            await self._begin(msg)
        except EngineError as e:  # nobody waits on this message: give the request up here
            job = self.jobs.get(msg.rid)
            if job is not None:
                await self._fail(job, f"relay could not start: {e}")

    async def _begin(self, start: RelayStart) -> None:
        """Decode from prefill's first token over the landed prompt KV."""
        rid = start.rid
        asked = start.catchup_threshold or 0
        job = RelayJob(rid, asked if asked > 0 else self.settings.catchup_threshold, router=start.router)
        job.span = self.tracer.start_span(
            "relay.decode",
            context=context_from_traceparent(start.traceparent),
            attributes={REQUEST_ID_ATTR: rid, "prompt_tokens": len(start.prompt_ids)},
        )
        self.jobs[rid] = job
        prompt = start.prompt_ids
        await self.engine_loop.call(
            self.engine.add_request,
            rid,
            prompt + [start.first_token],
            start.params,
            num_prompt_tokens=len(prompt),
        )
        job.timers.append(self.life.spawn(self._md_deadline(job)))
        if (md := self.early.ready.pop(rid)) is not None:
            job.md_instance = md
            job.state.to(RelayState.HANDING_OFF)
            await self.handoff.start(job)

    async def _resume(self, msg: ResumeRequest, raw) -> None:
        """The request moved here by its token IDs (its instance was lost, or no MD is
        reachable): the relay finishes it alone, recomputing what its cache lacks."""
        job = RelayJob(
            msg.rid, self.settings.catchup_threshold, StateMachine(RelayState.SOLO, MOVES), router=msg.router
        )
        job.span = self.tracer.start_span(
            "relay.decode",
            attributes={REQUEST_ID_ATTR: msg.rid, "mode": "resume", "resumed_at": len(msg.generated)},
        )
        if not await self.admit_resumed(msg, raw, job):
            job.span.end()

    async def on_abort(self, rid: str, reason: str) -> None:
        if rid not in self.jobs:  # stream aborted before decoding began: just unpin
            self.early.forget(rid)
            await self.unpin(rid)

    # ---- decoding ----------------------------------------------------------------------
    async def request_outputs(self, job: RelayJob, outs: list[StepOutput]) -> None:
        if job.produced == 0:
            await self.unpin(job.rid)  # the sequence holds its blocks now
        event = token_event(job.rid, self.role, outs[0].index if outs[0].index is not None else 0, outs)
        last = outs[-1]
        job.produced += len(event.tokens)
        metrics.OUTPUT_TOKENS.labels(role=self.role.value).inc(len(event.tokens))
        if not last.finished:
            if event.tokens:
                await self.send_tokens(job.router, event)
            return
        event.outcome = outcome_of(last.finish_reason)
        event.error = last.error
        if job.state.is_in(*HOLDS_REQUEST):
            # The relay finished the request before (or while) handing over: MD and the WAN
            # transfer stop; this is the anomalous-traffic filter at work.
            event.relay = RelayReport(handed_over=False, rld_tokens=job.produced)
            await self.send_abort(job.rid, AbortReason.RELAY_FINISHED, parent=job.span)
        await self.send_tokens(job.router, event)
        self._forget(job)

    # ---- handoff -----------------------------------------------------------------------
    async def _on_kv_ready(self, msg: KVReady, raw) -> None:
        job = self.jobs.get(msg.rid)
        if job is None:
            self.early.ready.put(msg.rid, msg.md_instance)
            return
        if job.state.is_in(RelayState.RELAYING):  # a duplicate kv_ready cannot start a second handoff
            job.md_instance = msg.md_instance
            job.state.to(RelayState.HANDING_OFF)
            self.life.spawn(self.handoff.start(job))

    def _snapshot(self, rid: str, final: bool) -> list[int] | None:
        """Engine thread: the output tokens so far; on the final batch also stop decoding."""
        try:
            tokens = self.engine.generated_token_ids(rid)
        except EngineError:
            return None
        if final:
            self._free_now(rid)
        return tokens

    async def tokens_so_far(self, rid: str, final: bool) -> list[int] | None:
        return await self.engine_loop.call(self._snapshot, rid, final)

    async def running(self) -> int:
        return (await self.engine_loop.call(self.engine.stats)).running

    async def handed(self, job: RelayJob, index: int, report: RelayReport) -> None:
        await self.send_tokens(job.router, TokenEvent(job.rid, self.role, index, [], relay=report))
        self._forget(job)

    async def _on_ack(self, msg: HandoffAck, raw) -> None:
        job = self.jobs.get(msg.rid)
        if job is not None:
            self.handoff.acked(job, msg.seq)

    async def lost_after_stop(self, job: RelayJob) -> None:
        if job.state.is_in(RelayState.SOLO):
            error = "main decode was lost during the handoff"
            await self.send_tokens(
                job.router, TokenEvent(job.rid, self.role, 0, [], outcome=Outcome.ERROR, error=error)
            )
        self._forget(job)

    # ---- faults ------------------------------------------------------------------------
    async def _md_deadline(self, job: RelayJob) -> None:
        await asyncio.sleep(self.settings.md_ready_timeout_s)
        if self.jobs.get(job.rid) is job and job.state.is_in(RelayState.RELAYING):
            await self.go_solo(job, "MD not ready in time")

    async def go_solo(self, job: RelayJob, why: str) -> None:
        """Fault fallback: MD is out of the picture; the relay finishes the request."""
        log.warning("request %s: %s; relay finishes it", job.rid, why)
        job.state.to(RelayState.SOLO)
        await self.send_abort(job.rid, AbortReason.MD_UNAVAILABLE, why, parent=job.span)

    async def _on_md_lost(self, msg: MainDecodeLost, raw) -> None:
        job = self.jobs.get(msg.rid)
        if job is not None and job.state.is_in(RelayState.RELAYING, RelayState.HANDING_OFF):
            await self.go_solo(job, f"main decode {msg.md_instance} was lost")

    async def on_abort_message(self, msg: Abort, source: Role) -> None:
        job = self.jobs.get(msg.rid)
        if job is None:
            self.early.forget(msg.rid)
            await self.unpin(msg.rid)
        elif source is Role.MAIN_DECODE and job.state.is_in(RelayState.RELAYING, RelayState.HANDING_OFF):
            await self.go_solo(job, f"MD gave up: {msg.reason.value} {msg.detail}")
        else:
            self._forget(job)
            await self.free(msg.rid)

    async def _expire(self) -> None:
        """No request outlives the timeout on the relay, whatever its peers (or the engine) did:
        the router gets an error, the other roles an abort, and the relay frees it. What came
        early for a request that never started (or had already ended) goes after EARLY_TTL_S,
        local KV whose RelayStart never came unpinned."""
        now = time.monotonic()
        for rid in self.early.expire(now):
            log.warning("request %s: no RelayStart within %g s of its local KV; dropped", rid, EARLY_TTL_S)
            await self.unpin(rid)
        for job in list(self.jobs.values()):
            if now - job.created > self.settings.request_timeout_s and job.state.is_in(*HOLDS_REQUEST):
                await self._fail(job, "request timed out on the relay")

    async def release_on_leaving(self, job: RelayJob) -> None:
        await self._fail(job, "the relay is leaving")

    async def _fail(self, job: RelayJob, error: str) -> None:
        """Give the request up: the router gets an error (and moves it), the other roles an abort."""
        log.warning("request %s: %s", job.rid, error)
        self._forget(job)
        await self.send_abort(job.rid, AbortReason.FAILED, error, parent=job.span)
        await self.send_tokens(
            job.router, TokenEvent(job.rid, self.role, 0, [], outcome=Outcome.ERROR, error=error)
        )
        await self.free(job.rid)

    def _forget(self, job: RelayJob) -> None:
        if job.state.is_in(RelayState.DONE):
            return
        last = job.state.state
        job.state.to(RelayState.DONE)
        self.jobs.pop(job.rid, None)
        if job.span and job.span.is_recording():
            job.span.set_attributes(
                {
                    "rld_tokens": job.produced,
                    "state": last.name.lower(),
                    "mode": job.mode.value if job.mode else "",
                }
            )
            job.span.end()
        for t in job.timers:
            if t is not asyncio.current_task():
                t.cancel()
