"""The router's request side, assembled: the request life (a pure state machine) and the
collaborators that route, dispatch, move, subscribe, keep time and perform its actions."""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator

from opentelemetry.context import Context

from shared.bus.messages import AbortReason, Pipeline, Role
from shared.config import RouterSettings
from shared.engine import SamplingParams
from shared.serving.runtime import Lifecycle
from shared.telemetry.tracing import get_tracer
from shared.telemetry.vllm_metrics import RequestMetrics

from .adapter import request_metrics
from .adapter.bus_adapter import BusAdapter
from .adapter.consumer import Consumer
from .adapter.dispatch import Dispatcher
from .adapter.effects import Effects
from .adapter.migration import Mover
from .core.actions import Deliver
from .core.options import PddOptions
from .core.request_life import RequestLife
from .core.request_stream import Delta, Failure, RequestStream
from .core.set_aside import SetAside
from .routing.cache_view import CacheView
from .routing.fleet_view import FleetView
from .routing.policy import RouteDecision
from .routing.prefix_index import PrefixIndex
from .routing.registry import Registry


class RouterCore:
    def __init__(
        self,
        settings: RouterSettings,
        nc,
        *,
        model_id: str,
        block_size: int,
        kv_bytes_per_token: int,
        served_model_name: str | None = None,
    ):
        # model_id: the weights' identity (KV block hashes); served_model_name: the API's model id.
        self.settings, self.nc, self.model_id = settings, nc, model_id
        self.served_model_name = served_model_name or model_id
        # Instance plus a per-process suffix: the requests of a router that restarted under the
        # same instance id belong to a router that is gone, and backends drop them.
        self.identity = f"{settings.instance}-{secrets.token_hex(4)}"
        # Its request ids start with this (a late event of another router's request is ignored).
        rid_prefix = f"cmpl-{self.identity}-"
        tracer = get_tracer("router", settings.instance, settings.datacenter)
        self.life = Lifecycle()
        self.requests = RequestLife(settings, rid_prefix)
        self.fleet = FleetView(
            settings, model_id=model_id, block_size=block_size, kv_bytes_per_token=kv_bytes_per_token
        )
        self.fleet.bound_for_relays = self.requests.bound_for_relays
        self.set_aside = SetAside()
        self.fleet.set_aside = self.set_aside.of
        self.vllm = RequestMetrics(self.served_model_name, settings.instance)
        request_metrics.start()
        self.effects = Effects(nc, tracer, self.life, self.fleet.assignments, self.vllm)
        self.mover = Mover(settings, nc, tracer, self.identity, self.requests, self.fleet, self.effects)
        self.effects.migrate = self.mover.migrate
        self.dispatcher = Dispatcher(
            settings, nc, tracer, self.identity, rid_prefix, self.requests, self.fleet, self.effects
        )
        self.bus = BusAdapter(settings, nc, self.identity, self.requests, self.fleet, self.effects, self.life)
        self.bus.set_aside = self.set_aside
        self.consumer = Consumer(settings, self.requests, self.effects)

    async def start(self) -> None:
        await self.bus.start()

    async def stop(self) -> None:
        await self.life.close()
        for rid in list(self.streams):
            await self.abort(rid, AbortReason.ROUTER_SHUTDOWN)

    def end_streams(self, message: str) -> int:
        """End every stream with `message` (a drain ran out of time): each client gets the
        error in its stream and the backends free the request. How many there were."""
        streams = list(self.streams.values())
        self.effects.perform(Deliver(s, Failure(message, 503)) for s in streams)
        return len(streams)

    async def abandon(self, rid: str) -> None:
        """The client of `rid` (a request of this router or of another one, maybe dead) resumed
        it in a new request: its first run stops now, not when its router's silence is noticed."""
        if (stream := self.streams.get(rid)) is not None:
            self.effects.perform(
                [Deliver(stream, Failure("the client resumed the stream in another request"))]
            )
            return
        attempts = [rid] + [f"{rid}-m{k}" for k in range(1, self.settings.migration_limit + 1)]
        for attempt_rid in attempts:
            await self.effects.publish_abort(attempt_rid, AbortReason.CLIENT_GONE)

    def ready(self) -> dict[str, int]:
        return {
            role.value: len(self.registry.alive(role))
            for role in (Role.PREFILL, Role.RELAY, Role.MAIN_DECODE)
        }

    # ---- a request ---------------------------------------------------------------------
    async def open(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        options: PddOptions | None = None,
        trace_context: Context | None = None,
    ) -> RequestStream:
        """Route and dispatch a request; `trace_context` is the caller's (W3C headers), if any."""
        return await self.dispatcher.open(prompt_ids, params, options, trace_context)

    def deltas(self, stream: RequestStream) -> AsyncIterator[Delta]:
        """Ordered new tokens until the request finishes; raises APIError on failure."""
        return self.consumer.deltas(stream)

    def release(self, stream: RequestStream) -> None:
        """Free a stream whose deltas() never ran to its end; a no-op once it is closed."""
        self.consumer.release(stream)

    async def abort(self, rid: str, reason: AbortReason) -> None:
        """Give up on the client's request `rid`: every instance drops its current attempt."""
        await self.effects.perform_in_order(self.requests.abort(rid, reason))

    def route(
        self, prompt_ids: list[int], forced: Pipeline | None
    ) -> tuple[RouteDecision, str, str | None, str | None, list[int]]:
        """See FleetView.route."""
        return self.fleet.route(prompt_ids, forced)

    # ---- what the HTTP side and the open-entries gauges read ---------------------------
    @property
    def streams(self) -> dict[str, RequestStream]:
        return self.requests.streams

    @property
    def attempts(self) -> dict[str, RequestStream]:
        return self.requests.attempts

    @property
    def stale_aborted(self) -> dict[str, float]:
        return self.requests.stale_aborted

    @property
    def strays(self) -> dict[str, float]:
        return self.requests.strays

    @property
    def registry(self) -> Registry:
        return self.fleet.registry

    @property
    def index(self) -> PrefixIndex:
        return self.fleet.index

    @property
    def prefill_index(self) -> PrefixIndex:
        return self.fleet.prefill_index

    @property
    def caches(self) -> dict[Role, CacheView]:
        return self.fleet.caches
