"""Prefill (P): computes what its prefix cache lacks, samples the first token, and
streams KV blocks as chunks finish — to MD over the WAN (only blocks MD lacks) and, on
P→RLD→MD, to the relay over the local path at the same time (dual path)."""

from __future__ import annotations

import asyncio
import logging

from opentelemetry import context as otel_context

from shared.advertise import check_advertised
from shared.bus import subjects
from shared.bus.connection import respond
from shared.bus.delivery import deliver
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
    Role,
    SubmitReply,
    TokenEvent,
)
from shared.bus.subjects import Req
from shared.config import EngineSettings, PrefillSettings
from shared.engine import EngineError, LLMEngine, StepOutput
from shared.kv import KVClientPool
from shared.kv.rdma_link import rdma_host
from shared.kv.sender import KVSenders
from shared.kv.tls import client_tls
from shared.serving.engine_service import EngineService, outcome_of, token_event
from shared.telemetry import metrics
from shared.telemetry.span_store import REQUEST_ID_ATTR

from .exporter import BlockExport, BlockExporter
from .job import END, KVPath, PrefillJob, PrefillState, after_first_token, after_target
from .kv_stream import KVStreamer

log = logging.getLogger(__name__)


class PrefillService(EngineService):
    role = Role.PREFILL
    publishes_cache = True
    publishes_backlog = True
    jobs: dict[str, PrefillJob]

    def __init__(self, settings: PrefillSettings, nc, engine: LLMEngine | None = None):
        engine = engine or LLMEngine(settings.model, chunked(settings.engine, settings.prefill_chunk))
        self.exporter = BlockExporter(engine)
        super().__init__(settings, nc, engine, post_step=self.exporter.after_step)
        # One pool per path, each peer's certificate naming that path's role (checked instead of
        # a host name: peers are at any address), so a relay's credentials never pass for a main
        # decoder's. Over unix:// the local path goes by the secret.
        tls = client_tls(settings, check_hostname=False)

        def pool(role: Role, via: str | None) -> KVClientPool:
            return KVClientPool(
                settings.secret,
                ssl=tls,
                via=via,
                peer_roles=(role.value,),
                parallel=settings.bulk_parallel,
                parallel_min_bytes=int(settings.bulk_parallel_min_mib * (1 << 20)),
            )

        self.kv_clients = pool(Role.MAIN_DECODE, settings.bulk_via)
        self.local_clients = pool(Role.RELAY, None)  # the relay is in this DC: never via the WAN
        self.track("export_plans", lambda: len(self.exporter._plans))
        self.senders = KVSenders(settings, nc, self.kv_clients, self.local_clients)
        self.streams = KVStreamer(
            settings,
            self.tracer,
            self.life.spawn,
            self.senders,
            self._stream_failed,
            self._stream_acked,
            self._release_if_drained,
        )

    @classmethod
    async def preflight(cls, settings: PrefillSettings) -> None:
        """Exit 2 when the RDMA engine's host, taken from this host's name, is loopback: MD on
        another host would write to its own (shared/advertise.py). A host given is taken as is."""
        if settings.kv_transport == "rdma" and not settings.rdma.host:
            host = await rdma_host(settings)
            fix, force = "PDD_PREFILL_RDMA__HOST", "PDD_PREFILL_ADVERTISE_LOOPBACK_OK"
            ok = settings.advertise_loopback_ok
            check_advertised("prefill", "the RDMA engine's host", host, "0.0.0.0", ok, fix, force)

    async def start(self) -> None:
        await self.senders.start()
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
        for kind, cls, handler in (
            (Req.MD_TARGET, MDTarget, self._on_md_target),
            (Req.MD_LOST, MainDecodeLost, self._on_md_lost),
        ):
            subject = subjects.to_instance(self.role, inst, kind)
            await self.life.subscribe(self.nc, subject, cls, handler, ack=True)

    async def stop(self) -> None:
        await self.life.close()
        for job in list(self.jobs.values()):
            await self._drop(job, AbortReason.SHUTDOWN)
        await self.kv_clients.close()
        await self.local_clients.close()
        await super().stop()

    # ---- admission -------------------------------------------------------------------
    async def _submit(self, msg: PrefillSubmit, raw) -> None:
        if bool(msg.relay_address) != bool(msg.relay):  # RelayStart goes to the relay by its instance
            await respond(raw, SubmitReply(ok=False, error="relay_address and relay must be given together"))
            return
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
            self.streams.start(job, KVPath.LOCAL, msg.relay_address, job.local_queue)
        self.life.spawn(self._watch(job))
        await respond(raw, SubmitReply(ok=True, instance=self.settings.instance, epoch=self.epoch))

    # ---- MD's target and the first token: the two events that start draining ----------
    async def _on_md_target(self, msg: MDTarget, raw) -> None:
        job = self.jobs.get(msg.rid)
        if job is None:
            self.count_unknown_request()
            return
        moved = after_target(job.state.state)
        if moved is None:
            return  # a duplicate target, or the request is gone
        job.state.to(moved)
        starts_draining = moved is PrefillState.DRAINING
        # The WAN sender exists before any await, so draining cannot see "all senders done"
        # while MD's blocks are still to come.
        job.md_instance = msg.md_instance
        job.md_address, job.md_missing, job.md_pending = (
            msg.md_bulk_address,
            msg.md_missing,
            set(msg.md_missing),
        )
        self.streams.start(job, KVPath.WAN, msg.md_bulk_address, job.md_queue)
        job.close_wan_if_complete()
        if starts_draining:
            # The handoff goes before the export's await: a WAN sender with nothing to send
            # (MD holds, or awaits, every block) may end during it and release the request,
            # and MD would then never get the first token.
            await self._on_draining(job)
        export = await self.engine_loop.call(self.exporter.target, job.rid, msg.md_missing)
        if export is not None:
            job.queue_blocks(export)

    async def _first_token(self, job: PrefillJob, out: StepOutput) -> None:
        token = out.token_id
        assert token is not None
        job.first_token = token
        if job.compute_span:
            job.compute_span.end()
        reason = out.ends  # told with the token: no round trip to the engine thread
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
            job.local_queue.put_nowait(END)  # the relay's stream ends with the first token
        moved = after_first_token(job.state.state)
        if moved is not None:
            job.state.to(moved)
        if moved is PrefillState.DRAINING:
            await self._on_draining(job)

    async def _on_draining(self, job: PrefillJob) -> None:
        """The first token is out and MD holds the request: on P→MD prefill is the relay and
        hands its one token over; the request is released once the senders are done."""
        if job.submit.pipeline is Pipeline.P_MD:
            batch = HandoffBatch(job.rid, 0, 0, [job.first_token], final=True, mode=HandoffMode.PREFILL)
            to_md = subjects.to_instance(Role.MAIN_DECODE, job.md_instance, Req.HANDOFF)
            self.life.spawn(deliver(self.nc, to_md, batch))
        await self._release_if_drained(job)

    # ---- blocks from the engine thread ------------------------------------------------
    async def on_outputs(self, outputs: list[StepOutput], exports: list[BlockExport] | None) -> None:
        for export in exports or []:
            job = self.jobs.get(export.rid)
            if job is not None:
                job.queue_blocks(export)
        for out in outputs:
            job = self.jobs.get(out.rid)
            if job is None:
                continue
            if out.token_id is not None:
                await self._first_token(job, out)
            elif out.finished:  # error or abort inside the engine
                await self._fail(job, out.error or "prefill failed")

    async def _stream_acked(self, job: PrefillJob, path: KVPath, traceparent: str | None) -> None:
        if path is KVPath.LOCAL:  # the relay holds the prompt KV: it decodes once told from where
            start = subjects.to_instance(Role.RELAY, job.submit.relay, Req.RELAY_START)
            self.life.spawn(deliver(self.nc, start, job.relay_start(traceparent)))

    async def _stream_failed(self, job: PrefillJob, path: KVPath, e: Exception) -> None:
        if path is KVPath.LOCAL or job.submit.pipeline is Pipeline.P_MD:
            await self._fail(job, f"KV transfer to {path.value} peer failed: {e}")
        # On P→RLD→MD a WAN failure is the relay's to absorb (it finishes the request).

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
        if job is not None and await self.streams.cancel(job, KVPath.WAN, "md_lost"):
            metrics.KV_TRANSFER_ABORTS.labels(reason=metrics.abort_reason("md_lost")).inc()

    async def _drop(self, job: PrefillJob, reason: AbortReason) -> None:
        """Cancel transfers (peers are told to drop what they got) and free the blocks."""
        for path in list(job.senders):
            if await self.streams.cancel(job, path, reason.value) and path is KVPath.WAN:
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
        return self.streams.link_reports(self.jobs.values())


def chunked(engine: EngineSettings, prefill_chunk: int) -> EngineSettings:
    """Compute each prompt in chunks of prefill_chunk tokens, so its KV blocks stream to the
    peers while the rest is still being prefilled; prompts that wait together share a forward
    (up to max_batched_tokens), so a burst's last prompt does not wait for one forward each."""
    if prefill_chunk <= 0:
        return engine
    return engine.model_copy(update={"chunk_tokens": prefill_chunk})
