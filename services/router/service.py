"""The router's request life: route, prepare MD, submit to P, merge indexed tokens."""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Span, Status, StatusCode, format_trace_id

from shared.bus import subjects
from shared.bus.connection import publish, request
from shared.bus.messages import (
    MD_LOST,
    Abort,
    KVEvents,
    LoadReport,
    MDTarget,
    PrefillSubmit,
    PrepareReply,
    PrepareRequest,
    SubmitReply,
    TokenEvent,
)
from shared.config import RouterSettings
from shared.engine import SamplingParams, block_hashes
from shared.runtime import Lifecycle
from shared.telemetry import metrics
from shared.telemetry.span_store import REQUEST_ID_ATTR
from shared.telemetry.tracing import get_tracer

from .merger import TokenMerger
from .policy import P_MD, P_RLD_MD, RouteDecision, choose_least_loaded, choose_main_decode, choose_pipeline
from .prefix_index import PrefixIndex
from .registry import Registry

log = logging.getLogger(__name__)


class RequestError(Exception):
    """A request that cannot be served; `status` is the HTTP status to answer with."""

    def __init__(self, message: str, status: int = 503, type_: str = "server_error"):
        super().__init__(message)
        self.status = status
        self.type = type_


@dataclass
class Delta:
    tokens: list[int]
    finished: bool = False
    finish_reason: str | None = None


@dataclass
class RequestStream:
    rid: str
    prompt_ids: list[int]
    decision: RouteDecision
    md_instance: str = ""
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    failure: str | None = None  # set when the router itself gives up on the request
    merger: TokenMerger = field(default_factory=TokenMerger)
    stats: dict = field(default_factory=dict)
    created: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    done: bool = False
    span: Span | None = None  # the request's root span: one trace across both datacenters

    @property
    def trace_id(self) -> str | None:
        return format_trace_id(self.span.get_span_context().trace_id) if self.span else None

    @property
    def traceparent(self) -> str | None:
        if not self.span:
            return None
        ctx = self.span.get_span_context()
        return f"00-{format_trace_id(ctx.trace_id)}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"

    @property
    def pipeline(self) -> str:
        return self.stats.get("pipeline", self.decision.pipeline)

    def summary(self) -> dict:
        return {
            "pipeline": self.pipeline,
            "prefix_hit_rate": round(self.decision.hit_rate, 4),
            "handoff_mode": self.stats.get("handoff_mode"),
            "handoff_batches": self.stats.get("handoff_batches", 0),
            "rld_tokens": self.stats.get("rld_tokens", 0),
            "md_tokens": self.stats.get("md_tokens", 0),
            "wan_bytes": self.stats.get("wan_bytes", 0),
            "trace_id": self.trace_id,
        }


class RouterCore:
    def __init__(
        self, settings: RouterSettings, nc, *, model_id: str, block_size: int, kv_bytes_per_token: int
    ):
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
        await self.life.subscribe(self.nc, subjects.all_req("tokens"), TokenEvent, self._on_tokens)
        await self.life.subscribe(self.nc, subjects.all_kv_events(), KVEvents, self._on_kv_events)
        await self.life.subscribe(self.nc, subjects.all_load(), LoadReport, self._on_load)
        self.life.every(1.0, self._watch_main_decode)

    async def stop(self) -> None:
        await self.life.close()
        for rid in list(self.streams):
            await self.abort(rid, "router shutdown")

    def ready(self) -> dict[str, int]:
        return {svc: len(self.registry.alive(svc)) for svc in ("prefill", "relay", "main_decode")}

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
        alive = {r.instance for r in self.registry.alive("main_decode")}
        for stream in list(self.streams.values()):
            if stream.md_instance in alive or stream.failure:
                continue
            handed_over = stream.decision.pipeline == P_MD or "handoff_mode" in stream.stats
            if handed_over:
                stream.failure = f"main decode instance {stream.md_instance} was lost"
                stream.queue.put_nowait(None)
            else:
                stream.failure = "md-lost-relayed"
                await publish(self.nc, subjects.req_abort(stream.rid), Abort(stream.rid, MD_LOST, "router"))

    # ---- a request ---------------------------------------------------------------------
    def route(
        self, prompt_ids: list[int], forced: str | None
    ) -> tuple[RouteDecision, str, str | None, list[int]]:
        hashes = block_hashes(prompt_ids, self.block_size, self.model_id)
        mds = self.registry.loads("main_decode")
        cached = {m.instance: self.index.cached_prefix_blocks(m.instance, hashes) for m in mds}
        md = choose_main_decode(mds, cached)
        if md is None:
            raise RequestError("no main-decode instance is available", 503)
        relay = choose_least_loaded(self.registry.loads("relay"))
        report = self.registry.get("main_decode", md)
        link = self.registry.link_to(report.address) if report and report.address else None
        bandwidth, rtt = link or (self.settings.default_bandwidth_bps, self.settings.default_rtt_s)
        decision = choose_pipeline(
            len(prompt_ids),
            cached.get(md, 0) * self.block_size,
            self.kv_bytes_per_token,
            bandwidth,
            rtt,
            self.settings.wan_time_threshold_s,
            relay is not None,
            backlog_bytes=self.registry.wan_backlog(report.address) if report and report.address else 0,
        )
        if forced is not None and forced != decision.pipeline:
            if forced == P_RLD_MD and relay is None:
                raise RequestError("pipeline p-rld-md requested but no relay instance is available", 503)
            decision = RouteDecision(forced, decision.hit_rate, decision.missing_bytes, decision.est_wan_s)
        return decision, md, relay if decision.pipeline == P_RLD_MD else None, hashes

    async def open(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        options: dict,
        trace_context: Context | None = None,
    ) -> RequestStream:
        """Route and dispatch a request; `trace_context` is the caller's (W3C headers), if any."""
        if not self.registry.alive("prefill"):
            raise RequestError("no prefill instance is available", 503)
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
                return await self._dispatch(rid, span, prompt_ids, params, options)
        except RequestError as e:
            span.set_status(Status(StatusCode.ERROR, str(e)))
            span.end()
            raise

    async def _dispatch(
        self, rid: str, span: Span, prompt_ids: list[int], params: SamplingParams, options: dict
    ) -> RequestStream:
        with self.tracer.start_as_current_span(
            "router.route", attributes={REQUEST_ID_ATTR: rid}
        ) as route_span:
            decision, md, relay, hashes = self.route(prompt_ids, options.get("pipeline"))
            route_span.set_attributes(
                {
                    "pdd.hit_rate": decision.hit_rate,
                    "pdd.missing_bytes": decision.missing_bytes,
                    "pdd.est_wan_s": decision.est_wan_s,
                    "pdd.pipeline": decision.pipeline,
                    "pdd.md_instance": md,
                    "pdd.relay_instance": relay or "",
                    "pdd.bandwidth_estimate": self._bandwidth_to(md),
                }
            )
        stream = RequestStream(rid, prompt_ids, decision, md_instance=md, span=span)
        span.set_attribute("pdd.pipeline", decision.pipeline)
        self.streams[rid] = stream
        metrics.PREFIX_HIT_RATE.observe(decision.hit_rate)
        try:
            relay_address = None
            if relay is not None:
                rep = self.registry.get("relay", relay)
                relay_address = rep.address if rep else None
            submit = PrefillSubmit(
                rid,
                prompt_ids,
                params.to_dict(),
                decision.pipeline,
                md,
                relay_instance=relay,
                relay_address=relay_address,
                options={k: v for k, v in options.items() if v is not None and k != "pipeline"},
            )
            prefill = choose_least_loaded(self.registry.loads("prefill"))
            # MD (across the WAN) and P are asked at once: prefill starts without waiting a
            # round trip; MD's answer (which blocks it lacks) follows P as an MDTarget.
            prep, reply = await asyncio.gather(
                request(
                    self.nc,
                    subjects.md_prepare(md),
                    PrepareRequest(rid, prompt_ids, params.to_dict(), hashes, decision.pipeline),
                    PrepareReply,
                    timeout=self.settings.prepare_timeout_s,
                ),
                request(
                    self.nc,
                    subjects.prefill_submit_to(prefill) if prefill else subjects.prefill_submit(),
                    submit,
                    SubmitReply,
                    timeout=self.settings.prepare_timeout_s,
                ),
            )
            if not reply.ok:
                raise RequestError(
                    f"prefill refused the request: {reply.error}", 400, "invalid_request_error"
                )
            if not prep.ok:
                raise RequestError(f"main decode refused the request: {prep.error}", 503)
            target = MDTarget(rid, prep.bulk_address, prep.missing)
            await publish(self.nc, subjects.req_md_target(rid), target)
        except TimeoutError as e:
            await self.abort(rid, "dispatch timed out")
            raise RequestError("timed out dispatching the request", 503) from e
        except RequestError:
            await self.abort(rid, "dispatch failed")
            raise
        except Exception as e:  # NATS trouble: no responders, connection lost
            await self.abort(rid, "dispatch failed")
            raise RequestError(f"could not dispatch the request: {e}", 503) from e
        return stream

    def _bandwidth_to(self, md: str) -> float:
        report = self.registry.get("main_decode", md)
        link = self.registry.link_to(report.address) if report and report.address else None
        bandwidth = link[0] if link else self.settings.default_bandwidth_bps
        metrics.WAN_BANDWIDTH.labels(peer=md).set(bandwidth)
        return bandwidth

    async def deltas(self, stream: RequestStream) -> AsyncIterator[Delta]:
        """Ordered new tokens until the request finishes; raises RequestError on failure."""
        deadline = stream.created + self.settings.request_timeout_s
        try:
            while True:
                timeout = min(self.settings.token_timeout_s, deadline - time.monotonic())
                if timeout <= 0:
                    raise RequestError("request timed out", 504, "timeout")
                try:
                    ev: TokenEvent = await asyncio.wait_for(stream.queue.get(), timeout=timeout)
                except TimeoutError as e:
                    raise RequestError(
                        "no progress from the serving instances before the timeout", 504, "timeout"
                    ) from e
                if ev is None:  # the watchdog gave up on this request
                    raise RequestError(stream.failure or "request failed", 502)
                stream.stats.update(ev.stats)
                if ev.finish_reason == "error":
                    raise RequestError(f"request failed on {ev.source}: {ev.error}", 502)
                merged = stream.merger.add(ev.index, ev.tokens, ev.finished, ev.finish_reason)
                if merged.tokens and stream.first_token_at is None:
                    stream.first_token_at = time.monotonic()
                    metrics.TTFT.labels(pipeline=stream.decision.pipeline).observe(
                        stream.first_token_at - stream.created
                    )
                if merged.tokens or merged.finished:
                    yield Delta(
                        merged.tokens,
                        merged.finished,
                        stream.merger.finish_reason if merged.finished else None,
                    )
                if merged.finished:
                    stream.done = True
                    return
        except RequestError as e:
            if stream.span:
                stream.span.set_status(Status(StatusCode.ERROR, str(e)))
            raise
        finally:
            self.streams.pop(stream.rid, None)
            if stream.span:
                stream.span.set_attributes(
                    {
                        "pdd.pipeline": stream.pipeline,
                        "pdd.output_tokens": stream.merger.next_index,
                        "pdd.outcome": "ok" if stream.done else "aborted",
                    }
                )
                stream.span.end()
            # Also after a normal finish: whatever still holds the request (e.g. an MD whose
            # transfer the relay made moot) frees it now rather than at its timeout.
            reason = "finished" if stream.done else "client went away or request failed"
            self.life.spawn(self.abort(stream.rid, reason, stream.span))

    async def abort(self, rid: str, reason: str, parent: Span | None = None) -> None:
        self.streams.pop(rid, None)
        ctx = trace.set_span_in_context(parent) if parent else None
        try:
            with self.tracer.start_as_current_span(
                "abort", context=ctx, attributes={REQUEST_ID_ATTR: rid, "reason": reason}
            ):
                await publish(self.nc, subjects.req_abort(rid), Abort(rid, reason, "router"))
        except Exception as e:  # NATS gone: peers time the request out on their own
            log.warning("could not publish abort for %s: %s", rid, e)
