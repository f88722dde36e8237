"""The router's request life: route, prepare MD, submit to P, merge indexed tokens."""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Span, Status, StatusCode

from shared.bus import subjects
from shared.bus.connection import publish, request
from shared.bus.messages import (
    Abort,
    AbortReason,
    KVEvents,
    LoadReport,
    MainDecodeLost,
    MDTarget,
    Outcome,
    Pipeline,
    PrefillSubmit,
    PrepareReply,
    PrepareRequest,
    Role,
    SubmitReply,
    TokenEvent,
)
from shared.bus.subjects import Req
from shared.config import RouterSettings
from shared.engine import SamplingParams, block_hashes
from shared.runtime import Lifecycle
from shared.telemetry import metrics
from shared.telemetry.span_store import REQUEST_ID_ATTR
from shared.telemetry.tracing import get_tracer

from .errors import APIError
from .merger import TokenMerger
from .policy import RouteDecision, choose_least_loaded, choose_main_decode, choose_pipeline
from .prefix_index import PrefixIndex
from .registry import Registry
from .request_stream import Delta, RequestStream, StreamState
from .schemas import PddOptions

log = logging.getLogger(__name__)


class RouterCore:
    def __init__(self, settings: RouterSettings, nc, *, model_id: str, block_size: int, kv_bytes_per_token: int):
        self.settings = settings
        self.nc = nc
        self.model_id = model_id
        self.block_size = block_size
        self.kv_bytes_per_token = kv_bytes_per_token
        self.index = PrefixIndex()
        self.registry = Registry()
        self.streams: dict[str, RequestStream] = {}
        self.tracer = get_tracer("router", settings.instance, settings.datacenter)
        self.life = Lifecycle()

    async def start(self) -> None:
        await self.life.subscribe(self.nc, subjects.all_req(Req.TOKENS), TokenEvent, self._on_tokens)
        await self.life.subscribe(self.nc, subjects.all_kv_events(), KVEvents, self._on_kv_events)
        await self.life.subscribe(self.nc, subjects.all_load(), LoadReport, self._on_load)
        self.life.every(1.0, self._watch_main_decode)

    async def stop(self) -> None:
        await self.life.close()
        for rid in list(self.streams):
            await self.abort(rid, AbortReason.ROUTER_SHUTDOWN)

    def ready(self) -> dict[str, int]:
        return {role.value: len(self.registry.alive(role)) for role in (Role.PREFILL, Role.RELAY, Role.MAIN_DECODE)}

    # ---- inbound events ----------------------------------------------------------------
    async def _on_tokens(self, ev: TokenEvent, raw) -> None:
        stream = self.streams.get(ev.rid)
        if stream is None:
            metrics.UNKNOWN_REQUEST_MESSAGES.labels(service="router").inc()
            return
        stream.queue.put_nowait(ev)

    async def _on_kv_events(self, ev: KVEvents, raw) -> None:
        self.index.apply(ev.instance, ev.stored, ev.evicted, ev.reset)

    async def _on_load(self, report: LoadReport, raw) -> None:
        self.registry.update(report)

    async def _watch_main_decode(self) -> None:
        """A request whose MD stopped reporting fails fast instead of waiting for a timeout,
        unless a relay still holds it: then the relay is told to finish it."""
        alive = {r.instance for r in self.registry.alive(Role.MAIN_DECODE)}
        for stream in list(self.streams.values()):
            watched = stream.state.is_in(StreamState.RELAYED, StreamState.WITH_MD)
            if watched and stream.md_instance not in alive and stream.md_lost():
                lost = MainDecodeLost(stream.rid, stream.md_instance)
                await publish(self.nc, subjects.req(stream.rid, Req.MD_LOST), lost)

    # ---- routing -----------------------------------------------------------------------
    def _link_to_md(self, md: str) -> tuple[str | None, float, float]:
        """(MD's bulk address, bandwidth B/s, RTT s): measured by prefill, else the prior."""
        report = self.registry.get(Role.MAIN_DECODE, md)
        address = report.address if report else None
        link = self.registry.link_to(address) if address else None
        bandwidth, rtt = link or (self.settings.default_bandwidth_bps, self.settings.default_rtt_s)
        metrics.WAN_BANDWIDTH.labels(peer=md).set(bandwidth)
        return address, bandwidth, rtt

    def route(self, prompt_ids: list[int], forced: Pipeline | None) -> tuple[RouteDecision, str, str | None, list[int]]:
        """(decision, MD instance, relay instance on P→RLD→MD, the prompt's block hashes)."""
        hashes = block_hashes(prompt_ids, self.block_size, self.model_id)
        mds = self.registry.loads(Role.MAIN_DECODE)
        cached = {m.instance: self.index.cached_prefix_blocks(m.instance, hashes) for m in mds}
        md = choose_main_decode(mds, cached)
        if md is None:
            raise APIError("no main-decode instance is available", 503)
        relay = choose_least_loaded(self.registry.loads(Role.RELAY))
        address, bandwidth, rtt = self._link_to_md(md)
        decision = choose_pipeline(
            len(prompt_ids), cached.get(md, 0) * self.block_size, self.kv_bytes_per_token, bandwidth, rtt,
            self.settings.wan_time_threshold_s, relay is not None,
            backlog_bytes=self.registry.wan_backlog(address) if address else 0,
        )  # fmt: skip
        if forced is not None and forced is not decision.pipeline:
            if forced is Pipeline.P_RLD_MD and relay is None:
                raise APIError("pipeline p-rld-md requested but no relay instance is available", 503)
            decision = RouteDecision(forced, decision.hit_rate, decision.missing_bytes, decision.est_wan_s)
        return decision, md, relay if decision.pipeline is Pipeline.P_RLD_MD else None, hashes

    # ---- a request ---------------------------------------------------------------------
    async def open(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        options: PddOptions | None = None,
        trace_context: Context | None = None,
    ) -> RequestStream:
        """Route and dispatch a request; `trace_context` is the caller's (W3C headers), if any."""
        if not self.registry.alive(Role.PREFILL):
            raise APIError("no prefill instance is available", 503)
        if params.seed is None:  # every instance must sample a request the same way
            params.seed = secrets.randbits(63)
        rid = f"cmpl-{uuid.uuid4().hex}"
        span = self.tracer.start_span(
            "router.request",
            context=trace_context or Context(),
            attributes={REQUEST_ID_ATTR: rid, "prompt_tokens": len(prompt_ids)},
        )
        try:
            with trace.use_span(span, end_on_exit=False):
                options = options or PddOptions()
                forced = Pipeline(options.pipeline) if options.pipeline else None
                stream = self._routed(rid, span, prompt_ids, forced, params.max_tokens)
                await self._dispatch(stream, params, options.catchup_threshold)
                return stream
        except APIError as e:
            span.set_status(Status(StatusCode.ERROR, str(e)))
            span.end()
            raise

    def _routed(
        self, rid: str, span: Span, prompt_ids: list[int], forced: Pipeline | None, max_tokens: int
    ) -> RequestStream:
        with self.tracer.start_as_current_span("router.route", attributes={REQUEST_ID_ATTR: rid}) as route_span:
            decision, md, relay, hashes = self.route(prompt_ids, forced)
            route_span.set_attributes({
                "pdd.hit_rate": decision.hit_rate, "pdd.missing_bytes": decision.missing_bytes,
                "pdd.est_wan_s": decision.est_wan_s, "pdd.pipeline": decision.pipeline.value,
                "pdd.md_instance": md, "pdd.relay_instance": relay or "",
                "pdd.bandwidth_estimate": self._link_to_md(md)[1],
            })  # fmt: skip
        stream = RequestStream(rid, prompt_ids, decision, md, hashes, relay, span=span, merger=TokenMerger(max_tokens))
        span.set_attribute("pdd.pipeline", decision.pipeline.value)
        metrics.PREFIX_HIT_RATE.observe(decision.hit_rate)
        self.streams[rid] = stream
        return stream

    async def _dispatch(self, stream: RequestStream, params: SamplingParams, catchup: int | None) -> None:
        """Ask MD (across the WAN) and P at once: prefill starts without waiting a round trip;
        MD's answer (which blocks it lacks) follows P as an MDTarget."""
        try:
            prep, reply = await asyncio.gather(self._prepare_md(stream, params), self._submit(stream, params, catchup))
            if not reply.ok:
                raise APIError(f"prefill refused the request: {reply.error}", 400, "invalid_request_error")
            if not prep.ok:
                raise APIError(f"main decode refused the request: {prep.error}", 503)
            target = MDTarget(stream.rid, prep.bulk_address, prep.missing)
            await publish(self.nc, subjects.req(stream.rid, Req.MD_TARGET), target)
            stream.dispatched()
        except Exception as e:
            stream.fail(str(e))
            await self.abort(stream.rid, AbortReason.DISPATCH_FAILED)
            if isinstance(e, APIError):
                raise
            if isinstance(e, TimeoutError):
                raise APIError("timed out dispatching the request", 503) from e
            raise APIError(f"could not dispatch the request: {e}", 503) from e  # NATS trouble

    async def _prepare_md(self, stream: RequestStream, params: SamplingParams) -> PrepareReply:
        msg = PrepareRequest(stream.rid, stream.prompt_ids, params, stream.block_hashes, stream.decision.pipeline)
        subject = subjects.md_prepare(stream.md_instance)
        return await request(self.nc, subject, msg, PrepareReply, timeout=self.settings.prepare_timeout_s)

    async def _submit(self, stream: RequestStream, params: SamplingParams, catchup: int | None) -> SubmitReply:
        relay = self.registry.get(Role.RELAY, stream.relay_instance) if stream.relay_instance else None
        msg = PrefillSubmit(stream.rid, stream.prompt_ids, params, stream.decision.pipeline,
                            relay_address=relay.address if relay else None, catchup_threshold=catchup)  # fmt: skip
        prefill = choose_least_loaded(self.registry.loads(Role.PREFILL))
        subject = subjects.prefill_submit_to(prefill) if prefill else subjects.prefill_submit()
        return await request(self.nc, subject, msg, SubmitReply, timeout=self.settings.prepare_timeout_s)

    async def deltas(self, stream: RequestStream) -> AsyncIterator[Delta]:
        """Ordered new tokens until the request finishes; raises APIError on failure."""
        try:
            while not stream.done:
                delta = self._merge(stream, await self._next_event(stream))
                if delta is not None:
                    yield delta
        except APIError as e:
            stream.fail(str(e))
            if stream.span:
                stream.span.set_status(Status(StatusCode.ERROR, str(e)))
            raise
        finally:
            self._close(stream)

    async def _next_event(self, stream: RequestStream) -> TokenEvent:
        deadline = stream.created + self.settings.request_timeout_s
        timeout = min(self.settings.token_timeout_s, deadline - time.monotonic())
        if timeout <= 0:
            raise APIError("request timed out", 504, "timeout")
        try:
            ev = await asyncio.wait_for(stream.queue.get(), timeout=timeout)
        except TimeoutError as e:
            raise APIError("no progress from the serving instances before the timeout", 504, "timeout") from e
        if ev is None:  # the watchdog gave up on this request
            raise APIError(stream.failure or "request failed", 502)
        if ev.outcome is Outcome.ERROR:
            raise APIError(f"request failed on {ev.source.value}: {ev.error}", 502)
        return ev

    def _merge(self, stream: RequestStream, ev: TokenEvent) -> Delta | None:
        stream.observe(ev)
        merged = stream.merger.add(ev.index, ev.tokens, ev.finished, ev.outcome.value if ev.outcome else None)
        if merged.tokens and stream.first_token_at is None:
            stream.first_token_at = time.monotonic()
            metrics.TTFT.labels(pipeline=stream.decision.pipeline.value).observe(stream.first_token_at - stream.created)
        if merged.finished:
            stream.finish()
        if not (merged.tokens or merged.finished):
            return None
        return Delta(merged.tokens, merged.finished, stream.merger.finish_reason if merged.finished else None)

    def _close(self, stream: RequestStream) -> None:
        """The stream ended (finished, failed or abandoned): record it and free it everywhere."""
        self.streams.pop(stream.rid, None)
        stream.fail("client went away")  # no-op unless it is still running
        if stream.span:
            stream.span.set_attributes({
                "pdd.pipeline": stream.pipeline.value, "pdd.output_tokens": stream.merger.next_index,
                "pdd.outcome": "ok" if stream.done else "aborted",
            })  # fmt: skip
            stream.span.end()
        # Also after a normal finish: whatever still holds the request (e.g. an MD whose
        # transfer the relay made moot) frees it now rather than at its timeout.
        reason = AbortReason.FINISHED if stream.done else AbortReason.CLIENT_GONE
        self.life.spawn(self.abort(stream.rid, reason, stream.span))

    async def abort(self, rid: str, reason: AbortReason, parent: Span | None = None) -> None:
        stream = self.streams.pop(rid, None)
        if stream is not None:
            stream.fail(reason.value)
        ctx = trace.set_span_in_context(parent) if parent else None
        try:
            with self.tracer.start_as_current_span(
                "abort", context=ctx, attributes={REQUEST_ID_ATTR: rid, "reason": reason.value}
            ):
                await publish(self.nc, subjects.abort(rid, Role.ROUTER.value), Abort(rid, reason))
        except Exception as e:  # NATS gone: peers time the request out on their own
            log.warning("could not publish abort for %s: %s", rid, e)

    def release(self, stream: RequestStream) -> None:
        """Free a stream whose deltas() never ran to its end (e.g. the client left before the
        first one was asked for); a no-op once the stream is closed."""
        if self.streams.get(stream.rid) is stream:
            self._close(stream)
