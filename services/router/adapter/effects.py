"""Performs what the request life asks for: publishes on NATS, hands deltas to the client's
consumer, starts moves, counts, and frees what a closed stream held."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable

from opentelemetry import trace
from opentelemetry.trace import Span

from shared.bus import subjects
from shared.bus.connection import publish
from shared.bus.delivery import deliver
from shared.bus.messages import Abort, AbortReason, Role
from shared.serving.runtime import Lifecycle
from shared.telemetry.span_store import REQUEST_ID_ATTR
from shared.telemetry.vllm_metrics import RequestMetrics

from ..core.actions import (
    Action,
    Closed,
    CountReports,
    Deliver,
    Forget,
    Move,
    Publish,
    Resume,
    SendAbort,
    UnknownMessage,
)
from ..core.request_stream import Delta, Failure, RequestStream
from ..routing.assignments import Assignments
from . import request_metrics

log = logging.getLogger(__name__)


class Effects:
    def __init__(self, nc, tracer, life: Lifecycle, assignments: Assignments, vllm: RequestMetrics) -> None:
        self.nc, self.tracer, self.life, self.assignments = nc, tracer, life, assignments
        self.vllm = vllm  # the request-level metrics under vLLM's names
        self.inboxes: dict[str, asyncio.Queue[Delta | Failure]] = {}  # by the client's request id
        # Set by the router once its mover exists: (stream, why, cause) -> moved?
        self.migrate: Callable[[RequestStream, str, str], Awaitable[bool]] | None = None

    def inbox(self, stream: RequestStream) -> asyncio.Queue[Delta | Failure]:
        return self.inboxes.setdefault(stream.rid, asyncio.Queue())

    def perform(self, actions: Iterable[Action]) -> None:
        """Now, without waiting: what goes on NATS is sent by a task of its own."""
        for action in actions:
            if isinstance(action, Publish | SendAbort):
                self.life.spawn(self._send(action))
            else:
                self._local(action)

    async def perform_in_order(self, actions: Iterable[Action]) -> None:
        """As perform, but each abort is sent before this returns (a control message that
        must arrive is handed to its own delivery task, which acks and resends it)."""
        for action in actions:
            if isinstance(action, Publish | SendAbort):
                await self._send(action)
            else:
                self._local(action)

    def _local(self, action: Action) -> None:
        if isinstance(action, Deliver):
            if isinstance(action.item, Delta):
                request_metrics.delivered(action.stream, action.item, action.ttft_s, action.gap_s, self.vllm)
            else:
                log.warning("request %s failed: %s", action.stream.rid, action.item.message)
            if (inbox := self.inboxes.get(action.stream.rid)) is not None:
                inbox.put_nowait(action.item)
        elif isinstance(action, Move):
            assert self.migrate is not None
            self.life.spawn(self.migrate(action.stream, action.why, action.cause))
        elif isinstance(action, CountReports):
            request_metrics.count_reports(action)
        elif isinstance(action, UnknownMessage):
            request_metrics.unknown_message()
        elif isinstance(action, Closed):
            self._closed(action.stream)
        elif isinstance(action, Forget):
            self.inboxes.pop(action.rid, None)
        elif not isinstance(action, Resume):  # (a Resume is the mover's to perform)
            raise TypeError(f"no effect for {action!r}")

    def _closed(self, stream: RequestStream) -> None:
        self.inboxes.pop(stream.rid, None)
        for key, at in stream.assigned:
            self.assignments.finished(key, at)
        if stream.span:
            stream.span.set_attributes(
                {
                    "pdd.pipeline": stream.pipeline.value,
                    "pdd.output_tokens": stream.merger.next_index,
                    "pdd.outcome": "ok" if stream.done else "aborted",
                    "pdd.migrations": stream.attempt,
                }
            )
            stream.span.end()

    async def _send(self, action: Publish | SendAbort) -> None:
        if isinstance(action, Publish):  # a control message one instance must get: acked, resent
            self.life.spawn(deliver(self.nc, action.subject, action.msg))
        else:
            await self.publish_abort(
                action.attempt_rid, action.reason, action.stream.span if action.stream else None
            )

    async def publish_abort(self, attempt_rid: str, reason: AbortReason, parent: Span | None = None) -> None:
        ctx = trace.set_span_in_context(parent) if parent else None
        try:
            with self.tracer.start_as_current_span(
                reason.span_name,
                context=ctx,
                attributes={REQUEST_ID_ATTR: attempt_rid, "reason": reason.value},
            ):
                await publish(
                    self.nc, subjects.abort(attempt_rid, Role.ROUTER.value), Abort(attempt_rid, reason)
                )
        except Exception as e:  # NATS gone: peers drop the request when this router's heartbeat stops
            log.warning("could not publish abort for %s: %s", attempt_rid, e)
