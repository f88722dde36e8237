"""Migration by token IDs: a request whose instance is lost continues on a live one from the
tokens the client already has. The request life starts the move and takes its outcome; this
offers the new attempt to the candidates, best first, until one takes it."""

from __future__ import annotations

import asyncio
import logging
import time

from opentelemetry import trace

from shared.bus import subjects
from shared.bus.messages import ResumeReply, ResumeRequest, Role
from shared.config import RouterSettings
from shared.serving.liveness import HEARTBEAT_S
from shared.telemetry import metrics
from shared.telemetry.span_store import REQUEST_ID_ATTR

from ..core.actions import Resume
from ..core.request_life import RequestLife
from ..core.request_stream import RequestStream
from ..routing.fleet_view import FleetView
from .dispatch import ask
from .effects import Effects

log = logging.getLogger(__name__)


# A move is a stalled stream's whole wait: a copy lost while a gateway reconnects is sent again
# sooner than a dispatch's (an instance answers a resume within a step; a repeat gets that answer).
MOVE_RESEND_FIRST_S = 0.4


class Mover:
    def __init__(
        self,
        settings: RouterSettings,
        nc,
        tracer,
        identity: str,
        requests: RequestLife,
        fleet: FleetView,
        effects: Effects,
    ) -> None:
        self.settings, self.nc, self.tracer, self.identity = settings, nc, tracer, identity
        self.requests, self.fleet, self.effects = requests, fleet, effects

    async def migrate(self, stream: RequestStream, why: str, cause: str) -> bool:
        """Move the request; False (the stream failed, its consumer told) if no instance takes it."""
        old = stream.attempt_rid
        actions = self.requests.move(stream, why, cause)
        self.effects.perform(actions)
        if not any(isinstance(a, Resume) for a in actions):
            return False  # ended, moving already, or out of moves
        log.warning("request %s (attempt %s): %s; moving it by token IDs", stream.rid, old, why)
        metrics.MIGRATIONS.labels(cause=cause).inc()
        ctx = trace.set_span_in_context(stream.span) if stream.span else None
        attrs = {
            REQUEST_ID_ATTR: stream.rid,
            "reason": why,
            "attempt": stream.attempt,
            "tokens_sent": stream.merger.next_index,
        }
        with self.tracer.start_as_current_span("router.migrate", context=ctx, attributes=attrs) as span:
            target = await self._resume(stream)
            span.set_attribute("target", f"{target[0].value}/{target[1]}" if target else "")
        if target is None:
            self.effects.perform(self.requests.give_up(stream, f"{why}; no live instance took the request"))
            return False
        self.requests.resumed(stream, *target)
        return True

    async def _resume(self, stream: RequestStream) -> tuple[Role, str] | None:
        """Offer the request to the candidates (best first; a lost producer, being silent, is
        none) until one takes it; wait a little for one to (re)appear. The instance that took
        it, or None."""
        avoid: set[tuple[Role, str]] = set()
        assert stream.params is not None
        msg = ResumeRequest(
            stream.attempt_rid,
            stream.prompt_ids,
            list(stream.merger.released),
            stream.params,
            router=self.identity,
        )
        deadline = time.monotonic() + self.settings.migration_wait_s
        while True:
            # The best candidate, chosen anew after each refusal: the other moves meanwhile changed what
            # is queued where.
            while targets := self.fleet.move_targets(
                stream.prompt_ids, stream.block_hashes, len(msg.generated), avoid, self.requests.recomputing()
            ):
                role, instance, tokens = targets[0]
                # (The moves that choose meanwhile count it there.)
                stream.offered_to, stream.recompute_tokens = (role, instance), tokens
                try:
                    subject = subjects.resume(role.value, instance)
                    reply = await ask(
                        self.nc,
                        self.fleet,
                        self.settings.lost_after_s,
                        (role, instance),
                        subject,
                        msg,
                        ResumeReply,
                        self.settings.resume_timeout_s,
                        MOVE_RESEND_FIRST_S,
                    )
                except Exception as e:  # gone, frozen, or NATS trouble: try the next one
                    reply = ResumeReply(ok=False, error=str(e) or type(e).__name__)
                if reply.ok:
                    return role, instance
                log.warning(
                    "request %s: %s %s did not take it: %s", stream.rid, role.value, instance, reply.error
                )
                avoid = avoid | {(role, instance)}
            stream.offered_to = None
            if time.monotonic() > deadline:
                return None
            await asyncio.sleep(HEARTBEAT_S)
