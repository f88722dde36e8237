"""The relay's handoff to MD by token IDs: one-shot, or catch-up batches (each acked by MD)
while the relay keeps decoding, then the final batch that stops decoding here. The batches
are built by pure functions of the job's progress and the tokens so far; HandoffSender does
the engine calls, the publishing and the ack deadlines."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Protocol

from opentelemetry import trace

from shared.bus import subjects
from shared.bus.delivery import deliver
from shared.bus.messages import HandoffBatch, HandoffMode, RelayReport, Role
from shared.bus.subjects import Req
from shared.config import RelaySettings
from shared.telemetry import metrics
from shared.telemetry.span_store import REQUEST_ID_ATTR

from .handoff_policy import catchup_batch_size, catchup_is_final, choose_handoff_mode
from .job import RelayJob, RelayState


def catchup_batch(job: RelayJob, tokens: list[int]) -> HandoffBatch:
    """The next catch-up batch of the output `tokens` so far; the job counts it as handed."""
    batch = tokens[job.handed : job.handed + catchup_batch_size(len(tokens), job.handed)]
    msg = HandoffBatch(job.rid, job.seq, job.handed, batch, final=False, mode=HandoffMode.CATCH_UP)
    job.handed += len(batch)
    job.seq += 1
    return msg


def final_batch(job: RelayJob, tokens: list[int]) -> tuple[HandoffBatch, RelayReport]:
    """The last batch (every token not handed yet) and the relay's report to the router."""
    mode = job.mode or HandoffMode.ONE_SHOT
    batch = HandoffBatch(job.rid, job.seq, job.handed, tokens[job.handed :], True, mode)
    report = RelayReport(
        handed_over=True,
        rld_tokens=max(len(tokens) - 1, 0),
        handoff_mode=mode,
        handoff_batches=job.seq + 1,
    )
    return batch, report


class RelayHost(Protocol):
    """What the handoff needs from the relay service."""

    async def tokens_so_far(self, rid: str, final: bool) -> list[int] | None:
        """The output tokens (None once finished); on the final batch decoding also stops."""

    async def running(self) -> int:
        """Requests the relay's engine is running."""

    async def handed(self, job: RelayJob, index: int, report: RelayReport) -> None:
        """The final batch is out: MD owns the request."""

    async def lost_after_stop(self, job: RelayJob) -> None:
        """MD gave up while decoding stopped for the final batch."""

    async def go_solo(self, job: RelayJob, why: str) -> None:
        """MD is out of the picture: the relay finishes the request."""


class HandoffSender:
    def __init__(
        self,
        settings: RelaySettings,
        nc: object,
        tracer: trace.Tracer,
        spawn: Callable[[Awaitable], asyncio.Task],
        jobs: Mapping[str, RelayJob],
        host: RelayHost,
    ):
        self.settings, self.nc, self.tracer, self.spawn = settings, nc, tracer, spawn
        self.jobs, self.host = jobs, host

    async def start(self, job: RelayJob) -> None:
        """MD's kv_ready came: pick the mode, then send the first (or only) batch."""
        job.handoff_at = time.monotonic()
        tokens = await self.host.tokens_so_far(job.rid, False)
        if tokens is None:
            return  # finished in the meantime: the output path handles it
        running = await self.host.running()
        if not job.state.is_in(RelayState.HANDING_OFF):
            return  # MD gave up meanwhile: the relay finishes the request
        job.mode = choose_handoff_mode(
            len(tokens), running, job.catchup_threshold, self.settings.catchup_load
        )
        if job.mode is HandoffMode.ONE_SHOT:
            await self._send_final(job)
        else:
            await self._send_batch(job, tokens)

    def acked(self, job: RelayJob, seq: int) -> None:
        """MD applied batch `seq`: the latest one starts the next round."""
        if job.state.is_in(RelayState.HANDING_OFF) and seq == job.seq - 1 and seq > job.acked:
            job.acked = seq  # a repeated ack starts no second round
            self.spawn(self._continue_catchup(job))

    async def _send_batch(self, job: RelayJob, tokens: list[int]) -> None:
        msg = catchup_batch(job, tokens)
        await self._publish(job, msg)
        job.timers.append(self.spawn(self._ack_deadline(job, msg.seq)))

    async def _send_final(self, job: RelayJob) -> None:
        tokens = await self.host.tokens_so_far(job.rid, True)
        if tokens is None:
            return
        if not job.state.is_in(RelayState.HANDING_OFF):  # MD gave up while decoding stopped
            await self.host.lost_after_stop(job)
            return
        job.state.to(RelayState.HANDED)
        batch, report = final_batch(job, tokens)
        await self._publish(job, batch)
        if job.handoff_at is not None:
            metrics.HANDOFF_SECONDS.labels(mode=batch.mode.value).observe(time.monotonic() - job.handoff_at)
        await self.host.handed(job, len(tokens), report)

    async def _publish(self, job: RelayJob, batch: HandoffBatch) -> None:
        metrics.HANDOFF_BATCHES.labels(mode=batch.mode.value).inc()
        ctx = trace.set_span_in_context(job.span) if job.span else None
        attrs = {
            REQUEST_ID_ATTR: job.rid,
            "mode": batch.mode.value,
            "seq": batch.seq,
            "tokens": len(batch.tokens),
            "final": batch.final,
        }
        with self.tracer.start_as_current_span("relay.handoff_batch", context=ctx, attributes=attrs):
            self.spawn(
                deliver(self.nc, subjects.to_instance(Role.MAIN_DECODE, job.md_instance, Req.HANDOFF), batch)
            )

    async def _continue_catchup(self, job: RelayJob) -> None:
        tokens = await self.host.tokens_so_far(job.rid, False)
        if tokens is None:
            return
        if not job.state.is_in(RelayState.HANDING_OFF):
            return  # MD gave up meanwhile: the relay finishes the request
        pending = len(tokens) - job.handed
        if catchup_is_final(pending, job.seq, job.catchup_threshold, self.settings.catchup_max_rounds):
            await self._send_final(job)
        else:
            await self._send_batch(job, tokens)

    async def _ack_deadline(self, job: RelayJob, seq: int) -> None:
        await asyncio.sleep(self.settings.md_ready_timeout_s)
        if self.jobs.get(job.rid) is job and job.state.is_in(RelayState.HANDING_OFF) and job.seq - 1 == seq:
            await self.host.go_solo(job, "MD did not acknowledge the handoff")
