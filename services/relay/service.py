"""Relay decode (RLD): decodes as soon as its local KV copy lands and streams eager
tokens while MD's copy crosses the WAN; on MD's kv_ready it hands over by token IDs
(one-shot or catch-up) and frees the request. If MD never gets ready, or the request
ends first (the anomalous-traffic filter), it finishes the request itself and stops the
WAN transfer."""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from dataclasses import dataclass, field

import torch
from opentelemetry import trace
from opentelemetry.trace import Span

from shared.bus import subjects
from shared.bus.connection import publish
from shared.bus.messages import (
    MD_LOST,
    RLD_ONLY,
    Abort,
    HandoffAck,
    HandoffBatch,
    KVReady,
    TokenEvent,
    load_report,
)
from shared.config import RelaySettings
from shared.engine import EngineError, LLMEngine, SamplingParams, StepOutput
from shared.engine.engine_loop import EngineLoop
from shared.engine.outputs import group_by_request
from shared.kv import KVServer, start_kv_server
from shared.runtime import Lifecycle
from shared.telemetry import metrics
from shared.telemetry.span_store import REQUEST_ID_ATTR
from shared.telemetry.tracing import context_from_traceparent, get_tracer

from .handoff_policy import CATCH_UP, ONE_SHOT, catchup_is_final, choose_handoff_mode

log = logging.getLogger(__name__)

RELAYING, HANDING_OFF, HANDED, SOLO = "relaying", "handing-off", "handed", "solo"
EARLY_READY_MAX = 1024


@dataclass
class RelayJob:
    rid: str
    state: str = RELAYING
    mode: str | None = None
    handed: int = 0  # output tokens already sent to MD
    seq: int = 0  # next handoff batch number (= catch-up rounds done, before the final one)
    produced: int = 0  # tokens this relay generated (the first one came from prefill)
    timers: list[asyncio.Task] = field(default_factory=list)
    catchup_threshold: int = 64
    span: Span | None = None  # relay.decode: from the local KV landing to handoff or finish


class RelayService:
    def __init__(self, settings: RelaySettings, nc, engine: LLMEngine | None = None):
        self.settings = settings
        self.nc = nc
        self.engine = engine or LLMEngine(settings.model, settings.engine)
        self.loop = EngineLoop(self.engine, self._on_outputs)
        self.jobs: dict[str, RelayJob] = {}
        self.early_ready: OrderedDict[str, None] = OrderedDict()  # kv_ready that beat the local KV
        self.tracer = get_tracer("relay", settings.instance, settings.datacenter)
        self.kv_server: KVServer | None = None
        self.life = Lifecycle()

    async def start(self) -> None:
        self.loop.start()
        self.kv_server = await start_kv_server(self.settings.local_address, self.settings.secret, self)
        for subject, cls, handler in [
            (subjects.all_req("kv_ready"), KVReady, self._on_kv_ready),
            (subjects.all_req("handoff_ack"), HandoffAck, self._on_ack),
            (subjects.all_req("abort"), Abort, self._on_abort),
        ]:
            await self.life.subscribe(self.nc, subject, cls, handler)
        self.life.every(0.5, self._report_load)

    async def stop(self) -> None:
        await self.life.close()
        if self.kv_server:
            await self.kv_server.close()
        await self.loop.stop()

    # ---- KV sink (local fast path from prefill) ----------------------------------------
    async def on_blocks(self, rid: str, hashes: list[int], kv: torch.Tensor, meta: dict) -> None:
        await self.loop.call(self.engine.transfer.import_blocks, hashes, kv, pin=rid)

    async def on_done(self, rid: str, meta: dict) -> None:
        """All prompt blocks are here: start decoding after prefill's first token."""
        prompt, first = list(meta["prompt_ids"]), int(meta["first_token"])
        params = SamplingParams.from_dict(meta["params"])
        job = RelayJob(rid, catchup_threshold=self.settings.catchup_threshold)
        override = (meta.get("options") or {}).get("catchup_threshold")
        if isinstance(override, int) and override > 0:
            job.catchup_threshold = override
        job.span = self.tracer.start_span(
            "relay.decode",
            context=context_from_traceparent(meta.get("traceparent")),
            attributes={REQUEST_ID_ATTR: rid, "prompt_tokens": len(prompt)},
        )
        self.jobs[rid] = job
        await self.loop.call(
            self.engine.add_request, rid, prompt + [first], params, num_prompt_tokens=len(prompt)
        )
        job.timers.append(self.life.spawn(self._md_deadline(job)))
        if self.early_ready.pop(rid, 0) is None:
            job.state = HANDING_OFF
            await self._start_handoff(job)

    async def on_abort(self, rid: str, reason: str) -> None:
        if rid not in self.jobs:  # stream aborted before decoding began: just unpin
            await self.loop.call(self.engine.transfer.unpin, rid)

    # ---- decoding ----------------------------------------------------------------------
    async def _on_outputs(self, outputs: list[StepOutput], _extra) -> None:
        for rid, outs in group_by_request(outputs).items():
            job = self.jobs.get(rid)
            if job is None:
                continue
            if job.produced == 0:
                await self.loop.call(self.engine.transfer.unpin, rid)  # the sequence holds its blocks now
            toks = [o.token_id for o in outs if o.token_id is not None]
            last = outs[-1]
            job.produced += len(toks)
            metrics.OUTPUT_TOKENS.labels(role="relay").inc(len(toks))
            event = TokenEvent(rid, "relay", outs[0].index if outs[0].index is not None else 0, toks)
            if last.finished:
                event.finished = True
                event.finish_reason = last.finish_reason
                event.error = last.error
                if job.state in (RELAYING, HANDING_OFF, SOLO):
                    # The relay finished the request before (or while) handing over: MD and
                    # the WAN transfer stop; this is the anomalous-traffic filter at work.
                    event.stats = {"pipeline": RLD_ONLY, "rld_tokens": job.produced}
                    await self._abort_others(job, "relay_finished", "relay")
                await publish(self.nc, subjects.req_tokens(rid), event)
                self._forget(job)
            elif toks:
                await publish(self.nc, subjects.req_tokens(rid), event)

    # ---- handoff -----------------------------------------------------------------------
    async def _on_kv_ready(self, msg: KVReady, raw) -> None:
        job = self.jobs.get(msg.rid)
        if job is None:
            self.early_ready[msg.rid] = None
            if len(self.early_ready) > EARLY_READY_MAX:  # only seconds matter: drop the oldest
                self.early_ready.popitem(last=False)
            return
        if job.state == RELAYING:
            job.state = HANDING_OFF  # claimed now, so a duplicate kv_ready cannot start a second handoff
            self.life.spawn(self._start_handoff(job))

    async def _start_handoff(self, job: RelayJob) -> None:
        tokens = await self.loop.call(self._snapshot, job.rid, False)
        if tokens is None:
            return  # finished in the meantime: the output path handles it
        running = (await self.loop.call(self.engine.stats)).running
        job.mode = choose_handoff_mode(
            len(tokens), running, job.catchup_threshold, self.settings.catchup_load
        )
        if job.mode == ONE_SHOT:
            await self._send_final(job)
        else:
            await self._send_batch(job, tokens)

    def _snapshot(self, rid: str, final: bool) -> list[int] | None:
        """Engine thread: the output tokens so far; on the final batch also stop decoding."""
        try:
            tokens = self.engine.generated_token_ids(rid)
        except (EngineError, KeyError):
            return None
        if final:
            self.engine.abort(rid)
            self.engine.transfer.unpin(rid)
        return tokens

    async def _send_batch(self, job: RelayJob, tokens: list[int]) -> None:
        # Keep the newest token back: the final batch must carry at least one token so MD
        # has logits to sample from after its extend pass.
        batch = tokens[job.handed : len(tokens) - 1]
        msg = HandoffBatch(job.rid, job.seq, job.handed, batch, final=False, mode=CATCH_UP)
        job.handed += len(batch)
        job.seq += 1
        metrics.HANDOFF_BATCHES.labels(mode=CATCH_UP).inc()
        await self._publish_batch(job, msg)
        job.timers.append(self.life.spawn(self._ack_deadline(job, msg.seq)))

    async def _send_final(self, job: RelayJob) -> None:
        tokens = await self.loop.call(self._snapshot, job.rid, True)
        if tokens is None:
            return
        job.state = HANDED
        batch = HandoffBatch(
            job.rid, job.seq, job.handed, tokens[job.handed :], final=True, mode=job.mode or ONE_SHOT
        )
        metrics.HANDOFF_BATCHES.labels(mode=batch.mode).inc()
        await self._publish_batch(job, batch)
        stats = {
            "handoff_mode": job.mode,
            "rld_tokens": max(len(tokens) - 1, 0),
            "handoff_batches": job.seq + 1,
        }
        await publish(
            self.nc, subjects.req_tokens(job.rid), TokenEvent(job.rid, "relay", len(tokens), [], stats=stats)
        )
        self._forget(job)

    async def _publish_batch(self, job: RelayJob, batch: HandoffBatch) -> None:
        ctx = trace.set_span_in_context(job.span) if job.span else None
        attrs = {
            REQUEST_ID_ATTR: job.rid,
            "mode": batch.mode,
            "seq": batch.seq,
            "tokens": len(batch.tokens),
            "final": batch.final,
        }
        with self.tracer.start_as_current_span("relay.handoff_batch", context=ctx, attributes=attrs):
            await publish(self.nc, subjects.req_handoff(job.rid), batch)

    async def _on_ack(self, msg: HandoffAck, raw) -> None:
        job = self.jobs.get(msg.rid)
        if job is None or job.state != HANDING_OFF or msg.seq != job.seq - 1:
            return
        self.life.spawn(self._continue_catchup(job, msg))

    async def _continue_catchup(self, job: RelayJob, msg: HandoffAck) -> None:
        if not msg.ok:
            await self._go_solo(job, f"MD rejected handoff: {msg.error}")
            return
        tokens = await self.loop.call(self._snapshot, job.rid, False)
        if tokens is None:
            return
        pending = len(tokens) - job.handed
        if catchup_is_final(pending, job.seq, job.catchup_threshold, self.settings.catchup_max_rounds):
            await self._send_final(job)
        else:
            await self._send_batch(job, tokens)

    # ---- faults ------------------------------------------------------------------------
    async def _md_deadline(self, job: RelayJob) -> None:
        await asyncio.sleep(self.settings.md_ready_timeout_s)
        if self.jobs.get(job.rid) is job and job.state == RELAYING:
            await self._go_solo(job, "MD not ready in time")

    async def _ack_deadline(self, job: RelayJob, seq: int) -> None:
        await asyncio.sleep(self.settings.md_ready_timeout_s)
        if self.jobs.get(job.rid) is job and job.state == HANDING_OFF and job.seq - 1 == seq:
            await self._go_solo(job, "MD did not acknowledge the handoff")

    async def _go_solo(self, job: RelayJob, reason: str) -> None:
        """Fault fallback: MD is out of the picture; the relay finishes the request."""
        log.warning("request %s: %s; relay finishes it", job.rid, reason)
        job.state = SOLO
        await self._abort_others(job, reason, "relay-fallback")

    async def _abort_others(self, job: RelayJob, reason: str, source: str) -> None:
        """Tell P and MD to drop the request (the relay keeps or ends it itself)."""
        ctx = trace.set_span_in_context(job.span) if job.span else None
        with self.tracer.start_as_current_span(
            "abort", context=ctx, attributes={REQUEST_ID_ATTR: job.rid, "reason": reason}
        ):
            await publish(self.nc, subjects.req_abort(job.rid), Abort(job.rid, reason, source))

    async def _on_abort(self, msg: Abort, raw) -> None:
        if msg.source.startswith("relay"):
            return
        job = self.jobs.get(msg.rid)
        if job is None:
            await self.loop.call(self.engine.transfer.unpin, msg.rid)
            return
        if (msg.source == "main_decode" or msg.reason == MD_LOST) and job.state in (RELAYING, HANDING_OFF):
            await self._go_solo(job, f"MD gave up: {msg.reason}")
            return
        if job.state == HANDED:
            return
        self._forget(job)
        await self.loop.call(self._free, msg.rid)

    def _free(self, rid: str) -> None:
        self.engine.abort(rid)
        self.engine.transfer.unpin(rid)

    def _forget(self, job: RelayJob) -> None:
        if self.jobs.get(job.rid) is job:
            del self.jobs[job.rid]
        if job.span and job.span.is_recording():
            job.span.set_attributes({"rld_tokens": job.produced, "state": job.state, "mode": job.mode or ""})
            job.span.end()
        for t in job.timers:
            if t is not asyncio.current_task():
                t.cancel()

    async def _report_load(self) -> None:
        stats = await self.loop.call(self.engine.stats)
        metrics.RELAY_RUNNING.set(stats.running)
        metrics.KV_BLOCKS_USED.labels(service="relay", instance=self.settings.instance).set(
            stats.used_blocks
        )
        report = load_report(
            "relay",
            self.settings.instance,
            stats,
            address=self.kv_server.address if self.kv_server else None,
            model_id=self.engine.model_id,
        )
        await publish(self.nc, subjects.load("relay", self.settings.instance), report)
