"""Main decode (MD): receives prompt KV over the WAN into its prefix cache (the
decode-side radix cache: one copy per distinct prefix), publishes what it stores and
evicts, rebuilds the KV of handed-over tokens with one extend pass per batch, then
decodes with continuous batching."""

from __future__ import annotations

import logging
import time

from opentelemetry import context as otel_context

from shared.advertise import check_advertised
from shared.bus.connection import respond
from shared.bus.messages import (
    Abort,
    AbortReason,
    HandoffBatch,
    PrepareReply,
    PrepareRequest,
    ResumeRequest,
    Role,
)
from shared.config import MainDecodeSettings
from shared.engine import Engine, EngineError, InvalidRequestError, Mode, StepOutput
from shared.engine.factory import build_engine
from shared.engine.kv_admission import Verdict
from shared.kv.refusal import PeerRefused
from shared.serving import identity_fault
from shared.serving.actions import SENT, Free, SendAbort, SendTokens, perform_sent
from shared.serving.engine_service import EngineService, advertised
from shared.telemetry import metrics
from shared.telemetry.span_store import REQUEST_ID_ATTR

from .core import Action, ApplyHandoffs, Decoding, ExtendPass, MainDecodeCore, Redelivered
from .job import Extend, MainDecodeJob
from .prepare_admission import KVAdmissionQueue, KVBusy
from .prompt_kv import PromptKVIntake
from .rdma_receiver import RdmaReceiver

log = logging.getLogger(__name__)


class MainDecodeService(EngineService):
    role = Role.MAIN_DECODE
    publishes_cache = True
    jobs: dict[str, MainDecodeJob]

    def __init__(self, settings: MainDecodeSettings, nc, engine: Engine | None = None):
        super().__init__(settings, nc, engine or build_engine(settings.model, settings.engine))
        self.kv_admission = KVAdmissionQueue(
            settings.admission_queue_max, settings.admission_wait_s, self.blocks_freed
        )
        self.core = MainDecodeCore(self.jobs, settings.instance)
        loop, engine = self.engine_loop, self.engine
        self.prompt_kv = PromptKVIntake(self.jobs, loop, engine, self.tracer, self, settings.share_in_flight)
        self.track("in_flight_blocks", lambda: len(self.prompt_kv.in_flight))
        self.track("in_flight_waiting", lambda: len(self.prompt_kv.in_flight.awaits))
        self.rdma = RdmaReceiver(settings, self.prompt_kv, loop, engine, self.life, nc)
        self.track("rdma_offered", lambda: len(self.rdma.offered))
        self.track("rdma_quarantined", lambda: len(self.rdma.quarantined))

    @classmethod
    async def preflight(cls, settings: MainDecodeSettings) -> None:
        """Exit 2 when the bulk address (or the RDMA host) MD would give prefill is loopback
        while its listener expects peers from other hosts (shared/advertise.py)."""
        await super().preflight(settings)
        bound, ok = settings.bulk_address, settings.advertise_loopback_ok
        force = "PDD_MD_ADVERTISE_LOOPBACK_OK"
        bulk = await advertised(settings, bound)
        check_advertised("main_decode", "the bulk address", bulk, bound, ok, "PDD_MD_ADVERTISE", force)
        if settings.kv_transport == "rdma" and settings.rdma.host:
            host = settings.rdma.host
            check_advertised("main_decode", "the RDMA host", host, bound, ok, "PDD_MD_RDMA__HOST", force)

    async def start(self) -> None:
        # The routers hear of a sender refused for its identity (it is set aside).
        await self.serve_kv(self.settings.bulk_address, self.prompt_kv, self._refused_kv_peer)
        await self.rdma.start(self.advertise_address)
        await super().start()
        self.life.every(1.0, self._expire)

    async def stop(self) -> None:
        await super().stop()
        self.rdma.close()

    def _refused_kv_peer(self, peer: str, refused: PeerRefused) -> None:
        fault = identity_fault.fault_of(refused, Role.PREFILL, "", self.settings.instance)
        self.life.spawn(identity_fault.report(self.nc, self.role, fault))

    # ---- prepare: which blocks must cross the WAN -------------------------------------
    async def prepare(self, msg: PrepareRequest, raw) -> None:
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
            await respond(raw, self.takes_no_part(msg))
            return
        missing = self.prompt_kv.claim(msg.rid, msg.block_hashes[have:])
        self.core.prepared(msg, missing, otel_context.get_current())
        await respond(raw, PrepareReply(ok=True, missing=missing, bulk_address=self.advertise_address))

    def takes_no_part(self, msg: PrepareRequest) -> PrepareReply:
        """Its abort came first (say the relay finished it while this prepare was on its way):
        it ended elsewhere, as when the abort comes during the wait for KV memory."""
        return PrepareReply(ok=True, bulk_address=self.advertise_address)

    async def resume(self, msg: ResumeRequest, raw) -> None:
        """The request moved here by its token IDs: no KV comes; decode from what is cached
        plus an extend over the rest."""
        job = self.core.resumed(msg, otel_context.get_current())
        if await self.admit_resumed(msg, raw, job):
            attrs = {REQUEST_ID_ATTR: msg.rid, "mode": "resume", "resumed_at": len(msg.generated)}
            job.decode_span = self.tracer.start_span("md.decode", attributes=attrs)

    async def _reserve_kv(self, msg: PrepareRequest) -> int | None:
        """Reserve the request's KV for its whole life (pin what is cached, set aside blocks
        for the rest, promise room for its tokens), so its import and decode never run out;
        while the pool is promised to others, wait in line. Returns how many prompt blocks
        are cached, or None if the request was aborted meanwhile."""
        need = self.engine.lifetime_blocks(len(msg.prompt_ids), msg.params)
        pool_blocks = self.engine_loop.stats.num_blocks
        if need > pool_blocks:
            raise InvalidRequestError(
                f"prompt plus max_tokens needs up to {need} KV blocks ({need * self.engine.block_size} tokens) "
                f"but main decode's whole KV pool holds {pool_blocks} blocks "
                f"({pool_blocks * self.engine.block_size} tokens): shorten the prompt or max_tokens"
            )

        async def attempt() -> int | None:
            verdict, have = await self.engine_loop.call(self.engine.reserve, msg.rid, msg.block_hashes, need)
            return have if verdict is Verdict.ADMIT else None

        return await self.kv_admission.admit(msg.rid, attempt, lambda: self.unpin(msg.rid))

    # ---- events in, the core's actions performed ----------------------------------------
    async def take_back(self, job: MainDecodeJob, hashes: list[int]) -> None:
        await self.rdma.take_back(job.rid, hashes)  # sent over TCP instead of into their RDMA slots

    async def kv_complete(self, job: MainDecodeJob) -> None:
        await self._perform(self.core.kv_complete(job))

    async def kv_abandoned(self, job: MainDecodeJob, reason: str) -> None:
        await self._perform(self.core.kv_abandoned(job, reason))

    async def on_handoff(self, msg: HandoffBatch, raw) -> None:
        await self._perform(self.core.handoff(msg, otel_context.get_current()))

    async def _drain_handoffs(self, job: MainDecodeJob) -> None:
        """Apply the batches the job says are due, one extend pass each."""
        while actions := self.core.next_extend(job):
            await self._perform(actions)

    async def request_outputs(self, job: MainDecodeJob, outs: list[StepOutput]) -> None:
        await self._perform(self.core.outputs(job, outs))

    async def on_abort_message(self, msg: Abort, source: Role) -> None:
        self.kv_admission.cancel(msg.rid)
        await self._perform(self.core.abort(msg))

    async def release_on_leaving(self, job: MainDecodeJob) -> None:
        await self._perform(self.core.fail(job, "main decode is leaving"))

    async def _expire(self) -> None:
        """No request outlives the timeout; nor waits for others' blocks that stopped coming."""
        now = time.monotonic()
        await self.prompt_kv.expire_waits(now, self.settings.shared_kv_stall_s)
        await self._perform(self.core.expire(now, self.settings.request_timeout_s))

    async def _perform(self, actions: list[Action]) -> None:
        """What the core decided, in order."""
        for action in actions:
            if isinstance(action, SendAbort) and action.reason is AbortReason.FAILED:
                log.warning("request %s failed on MD: %s", action.rid, action.detail)
            if isinstance(action, SendTokens):
                metrics.OUTPUT_TOKENS.labels(role=self.role.value).inc(len(action.event.tokens))
            if isinstance(action, SENT):
                await perform_sent(self, action)
            elif isinstance(action, ApplyHandoffs):
                if action.spawn:  # keep this subscription free for other requests
                    self.life.spawn(self._drain_handoffs(action.job))
                else:
                    await self._drain_handoffs(action.job)
            elif isinstance(action, ExtendPass):
                await self._extend(action.job, action.step)
            elif isinstance(action, Decoding):
                attrs = {REQUEST_ID_ATTR: action.job.rid, "mode": action.mode.value}
                action.job.decode_span = self.tracer.start_span(
                    "md.decode", context=action.job.ctx, attributes=attrs
                )
            elif isinstance(action, Redelivered):
                batch = action.batch
                metrics.HANDOFF_BATCHES_DROPPED.labels(reason=action.why).inc()
                log.warning(
                    "request %s: %s handoff batch %d dropped (next %d)",
                    batch.rid,
                    action.why,
                    batch.seq,
                    action.next_seq,
                )
            elif isinstance(action, Free):
                await self._drop(action.job)

    async def _extend(self, job: MainDecodeJob, step: Extend) -> None:
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
                await self.engine_loop.call(apply_batch, self.engine, job.req, batch, step.first)
        except EngineError as e:
            await self._perform(self.core.fail(job, f"extend failed: {e}"))
            return
        await self._perform(self.core.extended(job, batch))

    async def _drop(self, job: MainDecodeJob) -> None:
        if not self.core.forget(job):
            return
        job.end_spans()
        self.rdma.forget(job.rid)
        await self.prompt_kv.dropped(job)
        await self.free(job.rid)


def apply_batch(engine: Engine, req: PrepareRequest, batch: HandoffBatch, first: bool) -> None:
    """Engine thread: the first handoff batch adds the request (held until the final one),
    the next ones extend it."""
    if first:
        mode = Mode.GENERATE if batch.final else Mode.HOLD
        tokens = req.prompt_ids + batch.tokens
        engine.add_request(req.rid, tokens, req.params, num_prompt_tokens=len(req.prompt_ids), mode=mode)
    else:
        engine.extend(req.rid, batch.tokens, final=batch.final)
