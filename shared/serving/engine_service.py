"""What prefill, relay and main decode share: an engine on its own thread, the service's
subscriptions and timers, heartbeats (load reports listing the requests held), pins, the
abort protocol, dropping the requests of a router that went silent, taking over a
request by its token IDs (resume), prefix-cache events for the routers (prefill and MD), and
leaving without failing a request (drain)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any, ClassVar

from opentelemetry import trace
from opentelemetry.trace import Span

from shared.bus import subjects
from shared.bus.connection import publish, respond
from shared.bus.contract import TABLES, At
from shared.bus.messages import (
    Abort,
    AbortReason,
    LinkReport,
    LoadReport,
    ResumeReply,
    ResumeRequest,
    Role,
    TokenEvent,
)
from shared.engine import BlockFormat, Engine, EngineError, EngineStats, StepOutput
from shared.engine.factory import require_available_engine
from shared.engine.outputs import group_by_request
from shared.kv import KVServer, KVSink, start_kv_server
from shared.kv.tls import server_tls
from shared.kv.transport import OnRefused, advertised_address
from shared.model.source import served_name
from shared.serving.engine_loop import EngineLoop, PostStep
from shared.serving.host_share import host_share
from shared.serving.liveness import HEARTBEAT_S
from shared.serving.runtime import Lifecycle
from shared.telemetry import metrics
from shared.telemetry.span_bus import TraceAnswers
from shared.telemetry.span_store import REQUEST_ID_ATTR
from shared.telemetry.tracing import get_tracer
from shared.telemetry.vllm_metrics import EngineMetrics

from .aborts import ABORTS_KEPT_S, RecentAborts
from .cache_events import CacheEvents
from .job_admission import AdmissionGate
from .presence import Presence
from .subscriptions import serve
from .token_outbox import TokenOutbox

KV_SENDERS = (Role.PREFILL.value,)  # the only role whose certificate may send KV over TCP

log = logging.getLogger(__name__)

DRAIN_POLL_S = 0.1  # how often a drain looks whether the requests held have ended
UNFOLLOWED_EVENTS_DROP_S = 5.0  # how often a cache nobody follows drops its events
FREED_RECHECK_S = 0.25  # a wait for freed blocks looks again after this even unwoken (a free it missed)


class EngineService:
    """Base of the three engine services. Per-request state lives in each service's job
    objects, owned by the event loop; the engine is touched only through `engine_loop`."""

    role: ClassVar[Role]
    publishes_cache: ClassVar[bool] = False  # its prefix cache steers routing: the routers follow it
    # On a host shared with other engines (settings.host_share_dir): prefill publishes its
    # queued prompt tokens, the decoders give way to a burst of them (host_share.py).
    publishes_backlog: ClassVar[bool] = False

    @classmethod
    async def preflight(cls, settings: Any) -> None:
        """Settings checks that exit 2 before the service connects anywhere: an engine this
        build cannot run; a service adds its own."""
        require_available_engine(settings.engine, cls.role.value, settings.model)

    def __init__(self, settings: Any, nc: Any, engine: Engine, post_step: PostStep | None = None):
        self.settings = settings
        self.nc = nc
        self.engine = engine
        self.tokens = TokenOutbox(nc)
        # prefill publishes its backlog, a decoder gives way to it, on a host they share
        self.backlog, self.give_way = host_share(settings, self.publishes_backlog)
        self.engine_loop = EngineLoop(
            engine,
            self._on_step,
            post_step,
            settings.engine_call_timeout_s,
            on_stats=self.backlog.after_step if self.backlog else None,
            give_way=self.give_way,
            service=self.role.value,
        )
        self.tracer = get_tracer(self.role.value, settings.instance, settings.datacenter)
        discovery = {"instance": settings.instance, "datacenter": settings.datacenter}
        self.life = Lifecycle(f"pdd-{self.role.value.replace('_', '-')}", discovery)
        self.kv_server: KVServer | None = None
        self.advertise_address = ""  # what peers dial for this service's KV, once it listens
        self.jobs: dict[str, Any] = {}  # rid -> the service's job (event loop only)
        self.presence = Presence(self.role, settings.instance, nc, settings.orphan_after_s)
        self.aborted = RecentAborts()
        self._freed = asyncio.Event()  # set when KV blocks went back to the pool
        self.cache_events = CacheEvents(self.role, settings.instance, nc, self.engine_loop, engine)
        # This host's spans, for the router's GET /v1/traces when the DCs are separate hosts.
        self.traces = TraceAnswers(self.role, settings.instance, settings.datacenter)
        self.admission = AdmissionGate(self.life, nc, self.jobs, self.aborted, self.on_abort_message)
        self.blocks_used = metrics.KV_BLOCKS_USED.labels(service=self.role.value, instance=settings.instance)
        self.vllm = EngineMetrics(served_name(settings.model, engine.model_id), settings.instance)
        self.track("jobs", lambda: len(self.jobs))
        self.track("engine_requests", engine.num_requests)
        self.track("pins", engine.num_pin_owners)
        self.track("routers", lambda: len(self.presence.routers))
        self.track("aborted", lambda: len(self.aborted))

    # ---- lifecycle -------------------------------------------------------------------
    async def start(self) -> None:
        self.engine_loop.start()
        await self.life.announce(self.nc)
        at = At(self.settings.instance, self.settings.datacenter, self.advertise_address)
        await serve(self, TABLES[self.role.value], at, self.life, self.nc, self.admission)
        self.life.every(HEARTBEAT_S, self.report_load)
        self.life.every(HEARTBEAT_S, self._drop_orphans)
        self.life.every(ABORTS_KEPT_S / 10, self._forget_old_aborts)
        if self.publishes_cache:
            self.cache_events.start(self.life)
        else:  # nobody follows this cache: its events would only pile up
            self.life.every(UNFOLLOWED_EVENTS_DROP_S, self.cache_events.drop)
        # Started means reachable: the server has every subscription before start returns.
        await self.nc.flush(timeout=10)

    async def stop(self) -> None:
        await self.life.close()
        if self.kv_server:
            await self.kv_server.close()
        await self.engine_loop.stop()
        for shared in (self.backlog, self.give_way):
            if shared:
                shared.close()

    # ---- leaving (scale-in) ----------------------------------------------------------------
    async def drain(self, timeout_s: float) -> None:
        """Leave without failing a request: say so in a heartbeat now (routers stop choosing
        this instance), refuse new work (the router takes it elsewhere), and wait up to
        timeout_s for the requests held to end. Those still held then are released with an
        error, so their router moves them to another instance by token IDs."""
        self.admission.close(f"{self.role.value} {self.settings.instance} is leaving")
        log.info("%s %s leaving: %d requests held", self.role.value, self.settings.instance, len(self.jobs))
        try:
            await self.report_load()
        except Exception as e:  # the periodic heartbeat says it soon enough
            log.warning("could not announce the drain: %s", e)
        deadline = time.monotonic() + timeout_s
        while (self.jobs or self.admission.in_flight) and time.monotonic() < deadline:  # noqa: ASYNC110 - jobs end in many places
            await asyncio.sleep(DRAIN_POLL_S)
        for job in list(self.jobs.values()):
            log.warning("request %s still held after the %g s drain: released", job.rid, timeout_s)
            await self.release_on_leaving(job)

    @property
    def draining(self) -> bool:
        """Leaving: new work is refused, what is held is finished."""
        return self.admission.closed is not None

    async def release_on_leaving(self, job: Any) -> None:
        """Give up a request at the end of a drain, so that its router moves it."""
        raise NotImplementedError

    async def serve_kv(
        self, address: str, sink: KVSink | None = None, on_refused: OnRefused | None = None
    ) -> None:
        """Receive KV on the bulk channel into `sink` (default: this service's on_blocks/on_done/on_abort);
        `on_refused`: told of a sender refused for its identity."""
        self.kv_server = await listen_for_kv(
            self.settings, self.engine.block_format(), address, sink or self, on_refused=on_refused
        )
        self.advertise_address = await advertised(self.settings, self.kv_server.address)

    # ---- what each service defines ---------------------------------------------------
    async def _on_step(self, outputs: list[StepOutput], extra: Any) -> None:
        async with self.tokens.collecting():  # the step's token events leave together, per router
            await self.on_outputs(outputs, extra)

    async def on_outputs(self, outputs: list[StepOutput], extra: Any) -> None:
        """One step's outputs, per live request."""
        if any(o.finished for o in outputs):
            self._freed.set()  # a finished sequence gave its blocks back
        for rid, outs in group_by_request(outputs).items():
            job = self.jobs.get(rid)
            if job is not None:
                await self.request_outputs(job, outs)

    async def request_outputs(self, job: Any, outs: list[StepOutput]) -> None:
        raise NotImplementedError

    async def on_abort_message(self, msg: Abort, source: Role) -> None:
        """Another role (`source`, from the subject) gave up on `msg.rid`."""
        raise NotImplementedError

    def load_address(self) -> str | None:
        return self.advertise_address or None

    def load_links(self) -> list[LinkReport]:
        return []

    def track(self, name: str, size: metrics.SizeOf) -> None:
        """Publish one of this service's maps as pdd_open_entries{service=role, map=name}."""
        metrics.track(self.role.value, name, size)

    # ---- load ------------------------------------------------------------------------
    async def report_load(self) -> EngineStats:
        stats = self.engine_loop.stats  # not a call: a heartbeat never waits for a step to end
        self.blocks_used.set(stats.used_blocks)
        self.vllm.update(stats)
        report = self.presence.report(
            stats,
            self.jobs,
            address=self.load_address(),
            links=self.load_links(),
            model_id=self.engine.model_id,
            draining=self.draining,
        )
        await publish(self.nc, subjects.load(self.role.value, self.settings.instance), report)
        return stats

    # ---- the owning router ------------------------------------------------------------
    async def on_router_heartbeat(self, report: LoadReport, raw: Any) -> None:
        self.presence.routers.heard(report.instance)

    async def _drop_orphans(self) -> None:
        """A router that stopped heartbeating cannot stream its requests to anyone: drop them
        and free their blocks (a restarted router re-sends the ones it still wants)."""
        for job in self.presence.orphans(self.jobs.values()):
            log.warning("request %s: router %s stopped heartbeating; dropping it", job.rid, job.router)
            await self.on_abort_message(Abort(job.rid, AbortReason.ROUTER_LOST, job.router), Role.ROUTER)

    async def _forget_old_aborts(self) -> None:
        self.aborted.forget_old(time.monotonic())
        self.admission.forget_old()

    # ---- migration by token IDs ---------------------------------------------------------
    async def admit_resumed(self, msg: ResumeRequest, raw: Any, job: Any) -> bool:
        """Run `job` from the prompt plus the tokens the client already has: the engine reuses
        the cached prefix and recomputes the rest, then decodes from output index
        len(msg.generated). Replies to the router; False if the engine refused."""
        self.jobs[msg.rid] = job
        tokens = msg.prompt_ids + msg.generated
        try:
            msg.params.validate()
            await self.engine_loop.call(
                self.engine.add_request, msg.rid, tokens, msg.params, num_prompt_tokens=len(msg.prompt_ids)
            )
        except EngineError as e:
            self.jobs.pop(msg.rid, None)
            await respond(raw, ResumeReply(ok=False, error=str(e)))
            return False
        await respond(raw, ResumeReply(ok=True))
        return True

    # ---- freeing ---------------------------------------------------------------------
    def _free_now(self, rid: str) -> None:  # engine thread
        self.engine.abort(rid)
        self.engine.unpin(rid)

    async def free(self, rid: str) -> None:
        """Drop the request's sequence and its pinned blocks (late or not: must_run)."""
        await self.engine_loop.call(self._free_now, rid, must_run=True)
        self._freed.set()

    async def unpin(self, rid: str) -> None:
        await self.engine_loop.call(self.engine.unpin, rid, must_run=True)
        self._freed.set()

    async def blocks_freed(self) -> None:
        """Return once KV blocks may have gone back to the pool since the last call (for a
        wait for room); bounded, since a free between a failed try and this wait is missed."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._freed.wait(), FREED_RECHECK_S)
        self._freed.clear()

    # ---- messages --------------------------------------------------------------------
    async def on_bus_abort(self, msg: Abort, raw: Any) -> None:
        try:
            source = Role(subjects.abort_source(raw.subject))
        except ValueError:
            return  # not a role's subject: nobody we know sent it
        if source is not self.role:
            self.aborted.heard(msg, source, time.monotonic())
            await self.on_abort_message(msg, source)

    def was_aborted(self, rid: str) -> bool:
        """Another role gave up on `rid` lately: a job for it must not start (or not stay)."""
        return rid in self.aborted

    async def send_abort(
        self, rid: str, reason: AbortReason, detail: str = "", parent: Span | None = None
    ) -> None:
        """Tell every other role to drop `rid`."""
        ctx = trace.set_span_in_context(parent) if parent else None
        attrs = {REQUEST_ID_ATTR: rid, "reason": reason.value, "detail": detail}
        with self.tracer.start_as_current_span(reason.span_name, context=ctx, attributes=attrs):
            await publish(self.nc, subjects.abort(rid, self.role.value), Abort(rid, reason, detail))

    async def send_tokens(self, router: str, event: TokenEvent) -> None:
        """To the router that owns the request (within a step: with the step's other events)."""
        await self.tokens.send(router, event)

    def count_unknown_request(self) -> None:
        metrics.UNKNOWN_REQUEST_MESSAGES.labels(service=self.role.value).inc()


async def advertised(settings: Any, bound: str) -> str:
    """What peers dial for a KV listener bound at `bound`: the settings' advertise_address
    (PDD_<ROLE>_ADVERTISE) when given, else `bound` with a wildcard host as this host's IP."""
    return getattr(settings, "advertise_address", None) or await advertised_address(bound)


async def listen_for_kv(
    settings: Any, fmt: BlockFormat, address: str, sink: KVSink, on_refused: OnRefused | None = None
) -> KVServer:
    """The bulk channel's listener into `sink`. TLS on tcp:// when the settings name
    certificates, and then only from a sender whose certificate names prefill (the local unix://
    path goes by the settings' secret); groups that are not this model's dtype and per-block
    shape (`fmt`) are refused before any memory is reserved for them."""
    expect = (fmt.dtype, fmt.shape)
    tls = server_tls(settings)
    return await start_kv_server(
        address, settings.secret, sink, ssl=tls, expect=expect, peer_roles=KV_SENDERS, on_refused=on_refused
    )
