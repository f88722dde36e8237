"""One main-decode request: its states and what it holds while its prompt KV arrives, its
handoff batches are applied, and it decodes."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum, auto

from opentelemetry.context import Context
from opentelemetry.trace import Span

from shared.bus.messages import HandoffBatch, PrepareRequest
from shared.serving.state_machine import StateMachine, table_of


class DecodeState(Enum):
    RECEIVING = auto()  # prepared: prompt KV crossing the WAN; handoff batches wait
    READY = auto()  # prompt KV complete: the next handoff batch can be applied
    EXTENDING = auto()  # one handoff batch's extend pass is running
    DECODING = auto()  # the final batch is in: MD generates until the end
    DONE = auto()  # finished or dropped: nothing is held


MOVES = table_of(
    DecodeState,
    RECEIVING=("READY", "DONE"),
    READY=("EXTENDING", "DONE"),
    EXTENDING=("READY", "DECODING", "DONE"),
    DECODING=("DONE",),
    DONE=(),
)


@dataclass
class MDJob:
    req: PrepareRequest
    rid = property(lambda self: self.req.rid)
    router = property(lambda self: self.req.router)
    missing: set[int]
    state: StateMachine[DecodeState] = field(
        default_factory=lambda: StateMachine(DecodeState.RECEIVING, MOVES)
    )
    received: set[int] = field(default_factory=set)
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

    def end_spans(self) -> None:
        if self.decode_span and self.decode_span.is_recording():
            self.decode_span.set_attribute("md_tokens", self.md_tokens)
            self.decode_span.end()
        if self.receive_span and self.receive_span.is_recording():
            self.receive_span.set_attribute("aborted", True)
            self.receive_span.end()
