"""Main decode (MD): receives prompt KV over the WAN into its prefix cache (the
decode-side radix cache: one copy per distinct prefix), publishes what it stores and
evicts, rebuilds the KV of handed-over tokens with one extend pass per batch, then
decodes with continuous batching."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import torch
from opentelemetry import context as otel_context
from opentelemetry.context import Context
from opentelemetry.trace import Span

from shared.bus import subjects
from shared.bus.connection import publish, respond
from shared.bus.messages import (
    P_RLD_MD,
    Abort,
    HandoffAck,
    HandoffBatch,
    KVEvents,
    KVReady,
    PrepareReply,
    PrepareRequest,
    TokenEvent,
    load_report,
)
from shared.config import MainDecodeSettings
from shared.engine import EngineError, LLMEngine, Mode, SamplingParams, StepOutput
from shared.engine.engine_loop import EngineLoop
from shared.engine.outputs import group_by_request
from shared.kv import KVServer, start_kv_server
from shared.runtime import Lifecycle
from shared.telemetry import metrics
from shared.telemetry.span_store import REQUEST_ID_ATTR
from shared.telemetry.tracing import context_from_traceparent, get_tracer

log = logging.getLogger(__name__)


@dataclass
class MDJob:
    req: PrepareRequest
    params: SamplingParams
    missing: set[int]
    received: set[int] = field(default_factory=set)
    kv_complete: bool = False
    batches: dict[int, HandoffBatch] = field(default_factory=dict)
    next_seq: int = 0
    next_index: int = 0  # output index the next handoff batch must start at
    started: bool = False  # the engine holds a sequence for it
    decoding: bool = False  # the final batch is in: MD generates from here
    wan_bytes: int = 0
    md_tokens: int = 0
    handoff_mode: str = ""
    created: float = field(default_factory=time.monotonic)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    ctx: Context | None = None  # the router's request context
    batch_ctx: dict[int, Context] = field(default_factory=dict)  # each handoff batch's sender context
    receive_span: Span | None = None
    decode_span: Span | None = None

    @property
    def rid(self) -> str:
        return self.req.rid


class MainDecodeService:
    def __init__(self, settings: MainDecodeSettings, nc, engine: LLMEngine | None = None):
        self.settings = settings
        self.nc = nc
        self.engine = engine or LLMEngine(settings.model, settings.engine)
        self.loop = EngineLoop(self.engine, self._on_outputs)
        self.jobs: dict[str, MDJob] = {}
        self.kv_server: KVServer | None = None
        self.tracer = get_tracer("main_decode", settings.instance, settings.datacenter)
        self.life = Lifecycle()

    @property
    def advertise_address(self) -> str:
        return self.settings.advertise_address or (self.kv_server.address if self.kv_server else "")

    async def start(self) -> None:
        self.loop.start()
        self.kv_server = await start_kv_server(self.settings.bulk_address, self.settings.secret, self)
        inst = self.settings.instance
        for subject, cls, handler in [
            (subjects.md_prepare(inst), PrepareRequest, self._on_prepare),
            (subjects.all_req("handoff"), HandoffBatch, self._on_handoff),
            (subjects.all_req("abort"), Abort, self._on_abort),
        ]:
            await self.life.subscribe(self.nc, subject, cls, handler)
        await self._publish_kv_snapshot()
        self.life.every(0.05, self._publish_kv_events)
        self.life.every(10.0, self._publish_kv_snapshot)
        self.life.every(0.5, self._report_load)
        self.life.every(1.0, self._expire)

    async def stop(self) -> None:
        await self.life.close()
        if self.kv_server:
            await self.kv_server.close()
        await self.loop.stop()

    # ---- prepare: which blocks must cross the WAN -------------------------------------
    async def _on_prepare(self, msg: PrepareRequest, raw) -> None:
        # Admission waits for the engine thread (up to one step): do it off the subscription
        # so requests arriving together are admitted together.
        self.life.spawn(self._prepare(msg, raw))

    async def _prepare(self, msg: PrepareRequest, raw) -> None:
        if msg.rid in self.jobs:
            await respond(raw, PrepareReply(ok=False, error=f"duplicate request id {msg.rid}"))
            return
        try:
            params = SamplingParams.from_dict(msg.params)
            # Pin what is cached now so it cannot be evicted before the request uses it.
            have = await self.loop.call(self.engine.transfer.pin_blocks, msg.rid, msg.block_hashes)
        except (EngineError, ValueError, TypeError) as e:
            await respond(raw, PrepareReply(ok=False, error=str(e)))
            return
        missing = msg.block_hashes[have:]
        self.jobs[msg.rid] = MDJob(msg, params, set(missing), ctx=otel_context.get_current())
        await respond(raw, PrepareReply(ok=True, missing=missing, bulk_address=self.advertise_address))

    # ---- KV sink (bulk channel over the WAN) -------------------------------------------
    async def on_blocks(self, rid: str, hashes: list[int], kv: torch.Tensor, meta: dict) -> None:
        job = self.jobs.get(rid)
        if job is None:
            raise KeyError(f"unknown request id {rid}")
        if not set(hashes) <= job.missing:
            raise ValueError(f"request {rid}: unexpected blocks")
        if job.receive_span is None:  # parented by prefill's transfer span, from the frame header
            job.receive_span = self.tracer.start_span(
                "md.kv_receive",
                context=context_from_traceparent(meta.get("traceparent")),
                attributes={REQUEST_ID_ATTR: rid, "path": "wan"},
            )
        await self.loop.call(self.engine.transfer.import_blocks, hashes, kv, pin=rid)
        job.received.update(hashes)
        job.wan_bytes += kv.numel() * kv.element_size()

    async def on_done(self, rid: str, meta: dict) -> None:
        job = self.jobs.get(rid)
        if job is None:
            raise KeyError(f"unknown request id {rid}")
        lacking = job.missing - job.received
        if lacking:
            raise ValueError(f"request {rid}: {len(lacking)} prompt blocks never arrived")
        job.kv_complete = True
        if job.receive_span:
            job.receive_span.set_attributes({"bytes": job.wan_bytes, "blocks": len(job.received)})
            job.receive_span.end()
        if job.req.pipeline == P_RLD_MD:  # only a relay waits for it
            token = otel_context.attach(job.ctx) if job.ctx is not None else None
            try:  # kv_ready belongs to the request's trace, not to the bulk connection's
                ready = KVReady(rid, self.settings.instance, job.wan_bytes)
                await publish(self.nc, subjects.req_kv_ready(rid), ready)
            finally:
                if token is not None:
                    otel_context.detach(token)
        await self._drain_handoffs(job)

    async def on_abort(self, rid: str, reason: str) -> None:
        job = self.jobs.get(rid)
        if job is not None and not job.kv_complete:
            await self._drop(job)

    # ---- handoff: extend by token IDs --------------------------------------------------
    async def _on_handoff(self, msg: HandoffBatch, raw) -> None:
        job = self.jobs.get(msg.rid)
        if job is None:
            metrics.UNKNOWN_REQUEST_MESSAGES.labels(service="main_decode").inc()
            return
        job.batches[msg.seq] = msg
        job.batch_ctx[msg.seq] = otel_context.get_current()
        self.life.spawn(self._drain_handoffs(job))  # keep this subscription free for other requests

    async def _drain_handoffs(self, job: MDJob) -> None:
        async with job.lock:  # batches are applied strictly in seq order, one at a time
            while job.kv_complete and job.next_seq in job.batches and self.jobs.get(job.rid) is job:
                batch = job.batches.pop(job.next_seq)
                if batch.start_index != job.next_index or not batch.tokens:
                    await self._fail(job, f"handoff batch {batch.seq} out of order or empty")
                    return
                attrs = {
                    REQUEST_ID_ATTR: job.rid,
                    "seq": batch.seq,
                    "tokens": len(batch.tokens),
                    "mode": batch.mode,
                    "final": batch.final,
                }
                try:
                    with self.tracer.start_as_current_span(
                        "md.extend", context=job.batch_ctx.pop(batch.seq, job.ctx), attributes=attrs
                    ):
                        await self.loop.call(self._apply, job, batch)
                except EngineError as e:
                    await self._fail(job, f"extend failed: {e}")
                    return
                job.next_seq += 1
                job.next_index += len(batch.tokens)
                job.handoff_mode = batch.mode
                job.decoding = batch.final
                if batch.final:
                    job.decode_span = self.tracer.start_span(
                        "md.decode",
                        context=job.ctx,
                        attributes={REQUEST_ID_ATTR: job.rid, "mode": batch.mode},
                    )

    def _apply(self, job: MDJob, batch: HandoffBatch) -> None:  # engine thread
        if not job.started:
            mode = Mode.GENERATE if batch.final else Mode.HOLD
            tokens = job.req.prompt_ids + batch.tokens
            self.engine.add_request(
                job.rid, tokens, job.params, num_prompt_tokens=len(job.req.prompt_ids), mode=mode
            )
            job.started = True
        else:
            self.engine.extend(job.rid, batch.tokens, final=batch.final)

    async def _on_outputs(self, outputs: list[StepOutput], _extra) -> None:
        for rid, outs in group_by_request(outputs).items():
            job = self.jobs.get(rid)
            if job is None:
                continue
            if any(o.computed for o in outs):  # a catch-up batch is in: ask for the next one
                await publish(self.nc, subjects.req_handoff_ack(rid), HandoffAck(rid, job.next_seq - 1))
            toks = [o.token_id for o in outs if o.token_id is not None]
            last = outs[-1]
            if not toks and not last.finished:
                continue
            job.md_tokens += len(toks)
            metrics.OUTPUT_TOKENS.labels(role="main_decode").inc(len(toks))
            first = next((o.index for o in outs if o.index is not None), job.next_index)
            event = TokenEvent(rid, "main_decode", first, toks)
            if last.finished:
                event.finished = True
                event.finish_reason = last.finish_reason
                event.error = last.error
                event.stats = {
                    "md_tokens": job.md_tokens,
                    "wan_bytes": job.wan_bytes,
                    "md_instance": self.settings.instance,
                }
                self.jobs.pop(rid, None)
                self._end_spans(job)
                await self.loop.call(self.engine.transfer.unpin, rid)
            await publish(self.nc, subjects.req_tokens(rid), event)

    # ---- faults and cleanup ------------------------------------------------------------
    async def _on_abort(self, msg: Abort, raw) -> None:
        job = self.jobs.get(msg.rid)
        if job is not None and msg.source != "main_decode":
            with self.tracer.start_as_current_span(
                "abort", attributes={REQUEST_ID_ATTR: msg.rid, "reason": msg.reason}
            ):
                await self._drop(job)

    async def _fail(self, job: MDJob, error: str) -> None:
        log.warning("request %s failed on MD: %s", job.rid, error)
        await publish(self.nc, subjects.req_abort(job.rid), Abort(job.rid, error, "main_decode"))
        if job.decoding:  # nobody else can finish it
            await publish(
                self.nc,
                subjects.req_tokens(job.rid),
                TokenEvent(
                    job.rid,
                    "main_decode",
                    job.next_index,
                    [],
                    finished=True,
                    finish_reason="error",
                    error=error,
                ),
            )
        await self._drop(job)

    def _end_spans(self, job: MDJob) -> None:
        if job.decode_span and job.decode_span.is_recording():
            job.decode_span.set_attribute("md_tokens", job.md_tokens)
            job.decode_span.end()
        if job.receive_span and job.receive_span.is_recording():
            job.receive_span.set_attribute("aborted", True)
            job.receive_span.end()

    async def _drop(self, job: MDJob) -> None:
        if self.jobs.pop(job.rid, None) is None:
            return
        self._end_spans(job)

        def free() -> None:
            self.engine.abort(job.rid)
            self.engine.transfer.unpin(job.rid)

        await self.loop.call(free)

    async def _expire(self) -> None:
        """No request outlives the timeout, whatever its peers did."""
        now = time.monotonic()
        for job in list(self.jobs.values()):
            if now - job.created > self.settings.request_timeout_s:
                await self._fail(job, "request timed out on MD")

    async def _publish_kv_snapshot(self) -> None:
        """The whole cache, now and then: a router that restarted or missed events catches up."""

        def snapshot() -> list[int]:
            self.engine.transfer.drain_events()  # covered by the snapshot
            return self.engine.transfer.cached_hashes()

        inst = self.settings.instance
        stored = await self.loop.call(snapshot)
        await publish(self.nc, subjects.kv_events(inst), KVEvents(inst, stored=stored, reset=True))

    async def _publish_kv_events(self) -> None:
        events = await self.loop.call(self.engine.transfer.drain_events)
        if not events:
            return
        stored = [h for kind, h in events if kind == "stored"]
        evicted = [h for kind, h in events if kind == "evicted"]
        inst = self.settings.instance
        await publish(self.nc, subjects.kv_events(inst), KVEvents(inst, stored=stored, evicted=evicted))

    async def _report_load(self) -> None:
        stats = await self.loop.call(self.engine.stats)
        metrics.KV_BLOCKS_USED.labels(service="main_decode", instance=self.settings.instance).set(
            stats.used_blocks
        )
        report = load_report(
            "main_decode",
            self.settings.instance,
            stats,
            address=self.advertise_address,
            model_id=self.engine.model_id,
        )
        await publish(self.nc, subjects.load("main_decode", self.settings.instance), report)
