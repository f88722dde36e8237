"""One request as the router sees it: its route, its merged token stream, and where it is
in its life: which instance produces its tokens now (it must keep listing the request in its
heartbeat), and which can take over if that one is lost.

A request may move (migration by token IDs): each move is a new *attempt* with its own
backend request id, so late messages of an abandoned attempt never mix into the stream.
Plain data and its transitions: the request life (request_life.py) drives it."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum, auto

from opentelemetry.trace import Span, format_trace_id

from shared.bus.messages import DecodeReport, Pipeline, RelayReport, Role, TokenEvent
from shared.engine import SamplingParams
from shared.engine.logprobs import TokenLogprobs
from shared.serving.state_machine import StateMachine, table_of

from ..routing.policy import RouteDecision
from .merger import TokenMerger


class StreamState(Enum):
    DISPATCHING = auto()  # routed: MD's prepare and P's submit are in flight
    RELAYED = auto()  # p-rld-md before the handoff: if MD is lost, the relay finishes it
    WITH_MD = auto()  # p-md, or handed over: only MD can produce the rest
    RELAY_SOLO = auto()  # MD was lost before the handoff: the relay finishes alone
    MIGRATING = auto()  # its instance was lost: looking for another to continue from the tokens sent
    RESUMED = auto()  # continued by one instance (MD or relay) from the tokens already sent
    FINISHED = auto()
    FAILED = auto()


MOVES = table_of(
    StreamState,
    DISPATCHING=("RELAYED", "WITH_MD", "MIGRATING", "FAILED"),
    RELAYED=("WITH_MD", "RELAY_SOLO", "MIGRATING", "FINISHED", "FAILED"),
    WITH_MD=("MIGRATING", "FINISHED", "FAILED"),
    RELAY_SOLO=("MIGRATING", "FINISHED", "FAILED"),
    MIGRATING=("RESUMED", "FINISHED", "FAILED"),
    RESUMED=("MIGRATING", "FINISHED", "FAILED"),
    FINISHED=(),
    FAILED=(),
)
ENDED = (StreamState.FINISHED, StreamState.FAILED)
MOVABLE = (StreamState.RELAYED, StreamState.WITH_MD, StreamState.RELAY_SOLO, StreamState.RESUMED)


@dataclass
class Delta:  # what the client gets next: tokens released in order, and whether that was all
    tokens: list[int]
    finished: bool = False
    finish_reason: str | None = None
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)  # with tokens, when asked for


@dataclass(frozen=True)
class Failure:  # the request ended without its tokens: the client gets this error
    message: str
    status: int = 502
    type_: str = "server_error"


@dataclass
class RequestStream:
    rid: str
    prompt_ids: list[int]
    decision: RouteDecision
    md_instance: str
    block_hashes: list[int] = field(default_factory=list)
    relay_instance: str | None = None  # on P→RLD→MD, or the relay that took the request over
    prefill_instance: str | None = None  # the one that took the request (None: it started elsewhere)
    prefill_epoch: str = ""  # that prefill process (LoadReport.epoch): a restarted one holds nothing
    assigned: list = field(default_factory=list)  # ((role, instance), sent at): counted as their load
    span: Span | None = None  # the request's root span: one trace across both datacenters
    params: SamplingParams | None = None  # what a migration resends, with the prompt and tokens so far
    state: StateMachine[StreamState] = field(
        default_factory=lambda: StateMachine(StreamState.DISPATCHING, MOVES)
    )
    # The router passes one bounded by the request's max_tokens; a stream built without one takes no tokens.
    merger: TokenMerger = field(default_factory=lambda: TokenMerger(max_tokens=0))
    failure: str | None = None  # why the router gave up
    relay: RelayReport | None = None
    decode: DecodeReport | None = None
    created: float = field(default_factory=time.monotonic)
    queued_s: float = 0.0  # how long it waited for admission before `created`
    first_token_at: float | None = None
    merged_at: float | None = None  # when tokens were last merged for the client
    # Who must be holding the request now (listed in its heartbeat), and since when it was seen to.
    producer: tuple[Role, str] | None = None
    offered_to: tuple[Role, str] | None = None  # while moving: the instance asked to take it
    recompute_tokens: int = 0  # what a move makes that instance compute before its next token
    last_held: float = field(default_factory=time.monotonic)
    last_token_at: float | None = None  # when this attempt last produced a token (None: none yet)
    md_produced: bool = False  # this attempt's MD sent a token: it holds all it needs from prefill
    attempt: int = 0  # 0: the first dispatch; n: the n-th migration
    gap_since: float | None = None  # tokens after a missing one arrived at this time
    prompt_logprobs: list[TokenLogprobs] | None = None  # with output 0, when asked for (echo)

    # ---- transitions -----------------------------------------------------------------
    def dispatched(self, prefill: str) -> None:
        self.prefill_instance = prefill
        relayed = self.decision.pipeline is Pipeline.P_RLD_MD
        self.state.to(StreamState.RELAYED if relayed else StreamState.WITH_MD)
        if self.last_token_at is None:
            self.hand_to(Role.PREFILL, prefill)  # until the first token
        else:  # prefill's first token came before MD's answer to prepare did
            self._first_token_out()

    def hand_to(self, role: Role, instance: str) -> None:
        self.producer = (role, instance)
        self.last_held = time.monotonic()

    def observe(self, ev: TokenEvent) -> None:
        """An event of this attempt arrived (the router calls this on arrival, not when the
        client reads it, so a slow client never looks like a stalled instance). Takes the
        reports it carries and follows the request from instance to instance."""
        self.relay = ev.relay or self.relay
        self.decode = ev.decode or self.decode
        self.last_held = time.monotonic()  # progress: whoever sent it still holds the request
        if ev.tokens:
            self.last_token_at = self.last_held
            self.md_produced = self.md_produced or ev.source is Role.MAIN_DECODE
            if ev.index == 0 and self.producer is not None and self.producer[0] is Role.PREFILL:
                self._first_token_out()
        if ev.relay and ev.relay.handed_over and self.state.is_in(StreamState.RELAYED):
            self.state.to(StreamState.WITH_MD)
            self.hand_to(Role.MAIN_DECODE, self.md_instance)

    def _first_token_out(self) -> None:
        """After prefill's first token the relay (P→RLD→MD) or MD (P→MD) produces."""
        if self.state.is_in(StreamState.RELAYED) and self.relay_instance:
            self.hand_to(Role.RELAY, self.relay_instance)
        elif self.state.is_in(StreamState.WITH_MD):
            self.hand_to(Role.MAIN_DECODE, self.md_instance)

    def stall(
        self,
        now: float,
        lost_after_s: float,
        gap_after_s: float,
        stall_after_s: float,
        prefill_lost: bool = False,
        streaming_lost_after_s: float | None = None,
    ) -> tuple[str, str] | None:
        """(why, cause) if the request must move: the instance that should produce it stopped
        listing it in its heartbeat (it died, dropped it, or its heartbeats stopped; once this
        attempt's tokens flowed, silence in both for `streaming_lost_after_s` is enough); its MD
        waits for a prefill that is lost (`prefill_lost`: its KV or first handoff may never
        come); a token went missing in transit (NATS delivers at most once); or, once tokens
        flowed, none came for stall_after_s although someone holds it (a control message
        between instances was lost, and the one holding it waits for it)."""
        if not self.state.is_in(*MOVABLE):
            return None
        quiet_s = lost_after_s if self.last_token_at is None else (streaming_lost_after_s or lost_after_s)
        if self.producer is not None and now - self.last_held > quiet_s:
            role, instance = self.producer
            return f"{role.value} {instance} no longer holds it", "lost"
        if prefill_lost and self.waits_for_prefill:
            return f"prefill {self.prefill_instance} was lost before main decode started", "lost"
        if self.last_token_at is not None and now - self.last_token_at > stall_after_s:
            return f"no token for {now - self.last_token_at:.0f} s", "stall"
        if not self.merger.has_gap:
            self.gap_since = None
        elif self.gap_since is None:
            self.gap_since = now
        elif now - self.gap_since > gap_after_s:
            return f"token {self.merger.next_index} was lost in transit", "gap"
        return None

    @property
    def waits_for_prefill(self) -> bool:
        """P→MD with nothing from MD yet: MD may still wait for prefill's KV or first handoff."""
        return (
            self.state.is_in(StreamState.WITH_MD)
            and self.decision.pipeline is Pipeline.P_MD
            and self.attempt == 0
            and not self.md_produced
        )

    def md_lost(self) -> None:
        """MD stopped reporting before the handoff: the relay finishes the request."""
        self.state.to(StreamState.RELAY_SOLO)

    def migrating(self) -> str:
        """Start a move; the new attempt's backend request id."""
        self.state.to(StreamState.MIGRATING)
        self.attempt += 1
        self.producer, self.offered_to, self.gap_since, self.last_token_at = None, None, None, None
        self.merger.restart_at_released()
        return self.attempt_rid

    def resumed(self, role: Role, instance: str) -> None:
        self.state.to(StreamState.RESUMED)
        self.hand_to(role, instance)
        if role is Role.MAIN_DECODE:
            self.md_instance = instance
        else:
            self.relay_instance = instance

    @property
    def recomputing_on(self) -> tuple[Role, str] | None:
        """Moved, and its new instance (or the one asked) has not sent a token yet: it is
        recomputing the prompt and the tokens so far there (None otherwise)."""
        if self.last_token_at is not None:
            return None
        if self.state.is_in(StreamState.MIGRATING):
            return self.offered_to
        return self.producer if self.state.is_in(StreamState.RESUMED) else None

    def finish(self) -> None:
        self.state.to(StreamState.FINISHED)

    def fail(self, why: str) -> None:
        if not self.state.is_in(*ENDED):
            self.failure = why
            self.state.to(StreamState.FAILED)

    # ---- views -----------------------------------------------------------------------
    @property
    def attempt_rid(self) -> str:
        """The request id the backends know this attempt by."""
        return self.rid if self.attempt == 0 else f"{self.rid}-m{self.attempt}"

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
            "migrations": self.attempt,
            "trace_id": self.trace_id,
            "instances": self.instances(),
        }

    def instances(self) -> dict[str, str | None]:
        """Per role, the last instance of it the request ran on (None: none): after a move,
        the one that took it over."""
        return {
            "prefill": self.prefill_instance,
            "relay": self.relay_instance,
            "main_decode": self.md_instance or None,
        }
