"""One request as the router sees it: its route, its merged token stream, and where it is
in its life (which instance can still finish it if main decode is lost)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from enum import Enum, auto

from opentelemetry.trace import Span, format_trace_id

from shared.bus.messages import DecodeReport, Pipeline, RelayReport, TokenEvent
from shared.state_machine import StateMachine, table_of

from .merger import TokenMerger
from .policy import RouteDecision


class StreamState(Enum):
    DISPATCHING = auto()  # routed: MD's prepare and P's submit are in flight
    RELAYED = auto()  # p-rld-md before the handoff: if MD is lost, the relay finishes it
    WITH_MD = auto()  # p-md, or handed over: only MD can produce the rest
    RELAY_SOLO = auto()  # MD was lost before the handoff: the relay finishes alone
    FINISHED = auto()
    FAILED = auto()


MOVES = table_of(
    StreamState,
    DISPATCHING=("RELAYED", "WITH_MD", "FAILED"),
    RELAYED=("WITH_MD", "RELAY_SOLO", "FINISHED", "FAILED"),
    WITH_MD=("FINISHED", "FAILED"),
    RELAY_SOLO=("FINISHED", "FAILED"),
    FINISHED=(),
    FAILED=(),
)
ENDED = (StreamState.FINISHED, StreamState.FAILED)


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
    md_instance: str
    block_hashes: list[int] = field(default_factory=list)
    relay_instance: str | None = None  # on P→RLD→MD
    span: Span | None = None  # the request's root span: one trace across both datacenters
    state: StateMachine[StreamState] = field(default_factory=lambda: StateMachine(StreamState.DISPATCHING, MOVES))
    queue: asyncio.Queue[TokenEvent | None] = field(default_factory=asyncio.Queue)  # None: the router gave up
    # The router passes one bounded by the request's max_tokens; a stream built without one takes no tokens.
    merger: TokenMerger = field(default_factory=lambda: TokenMerger(max_tokens=0))
    failure: str | None = None  # why the router gave up
    relay: RelayReport | None = None
    decode: DecodeReport | None = None
    created: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None

    # ---- transitions -----------------------------------------------------------------
    def dispatched(self) -> None:
        relayed = self.decision.pipeline is Pipeline.P_RLD_MD
        self.state.to(StreamState.RELAYED if relayed else StreamState.WITH_MD)

    def observe(self, ev: TokenEvent) -> None:
        """Take the reports an event carries; a relay that handed over leaves MD in charge."""
        self.relay = ev.relay or self.relay
        self.decode = ev.decode or self.decode
        if ev.relay and ev.relay.handed_over and self.state.is_in(StreamState.RELAYED):
            self.state.to(StreamState.WITH_MD)

    def md_lost(self) -> bool:
        """MD stopped reporting. True if the relay can still finish the request; else the
        request has failed (the consumer is woken)."""
        if self.state.is_in(StreamState.RELAYED):
            self.state.to(StreamState.RELAY_SOLO)
            return True
        self.fail(f"main decode instance {self.md_instance} was lost")
        self.queue.put_nowait(None)
        return False

    def finish(self) -> None:
        self.state.to(StreamState.FINISHED)

    def fail(self, why: str) -> None:
        if not self.state.is_in(*ENDED):
            self.failure = why
            self.state.to(StreamState.FAILED)

    # ---- views -----------------------------------------------------------------------
    @property
    def done(self) -> bool:
        return self.state.is_in(StreamState.FINISHED)

    @property
    def pipeline(self) -> Pipeline:
        if self.relay is not None and not self.relay.handed_over:
            return Pipeline.RLD_ONLY
        return self.decision.pipeline

    @property
    def trace_id(self) -> str | None:
        return format_trace_id(self.span.get_span_context().trace_id) if self.span else None

    @property
    def traceparent(self) -> str | None:
        if not self.span:
            return None
        ctx = self.span.get_span_context()
        return f"00-{format_trace_id(ctx.trace_id)}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"

    def summary(self) -> dict:
        relay, decode = self.relay, self.decode
        return {
            "pipeline": self.pipeline.value,
            "prefix_hit_rate": round(self.decision.hit_rate, 4),
            "handoff_mode": relay.handoff_mode.value if relay and relay.handoff_mode else None,
            "handoff_batches": relay.handoff_batches if relay else 0,
            "rld_tokens": relay.rld_tokens if relay else 0,
            "md_tokens": decode.md_tokens if decode else 0,
            "wan_bytes": decode.wan_bytes if decode else 0,
            "trace_id": self.trace_id,
        }
