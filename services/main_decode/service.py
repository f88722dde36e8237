"""Main decode (MD): receives prompt KV over the WAN into its prefix cache (the
decode-side radix cache: one copy per distinct prefix), publishes what it stores and
evicts, rebuilds the KV of handed-over tokens with one extend pass per batch, then
decodes with continuous batching."""

from __future__ import annotations

import logging
import time

from opentelemetry import context as otel_context

from shared.advertise import check_advertised
from shared.bus import subjects
from shared.bus.connection import respond
from shared.bus.delivery import deliver
from shared.bus.messages import (
    Abort,
    AbortReason,
    DecodeReport,
    HandoffAck,
    HandoffBatch,
    KVReady,
    Outcome,
    Pipeline,
    PrepareReply,
    PrepareRequest,
    ResumeReply,
    ResumeRequest,
    Role,
    TokenEvent,
)
from shared.bus.subjects import Req
from shared.config import MainDecodeSettings
from shared.engine import EngineError, InvalidRequestError, LLMEngine, Mode, StepOutput
from shared.engine.request_admission import Verdict
from shared.kv.rdma_receiver import RdmaReceiver
from shared.kv.sink import CONNECTION_LOST
from shared.serving.engine_service import EngineService, advertised, outcome_of, token_event
from shared.serving.state_machine import StateMachine
from shared.telemetry import metrics
from shared.telemetry.span_store import REQUEST_ID_ATTR

from .job import MOVES, DecodeState, MDJob
from .prepare_admission import KVAdmissionQueue, KVBusy
from .prompt_kv import PromptKVIntake

log = logging.getLogger(__name__)


class MainDecodeService(EngineService):
    role = Role.MAIN_DECODE
    publishes_cache = True
    jobs: dict[str, MDJob]

    def __init__(self, settings: MainDecodeSettings, nc, engine: LLMEngine | None = None):
        super().__init__(settings, nc, engine or LLMEngine(settings.model, settings.engine))
        self.kv_admission = KVAdmissionQueue(
            settings.admission_queue_max, settings.admission_wait_s, self.blocks_freed
        )
        loop, ex = self.engine_loop, self.engine.exchange
        self.prompt_kv = PromptKVIntake(
            self.jobs,
            loop,
            ex,
            self.tracer,
            self._take_back,
            self._kv_complete,
            self._abandoned,
            settings.share_in_flight,
        )
        self.track("in_flight_blocks", lambda: len(self.prompt_kv.in_flight))
        self.track("in_flight_waiting", lambda: len(self.prompt_kv.in_flight.awaits))
        self.rdma = RdmaReceiver(settings, self.prompt_kv, loop, ex, self.life, nc)
        self.track("rdma_offered", lambda: len(self.rdma.offered))
        self.track("rdma_quarantined", lambda: len(self.rdma.quarantined))

    async def _take_back(self, job: MDJob, hashes: list[int]) -> None:
        await self.rdma.take_back(job.rid, hashes)  # sent over TCP instead of into their RDMA slots

    @classmethod
    async def preflight(cls, settings: MainDecodeSettings) -> None:
        """Exit 2 when the bulk address (or the RDMA host) MD would give prefill is loopback
        while its listener expects peers from other hosts (shared/advertise.py)."""
        bound, ok = settings.bulk_address, settings.advertise_loopback_ok
        force = "PDD_MD_ADVERTISE_LOOPBACK_OK"
        bulk = await advertised(settings, bound)
        check_advertised("main_decode", "the bulk address", bulk, bound, ok, "PDD_MD_ADVERTISE", force)
        if settings.kv_transport == "rdma" and settings.rdma.host:
            host = settings.rdma.host
            check_advertised("main_decode", "the RDMA host", host, bound, ok, "PDD_MD_RDMA__HOST", force)

    async def start(self) -> None:
        await self.serve_kv(self.settings.bulk_address, self.prompt_kv)
        await self.rdma.start(self.advertise_address)
        await super().start()
        self.life.every(1.0, self._expire)

    async def stop(self) -> None:
        await super().stop()
        self.rdma.close()

    async def subscribe(self) -> None:
        inst = self.settings.instance
        await self.admission.subscribe(
            subjects.md_prepare(inst),
            PrepareRequest,
            PrepareReply,
            self._prepare,
            if_aborted=self._takes_no_part,
        )
        await self.admission.subscribe(
            subjects.resume(self.role, inst), ResumeRequest, ResumeReply, self._resume
        )
        await self.life.subscribe(
            self.nc,
            subjects.to_instance(self.role, inst, Req.HANDOFF),
            HandoffBatch,
            self._on_handoff,
            ack=True,
        )

    # ---- prepare: which blocks must cross the WAN -------------------------------------
    async def _prepare(self, msg: PrepareRequest, raw) -> None:
        try:
            msg.params.validate()
            # Hashes name cache entries every later request may reuse: derive them, trust none.
            if msg.block_hashes != self.engine.block_hashes(msg.prompt_ids):
                raise EngineError("block_hashes do not match the prompt")
            have = await self._reserve_kv(msg)
        except KVBusy as e:
            await respond(raw, PrepareReply(ok=False, busy=True, error=str(e)))
            return
        except EngineError as e:
            await respond(raw, PrepareReply(ok=False, error=str(e)))
            return
        if have is None:  # it ended elsewhere while it waited (say the relay finished it): MD takes no part
            await respond(raw, PrepareReply(ok=True, bulk_address=self.advertise_address))
            return
        missing = self.prompt_kv.claim(msg.rid, msg.block_hashes[have:])
        self.jobs[msg.rid] = MDJob(msg, set(missing), ctx=otel_context.get_current())
        await respond(raw, PrepareReply(ok=True, missing=missing, bulk_address=self.advertise_address))

    def _takes_no_part(self, msg: PrepareRequest) -> PrepareReply:
        """Its abort came first (say the relay finished it while this prepare was on its way):
        it ended elsewhere, as when the abort comes during the wait for KV memory."""
        return PrepareReply(ok=True, bulk_address=self.advertise_address)

    async def _resume(self, msg: ResumeRequest, raw) -> None:
        """The request moved here by its token IDs: no KV comes; decode from what is cached
        plus an extend over the rest."""
        req = PrepareRequest(msg.rid, msg.prompt_ids, msg.params, [], Pipeline.P_MD, router=msg.router)
        job = MDJob(
            req,
            set(),
            state=StateMachine(DecodeState.DECODING, MOVES),
            next_index=len(msg.generated),
            ctx=otel_context.get_current(),
        )
        if await self.admit_resumed(msg, raw, job):
            attrs = {REQUEST_ID_ATTR: msg.rid, "mode": "resume", "resumed_at": len(msg.generated)}
            job.decode_span = self.tracer.start_span("md.decode", attributes=attrs)

    async def _reserve_kv(self, msg: PrepareRequest) -> int | None:
        """Reserve the request's KV for its whole life (pin what is cached, set aside blocks
        for the rest, promise room for its tokens), so its import and decode never run out;
        while the pool is promised to others, wait in line. Returns how many prompt blocks
        are cached, or None if the request was aborted meanwhile."""
        need = self.engine.lifetime_blocks(len(msg.prompt_ids), msg.params)
        pool_blocks = self.engine.pool.num_blocks
        if need > pool_blocks:
            raise InvalidRequestError(
                f"prompt plus max_tokens needs up to {need} KV blocks ({need * self.engine.block_size} tokens) "
                f"but main decode's whole KV pool holds {pool_blocks} blocks "
                f"({pool_blocks * self.engine.block_size} tokens): shorten the prompt or max_tokens"
            )

        async def attempt() -> int | None:
            verdict, have = await self.engine_loop.call(
                self.engine.exchange.reserve, msg.rid, msg.block_hashes, need
            )
            return have if verdict is Verdict.ADMIT else None

        return await self.kv_admission.admit(msg.rid, attempt, lambda: self.unpin(msg.rid))

    # ---- prompt KV complete (bulk channel over the WAN) --------------------------------
    async def _abandoned(self, job: MDJob, reason: str) -> None:
        """Its KV transfer ended unfinished. A sender that aborted it knows why; one that vanished
        (prefill died) does not tell the router: fail it, so the router moves it now rather
        than when its stream stalls."""
        if reason == CONNECTION_LOST:
            await self._fail(job, f"prompt KV transfer lost: {reason}")
        else:
            await self._drop(job)

    async def _kv_complete(self, job: MDJob) -> None:
        if job.req.pipeline is Pipeline.P_RLD_MD and job.req.relay:  # only a relay waits for it
            await self._send_kv_ready(job)
        await self._drain_handoffs(job)

    async def _send_kv_ready(self, job: MDJob) -> None:
        token = otel_context.attach(job.ctx) if job.ctx is not None else None
        try:  # kv_ready belongs to the request's trace, not to the bulk connection's
            ready = KVReady(job.rid, self.settings.instance, job.wan_bytes)
            self.life.spawn(
                deliver(self.nc, subjects.to_instance(Role.RELAY, job.req.relay, Req.KV_READY), ready)
            )
        finally:
            if token is not None:
                otel_context.detach(token)

    # ---- handoff: extend by token IDs --------------------------------------------------
    async def _on_handoff(self, msg: HandoffBatch, raw) -> None:
        job = self.jobs.get(msg.rid)
        if job is None:
            self.count_unknown_request()
            return
        reason = job.hold(msg, otel_context.get_current())
        if reason is not None:
            metrics.HANDOFF_BATCHES_DROPPED.labels(reason=reason).inc()
            log.warning(
                "request %s: %s handoff batch %d dropped (next %d)", msg.rid, reason, msg.seq, job.next_seq
            )
            return
        self.life.spawn(self._drain_handoffs(job))  # keep this subscription free for other requests

    async def _drain_handoffs(self, job: MDJob) -> None:
        """Apply the batches the job says are due, one extend pass each."""
        while (step := job.next_extend()) is not None:
            if isinstance(step, str):
                await self._fail(job, step)
                return
            batch = step.batch
            attrs = {
                REQUEST_ID_ATTR: job.rid,
                "seq": batch.seq,
                "tokens": len(batch.tokens),
                "mode": batch.mode.value,
                "final": batch.final,
            }
            try:
                with self.tracer.start_as_current_span("md.extend", context=step.ctx, attributes=attrs):
                    await self.engine_loop.call(self._apply, job.req, batch, step.first)
            except EngineError as e:
                await self._fail(job, f"extend failed: {e}")
                return
            if job.state.is_in(DecodeState.DONE):  # dropped while extending
                return
            job.extended(batch)
            if batch.final:
                job.decode_span = self.tracer.start_span(
                    "md.decode",
                    context=job.ctx,
                    attributes={REQUEST_ID_ATTR: job.rid, "mode": batch.mode.value},
                )

    def _apply(self, req: PrepareRequest, batch: HandoffBatch, first: bool) -> None:  # engine thread
        if first:
            mode = Mode.GENERATE if batch.final else Mode.HOLD
            tokens = req.prompt_ids + batch.tokens
            self.engine.add_request(
                req.rid, tokens, req.params, num_prompt_tokens=len(req.prompt_ids), mode=mode
            )
        else:
            self.engine.extend(req.rid, batch.tokens, final=batch.final)

    async def request_outputs(self, job: MDJob, outs: list[StepOutput]) -> None:
        if job.req.relay and any(o.computed for o in outs):  # a catch-up batch is in: ask for the next one
            ack = HandoffAck(job.rid, job.next_seq - 1)
            self.life.spawn(
                deliver(self.nc, subjects.to_instance(Role.RELAY, job.req.relay, Req.HANDOFF_ACK), ack)
            )
        first = next((o.index for o in outs if o.index is not None), job.next_index)
        event = token_event(job.rid, self.role, first, outs)
        last = outs[-1]
        if not event.tokens and not last.finished:
            return
        job.md_tokens += len(event.tokens)
        metrics.OUTPUT_TOKENS.labels(role=self.role.value).inc(len(event.tokens))
        if last.finished:
            event.outcome = outcome_of(last.finish_reason)
            event.error = last.error
            event.decode = DecodeReport(self.settings.instance, job.md_tokens, job.wan_bytes)
            await self._drop(job)
        await self.send_tokens(job.router, event)

    # ---- faults and cleanup ------------------------------------------------------------
    async def on_abort_message(self, msg: Abort, source: Role) -> None:
        self.kv_admission.cancel(msg.rid)
        job = self.jobs.get(msg.rid)
        if job is not None:
            await self._drop(job)

    async def _fail(self, job: MDJob, error: str) -> None:
        log.warning("request %s failed on MD: %s", job.rid, error)
        await self.send_abort(job.rid, AbortReason.FAILED, error)
        if job.state.is_in(DecodeState.DECODING):  # nobody else can finish it
            error_event = TokenEvent(
                job.rid, self.role, job.next_index, [], outcome=Outcome.ERROR, error=error
            )
            await self.send_tokens(job.router, error_event)
        await self._drop(job)

    async def release_on_leaving(self, job: MDJob) -> None:
        await self._fail(job, "main decode is leaving")

    async def _drop(self, job: MDJob) -> None:
        if job.state.is_in(DecodeState.DONE):
            return
        job.state.to(DecodeState.DONE)
        self.jobs.pop(job.rid, None)
        job.end_spans()
        self.rdma.forget(job.rid)
        await self.prompt_kv.dropped(job)
        await self.free(job.rid)

    async def _expire(self) -> None:
        """No request outlives the timeout, whatever its peers did."""
        now = time.monotonic()
        await self.prompt_kv.expire_waits(now, self.settings.shared_kv_stall_s)
        for job in list(self.jobs.values()):
            if now - job.created > self.settings.request_timeout_s:
                await self._fail(job, "request timed out on MD")
