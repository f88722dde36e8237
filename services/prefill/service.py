"""Prefill (P): computes what its prefix cache lacks, samples the first token, and
streams KV blocks as chunks finish — to MD over the WAN (only blocks MD lacks) and, on
P→RLD→MD, to the relay over the local path at the same time (dual path)."""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from dataclasses import dataclass, field

import torch
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Span

from shared.bus import subjects
from shared.bus.connection import publish, respond
from shared.bus.messages import (
    MD_LOST,
    P_MD,
    Abort,
    HandoffBatch,
    MDTarget,
    PrefillSubmit,
    SubmitReply,
    TokenEvent,
    load_report,
)
from shared.config import EngineSettings, PrefillSettings
from shared.engine import EngineError, FinishReason, LLMEngine, Mode, SamplingParams, StepOutput
from shared.engine.engine_loop import EngineLoop
from shared.kv import KVClient, KVClientPool, KVTransferError, LinkEstimator
from shared.runtime import Lifecycle
from shared.telemetry import metrics
from shared.telemetry.span_store import REQUEST_ID_ATTR
from shared.telemetry.tracing import get_tracer, traceparent

log = logging.getLogger(__name__)
_DONE = None  # queue sentinel: no more blocks for this destination


@dataclass
class PrefillJob:
    submit: PrefillSubmit
    params: SamplingParams
    md_missing: set[int] | None  # None until MD's target is known (engine thread sets it)
    md_address: str = ""
    md_queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    local_queue: asyncio.Queue | None = None
    exported: int = 0  # computed full blocks already handed to the senders (engine thread only)
    first_token: int | None = None
    handoff_waiting: bool = False  # P→MD: the first token waits for MD's target
    wan_bytes: int = 0
    wan_queued: int = 0  # KV bytes waiting in md_queue (reported as backlog to the router)
    senders: dict[str, asyncio.Task] = field(default_factory=dict)  # address -> sender
    clients: dict[str, KVClient] = field(default_factory=dict)  # address -> connection in use
    ctx: Context | None = None  # trace context of the router's request
    compute_span: Span | None = None

    @property
    def rid(self) -> str:
        return self.submit.rid


class PrefillService:
    def __init__(self, settings: PrefillSettings, nc, engine: LLMEngine | None = None):
        self.settings = settings
        self.nc = nc
        self.engine = engine or LLMEngine(settings.model, chunked(settings.engine, settings.prefill_chunk))
        self.loop = EngineLoop(self.engine, self._on_outputs, self._export_new_blocks)
        self.jobs: dict[str, PrefillJob] = {}  # event-loop view
        self._active: dict[str, PrefillJob] = {}  # engine-thread view (mutated only there)
        self.pool = KVClientPool(settings.secret)
        self.links = LinkEstimator()
        self._rtt_seen: weakref.WeakSet[KVClient] = weakref.WeakSet()  # connections whose RTT is counted
        self.tracer = get_tracer("prefill", settings.instance, settings.datacenter)
        self.life = Lifecycle()

    # ---- lifecycle -------------------------------------------------------------------
    async def start(self) -> None:
        self.loop.start()
        # Least-loaded choice by the router on the instance subject; the queue group serves
        # clients that do not pick an instance.
        await self.life.subscribe(
            self.nc, subjects.prefill_submit_to(self.settings.instance), PrefillSubmit, self._on_submit
        )
        await self.life.subscribe(
            self.nc, subjects.prefill_submit(), PrefillSubmit, self._on_submit, queue="prefill"
        )
        await self.life.subscribe(self.nc, subjects.all_req("abort"), Abort, self._on_abort)
        await self.life.subscribe(self.nc, subjects.all_req("md_target"), MDTarget, self._on_md_target)
        self.life.every(0.5, self._report_load)

    async def stop(self) -> None:
        await self.life.close()
        for job in list(self.jobs.values()):
            await self._drop(job, "shutdown")
        await self.pool.close()
        await self.loop.stop()

    # ---- requests --------------------------------------------------------------------
    async def _on_submit(self, msg: PrefillSubmit, raw) -> None:
        # Admission waits for the engine thread (up to one step): do it off the subscription
        # so requests arriving together are admitted together.
        self.life.spawn(self._submit(msg, raw))

    async def _submit(self, msg: PrefillSubmit, raw) -> None:
        if msg.rid in self.jobs:
            await respond(raw, SubmitReply(ok=False, error=f"duplicate request id {msg.rid}"))
            return
        try:
            params = SamplingParams.from_dict(msg.params)
            local_queue = asyncio.Queue() if msg.relay_address else None
            job = PrefillJob(msg, params, None, local_queue=local_queue, ctx=otel_context.get_current())
            job.compute_span = self.tracer.start_span(
                "prefill.compute",
                context=job.ctx,
                attributes={
                    REQUEST_ID_ATTR: msg.rid,
                    "prompt_tokens": len(msg.prompt_ids),
                    "pdd.pipeline": msg.pipeline,
                },
            )
            self.jobs[msg.rid] = job
            await self.loop.call(self._admit, job)
        except (EngineError, ValueError, TypeError) as e:
            dropped = self.jobs.pop(msg.rid, None)
            if dropped and dropped.compute_span:
                dropped.compute_span.end()
            await respond(raw, SubmitReply(ok=False, error=str(e)))
            return
        if msg.md_missing is not None:
            await self._target(job, msg.md_bulk_address, msg.md_missing)
        if job.local_queue is not None and msg.relay_address:
            job.senders[msg.relay_address] = self.life.spawn(
                self._ship(job, "local", msg.relay_address, job.local_queue)
            )
        self.life.spawn(self._watch(job))
        await respond(raw, SubmitReply(ok=True, instance=self.settings.instance))

    async def _on_md_target(self, msg: MDTarget, raw) -> None:
        job = self.jobs.get(msg.rid)
        if job is None:
            metrics.UNKNOWN_REQUEST_MESSAGES.labels(service="prefill").inc()
            return
        await self._target(job, msg.md_bulk_address, msg.md_missing)

    async def _target(self, job: PrefillJob, address: str, missing: list[int]) -> None:
        """MD's answer is in: queue what it lacks of the blocks computed so far, start the
        WAN stream, and hand the first token over if it was waiting."""
        if job.md_address or job.md_missing is not None:
            return
        hashes, kv = await self.loop.call(self._set_target, job, set(missing))
        if hashes:
            job.md_queue.put_nowait((hashes, kv))
            job.wan_queued += kv.numel() * kv.element_size()
        # No await from here to the end-of-stream check: exactly one of this and
        # _first_token closes the WAN queue, after every block.
        job.md_address = address
        if job.first_token is not None:
            job.md_queue.put_nowait(_DONE)
        job.senders[address] = self.life.spawn(self._ship(job, "wan", address, job.md_queue))
        if job.handoff_waiting:
            job.handoff_waiting = False
            await self._handoff_first_token(job)

    def _set_target(self, job: PrefillJob, missing: set[int]) -> tuple[list[int], torch.Tensor | None]:
        """Engine thread: from now on exports filter by `missing`; export what was skipped."""
        job.md_missing = missing
        done = self.engine.computed_block_hashes(job.rid)[: job.exported]
        wanted = [h for h in done if h in missing]
        return wanted, self.engine.transfer.export_blocks(wanted) if wanted else None

    def _admit(self, job: PrefillJob) -> None:  # engine thread
        self.engine.add_request(job.rid, job.submit.prompt_ids, job.params, mode=Mode.PREFILL)
        self._active[job.rid] = job

    def _end_compute(self, rid: str) -> FinishReason | None:  # engine thread
        """The first token is out: stop exporting; does the request end right there?"""
        self._active.pop(rid, None)
        return self.engine.finish_reason(rid)

    def _export_new_blocks(self, engine: LLMEngine) -> list[tuple[PrefillJob, list[int], torch.Tensor]]:
        """Engine thread, after each step: export the full blocks that just got computed."""
        out = []
        for rid, job in list(self._active.items()):
            try:
                hashes = engine.computed_block_hashes(rid)
            except EngineError:
                continue
            new = hashes[job.exported :]
            if not new:
                continue
            job.exported = len(hashes)
            md_wants = [h for h in new if job.md_missing is not None and h in job.md_missing]
            wanted = new if job.local_queue is not None else md_wants
            if wanted:
                out.append((job, wanted, engine.transfer.export_blocks(wanted)))
        return out

    async def _on_outputs(self, outputs: list[StepOutput], exports) -> None:
        for job, hashes, kv in exports or []:
            if job.local_queue is not None:
                job.local_queue.put_nowait((hashes, kv))
            idx = [i for i, h in enumerate(hashes) if job.md_missing is not None and h in job.md_missing]
            if idx:
                md_kv = kv if len(idx) == len(hashes) else kv[:, :, idx].contiguous()
                job.md_queue.put_nowait(([hashes[i] for i in idx], md_kv))
                job.wan_queued += md_kv.numel() * md_kv.element_size()
        for out in outputs:
            job = self.jobs.get(out.rid)
            if job is None:
                continue
            if out.finish_reason is FinishReason.PREFILLED and out.token_id is not None:
                await self._first_token(job, out.token_id)
            elif out.finished:  # error or abort inside the engine
                await self._fail(job, out.error or out.finish_reason or "prefill failed")

    async def _first_token(self, job: PrefillJob, token: int) -> None:
        job.first_token = token
        if job.compute_span:
            job.compute_span.set_attribute("pdd.blocks_exported", job.exported)
            job.compute_span.end()
        done_reason = await self.loop.call(self._end_compute, job.rid)
        await publish(
            self.nc,
            subjects.req_tokens(job.rid),
            TokenEvent(
                job.rid,
                "prefill",
                0,
                [token],
                finished=done_reason is not None,
                finish_reason=done_reason,
                stats={"pipeline": job.submit.pipeline} if done_reason else {},
            ),
        )
        if done_reason is not None:
            # Nothing left to decode: stop the transfers and tell MD / RLD to drop the request.
            await publish(
                self.nc, subjects.req_abort(job.rid), Abort(job.rid, "finished_at_prefill", "prefill")
            )
            await self._drop(job, "finished_at_prefill")
            return
        if job.md_address:
            job.md_queue.put_nowait(_DONE)
        if job.local_queue is not None:
            job.local_queue.put_nowait(_DONE)
        elif job.md_address:
            await self._handoff_first_token(job)
        else:
            job.handoff_waiting = True  # MD may not hold the request yet: wait for its target

    async def _handoff_first_token(self, job: PrefillJob) -> None:
        """P→MD: prefill is the only relay; it hands over its one token."""
        batch = HandoffBatch(
            job.rid, seq=0, start_index=0, tokens=[job.first_token], final=True, mode="prefill"
        )
        await publish(self.nc, subjects.req_handoff(job.rid), batch)

    # ---- transfers -------------------------------------------------------------------
    async def _ship(self, job: PrefillJob, path: str, address: str, queue: asyncio.Queue) -> None:
        """Stream one destination's blocks for one request, then wait for its ack."""
        timeout = self.settings.request_timeout_s
        meta = {}
        span = self.tracer.start_span(
            "kv.transfer",
            context=job.ctx,
            attributes={REQUEST_ID_ATTR: job.rid, "path": path, "peer": address},
        )
        t_start = time.monotonic()
        sent = 0
        try:
            client = await self.pool.acquire(address)
            job.clients[address] = client
            tp = traceparent_of(span)
            t_first = None
            while True:
                item = await asyncio.wait_for(queue.get(), timeout=timeout)
                if item is _DONE:
                    break
                hashes, kv = item
                t_first = t_first or time.monotonic()
                n = await client.send_blocks(job.rid, hashes, kv, traceparent=tp, timeout=timeout)
                sent += n
                if path == "wan":
                    job.wan_bytes += n
                    job.wan_queued = max(job.wan_queued - kv.numel() * kv.element_size(), 0)
                metrics.KV_BYTES.labels(path=path).inc(n)
            if path == "local":
                meta = {
                    "prompt_ids": job.submit.prompt_ids,
                    "first_token": job.first_token,
                    "params": job.submit.params,
                    "md_instance": job.submit.md_instance,
                    "options": job.submit.options,
                    "traceparent": tp,
                }
            await client.finish(job.rid, meta=meta, timeout=timeout)
            if path == "wan":
                self._observe_link(address, client, sent, t_first, time.monotonic())
        except asyncio.CancelledError:
            raise
        except Exception as e:  # transfer errors, timeouts, and bugs alike end the request cleanly
            if not isinstance(e, KVTransferError | TimeoutError | OSError):
                log.exception("%s transfer of %s crashed", path, job.rid)
            log.warning("%s transfer of %s to %s failed: %s", path, job.rid, address, e)
            span.set_status(trace.Status(trace.StatusCode.ERROR, str(e)))
            if path == "local" or job.submit.pipeline == P_MD:
                await self._fail(job, f"KV transfer to {path} peer failed: {e}")
            # On P→RLD→MD a WAN failure is the relay's to absorb (it finishes the request).
        finally:
            span.set_attributes({"bytes": sent, "duration_s": time.monotonic() - t_start})
            span.end()
            if address in job.clients:
                self.pool.release(job.clients[address])
            others = [t for t in job.senders.values() if t is not asyncio.current_task()]
            if all(t.done() for t in others) and job.first_token is not None and job.md_address:
                await self._release(job)

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

    async def _watch(self, job: PrefillJob) -> None:
        """Bound every request: whatever happens, it is freed after the timeout."""
        await asyncio.sleep(self.settings.request_timeout_s)
        if self.jobs.get(job.rid) is job:
            await self._fail(job, "prefill timed out")

    async def _fail(self, job: PrefillJob, error: str) -> None:
        if self.jobs.get(job.rid) is not job:
            return
        await publish(
            self.nc,
            subjects.req_tokens(job.rid),
            TokenEvent(job.rid, "prefill", 0, [], finished=True, finish_reason="error", error=error),
        )
        await publish(self.nc, subjects.req_abort(job.rid), Abort(job.rid, error, "prefill"))
        await self._drop(job, error)

    async def _on_abort(self, msg: Abort, raw) -> None:
        if msg.source == "prefill":
            return
        job = self.jobs.get(msg.rid)
        if job is not None and msg.reason == MD_LOST:
            # Only the WAN stream goes: the relay's local stream must go on.
            sender = job.senders.get(job.md_address)
            client = job.clients.get(job.md_address)
            if sender is not None and not sender.done():
                sender.cancel()
                metrics.KV_TRANSFER_ABORTS.labels(reason=MD_LOST).inc()
                if client is not None and not client.closed:
                    self.life.spawn(client.abort(job.rid, MD_LOST))
            return
        if job is not None:
            with self.tracer.start_as_current_span(
                "abort", attributes={REQUEST_ID_ATTR: msg.rid, "reason": msg.reason}
            ):
                await self._drop(job, msg.reason)

    async def _drop(self, job: PrefillJob, reason: str) -> None:
        """Cancel transfers (peers are told to drop what they got) and free the blocks."""
        for address, task in job.senders.items():
            if task.done() or task is asyncio.current_task():
                continue  # that stream completed (or is this one): nothing to abort there
            task.cancel()
            if address == job.md_address:
                metrics.KV_TRANSFER_ABORTS.labels(reason=reason.split(":")[0][:40]).inc()  # bounded label set
            client = job.clients.get(address)
            if client is not None and not client.closed:
                try:
                    await client.abort(job.rid, reason)
                except Exception as e:  # the peer may already be gone
                    log.debug("abort of %s at %s failed: %s", job.rid, address, e)
        await self._release(job)

    async def _release(self, job: PrefillJob) -> None:
        if self.jobs.pop(job.rid, None) is None:
            return
        if job.compute_span and job.compute_span.is_recording():
            job.compute_span.end()

        def free(engine: LLMEngine = self.engine) -> None:
            self._active.pop(job.rid, None)
            engine.abort(job.rid)
            engine.release(job.rid)

        await self.loop.call(free)

    # ---- reporting -------------------------------------------------------------------
    async def _report_load(self) -> None:
        stats = await self.loop.call(self.engine.stats)
        metrics.KV_BLOCKS_USED.labels(service="prefill", instance=self.settings.instance).set(
            stats.used_blocks
        )
        # Only links with measured transfers: otherwise the router keeps its configured prior.
        links: dict[str, dict] = {
            peer: {"bandwidth": info["bandwidth"], "rtt": info["rtt"]}
            for peer, info in self.links.snapshot().items()
            if info["transfers"]
        }
        for job in self.jobs.values():
            if job.md_address and job.wan_queued:
                entry = links.setdefault(job.md_address, {})
                entry["backlog"] = entry.get("backlog", 0) + job.wan_queued
        report = load_report(
            "prefill", self.settings.instance, stats, links=links, model_id=self.engine.model_id
        )
        await publish(self.nc, subjects.load("prefill", self.settings.instance), report)


def chunked(engine: EngineSettings, prefill_chunk: int) -> EngineSettings:
    """Cap the tokens per forward so KV blocks stream to the peers while the prompt is still
    being prefilled, instead of after one long forward."""
    if prefill_chunk <= 0:
        return engine
    return engine.model_copy(update={"max_batched_tokens": min(engine.max_batched_tokens, prefill_chunk)})


def traceparent_of(span: Span) -> str | None:
    with trace.use_span(span, end_on_exit=False):
        return traceparent()
