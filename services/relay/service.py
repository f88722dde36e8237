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
from shared.bus.messages import (
    Abort,
    AbortReason,
    HandoffAck,
    KVReady,
    MainDecodeLost,
    RelayReport,
    RelayStart,
    ResumeRequest,
    Role,
    TokenEvent,
)
from shared.config import RelaySettings
from shared.engine import Engine, EngineError, EngineStats, StepOutput
from shared.engine.factory import build_engine
from shared.serving.engine_service import EngineService, advertised
from shared.serving.state_machine import StateMachine
from shared.serving.token_events import error_event, outcome_of, token_event
from shared.telemetry import metrics
from shared.telemetry.span_store import REQUEST_ID_ATTR
from shared.telemetry.tracing import context_from_traceparent

from .core import Action, Begin, Drop, Fail, GoSolo, Handoff, RelayCore, Unpin
from .handoff import HandoffSender
from .job import HOLDS_REQUEST, MOVES, RelayJob, RelayState
from .kv_import import import_when_room

log = logging.getLogger(__name__)


class RelayService(EngineService):
    role = Role.RELAY
    jobs: dict[str, RelayJob]

    def __init__(self, settings: RelaySettings, nc, engine: Engine | None = None):
        super().__init__(settings, nc, engine or build_engine(settings.model, settings.engine))
        self.engine_loop.min_step_s = settings.min_step_s
        self.core = RelayCore(self.jobs, self.aborted, settings.catchup_threshold)
        self.early = self.core.early
        self.handoff = HandoffSender(self.settings, nc, self.tracer, self.life.spawn, self.jobs, self)

    @classmethod
    async def preflight(cls, settings: RelaySettings) -> None:
        """Exit 2 when the local path's address prefill would get is loopback while its listener
        expects prefill on another host (shared/advertise.py); a unix socket always passes."""
        await super().preflight(settings)
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

    async def report_load(self) -> EngineStats:
        stats = await super().report_load()
        metrics.RELAY_RUNNING.set(stats.running)
        return stats

    # ---- KV sink (local fast path from prefill) ----------------------------------------
    async def on_blocks(self, rid: str, hashes: list[int], kv: torch.Tensor, traceparent: str | None) -> None:
        wait_s = self.settings.kv_import_wait_s
        await import_when_room(self.engine_loop, self.engine, self.blocks_freed, wait_s, rid, hashes, kv)

    async def on_done(self, rid: str, payload: bytes) -> None:
        """All prompt blocks are here: decode once prefill's RelayStart is in too."""
        await self._perform(self.core.kv_landed(rid))

    async def on_relay_start(self, msg: RelayStart, raw) -> None:
        """Prefill's first token and the request's parameters, once the local KV is acked."""
        try:
            await self._perform(self.core.relay_start(msg))
        except EngineError as e:  # nobody waits on this message: give the request up here
            job = self.jobs.get(msg.rid)
            if job is not None:
                await self._fail(job, f"relay could not start: {e}")

    async def _perform(self, actions: list[Action]) -> None:
        """What the core decided, in order."""
        for action in actions:
            if isinstance(action, Begin):
                await self._begin(action.job, action.start)
                if action.handoff:
                    await self.handoff.start(action.job)
            elif isinstance(action, Handoff):
                self.life.spawn(self.handoff.start(action.job))
            elif isinstance(action, GoSolo):
                await self._go_solo(action.job, action.why)
            elif isinstance(action, Unpin):
                await self.unpin(action.rid)
            elif isinstance(action, Drop):  # the core forgot it already
                self._close(action.job, RelayState.DONE)
                await self.free(action.job.rid)
            elif isinstance(action, Fail):
                await self._fail(action.job, action.error)

    async def _begin(self, job: RelayJob, start: RelayStart) -> None:
        """Decode from prefill's first token over the landed prompt KV."""
        job.span = self.tracer.start_span(
            "relay.decode",
            context=context_from_traceparent(start.traceparent),
            attributes={REQUEST_ID_ATTR: job.rid, "prompt_tokens": len(start.prompt_ids)},
        )
        prompt = start.prompt_ids
        await self.engine_loop.call(
            self.engine.add_request,
            job.rid,
            prompt + [start.first_token],
            start.params,
            num_prompt_tokens=len(prompt),
        )
        job.timers.append(self.life.spawn(self._md_deadline(job)))

    async def resume(self, msg: ResumeRequest, raw) -> None:
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
        await self._perform(self.core.stream_aborted(rid))

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
        self._ended(job)

    # ---- handoff -----------------------------------------------------------------------
    async def on_kv_ready(self, msg: KVReady, raw) -> None:
        await self._perform(self.core.kv_ready(msg))

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
        self._ended(job)

    async def on_ack(self, msg: HandoffAck, raw) -> None:
        job = self.jobs.get(msg.rid)
        if job is not None:
            self.handoff.acked(job, msg.seq)

    async def lost_after_stop(self, job: RelayJob) -> None:
        if job.state.is_in(RelayState.SOLO):
            error = "main decode was lost during the handoff"
            await self.send_tokens(job.router, error_event(job.rid, self.role, error))
        self._ended(job)

    # ---- faults ------------------------------------------------------------------------
    async def _md_deadline(self, job: RelayJob) -> None:
        await asyncio.sleep(self.settings.md_ready_timeout_s)
        await self._perform(self.core.md_deadline(job))

    async def go_solo(self, job: RelayJob, why: str) -> None:
        """The handoff's fallback (MD did not acknowledge): the relay finishes the request."""
        await self._go_solo(self.core.solo(job, why).job, why)

    async def _go_solo(self, job: RelayJob, why: str) -> None:
        log.warning("request %s: %s; relay finishes it", job.rid, why)
        await self.send_abort(job.rid, AbortReason.MD_UNAVAILABLE, why, parent=job.span)

    async def on_md_lost(self, msg: MainDecodeLost, raw) -> None:
        await self._perform(self.core.md_lost(msg))

    async def on_abort_message(self, msg: Abort, source: Role) -> None:
        await self._perform(self.core.abort(msg, source))

    async def _expire(self) -> None:
        """No request outlives the timeout on the relay, whatever its peers (or the engine) did:
        the router gets an error, the other roles an abort, and the relay frees it. Local KV
        whose RelayStart never came within EARLY_TTL_S is unpinned."""
        await self._perform(self.core.expire(time.monotonic(), self.settings.request_timeout_s))

    async def release_on_leaving(self, job: RelayJob) -> None:
        await self._fail(job, "the relay is leaving")

    async def _fail(self, job: RelayJob, error: str) -> None:
        """Give the request up: the router gets an error (and moves it), the other roles an abort."""
        log.warning("request %s: %s", job.rid, error)
        self._ended(job)
        await self.send_abort(job.rid, AbortReason.FAILED, error, parent=job.span)
        await self.send_tokens(job.router, error_event(job.rid, self.role, error))
        await self.free(job.rid)

    def _ended(self, job: RelayJob) -> None:
        """The core forgets the job; its span ends and its timers stop."""
        last = job.state.state
        if self.core.forget(job):
            self._close(job, last)

    def _close(self, job: RelayJob, last: RelayState) -> None:
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
