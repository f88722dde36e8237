"""Main decode's sink for prompt KV from prefill (the bulk channel over the WAN; the RDMA path's
receiver, rdma_receiver.py, reports its blocks here too): blocks of a prepared
request go into the cache pinned for it, idempotently by block hash (after a dropped connection
prefill sends every block again); once all it lacked are in, the request is READY for its
handoff batches.

A prefix crosses the WAN once: a block already on its way for another request is not asked
for again (shared/engine/in_flight.py). The request waits for that transfer's copy and pins it
as it lands; if that transfer ends without it, or stops making progress, the extend pass computes it."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Protocol

import torch
from opentelemetry import trace

from shared.engine import Engine
from shared.engine.in_flight import BlocksInFlight
from shared.kv.codec import wire_nbytes, wire_ratio
from shared.serving.engine_loop import EngineLoop
from shared.telemetry import metrics
from shared.telemetry.span_store import REQUEST_ID_ATTR
from shared.telemetry.tracing import context_from_traceparent

from .job import MainDecodeJob, MainDecodeState


class IntakeEvents(Protocol):
    """What the intake tells the service."""

    async def take_back(self, job: MainDecodeJob, hashes: list[int]) -> None:
        """These blocks came over TCP: the RDMA slots offered for them are free again."""

    async def kv_complete(self, job: MainDecodeJob) -> None:
        """The prompt KV is all in: the request is ready for its handoff batches."""

    async def kv_abandoned(self, job: MainDecodeJob, reason: str) -> None:
        """The sender gave up before the KV was complete (`reason`: the sender's)."""


class PromptKVIntake:
    def __init__(
        self,
        jobs: Mapping[str, MainDecodeJob],
        engine_loop: EngineLoop,
        engine: Engine,
        tracer: trace.Tracer,
        events: IntakeEvents,
        share_in_flight: bool = True,
    ):
        self.jobs, self.engine_loop, self.engine = jobs, engine_loop, engine
        self.tracer, self.events, self.share_in_flight = tracer, events, share_in_flight
        self.in_flight = BlocksInFlight()

    def claim(self, rid: str, lacking: list[int]) -> list[int]:
        """Of the prompt blocks `rid` lacks, those its own transfer must bring: the rest are on
        their way for other requests already, and it waits for them."""
        if not self.share_in_flight:
            return lacking
        carry, _waited_for = self.in_flight.claim(rid, lacking)
        return carry

    def receiving_job(self, rid: str) -> MainDecodeJob | None:
        job = self.jobs.get(rid)
        return job if job is not None and job.state.is_in(MainDecodeState.RECEIVING) else None

    async def received(
        self, job: MainDecodeJob, hashes: list[int], nbytes: int, traceparent: str | None, transport: str
    ) -> None:
        """Blocks of the request are cached and pinned for it (over TCP or RDMA): those that
        others wait for are theirs too."""
        if job.receive_span is None:  # parented by prefill's transfer span
            job.receive_span = self.tracer.start_span(
                "md.kv_receive",
                context=context_from_traceparent(traceparent),
                attributes={REQUEST_ID_ATTR: job.rid, "path": "wan", "transport": transport},
            )
        job.received.update(hashes)
        job.wan_bytes += nbytes
        job.last_block_at = time.monotonic()
        await self._share(self.in_flight.landed(job.rid, hashes), lost=False)

    async def dropped(self, job: MainDecodeJob) -> None:
        """The request ended: what its transfer still owed others is lost to them."""
        await self._share(self.in_flight.dropped(job.rid), lost=True)

    async def expire_waits(self, now: float, stall_s: float) -> None:
        """A request whose own KV is in stops waiting for others' blocks once no transfer that
        carries them has landed a block for stall_s (a carrier whose sender never got its
        target, say, and whose abort was lost); a slow transfer that progresses is waited for."""
        for job in list(self.jobs.values()):
            if job.kv_sent_at is None or not (waiting := self.in_flight.waiting(job.rid)):
                continue
            carriers = {self.in_flight.carrier[h] for h in waiting if h in self.in_flight.carrier}
            moved = max((self._last_progress(c) for c in carriers), default=0.0)
            if now - max(moved, job.kv_sent_at) > stall_s:
                await self._share({job.rid: self.in_flight.stop_waiting(job.rid)}, lost=True)

    def _last_progress(self, rid: str) -> float:
        """When the carrier `rid` last landed a block (or was prepared); 0 if it is gone."""
        job = self.jobs.get(rid)
        return 0.0 if job is None else (job.last_block_at or job.created)

    async def _share(self, resolved: dict[str, list[int]], lost: bool) -> None:
        """Waiting requests got the blocks they waited for (`lost`: they will not come)."""
        for rid, hashes in resolved.items():
            landed, gone = ([], hashes) if lost else (hashes, [])
            pinned = await self.engine_loop.call(self.engine.share, rid, landed, gone, must_run=True)
            job = self.jobs.get(rid)
            if job is None:
                continue
            job.computed_blocks += len(hashes) - len(pinned)
            metrics.KV_BLOCKS_SHARED_IN_FLIGHT.labels(outcome="landed").inc(len(pinned))
            metrics.KV_BLOCKS_SHARED_IN_FLIGHT.labels(outcome="computed").inc(len(hashes) - len(pinned))
            await self._ready_if_complete(job)

    def _receiving(self, rid: str) -> MainDecodeJob:
        job = self.jobs.get(rid)
        if job is None:
            raise KeyError(f"unknown request id {rid}")
        if not job.state.is_in(MainDecodeState.RECEIVING):
            raise ValueError(f"request {rid} is not receiving KV ({job.state.state.name})")
        return job

    async def on_blocks(self, rid: str, hashes: list[int], kv: torch.Tensor, traceparent: str | None) -> None:
        """Idempotent by block hash: after a dropped connection prefill sends every block again,
        and a block this request already holds is skipped (even once its KV is complete)."""
        job = self.jobs.get(rid)
        if job is None:
            raise KeyError(f"unknown request id {rid}")
        if not set(hashes) <= job.missing:
            raise ValueError(f"request {rid}: unexpected blocks")
        fresh = [i for i, h in enumerate(hashes) if h not in job.received]
        if not fresh:
            return
        job = self._receiving(rid)
        ratio = wire_ratio(kv)  # a lossy WAN codec's, read before kv is sliced
        if len(fresh) < len(hashes):
            hashes, kv = [hashes[i] for i in fresh], kv[:, :, fresh]
        await self.events.take_back(job, hashes)  # sent over TCP instead of into their RDMA slots
        await self.engine_loop.call(self.engine.import_blocks, hashes, kv, pin=rid)
        await self.received(job, hashes, wire_nbytes(kv, ratio), traceparent, "tcp")

    async def on_done(self, rid: str, payload: bytes) -> None:
        job = self.jobs.get(rid)
        if job is not None and not job.state.is_in(MainDecodeState.RECEIVING):
            return  # again after a dropped connection lost the ack: the first one was applied
        job = self._receiving(rid)
        lacking = job.missing - job.received
        if lacking:
            raise ValueError(f"request {rid}: {len(lacking)} prompt blocks never arrived")
        if job.kv_sent_at is None:
            job.kv_sent_at = time.monotonic()
        await self._ready_if_complete(job)

    async def _ready_if_complete(self, job: MainDecodeJob) -> None:
        """READY once its own transfer is done and nothing it waits for is still in flight."""
        if not job.state.is_in(MainDecodeState.RECEIVING) or job.kv_sent_at is None:
            return
        if self.in_flight.waiting(job.rid):
            return
        if job.receive_span:
            attrs = {
                "bytes": job.wan_bytes,
                "blocks": len(job.received),
                "computed_blocks": job.computed_blocks,
            }
            job.receive_span.set_attributes(attrs)
            job.receive_span.end()
        await self.events.kv_complete(job)  # READY now (core.py)

    async def on_abort(self, rid: str, reason: str) -> None:
        """The sender aborted the transfer: drop a request whose KV never completed."""
        job = self.jobs.get(rid)
        if job is not None and job.state.is_in(MainDecodeState.RECEIVING):
            await self.events.kv_abandoned(job, reason)
