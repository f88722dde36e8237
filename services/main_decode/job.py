"""One main-decode request: its states and what it holds while its prompt KV arrives, its
handoff batches are applied, and it decodes. The handoff protocol lives here as plain methods
of (job, event) with no I/O: a batch arrives (`hold`), the next one to apply (`next_extend`),
its extend pass ran (`extended`). The service performs what they decide."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum, auto

from opentelemetry.context import Context
from opentelemetry.trace import Span

from shared.bus.messages import HandoffBatch, PrepareRequest
from shared.serving.state_machine import StateMachine, table_of


class MainDecodeState(Enum):
    RECEIVING = auto()  # prepared: prompt KV crossing the WAN (its own, or others'); handoff batches wait
    READY = auto()  # prompt KV complete: the next handoff batch can be applied
    EXTENDING = auto()  # one handoff batch's extend pass is running
    DECODING = auto()  # the final batch is in: MD generates until the end
    DONE = auto()  # finished or dropped: nothing is held


MOVES = table_of(
    MainDecodeState,
    RECEIVING=("READY", "DONE"),
    READY=("EXTENDING", "DONE"),
    EXTENDING=("READY", "DECODING", "DONE"),
    DECODING=("DONE",),
    DONE=(),
)


@dataclass
class Extend:
    """One handoff batch to apply: the first one adds the request to the engine."""

    batch: HandoffBatch
    ctx: Context
    first: bool


@dataclass
class MainDecodeJob:
    req: PrepareRequest
    rid = property(lambda self: self.req.rid)
    router = property(lambda self: self.req.router)
    missing: set[int]
    state: StateMachine[MainDecodeState] = field(
        default_factory=lambda: StateMachine(MainDecodeState.RECEIVING, MOVES)
    )
    received: set[int] = field(default_factory=set)
    kv_sent_at: float | None = None  # prefill's transfer of `missing` ended (its done marker came)
    last_block_at: float | None = None  # when a block of its transfer last landed
    computed_blocks: int = 0  # blocks it waited for whose transfer failed: its extend computes them
    batches: dict[int, tuple[HandoffBatch, Context]] = field(default_factory=dict)  # seq -> batch, sender ctx
    next_seq: int = 0
    next_index: int = 0  # output index the next handoff batch must start at
    wan_bytes: int = 0
    md_tokens: int = 0
    created: float = field(default_factory=time.monotonic)
    ctx: Context | None = None  # the router's request context
    receive_span: Span | None = None
    decode_span: Span | None = None

    def redelivery(self, seq: int) -> str | None:
        """Why handoff batch `seq` is a redelivery to drop: "stale" (already applied) or
        "duplicate" (held, waiting for an earlier one); None for a new batch."""
        if seq < self.next_seq:
            return "stale"
        return "duplicate" if seq in self.batches else None

    def hold(self, batch: HandoffBatch, ctx: Context) -> str | None:
        """A batch arrived: keep it until its turn. Returns why it is dropped instead (a
        redelivery: the first copy stands)."""
        reason = self.redelivery(batch.seq)
        if reason is None:
            self.batches[batch.seq] = (batch, ctx)
        return reason

    def next_extend(self) -> Extend | str | None:
        """The batch to apply now, strictly in seq order: only a READY job starts one, and
        EXTENDING keeps a second one out until it is applied. None: nothing to do yet; a str:
        why the request fails (a batch that does not continue the output, or an empty one)."""
        if not (self.state.is_in(MainDecodeState.READY) and self.next_seq in self.batches):
            return None
        batch, ctx = self.batches.pop(self.next_seq)
        if batch.start_index != self.next_index or not batch.tokens:
            return f"handoff batch {batch.seq} out of order or empty"
        self.state.to(MainDecodeState.EXTENDING)
        return Extend(batch, ctx, first=self.next_seq == 0)

    def extended(self, batch: HandoffBatch) -> None:
        """The batch's extend pass ran: after the final one MD decodes on its own."""
        self.next_seq += 1
        self.next_index += len(batch.tokens)
        self.state.to(MainDecodeState.DECODING if batch.final else MainDecodeState.READY)

    def end_spans(self) -> None:
        if self.decode_span and self.decode_span.is_recording():
            self.decode_span.set_attribute("md_tokens", self.md_tokens)
            self.decode_span.end()
        if self.receive_span and self.receive_span.is_recording():
            self.receive_span.set_attribute("aborted", True)
            self.receive_span.end()
