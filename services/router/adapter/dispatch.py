"""A request's way in: route it, open its stream, then ask MD (across the WAN) and P at once;
if the normal path is not available, start it elsewhere by token IDs."""

from __future__ import annotations

import asyncio
import math
import secrets
import time
import uuid

from nats.errors import NoRespondersError
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Span, Status, StatusCode

from shared.bus import subjects
from shared.bus.connection import request
from shared.bus.messages import (
    AbortReason,
    MainDecodeTarget,
    Pipeline,
    PrefillSubmit,
    PrepareReply,
    PrepareRequest,
    Role,
    SubmitReply,
)
from shared.config import RouterSettings
from shared.engine import SamplingParams
from shared.serving.liveness import HEARTBEAT_S
from shared.telemetry import metrics
from shared.telemetry.span_store import REQUEST_ID_ATTR

from ..core.errors import APIError
from ..core.merger import TokenMerger
from ..core.options import PddOptions
from ..core.request_life import RequestLife
from ..core.request_stream import RequestStream, StreamState
from ..routing.fleet_view import FleetView
from ..routing.policy import LineWait, RoutePlan, line_wait
from .effects import Effects

NO_RESPONDERS_RETRY_S = 0.1  # between tries while a live instance has no subscription heard
RESEND_FIRST_S = 1.0  # no answer this long: the request is sent again (then every 2, 4, 4... s)
RESEND_MAX_S = 4.0


async def ask(
    nc,
    fleet: FleetView,
    lost_after_s: float,
    peer: tuple[Role, str],
    subject: str,
    msg,
    reply_cls: type,
    timeout: float,
    resend_first_s: float = RESEND_FIRST_S,
):
    """Request/reply to one instance, given up as soon as the instance is lost (a request
    to a dead instance across the gateway gets no "no responders", only silence).

    NATS delivers at most once: while a server restarts or a gateway reconnects, the request
    or its answer can be lost. So a request not answered within `resend_first_s` is sent again
    (backing off to RESEND_MAX_S), and the first answer to any copy is taken: the instance
    answers a repeat with the first copy's answer (shared/serving/job_admission.py). "No
    responders" from an instance that is not lost means nobody received that copy (its NATS
    node died and it is subscribing again elsewhere): it is sent again after
    NO_RESPONDERS_RETRY_S. All until the timeout or the loss."""
    deadline = time.monotonic() + timeout
    copies: set[asyncio.Future] = set()
    resend_s, next_send = resend_first_s, time.monotonic()
    try:
        while True:
            now = time.monotonic()
            left = deadline - now
            if left <= 0:
                raise TimeoutError(f"no answer from {peer[0].value} {peer[1]} within {timeout:g} s")
            if copies and fleet.registry.silent_for(*peer) > lost_after_s:
                raise ConnectionError(f"{peer[0].value} {peer[1]} was lost")
            if now >= next_send:
                copies.add(asyncio.ensure_future(request(nc, subject, msg, reply_cls, timeout=left)))
                next_send, resend_s = now + resend_s, min(2 * resend_s, RESEND_MAX_S)
            wait_s = min(HEARTBEAT_S, max(next_send - now, 0.0), left)
            if not copies:  # each copy met "no responders": wait for the next try
                await asyncio.sleep(wait_s)
                continue
            done, _ = await asyncio.wait(copies, timeout=wait_s, return_when=asyncio.FIRST_COMPLETED)
            for copy in done:
                copies.discard(copy)
                try:
                    return copy.result()
                except NoRespondersError:
                    if left < 2 * NO_RESPONDERS_RETRY_S or fleet.registry.silent_for(*peer) > lost_after_s:
                        raise
                    resend_s, next_send = (
                        resend_first_s,
                        min(next_send, time.monotonic() + NO_RESPONDERS_RETRY_S),
                    )
                except TimeoutError:
                    pass  # this copy's wait ran out with the deadline: the loop raises
    finally:
        for copy in copies:
            copy.cancel()


class Dispatcher:
    def __init__(
        self,
        settings: RouterSettings,
        nc,
        tracer,
        identity: str,
        rid_prefix: str,
        requests: RequestLife,
        fleet: FleetView,
        effects: Effects,
    ) -> None:
        self.settings, self.nc, self.tracer = settings, nc, tracer
        self.identity, self.rid_prefix = identity, rid_prefix
        self.requests, self.fleet, self.effects = requests, fleet, effects
        self.held = 0  # requests waiting for the line (see _admitted)

    async def open(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        options: PddOptions | None,
        trace_context: Context | None,
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
                stream, prefill = await self._routed(rid, span, prompt_ids, forced, params)
                if stream.decision.pipeline is Pipeline.RLD_ONLY or prefill is None:
                    await self.start_elsewhere(stream, "no prefill or main-decode instance is available")
                else:
                    await self._dispatch(stream, prefill, options.catchup_threshold)
                return stream
        except APIError as e:
            span.set_status(Status(StatusCode.ERROR, str(e)))
            span.end()
            raise

    async def _routed(
        self, rid: str, span: Span, prompt_ids: list[int], forced: Pipeline | None, params: SamplingParams
    ) -> tuple[RequestStream, str | None]:
        """The request's stream, routed, and the prefill instance chosen for it."""
        with self.tracer.start_as_current_span(
            "router.route", attributes={REQUEST_ID_ATTR: rid}
        ) as route_span:
            started = time.monotonic()
            plan, hashes = await self._admitted(prompt_ids, forced)
            decision, md, relay, prefill = plan.decision, plan.md, plan.relay, plan.prefill
            route_span.set_attributes(
                {
                    "pdd.line_wait_s": time.monotonic() - started,
                    "pdd.hit_rate": decision.hit_rate,
                    "pdd.missing_bytes": decision.missing_bytes,
                    "pdd.est_wan_s": decision.est_wan_s,
                    "pdd.pipeline": decision.pipeline.value,
                    "pdd.md_instance": md,
                    "pdd.relay_instance": relay or "",
                    "pdd.instances.prefill": prefill or "",
                    "pdd.instances.relay": relay or "",
                    "pdd.instances.main_decode": md,
                }
            )
        stream = RequestStream(
            rid,
            prompt_ids,
            decision,
            md,
            hashes,
            relay,
            span=span,
            params=params,
            merger=TokenMerger(params.max_tokens),
        )
        span.set_attribute("pdd.pipeline", decision.pipeline.value)
        metrics.PREFIX_HIT_RATE.observe(decision.hit_rate)
        self.requests.opened(stream)
        self.effects.inbox(stream)
        return stream, prefill

    async def _admitted(self, prompt_ids: list[int], forced: Pipeline | None) -> tuple[RoutePlan, list[int]]:
        """The request's route once the line admits it (policy.line_admission). Until then it
        is held here, planned again every line_replan_s (loads and the line's queue move
        meanwhile); held past line_wait_s, or with line_wait_max held already, it gets a 429.
        Each held request plans on its own clock: the order in which they leave is roughly
        their arrival order, not strictly."""
        s, started, holding, hashes = self.settings, time.monotonic(), False, None
        try:
            while True:
                others = self.held - holding
                plan, hashes = self.fleet.plan(prompt_ids, forced, hashes, not holding and others > 0)
                waited = time.monotonic() - started
                verdict = line_wait(not plan.held, waited, others, s, newcomer=not holding)
                if verdict is LineWait.GO:
                    return plan, hashes
                if verdict is LineWait.REFUSE:
                    raise line_refusal(plan, waited, s)
                if not holding:
                    holding, self.held = True, self.held + 1
                await asyncio.sleep(max(0.0, min(s.line_replan_s, s.line_wait_s - waited)))
        finally:
            if holding:
                self.held -= 1

    async def _dispatch(self, stream: RequestStream, prefill: str, catchup: int | None) -> None:
        """Ask MD (across the WAN) and P at once: prefill starts without waiting a round trip;
        MD's answer (which blocks it lacks) follows P as an MainDecodeTarget. If an instance does not
        answer, the request starts on another one instead (by token IDs)."""
        now = time.monotonic()
        for role, instance in (
            (Role.PREFILL, prefill),
            (Role.RELAY, stream.relay_instance),
            (Role.MAIN_DECODE, stream.md_instance),
        ):
            if instance:  # its load counts it until it reports again (or the request ends)
                self.fleet.assignments.record((role, instance), now)
                stream.assigned.append(((role, instance), now))
        failed: Exception | None = None
        try:  # if one side fails, the other is cancelled (and awaited) rather than left running
            async with asyncio.TaskGroup() as both:
                asked_md = both.create_task(self._prepare_md(stream))
                asked_p = both.create_task(self._submit(stream, prefill, catchup))
        except* Exception as group:  # an instance vanished, or NATS trouble
            failed = group.exceptions[0]
        if failed is not None:
            await self.start_elsewhere(
                stream, f"could not dispatch the request: {failed or type(failed).__name__}"
            )
            return
        prep, reply = asked_md.result(), asked_p.result()
        if not stream.state.is_in(StreamState.DISPATCHING):
            return  # an instance failed it meanwhile and it moved (or ended)
        if not (reply.ok and prep.ok):
            error = (
                md_refusal(prep)
                if reply.ok
                else APIError(f"prefill refused the request: {reply.error}", 400, "invalid_request_error")
            )
            await self.effects.perform_in_order(self.requests.refused(stream, str(error)))
            raise error
        target = MainDecodeTarget(stream.rid, prep.bulk_address, prep.missing, stream.md_instance)
        stream.prefill_epoch = reply.epoch
        await self.effects.perform_in_order(self.requests.dispatched(stream, reply.instance, target))
        # MD keeps the prompt's blocks once they arrive: count them as its own now, as a
        # session's next turn may come before MD's cache events say so (a snapshot or an
        # eviction event corrects this view).
        self.fleet.index.apply(stream.md_instance, stream.block_hashes, [])

    async def start_elsewhere(self, stream: RequestStream, why: str) -> None:
        """The normal path is not available: start the request on a live MD or relay, which
        computes the prompt itself; 503 if none takes it."""
        if stream.state.is_in(StreamState.MIGRATING, StreamState.RESUMED):
            return  # an instance failed it meanwhile: it is moving already
        assert self.effects.migrate is not None
        if not await self.effects.migrate(stream, why, "dispatch"):
            await self.effects.perform_in_order(self.requests.abort(stream.rid, AbortReason.DISPATCH_FAILED))
            raise APIError(stream.failure or why, 503)

    async def _prepare_md(self, stream: RequestStream) -> PrepareReply:
        msg = PrepareRequest(
            stream.rid,
            stream.prompt_ids,
            stream.params,
            stream.block_hashes,
            stream.decision.pipeline,
            router=self.identity,
            relay=stream.relay_instance or "",
        )
        subject = subjects.md_prepare(stream.md_instance)
        return await self._ask((Role.MAIN_DECODE, stream.md_instance), subject, msg, PrepareReply)

    async def _submit(self, stream: RequestStream, prefill: str, catchup: int | None) -> SubmitReply:
        relay = self.fleet.registry.get(Role.RELAY, stream.relay_instance) if stream.relay_instance else None
        msg = PrefillSubmit(
            stream.rid,
            stream.prompt_ids,
            stream.params,
            stream.decision.pipeline,
            relay_address=relay.address if relay else None,
            catchup_threshold=catchup,
            router=self.identity,
            relay=stream.relay_instance or "",
        )
        return await self._ask((Role.PREFILL, prefill), subjects.prefill_submit_to(prefill), msg, SubmitReply)

    async def _ask(self, peer: tuple[Role, str], subject: str, msg, reply_cls: type):
        timeout = self.settings.prepare_timeout_s
        return await ask(
            self.nc, self.fleet, self.settings.lost_after_s, peer, subject, msg, reply_cls, timeout
        )


def md_refusal(prep: PrepareReply) -> APIError:
    """MD busy (its KV memory is taken for now): 503, try again. Otherwise MD refused the
    request itself (e.g. it can never fit MD's KV pool): 400, like prefill's refusal."""
    if prep.busy:
        return APIError(f"main decode is busy ({prep.error}): try again later", 503)
    return APIError(f"main decode refused the request: {prep.error}", 400, "invalid_request_error")


def line_refusal(plan: RoutePlan, waited_s: float, s: RouterSettings) -> APIError:
    """A 429 for a request the line could not take in time: as an OpenAI-compatible server
    answers a rate limit, with Retry-After (the hold's bound, whole seconds)."""
    why = (
        f"held {waited_s:.1f} s"
        if waited_s >= s.line_wait_s
        else f"{s.line_wait_max} requests are waiting already"
    )
    return APIError(
        f"the cross-datacenter KV line is saturated: this request's KV would take "
        f"{plan.decision.est_wan_s:.1f} s to arrive (budget {s.line_budget_s:g} s) and every relay "
        f"is full ({why}); retry later",
        429,
        "rate_limit_error",
        code="rate_limit_exceeded",
        headers={"Retry-After": str(max(1, math.ceil(s.line_wait_s)))},
    )
