"""The router's request life: route, prepare MD, submit to P, merge indexed tokens, and move
a request whose instance is lost to a live one by its token IDs (migration)."""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Span, Status, StatusCode

from shared.bus import subjects
from shared.bus.connection import publish, request
from shared.bus.messages import (
    Abort,
    AbortReason,
    KVEvents,
    KVSnapshot,
    KVSnapshotRequest,
    LoadReport,
    MainDecodeLost,
    MDTarget,
    Outcome,
    Pipeline,
    PrefillSubmit,
    PrepareReply,
    PrepareRequest,
    ResumeReply,
    ResumeRequest,
    Role,
    SubmitReply,
    TokenBatch,
    TokenEvent,
)
from shared.bus.subjects import Req
from shared.config import RouterSettings
from shared.engine import SamplingParams, block_hashes
from shared.liveness import HEARTBEAT_S, ConnectionWatch
from shared.runtime import Lifecycle
from shared.telemetry import metrics
from shared.telemetry.span_store import REQUEST_ID_ATTR
from shared.telemetry.token_latency import token_latency
from shared.telemetry.tracing import get_tracer

from .assignments import Assignments
from .cache_view import CacheView
from .errors import APIError
from .merger import TokenMerger
from .policy import InstanceLoad, RouteDecision, resume_candidates
from .prefix_index import PrefixIndex
from .registry import Registry
from .request_stream import MOVABLE, Delta, RequestStream, StreamState
from .route_plan import LinkView, RouteContext, md_options, md_weights, plan_route
from .schemas import PddOptions

log = logging.getLogger(__name__)

STALE_ABORT_EVERY_S = 10.0  # an abandoned attempt that keeps producing is told again after this


class RouterCore:
    def __init__(self, settings: RouterSettings, nc, *, model_id: str, block_size: int, kv_bytes_per_token: int):
        self.settings = settings
        self.nc = nc
        self.model_id = model_id
        self.block_size = block_size
        self.kv_bytes_per_token = kv_bytes_per_token
        self.index = PrefixIndex()
        self.prefill_index = PrefixIndex()
        self.assignments = Assignments()
        self.route_ctx = RouteContext(settings, self.index, self.prefill_index, block_size, kv_bytes_per_token)
        self.caches = {Role.MAIN_DECODE: CacheView(self.index), Role.PREFILL: CacheView(self.prefill_index)}
        self.registry = Registry(stale_after_s=settings.lost_after_s)
        self.streams: dict[str, RequestStream] = {}  # by the client's request id
        self.attempts: dict[str, RequestStream] = {}  # by the backends' id of the current attempt
        self.stale_aborted: dict[str, float] = {}  # attempt ids told to stop recently (rate limit)
        self.conn = ConnectionWatch(nc)
        # Instance plus a per-process suffix: the requests of a router that restarted under the
        # same instance id belong to a router that is gone, and backends drop them.
        self.identity = f"{settings.instance}-{secrets.token_hex(4)}"
        # Its own request ids start with this (late events of an abandoned attempt still come).
        self.rid_prefix = f"cmpl-{self.identity}-"
        self.tracer = get_tracer("router", settings.instance, settings.datacenter)
        self.life = Lifecycle()

    async def start(self) -> None:
        await self.life.subscribe(self.nc, subjects.router_tokens(self.identity), TokenBatch, self._on_token_batch)
        await self.life.subscribe(self.nc, subjects.all_kv_events(), KVEvents, self._on_kv_events)
        await self.life.subscribe(self.nc, subjects.all_load(), LoadReport, self._on_load)
        self.life.every(HEARTBEAT_S, self._heartbeat)
        self.life.every(HEARTBEAT_S, self._watch_streams)
        self.life.every(self.settings.kv_snapshot_every_s, self._resync_caches)

    async def stop(self) -> None:
        await self.life.close()
        for rid in list(self.streams):
            await self.abort(rid, AbortReason.ROUTER_SHUTDOWN)

    def ready(self) -> dict[str, int]:
        return {role.value: len(self.registry.alive(role)) for role in (Role.PREFILL, Role.RELAY, Role.MAIN_DECODE)}

    # ---- inbound events ----------------------------------------------------------------
    async def _on_token_batch(self, batch: TokenBatch, raw) -> None:
        """One engine step's events for this router's requests, from one instance."""
        for ev in batch.events:
            await self._on_tokens(ev, raw)

    async def _on_tokens(self, ev: TokenEvent, raw) -> None:
        stream = self.attempts.get(ev.rid)
        if stream is None:
            if not ev.rid.startswith(self.rid_prefix):
                return  # another router's request
            metrics.UNKNOWN_REQUEST_MESSAGES.labels(service="router").inc()
            if not ev.finished:  # an abandoned attempt (its abort was lost?) still producing
                await self._abort_stale(ev.rid)
            return
        if ev.outcome is Outcome.ERROR and stream.state.is_in(StreamState.DISPATCHING, *MOVABLE):
            # The instance failed the request (a lost peer, a cut transfer): continue elsewhere.
            self.life.spawn(self._migrate(stream, f"{ev.source.value} failed it: {ev.error}", "error"))
            return
        _count_reports(stream, ev)
        stream.observe(ev)
        stream.queue.put_nowait(ev)

    async def _on_kv_events(self, ev: KVEvents, raw) -> None:
        """An instance's numbered cache changes; when its numbering breaks (first contact, a
        restart, a lost message), fetch its whole cache."""
        if subjects.kv_events_source(raw.subject) != (ev.role.value, ev.instance):
            return  # the subject (which permissions vouch for) names someone else
        view = self.caches.get(ev.role)
        if view is not None and view.on_events(ev):
            self.life.spawn(self._sync_cache(ev.role, ev.instance))

    async def _sync_cache(self, role: Role, instance: str) -> None:
        """Ask the instance for its cache until the view is whole again (one at a time: only
        the call that started the sync runs this); stops if the instance is forgotten."""
        view = self.caches[role]
        subject = subjects.kv_snapshot(role.value, instance)
        timeout = self.settings.kv_snapshot_timeout_s
        while view.syncing(instance):
            try:
                snap = await request(self.nc, subject, KVSnapshotRequest(self.identity), KVSnapshot, timeout=timeout)
                if (snap.role, snap.instance) != (role, instance):
                    raise ValueError(f"the snapshot is {snap.role.value} {snap.instance}'s")
            except Exception as e:  # gone, busy, or NATS trouble: ask again
                log.info("no cache snapshot from %s %s: %s", role.value, instance, e or type(e).__name__)
                await asyncio.sleep(timeout)
                continue
            view.on_snapshot(snap)

    async def _resync_caches(self) -> None:
        """The safety net: now and then every instance's whole cache, whatever its numbering says."""
        for role, view in self.caches.items():
            for instance in view.resync():
                self.life.spawn(self._sync_cache(role, instance))

    async def _on_load(self, report: LoadReport, raw) -> None:
        """A heartbeat: the instance is alive, and holds the requests it lists."""
        if report.service is Role.ROUTER:
            return
        self.registry.update(report)
        me = (report.service, report.instance)
        for rid in report.held:
            stream = self.attempts.get(rid)
            if stream is not None and stream.producer == me:
                stream.last_held = time.monotonic()

    async def _heartbeat(self) -> None:
        """Backends drop the requests of a router that stops heartbeating."""
        report = LoadReport(service=Role.ROUTER, instance=self.identity, running=len(self.streams))
        await publish(self.nc, subjects.load(Role.ROUTER.value, self.identity), report)

    async def _watch_streams(self) -> None:
        """Act on lost instances. Not while this router's own NATS link was just down: then
        every silence is its own, and the heartbeats need a moment to come back."""
        if self.conn.up_for() <= self.settings.lost_after_s:
            return
        alive_md = {r.instance for r in self.registry.alive(Role.MAIN_DECODE)}
        now = time.monotonic()
        for stream in list(self.streams.values()):
            if stream.state.is_in(StreamState.RELAYED) and stream.md_instance not in alive_md:
                stream.md_lost()  # before the handoff the relay finishes it: no move needed
                lost = MainDecodeLost(stream.attempt_rid, stream.md_instance)
                await publish(self.nc, subjects.req(stream.attempt_rid, Req.MD_LOST), lost)
            stall = stream.stall(now, self.settings.lost_after_s, self.settings.gap_timeout_s,
                                 self.settings.stall_timeout_s)  # fmt: skip
            if stall is not None:
                self.life.spawn(self._migrate(stream, *stall))
        self._prune(now)

    def _prune(self, now: float) -> None:
        """Maps keyed by what the network told us stay bounded."""
        for service, instance in self.registry.prune(self.settings.forget_after_s):
            if service in self.caches:
                self.caches[Role(service)].forget(instance)
            if service == Role.MAIN_DECODE:
                metrics.forget_peer(instance)
        for rid in [r for r, t in self.stale_aborted.items() if now - t > STALE_ABORT_EVERY_S]:
            del self.stale_aborted[rid]

    # ---- routing -----------------------------------------------------------------------
    def _links_to_mds(self, mds: list[str]) -> dict[str, tuple[str | None, float, float]]:
        """Per MD: (its bulk address, bandwidth B/s, RTT s) as prefill measured them. An MD no
        transfer went to yet gets the mean of the others' (MDs of one DC are usually behind one
        line; the configured prior only when nothing was measured)."""
        addresses = {md: (r.address if (r := self.registry.get(Role.MAIN_DECODE, md)) else None) for md in mds}
        measured = {md: link for md, a in addresses.items() if a and (link := self.registry.link_to(a))}
        if measured:
            fallback = tuple(sum(x) / len(measured) for x in zip(*measured.values(), strict=True))
        else:
            fallback = (self.settings.default_bandwidth_bps, self.settings.default_rtt_s)
        links = {}
        for md, address in addresses.items():
            bandwidth, rtt = measured.get(md, fallback)
            metrics.WAN_BANDWIDTH.labels(peer=md).set(bandwidth)
            links[md] = address, bandwidth, rtt
        return links

    def _loads(self, role: Role) -> list[InstanceLoad]:
        """The live instances of a role, asked anew each time (instances that join or leave
        count at once), with what their last report adds and the requests sent since."""
        now = time.monotonic()
        loads = []
        for load in self.registry.loads(role):
            report = self.registry.get(role, load.instance)
            reported_at = now - self.registry.silent_for(role, load.instance)
            loads.append(replace(
                load, num_blocks=report.num_blocks if report else 0, held=len(report.held) if report else 0,
                pending=self.assignments.pending((role, load.instance), reported_at),
                recent=self.assignments.recent((role, load.instance), now),
            ))  # fmt: skip
        return loads

    def _links(self, mds: list[str]) -> dict[str, LinkView]:
        """Per MD: the link figures as prefill measured them, and the KV queued toward it."""
        links = self._links_to_mds(mds)
        return {md: LinkView(bandwidth, rtt, self.registry.wan_backlog(address) if address else 0)
                for md, (address, bandwidth, rtt) in links.items()}  # fmt: skip

    def route(
        self, prompt_ids: list[int], forced: Pipeline | None
    ) -> tuple[RouteDecision, str, str | None, str | None, list[int]]:
        """(decision, MD instance, relay instance on P→RLD→MD, prefill instance, the prompt's
        block hashes); see route_plan.plan_route. With no MD alive (lost, or its datacenter
        unreachable) the MD is "" and the request goes to a relay (RLD-only: a fault
        fallback, never a policy)."""
        hashes = block_hashes(prompt_ids, self.block_size, self.model_id)
        self.assignments.expire(time.monotonic() - self.settings.lost_after_s)
        mds = self._loads(Role.MAIN_DECODE)
        loads = (mds, self._loads(Role.RELAY), self._loads(Role.PREFILL))
        plan = plan_route(self.route_ctx, len(prompt_ids), hashes, loads, self._links([m.instance for m in mds]), forced)
        return plan.decision, plan.md, plan.relay, plan.prefill, hashes

    # ---- a request ---------------------------------------------------------------------
    async def open(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        options: PddOptions | None = None,
        trace_context: Context | None = None,
    ) -> RequestStream:
        """Route and dispatch a request; `trace_context` is the caller's (W3C headers), if any."""
        if params.seed is None:  # every instance must sample a request the same way
            params.seed = secrets.randbits(63)
        rid = f"{self.rid_prefix}{uuid.uuid4().hex}"
        span = self.tracer.start_span(
            "router.request",
            context=trace_context or Context(),
            attributes={REQUEST_ID_ATTR: rid, "prompt_tokens": len(prompt_ids)},
        )
        try:
            with trace.use_span(span, end_on_exit=False):
                options = options or PddOptions()
                forced = Pipeline(options.pipeline) if options.pipeline else None
                stream, prefill = self._routed(rid, span, prompt_ids, forced, params)
                if stream.decision.pipeline is Pipeline.RLD_ONLY or prefill is None:
                    await self._start_elsewhere(stream, "no prefill or main-decode instance is available")
                else:
                    await self._dispatch(stream, prefill, options.catchup_threshold)
                return stream
        except APIError as e:
            span.set_status(Status(StatusCode.ERROR, str(e)))
            span.end()
            raise

    def _routed(
        self, rid: str, span: Span, prompt_ids: list[int], forced: Pipeline | None, params: SamplingParams
    ) -> tuple[RequestStream, str | None]:
        """The request's stream, routed, and the prefill instance chosen for it."""
        with self.tracer.start_as_current_span("router.route", attributes={REQUEST_ID_ATTR: rid}) as route_span:
            decision, md, relay, prefill, hashes = self.route(prompt_ids, forced)
            route_span.set_attributes({
                "pdd.hit_rate": decision.hit_rate, "pdd.missing_bytes": decision.missing_bytes,
                "pdd.est_wan_s": decision.est_wan_s, "pdd.pipeline": decision.pipeline.value,
                "pdd.md_instance": md, "pdd.relay_instance": relay or "",
                "pdd.instances.prefill": prefill or "", "pdd.instances.relay": relay or "",
                "pdd.instances.main_decode": md,
            })  # fmt: skip
        stream = RequestStream(rid, prompt_ids, decision, md, hashes, relay, span=span, params=params,
                               merger=TokenMerger(params.max_tokens))  # fmt: skip
        span.set_attribute("pdd.pipeline", decision.pipeline.value)
        metrics.PREFIX_HIT_RATE.observe(decision.hit_rate)
        self.streams[rid] = self.attempts[rid] = stream
        return stream, prefill

    async def _dispatch(self, stream: RequestStream, prefill: str, catchup: int | None) -> None:
        """Ask MD (across the WAN) and P at once: prefill starts without waiting a round trip;
        MD's answer (which blocks it lacks) follows P as an MDTarget. If an instance does not
        answer, the request starts on another one instead (by token IDs)."""
        now = time.monotonic()
        for role, instance in ((Role.PREFILL, prefill), (Role.RELAY, stream.relay_instance),
                               (Role.MAIN_DECODE, stream.md_instance)):  # fmt: skip
            if instance:  # its load counts it until it reports again (or the request ends)
                self.assignments.record((role, instance), now)
                stream.assigned.append(((role, instance), now))
        try:
            prep, reply = await asyncio.gather(self._prepare_md(stream), self._submit(stream, prefill, catchup))
        except Exception as e:  # an instance vanished, or NATS trouble
            await self._start_elsewhere(stream, f"could not dispatch the request: {e or type(e).__name__}")
            return
        if not stream.state.is_in(StreamState.DISPATCHING):
            return  # an instance failed it meanwhile and it moved (or ended)
        if not (reply.ok and prep.ok):
            error = md_refusal(prep) if reply.ok else APIError(
                f"prefill refused the request: {reply.error}", 400, "invalid_request_error"
            )
            stream.fail(str(error))
            await self.abort(stream.rid, AbortReason.DISPATCH_FAILED)
            raise error
        target = MDTarget(stream.rid, prep.bulk_address, prep.missing)
        await publish(self.nc, subjects.req(stream.rid, Req.MD_TARGET), target)
        stream.dispatched(reply.instance)
        # MD keeps the prompt's blocks once they arrive: count them as its own now, as a
        # session's next turn may come before MD's cache events say so (a snapshot or an
        # eviction event corrects this view).
        self.index.apply(stream.md_instance, stream.block_hashes, [])

    async def _start_elsewhere(self, stream: RequestStream, why: str) -> None:
        """The normal path is not available: start the request on a live MD or relay, which
        computes the prompt itself; 503 if none takes it."""
        if stream.state.is_in(StreamState.MIGRATING, StreamState.RESUMED):
            return  # an instance failed it meanwhile: it is moving already
        if not await self._migrate(stream, why, "dispatch"):
            await self.abort(stream.rid, AbortReason.DISPATCH_FAILED)
            raise APIError(stream.failure or why, 503)

    async def _prepare_md(self, stream: RequestStream) -> PrepareReply:
        msg = PrepareRequest(stream.rid, stream.prompt_ids, stream.params, stream.block_hashes, stream.decision.pipeline,
                             router=self.identity)  # fmt: skip
        subject = subjects.md_prepare(stream.md_instance)
        peer = (Role.MAIN_DECODE, stream.md_instance)
        return await self._ask(peer, subject, msg, PrepareReply, self.settings.prepare_timeout_s)

    async def _submit(self, stream: RequestStream, prefill: str, catchup: int | None) -> SubmitReply:
        relay = self.registry.get(Role.RELAY, stream.relay_instance) if stream.relay_instance else None
        msg = PrefillSubmit(stream.rid, stream.prompt_ids, stream.params, stream.decision.pipeline,
                            relay_address=relay.address if relay else None, catchup_threshold=catchup,
                            router=self.identity)  # fmt: skip
        subject = subjects.prefill_submit_to(prefill)
        return await self._ask((Role.PREFILL, prefill), subject, msg, SubmitReply, self.settings.prepare_timeout_s)

    async def _ask(self, peer: tuple[Role, str], subject: str, msg, reply_cls: type, timeout: float):
        """Request/reply to one instance, given up as soon as the instance is lost (a request
        to a dead instance across the gateway gets no "no responders", only silence)."""
        task = asyncio.ensure_future(request(self.nc, subject, msg, reply_cls, timeout=timeout))
        try:
            while not (await asyncio.wait({task}, timeout=HEARTBEAT_S))[0]:
                if self.registry.silent_for(*peer) > self.settings.lost_after_s:
                    raise ConnectionError(f"{peer[0].value} {peer[1]} was lost")
            return task.result()
        finally:
            task.cancel()

    # ---- migration by token IDs --------------------------------------------------------
    async def _migrate(self, stream: RequestStream, why: str, cause: str) -> bool:
        """Continue the request on a live instance from the tokens the client already has.
        The old attempt is aborted; its late messages no longer reach the stream. False (and
        the stream failed, its consumer woken) if no instance takes it."""
        if not stream.state.is_in(StreamState.DISPATCHING, *MOVABLE):
            return False  # ended, or another move is under way
        lost = stream.producer
        if stream.attempt >= self.settings.migration_limit:
            return self._give_up(stream, f"{why}; migration limit ({self.settings.migration_limit}) reached")
        log.warning("request %s (attempt %s): %s; moving it by token IDs", stream.rid, stream.attempt_rid, why)
        metrics.MIGRATIONS.labels(cause=cause).inc()
        old = stream.attempt_rid
        self.attempts.pop(old, None)
        self.attempts[stream.migrating()] = stream
        self.life.spawn(self._publish_abort(old, AbortReason.MIGRATED, stream.span))
        avoid = {lost} if lost and self.registry.silent_for(*lost) > self.settings.lost_after_s else set()
        ctx = trace.set_span_in_context(stream.span) if stream.span else None
        attrs = {REQUEST_ID_ATTR: stream.rid, "reason": why, "attempt": stream.attempt,
                 "tokens_sent": stream.merger.next_index}  # fmt: skip
        with self.tracer.start_as_current_span("router.migrate", context=ctx, attributes=attrs) as span:
            target = await self._resume(stream, avoid)
            span.set_attribute("target", f"{target[0].value}/{target[1]}" if target else "")
        if target is None:
            return self._give_up(stream, f"{why}; no live instance took the request")
        stream.resumed(*target)
        return True

    async def _resume(self, stream: RequestStream, avoid: set[tuple[Role, str]]) -> tuple[Role, str] | None:
        """Offer the request to the candidates (best first) until one takes it; wait a little
        for one to (re)appear. The instance that took it, or None."""
        assert stream.params is not None
        msg = ResumeRequest(stream.attempt_rid, stream.prompt_ids, list(stream.merger.released), stream.params,
                            router=self.identity)  # fmt: skip
        deadline = time.monotonic() + self.settings.migration_wait_s
        while True:
            for role, instance in self._resume_candidates(stream, avoid):
                try:
                    subject = subjects.resume(role.value, instance)
                    reply = await self._ask((role, instance), subject, msg, ResumeReply, self.settings.resume_timeout_s)
                except Exception as e:  # gone, frozen, or NATS trouble: try the next one
                    reply = ResumeReply(ok=False, error=str(e) or type(e).__name__)
                if reply.ok:
                    return role, instance
                log.warning("request %s: %s %s did not take it: %s", stream.rid, role.value, instance, reply.error)
                avoid = avoid | {(role, instance)}
            if time.monotonic() > deadline:
                return None
            await asyncio.sleep(HEARTBEAT_S)

    def _resume_candidates(self, stream: RequestStream, avoid: set[tuple[Role, str]]) -> list[tuple[Role, str]]:
        mds = [m for m in self._loads(Role.MAIN_DECODE) if (Role.MAIN_DECODE, m.instance) not in avoid]
        relays = [r for r in self._loads(Role.RELAY) if (Role.RELAY, r.instance) not in avoid]
        links = self._links([m.instance for m in mds])
        options = md_options(self.route_ctx, len(stream.prompt_ids), stream.block_hashes, links, False)
        wan_s = {m: cost_s for m, (_, cost_s) in options.items()}
        return resume_candidates(mds, relays, wan_s, md_weights(self.route_ctx, len(stream.prompt_ids)))

    def _give_up(self, stream: RequestStream, why: str) -> bool:
        log.warning("request %s failed: %s", stream.rid, why)
        stream.fail(why)
        stream.queue.put_nowait(None)  # wake the consumer: it reports the failure
        return False

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
        if ev.rid != stream.attempt_rid:
            return None  # queued before the request moved: the new attempt resends what counts
        merged = stream.merger.add(
            ev.index, ev.tokens, ev.finished, ev.outcome.value if ev.outcome else None, ev.logprobs
        )
        if ev.prompt_logprobs is not None and stream.prompt_logprobs is None:
            stream.prompt_logprobs = ev.prompt_logprobs
        if merged.tokens and stream.first_token_at is None:
            stream.first_token_at = time.monotonic()
            metrics.TTFT.labels(pipeline=stream.decision.pipeline.value).observe(stream.first_token_at - stream.created)
        if merged.finished:
            stream.finish()
        if not (merged.tokens or merged.finished):
            return None
        self._observe_latency(stream, len(merged.tokens))
        reason = stream.merger.finish_reason if merged.finished else None
        return Delta(merged.tokens, merged.finished, reason, merged.logprobs)

    def _observe_latency(self, stream: RequestStream, delivered: int) -> None:
        """Time to the 2nd token and TPOT, as the client sees them (after the merge)."""
        after = stream.merger.next_index
        lat = token_latency(stream.created, stream.first_token_at, time.monotonic(), after - delivered, after,
                            stream.done)  # fmt: skip
        pipeline = stream.decision.pipeline.value
        if lat.second_token_s is not None:
            metrics.SECOND_TOKEN.labels(pipeline=pipeline).observe(lat.second_token_s)
        if lat.tpot_s is not None:
            metrics.TPOT.labels(pipeline=pipeline).observe(lat.tpot_s)

    def _close(self, stream: RequestStream) -> None:
        """The stream ended (finished, failed or abandoned): record it and free it everywhere."""
        self.streams.pop(stream.rid, None)
        self.attempts.pop(stream.attempt_rid, None)
        for key, at in stream.assigned:
            self.assignments.finished(key, at)
        stream.fail("client went away")  # no-op unless it is still running
        if stream.span:
            stream.span.set_attributes({
                "pdd.pipeline": stream.pipeline.value, "pdd.output_tokens": stream.merger.next_index,
                "pdd.outcome": "ok" if stream.done else "aborted", "pdd.migrations": stream.attempt,
            })  # fmt: skip
            stream.span.end()
        # Also after a normal finish: whatever still holds the request (e.g. an MD whose
        # transfer the relay made moot) frees it now rather than at its timeout.
        reason = AbortReason.FINISHED if stream.done else AbortReason.CLIENT_GONE
        self.life.spawn(self._publish_abort(stream.attempt_rid, reason, stream.span))

    async def abort(self, rid: str, reason: AbortReason, parent: Span | None = None) -> None:
        """Give up on the client's request `rid`: every instance drops its current attempt."""
        stream = self.streams.pop(rid, None)
        attempt = rid
        if stream is not None:
            stream.fail(reason.value)
            attempt = stream.attempt_rid
            self.attempts.pop(attempt, None)
        await self._publish_abort(attempt, reason, parent)

    async def _abort_stale(self, attempt_rid: str) -> None:
        if attempt_rid not in self.stale_aborted:
            self.stale_aborted[attempt_rid] = time.monotonic()
            await self._publish_abort(attempt_rid, AbortReason.STALE)

    async def _publish_abort(self, attempt_rid: str, reason: AbortReason, parent: Span | None = None) -> None:
        ctx = trace.set_span_in_context(parent) if parent else None
        try:
            with self.tracer.start_as_current_span(
                "abort", context=ctx, attributes={REQUEST_ID_ATTR: attempt_rid, "reason": reason.value}
            ):
                await publish(self.nc, subjects.abort(attempt_rid, Role.ROUTER.value), Abort(attempt_rid, reason))
        except Exception as e:  # NATS gone: peers drop the request when this router's heartbeat stops
            log.warning("could not publish abort for %s: %s", attempt_rid, e)

    def release(self, stream: RequestStream) -> None:
        """Free a stream whose deltas() never ran to its end (e.g. the client left before the
        first one was asked for); a no-op once the stream is closed."""
        if self.streams.get(stream.rid) is stream:
            self._close(stream)


def md_refusal(prep: PrepareReply) -> APIError:
    """MD busy (its KV memory is taken for now): 503, try again. Otherwise MD refused the
    request itself (e.g. it can never fit MD's KV pool): 400, like prefill's refusal."""
    if prep.busy:
        return APIError(f"main decode is busy ({prep.error}): try again later", 503)
    return APIError(f"main decode refused the request: {prep.error}", 400, "invalid_request_error")


def _count_reports(stream: RequestStream, ev: TokenEvent) -> None:
    """The router's own count of the reports instances send with a request's last tokens
    (each once: a redelivered one equals what the stream holds already)."""
    if ev.decode is not None and ev.decode != stream.decode:
        metrics.ROUTER_WAN_BYTES.labels(md=ev.decode.md_instance).inc(ev.decode.wan_bytes)
        metrics.ROUTER_OUTPUT_TOKENS.labels(role=Role.MAIN_DECODE.value).inc(ev.decode.md_tokens)
    if ev.relay is not None and ev.relay != stream.relay:
        metrics.ROUTER_OUTPUT_TOKENS.labels(role=Role.RELAY.value).inc(ev.relay.rld_tokens)
        if ev.relay.handed_over and ev.relay.handoff_mode is not None:
            metrics.ROUTER_HANDOFFS.labels(mode=ev.relay.handoff_mode.value).inc()
