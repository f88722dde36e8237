"""Prefill (P): computes what its prefix cache lacks, samples the first token, and
streams KV blocks as chunks finish — to MD over the WAN (only blocks MD lacks) and, on
P→RLD→MD, to the relay over the local path at the same time (dual path)."""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from dataclasses import dataclass, field
from enum import Enum, StrEnum, auto

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Span

from shared.bus import subjects
from shared.bus.codec import encode
from shared.bus.connection import publish, respond
from shared.bus.messages import (
    Abort,
    AbortReason,
    HandoffBatch,
    HandoffMode,
    LinkReport,
    MainDecodeLost,
    MDTarget,
    Outcome,
    Pipeline,
    PrefillSubmit,
    RelayStart,
    Role,
    SubmitReply,
    TokenEvent,
)
from shared.bus.subjects import Req
from shared.config import EngineSettings, PrefillSettings
from shared.engine import EngineError, LLMEngine, StepOutput
from shared.kv import KVClient, KVClientPool, KVTransfer, KVTransferError, LinkEstimator
from shared.kv.tls import client_tls
from shared.serving.engine_service import EngineService, outcome_of, token_event
from shared.serving.state_machine import StateMachine, table_of
from shared.telemetry import metrics
from shared.telemetry.span_store import REQUEST_ID_ATTR
from shared.telemetry.tracing import traceparent

from .exporter import BlockExport, BlockExporter
from .rdma_path import RdmaLink, RdmaPeers, start_writer

log = logging.getLogger(__name__)
_END = None  # queue sentinel: no more blocks for this destination


class KVPath(StrEnum):
    WAN = "wan"  # to MD, across the datacenters
    LOCAL = "local"  # to the relay, next door


class PrefillState(Enum):
    PREFILLING = auto()  # computing; MD's target not known yet
    TARGETED = auto()  # computing; the blocks MD lacks stream over the WAN
    AWAITING_TARGET = auto()  # first token out; MD's target not known yet
    DRAINING = auto()  # first token out, target known: the senders finish their queues
    RELEASED = auto()  # nothing held


MOVES = table_of(
    PrefillState,
    PREFILLING=("TARGETED", "AWAITING_TARGET", "RELEASED"),
    TARGETED=("DRAINING", "RELEASED"),
    AWAITING_TARGET=("DRAINING", "RELEASED"),
    DRAINING=("RELEASED",),
    RELEASED=(),
)


@dataclass
class PrefillJob:
    """One request's event-loop state (the engine thread has its own, in BlockExporter)."""

    submit: PrefillSubmit
    state: StateMachine[PrefillState] = field(
        default_factory=lambda: StateMachine(PrefillState.PREFILLING, MOVES)
    )
    md_address: str = ""
    md_missing: list[int] = field(default_factory=list)  # blocks MD lacks
    md_pending: set[int] = field(default_factory=set)  # blocks MD lacks, not queued yet
    md_end_queued: bool = False
    md_queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    local_queue: asyncio.Queue | None = None
    first_token: int | None = None
    wan_bytes: int = 0
    rdma_bytes: int = 0  # of wan_bytes, written over the RDMA path
    wan_queued: int = 0  # KV bytes waiting in md_queue (reported as backlog to the router)
    senders: dict[KVPath, asyncio.Task] = field(default_factory=dict)
    transfers: dict[KVPath, KVTransfer] = field(default_factory=dict)  # each sender's (it survives drops)
    ctx: Context | None = None  # trace context of the router's request
    compute_span: Span | None = None

    rid = property(lambda self: self.submit.rid)
    router = property(lambda self: self.submit.router)


class PrefillService(EngineService):
    role = Role.PREFILL
    publishes_cache = True
    jobs: dict[str, PrefillJob]

    def __init__(self, settings: PrefillSettings, nc, engine: LLMEngine | None = None):
        engine = engine or LLMEngine(settings.model, chunked(settings.engine, settings.prefill_chunk))
        self.exporter = BlockExporter(engine)
        super().__init__(settings, nc, engine, post_step=self.exporter.after_step)
        # Peers over tcp:// are main decoders at any address: their certificates must name that identity.
        self.kv_clients = KVClientPool(
            settings.secret,
            ssl=client_tls(settings),
            via=settings.bulk_via,
            server_name=Role.MAIN_DECODE.value,
            parallel=settings.bulk_parallel,
            parallel_min_bytes=int(settings.bulk_parallel_min_mib * (1 << 20)),
        )
        self.links = LinkEstimator()
        self._rtt_seen: weakref.WeakSet[KVClient] = weakref.WeakSet()  # connections whose RTT is counted
        self._labelled_peers: set[str] = set()  # peers with a WAN_BANDWIDTH series
        self.track("export_plans", lambda: len(self.exporter._plans))
        self.rdma = RdmaPeers(nc, None, settings.rdma.control_timeout_s)  # the RDMA path to MD, once started

    async def start(self) -> None:
        self.rdma.writer = await start_writer(self.settings)
        await super().start()

    async def subscribe(self) -> None:
        # Least-loaded choice by the router on the instance subject; the queue group serves
        # clients that do not pick an instance.
        inst = self.settings.instance
        await self.admission.subscribe(
            subjects.prefill_submit_to(inst), PrefillSubmit, SubmitReply, self._submit
        )
        await self.admission.subscribe(
            subjects.prefill_submit(), PrefillSubmit, SubmitReply, self._submit, "prefill"
        )
        await self.life.subscribe(self.nc, subjects.all_req(Req.MD_TARGET), MDTarget, self._on_md_target)
        await self.life.subscribe(self.nc, subjects.all_req(Req.MD_LOST), MainDecodeLost, self._on_md_lost)

    async def stop(self) -> None:
        await self.life.close()
        for job in list(self.jobs.values()):
            await self._drop(job, AbortReason.SHUTDOWN)
        await self.kv_clients.close()
        await super().stop()

    # ---- admission -------------------------------------------------------------------
    async def _submit(self, msg: PrefillSubmit, raw) -> None:
        local = bool(msg.relay_address)
        job = PrefillJob(msg, local_queue=asyncio.Queue() if local else None, ctx=otel_context.get_current())
        job.compute_span = self.tracer.start_span(
            "prefill.compute",
            context=job.ctx,
            attributes={
                REQUEST_ID_ATTR: msg.rid,
                "prompt_tokens": len(msg.prompt_ids),
                "pdd.pipeline": msg.pipeline.value,
            },
        )
        self.jobs[msg.rid] = job
        try:
            await self.engine_loop.call(self.exporter.admit, msg.rid, msg.prompt_ids, msg.params, local)
        except (EngineError, TimeoutError) as e:
            self.jobs.pop(msg.rid, None)
            if isinstance(e, TimeoutError):  # an admit that was already running still lands: free it after
                self.life.spawn(self.engine_loop.call(self._free_request, msg.rid, must_run=True))
            job.compute_span.end()
            await respond(raw, SubmitReply(ok=False, error=str(e)))
            return
        if job.local_queue is not None and msg.relay_address:  # P→RLD→MD
            self._start_sender(job, KVPath.LOCAL, msg.relay_address, job.local_queue)
        self.life.spawn(self._watch(job))
        await respond(raw, SubmitReply(ok=True, instance=self.settings.instance))

    # ---- MD's target and the first token: the two events that start draining ----------
    async def _on_md_target(self, msg: MDTarget, raw) -> None:
        job = self.jobs.get(msg.rid)
        if job is None:
            self.count_unknown_request()
            return
        starts_draining = job.state.is_in(PrefillState.AWAITING_TARGET)  # the first token is out
        if job.state.is_in(PrefillState.PREFILLING):
            job.state.to(PrefillState.TARGETED)  # the first token will start draining
        elif starts_draining:
            job.state.to(PrefillState.DRAINING)
        else:
            return  # a duplicate target, or the request is gone
        # The WAN sender exists before any await, so draining cannot see "all senders done"
        # while MD's blocks are still to come.
        job.md_address, job.md_missing, job.md_pending = (
            msg.md_bulk_address,
            msg.md_missing,
            set(msg.md_missing),
        )
        self._start_sender(job, KVPath.WAN, msg.md_bulk_address, job.md_queue)
        self._close_wan_if_complete(job)
        export = await self.engine_loop.call(self.exporter.target, job.rid, msg.md_missing)
        if export is not None:
            self._queue_blocks(job, export)
        if starts_draining and job.state.is_in(PrefillState.DRAINING):
            await self._on_draining(job)

    async def _first_token(self, job: PrefillJob, out: StepOutput) -> None:
        token = out.token_id
        assert token is not None
        job.first_token = token
        if job.compute_span:
            job.compute_span.end()
        reason = await self.engine_loop.call(self.engine.finish_reason, job.rid)
        if job.state.is_in(PrefillState.RELEASED):
            return  # dropped meanwhile (abort, failed transfer)
        if reason is not None:
            # Nothing left to decode: stop the transfers and tell MD / RLD to drop the request.
            event = token_event(job.rid, self.role, 0, [out])
            event.outcome = outcome_of(reason)
            await self.send_tokens(job.router, event)
            await self.send_abort(job.rid, AbortReason.FINISHED_AT_PREFILL)
            await self._drop(job, AbortReason.FINISHED_AT_PREFILL)
            return
        await self.send_tokens(job.router, token_event(job.rid, self.role, 0, [out]))
        if job.local_queue is not None:
            job.local_queue.put_nowait(_END)  # the relay's stream ends with the first token
        if job.state.is_in(PrefillState.PREFILLING):
            job.state.to(PrefillState.AWAITING_TARGET)
        elif job.state.is_in(PrefillState.TARGETED):
            job.state.to(PrefillState.DRAINING)
            await self._on_draining(job)

    async def _on_draining(self, job: PrefillJob) -> None:
        """The first token is out and MD holds the request: on P→MD prefill is the relay and
        hands its one token over; the request is released once the senders are done."""
        if job.submit.pipeline is Pipeline.P_MD:
            batch = HandoffBatch(job.rid, 0, 0, [job.first_token], final=True, mode=HandoffMode.PREFILL)
            await publish(self.nc, subjects.req(job.rid, Req.HANDOFF), batch)
        await self._release_if_drained(job)

    # ---- blocks from the engine thread ------------------------------------------------
    async def on_outputs(self, outputs: list[StepOutput], exports: list[BlockExport] | None) -> None:
        for export in exports or []:
            job = self.jobs.get(export.rid)
            if job is not None:
                self._queue_blocks(job, export)
        for out in outputs:
            job = self.jobs.get(out.rid)
            if job is None:
                continue
            if out.token_id is not None:
                await self._first_token(job, out)
            elif out.finished:  # error or abort inside the engine
                await self._fail(job, out.error or "prefill failed")

    def _queue_blocks(self, job: PrefillJob, export: BlockExport) -> None:
        if export.local is not None and job.local_queue is not None:
            job.local_queue.put_nowait(export.local)
        if export.wan is not None:
            hashes, kv = export.wan
            job.md_queue.put_nowait(export.wan)
            job.wan_queued += kv.numel() * kv.element_size()
            job.md_pending.difference_update(hashes)
            self._close_wan_if_complete(job)

    def _close_wan_if_complete(self, job: PrefillJob) -> None:
        """MD asked for an exact set of blocks: the WAN stream ends once all are queued."""
        if not job.md_pending and not job.md_end_queued:
            job.md_end_queued = True
            job.md_queue.put_nowait(_END)

    # ---- transfers -------------------------------------------------------------------
    def _start_sender(self, job: PrefillJob, path: KVPath, address: str, queue: asyncio.Queue) -> None:
        job.senders[path] = self.life.spawn(self._ship(job, path, address, queue))

    async def _ship(self, job: PrefillJob, path: KVPath, address: str, queue: asyncio.Queue) -> None:
        """Stream one destination's blocks for one request, then wait for its ack."""
        span = self.tracer.start_span(
            "kv.transfer",
            context=job.ctx,
            attributes={REQUEST_ID_ATTR: job.rid, "path": path.value, "peer": address},
        )
        t_start, sent = time.monotonic(), 0
        transfer = job.transfers[path] = KVTransfer(
            self.kv_clients, address, job.rid, timeout=self.settings.request_timeout_s
        )
        try:
            sent, t_first = await self._stream(job, path, transfer, queue, traceparent_of(span))
            payload = encode(self._relay_start(job, span)) if path is KVPath.LOCAL else b""
            await transfer.finish(payload)
            if path is KVPath.WAN and transfer.client is not None and not transfer.reconnects:
                self._observe_link(
                    address, transfer.client, sent, t_first, time.monotonic()
                )  # no outage in it
        except asyncio.CancelledError:
            raise
        except Exception as e:  # transfer errors, timeouts, and bugs alike end the request cleanly
            await self._transfer_failed(job, path, address, span, e)
        finally:
            span.set_attributes(
                {
                    "bytes": sent,
                    "duration_s": time.monotonic() - t_start,
                    "reconnects": transfer.reconnects,
                    "rdma_bytes": job.rdma_bytes,
                }
            )
            span.end()
            job.transfers.pop(path, None)
            transfer.close()
            await self._release_if_drained(job)

    async def _stream(
        self, job: PrefillJob, path: KVPath, transfer: KVTransfer, queue: asyncio.Queue, tp: str | None
    ) -> tuple[int, float | None]:
        """Send queued blocks until the end marker: (bytes sent, time of the first block).
        To MD over the RDMA path where both ends have it, the rest over the TCP channel."""
        timeout = self.settings.request_timeout_s
        sent, t_first = 0, None
        link = await self._open_rdma(job) if path is KVPath.WAN else None
        try:
            while (item := await asyncio.wait_for(queue.get(), timeout=timeout)) is not _END:
                hashes, kv = item
                t_first = t_first or time.monotonic()
                n = await self._send_group(transfer, link, hashes, kv, tp)
                sent += n
                if path is KVPath.WAN:
                    job.wan_bytes += n
                    job.wan_queued = max(job.wan_queued - kv.numel() * kv.element_size(), 0)
                metrics.KV_BYTES.labels(path=path.value).inc(n)
            if link is not None:
                sent += await self._resend(job, transfer, link, tp)
        finally:
            if link is not None:
                link.cancel()
                job.rdma_bytes = link.bytes
        return sent, t_first

    async def _open_rdma(self, job: PrefillJob) -> RdmaLink | None:
        if self.settings.kv_transport != "rdma":
            return None
        return await self.rdma.open(job.md_address, job.rid, job.md_missing)

    async def _send_group(
        self, transfer: KVTransfer, link: RdmaLink | None, hashes: list[int], kv, tp: str | None
    ) -> int:
        """One exported group: what MD gave RDMA slots for one-sided, the rest over TCP."""
        written, rest = await link.send(hashes, kv, tp) if link is not None else (0, list(range(len(hashes))))
        if not rest:
            return written
        part = kv if len(rest) == len(hashes) else kv[:, :, rest]
        return written + await transfer.send_blocks([hashes[i] for i in rest], part, traceparent=tp)

    async def _resend(self, job: PrefillJob, transfer: KVTransfer, link: RdmaLink, tp: str | None) -> int:
        """Blocks MD did not verify go again over TCP."""
        again, kv = await link.settle()
        if kv is None:
            return 0
        n = await transfer.send_blocks(again, kv, traceparent=tp)
        job.wan_bytes += n
        metrics.KV_BYTES.labels(path=KVPath.WAN.value).inc(n)
        return n

    def _relay_start(self, job: PrefillJob, span: Span) -> RelayStart:
        s = job.submit
        assert job.first_token is not None  # the local stream ends only after the first token
        return RelayStart(
            s.rid,
            s.prompt_ids,
            job.first_token,
            s.params,
            s.catchup_threshold,
            traceparent_of(span),
            router=s.router,
        )

    async def _transfer_failed(
        self, job: PrefillJob, path: KVPath, address: str, span: Span, e: Exception
    ) -> None:
        if not isinstance(e, KVTransferError | TimeoutError | OSError):
            log.exception("%s transfer of %s crashed", path.value, job.rid)
        log.warning("%s transfer of %s to %s failed: %s", path.value, job.rid, address, e)
        span.set_status(trace.Status(trace.StatusCode.ERROR, str(e)))
        if path is KVPath.LOCAL or job.submit.pipeline is Pipeline.P_MD:
            await self._fail(job, f"KV transfer to {path.value} peer failed: {e}")
        # On P→RLD→MD a WAN failure is the relay's to absorb (it finishes the request).

    def _observe_link(
        self, address: str, client: KVClient, sent: int, t_first: float | None, t_end: float
    ) -> None:
        """Feed the link estimator: each connection's handshake RTT once, and goodput from
        first byte to ack."""
        if client.rtt and client not in self._rtt_seen:
            self._rtt_seen.add(client)
            self.links.observe_rtt(address, client.rtt)
        if t_first is not None:
            self.links.observe_transfer(address, sent, t_end - t_first)  # small transfers are ignored there
        metrics.WAN_BANDWIDTH.labels(peer=address).set(self.links.bandwidth(address))
        self._labelled_peers.add(address)

    # ---- endings ---------------------------------------------------------------------
    async def _watch(self, job: PrefillJob) -> None:
        """Bound every request: whatever happens, it is freed after the timeout."""
        await asyncio.sleep(self.settings.request_timeout_s)
        if self.jobs.get(job.rid) is job:
            await self._fail(job, "prefill timed out")

    async def _fail(self, job: PrefillJob, error: str) -> None:
        if self.jobs.get(job.rid) is not job:
            return
        await self.send_tokens(
            job.router, TokenEvent(job.rid, self.role, 0, [], outcome=Outcome.ERROR, error=error)
        )
        await self.send_abort(job.rid, AbortReason.FAILED, error)
        await self._drop(job, AbortReason.FAILED)

    async def release_on_leaving(self, job: PrefillJob) -> None:
        await self._fail(job, "prefill is leaving")

    async def on_abort_message(self, msg: Abort, source: Role) -> None:
        job = self.jobs.get(msg.rid)
        if job is not None:
            with self.tracer.start_as_current_span(
                "abort", attributes={REQUEST_ID_ATTR: msg.rid, "reason": msg.reason.value}
            ):
                await self._drop(job, msg.reason)

    async def _on_md_lost(self, msg: MainDecodeLost, raw) -> None:
        """Only the WAN stream goes: the relay's local stream must go on."""
        job = self.jobs.get(msg.rid)
        if job is not None and await self._cancel_sender(job, KVPath.WAN, "md_lost"):
            metrics.KV_TRANSFER_ABORTS.labels(reason=metrics.abort_reason("md_lost")).inc()

    async def _cancel_sender(self, job: PrefillJob, path: KVPath, reason: str) -> bool:
        """Stop one stream and tell its peer to drop what it got; False if it had ended."""
        task = job.senders.get(path)
        if task is None or task.done() or task is asyncio.current_task():
            return False
        transfer = job.transfers.get(path)
        task.cancel()
        if transfer is not None:
            try:
                await transfer.abort(reason)
            except Exception as e:  # the peer may already be gone
                log.debug("abort of %s on the %s path failed: %s", job.rid, path.value, e)
        return True

    async def _drop(self, job: PrefillJob, reason: AbortReason) -> None:
        """Cancel transfers (peers are told to drop what they got) and free the blocks."""
        for path in list(job.senders):
            if await self._cancel_sender(job, path, reason.value) and path is KVPath.WAN:
                metrics.KV_TRANSFER_ABORTS.labels(reason=metrics.abort_reason(reason.value)).inc()
        await self._release(job)

    async def _release_if_drained(self, job: PrefillJob) -> None:
        others = [t for t in job.senders.values() if t is not asyncio.current_task()]
        if job.state.is_in(PrefillState.DRAINING) and all(t.done() for t in others):
            await self._release(job)

    async def _release(self, job: PrefillJob) -> None:
        if job.state.is_in(PrefillState.RELEASED):
            return
        job.state.to(PrefillState.RELEASED)
        self.jobs.pop(job.rid, None)
        if job.compute_span and job.compute_span.is_recording():
            job.compute_span.end()
        await self.engine_loop.call(self._free_request, job.rid, must_run=True)

    def _free_request(self, rid: str) -> None:  # engine thread
        self.exporter.forget(rid)
        self._free_now(rid)

    # ---- reporting -------------------------------------------------------------------
    def load_links(self) -> list[LinkReport]:
        """Measured links (otherwise the router keeps its configured prior) and the KV still
        queued toward each MD."""
        known = self.links.snapshot()
        metrics.forget_peers_except(self._labelled_peers, known)  # the estimator dropped them
        links = {
            peer: LinkReport(peer, bandwidth=info["bandwidth"], rtt=info["rtt"])
            for peer, info in known.items()
            if info["transfers"]
        }
        for job in self.jobs.values():
            if job.md_address and job.wan_queued:
                links.setdefault(job.md_address, LinkReport(job.md_address)).backlog += job.wan_queued
        return list(links.values())


def chunked(engine: EngineSettings, prefill_chunk: int) -> EngineSettings:
    """Cap the tokens per forward so KV blocks stream to the peers while the prompt is still
    being prefilled, instead of after one long forward."""
    if prefill_chunk <= 0:
        return engine
    return engine.model_copy(update={"max_batched_tokens": min(engine.max_batched_tokens, prefill_chunk)})


def traceparent_of(span: Span) -> str | None:
    with trace.use_span(span, end_on_exit=False):
        return traceparent()
