"""Prefill (P): computes what its prefix cache lacks, samples the first token, and
streams KV blocks as chunks finish — to MD over the WAN (only blocks MD lacks) and, on
P→RLD→MD, to the relay over the local path at the same time (dual path)."""

from __future__ import annotations

import asyncio
import logging

from opentelemetry import context as otel_context

from shared.advertise import check_advertised
from shared.bus.connection import respond
from shared.bus.messages import (
    Abort,
    AbortReason,
    LinkReport,
    MainDecodeLost,
    MainDecodeTarget,
    PrefillSubmit,
    Role,
    SubmitReply,
)
from shared.config import EngineSettings, PrefillSettings
from shared.engine import Engine, EngineError, StepOutput
from shared.engine.factory import build_engine
from shared.kv import KVClientPool
from shared.kv.rdma.link import rdma_host
from shared.kv.tls import client_tls
from shared.serving import identity_fault
from shared.serving.actions import SENT, Free, perform_sent
from shared.serving.engine_service import EngineService
from shared.telemetry import metrics
from shared.telemetry.span_store import REQUEST_ID_ATTR

from .core import (
    Action,
    CancelStream,
    ExportTarget,
    PrefillCore,
    ReportRefused,
    StartStream,
    submit_error,
)
from .exporter import BlockExport, BlockExporter
from .job import KVPath, PrefillJob
from .kv_stream import KVStreamer, kv_senders

log = logging.getLogger(__name__)


class PrefillService(EngineService):
    role = Role.PREFILL
    publishes_cache = True
    publishes_backlog = True
    jobs: dict[str, PrefillJob]

    def __init__(self, settings: PrefillSettings, nc, engine: Engine | None = None):
        engine = engine or build_engine(settings.model, chunked(settings.engine, settings.prefill_chunk))
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
        self.senders = kv_senders(settings, nc, self.kv_clients, self.local_clients)
        self.streams = KVStreamer(settings, self.tracer, self.life.spawn, self.senders, self)
        self.core = PrefillCore(self.jobs)

    @classmethod
    async def preflight(cls, settings: PrefillSettings) -> None:
        """Exit 2 when the RDMA engine's host, taken from this host's name, is loopback: MD on
        another host would write to its own (shared/advertise.py). A host given is taken as is."""
        await super().preflight(settings)
        if settings.kv_transport == "rdma" and not settings.rdma.host:
            host = await rdma_host(settings.rdma)
            fix, force = "PDD_PREFILL_RDMA__HOST", "PDD_PREFILL_ADVERTISE_LOOPBACK_OK"
            ok = settings.advertise_loopback_ok
            check_advertised("prefill", "the RDMA engine's host", host, "0.0.0.0", ok, fix, force)

    async def start(self) -> None:
        await self.senders.start()
        await super().start()

    async def stop(self) -> None:
        await self.life.close()
        for job in list(self.jobs.values()):
            await self._perform(self.core.drop(job, AbortReason.SHUTDOWN))
        await self.kv_clients.close()
        await self.local_clients.close()
        await super().stop()

    # ---- admission -------------------------------------------------------------------
    async def submit(self, msg: PrefillSubmit, raw) -> None:
        if (error := submit_error(msg)) is not None:
            await respond(raw, SubmitReply(ok=False, error=error))
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
        self.core.admit(job)
        try:
            await self.engine_loop.call(self.exporter.admit, msg.rid, msg.prompt_ids, msg.params, local)
        except (EngineError, TimeoutError) as e:
            self.core.refused(job)
            if isinstance(e, TimeoutError):  # an admit that was already running still lands: free it after
                self.life.spawn(self.engine_loop.call(self._free_request, msg.rid, must_run=True))
            job.compute_span.end()
            await respond(raw, SubmitReply(ok=False, error=str(e)))
            return
        await self._perform(self.core.admitted(job))
        self.life.spawn(self._watch(job))
        await respond(raw, SubmitReply(ok=True, instance=self.settings.instance, epoch=self.presence.epoch))

    # ---- events in, the core's actions performed ----------------------------------------
    async def on_md_target(self, msg: MainDecodeTarget, raw) -> None:
        await self._perform(self.core.md_target(msg))

    async def on_outputs(self, outputs: list[StepOutput], exports: list[BlockExport] | None) -> None:
        for out in outputs:  # the first token is out: its compute is done
            job = self.jobs.get(out.rid)
            if job is not None and job.compute_span and out.token_id is not None:
                job.compute_span.end()
        await self._perform(self.core.outputs(outputs, exports))

    async def stream_acked(self, job: PrefillJob, path: KVPath, traceparent: str | None) -> None:
        await self._perform(self.core.stream_acked(job, path, traceparent))

    async def stream_failed(self, job: PrefillJob, path: KVPath, e: Exception) -> None:
        await self._perform(self.core.stream_failed(job, path, e))

    async def stream_ended(self, job: PrefillJob, path: KVPath) -> None:
        await self._perform(self.core.stream_ended(job, path))

    async def _watch(self, job: PrefillJob) -> None:
        """Bound every request: whatever happens, it is freed after the timeout."""
        await asyncio.sleep(self.settings.request_timeout_s)
        await self._perform(self.core.timed_out(job))

    async def release_on_leaving(self, job: PrefillJob) -> None:
        await self._perform(self.core.fail(job, "prefill is leaving"))

    async def on_abort_message(self, msg: Abort, source: Role) -> None:
        actions = self.core.abort(msg)
        if actions:
            attrs = {REQUEST_ID_ATTR: msg.rid, "reason": msg.reason.value}
            with self.tracer.start_as_current_span(msg.reason.span_name, attributes=attrs):
                await self._perform(actions)

    async def on_md_lost(self, msg: MainDecodeLost, raw) -> None:
        await self._perform(self.core.md_lost(msg))

    async def _perform(self, actions: list[Action]) -> None:
        """What the core decided, in order."""
        for action in actions:
            if isinstance(action, SENT):
                await perform_sent(self, action)
            elif isinstance(action, StartStream):
                job, path = action.job, action.path
                queue = job.local_queue if path is KVPath.LOCAL else job.md_queue
                assert queue is not None
                self.streams.start(job, path, action.address, queue)
            elif isinstance(action, CancelStream):
                await self._cancel(action.job, action.path, action.reason)
            elif isinstance(action, ExportTarget):
                export = await self.engine_loop.call(self.exporter.target, action.job.rid, action.missing)
                if export is not None:
                    action.job.queue_blocks(export)
            elif isinstance(action, Free):
                await self._release(action.job)
            elif isinstance(action, ReportRefused):
                fault = identity_fault.fault_of(
                    action.refused, Role.MAIN_DECODE, action.job.md_instance, self.settings.instance
                )
                await identity_fault.report(self.nc, self.role, fault)

    async def _cancel(self, job: PrefillJob, path: KVPath, reason: str) -> None:
        if not await self.streams.cancel(job, path, reason):
            return  # it had ended: its own task told the core
        if path is KVPath.WAN:
            metrics.KV_TRANSFER_ABORTS.labels(reason=metrics.abort_reason(reason)).inc()
        await self._perform(self.core.stream_ended(job, path))  # a task cancelled unstarted tells nothing

    async def _release(self, job: PrefillJob) -> None:
        if not self.core.release(job):
            return
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
