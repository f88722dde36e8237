"""One prefill request on the event loop: its states, and the two events that move it toward
draining (MD's target and the first token) as pure functions of the state."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from enum import Enum, StrEnum, auto

from opentelemetry.context import Context
from opentelemetry.trace import Span

from shared.bus.messages import PrefillSubmit, RelayStart
from shared.kv.sender import KVSender
from shared.serving.state_machine import StateMachine, table_of

from .exporter import BlockExport

END = None  # queue sentinel: no more blocks for this destination


class KVPath(StrEnum):
    WAN = "wan"  # to MD, across the datacenters
    LOCAL = "local"  # to the relay, next door


class PrefillState(Enum):
    PREFILLING = auto()  # computing; MD's target not known yet
    TARGETED = auto()  # computing; the blocks MD lacks stream over the WAN
    AWAITING_TARGET = auto()  # first token out; MD's target not known yet
    DRAINING = auto()  # first token out, target known: the senders finish their queues
    RELEASED = auto()  # nothing held


MOVES = table_of(
    PrefillState,
    PREFILLING=("TARGETED", "AWAITING_TARGET", "RELEASED"),
    TARGETED=("DRAINING", "RELEASED"),
    AWAITING_TARGET=("DRAINING", "RELEASED"),
    DRAINING=("RELEASED",),
    RELEASED=(),
)


def after_target(state: PrefillState) -> PrefillState | None:
    """The state once MD's target is known; None if it changes nothing (a duplicate, or gone)."""
    if state is PrefillState.PREFILLING:
        return PrefillState.TARGETED  # the first token will start draining
    if state is PrefillState.AWAITING_TARGET:
        return PrefillState.DRAINING  # the first token is out
    return None


def after_first_token(state: PrefillState) -> PrefillState | None:
    """The state once the first token is out (and more is to decode elsewhere)."""
    if state is PrefillState.PREFILLING:
        return PrefillState.AWAITING_TARGET
    if state is PrefillState.TARGETED:
        return PrefillState.DRAINING
    return None


@dataclass
class PrefillJob:
    """One request's event-loop state (the engine thread has its own, in BlockExporter)."""

    submit: PrefillSubmit
    state: StateMachine[PrefillState] = field(
        default_factory=lambda: StateMachine(PrefillState.PREFILLING, MOVES)
    )
    md_address: str = ""
    md_instance: str = ""  # P→MD: where the first token is handed over
    md_missing: list[int] = field(default_factory=list)  # blocks MD lacks
    md_pending: set[int] = field(default_factory=set)  # blocks MD lacks, not queued yet
    md_end_queued: bool = False
    md_queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    local_queue: asyncio.Queue | None = None
    first_token: int | None = None
    wan_bytes: int = 0
    rdma_bytes: int = 0  # of wan_bytes, written over the RDMA path
    wan_queued: int = 0  # KV bytes waiting in md_queue (reported as backlog to the router)
    streaming: set[KVPath] = field(default_factory=set)  # streams started and not ended yet (core.py)
    senders: dict[KVPath, asyncio.Task] = field(default_factory=dict)
    transfers: dict[KVPath, KVSender] = field(default_factory=dict)  # each stream's (it survives drops)
    ctx: Context | None = None  # trace context of the router's request
    compute_span: Span | None = None

    rid = property(lambda self: self.submit.rid)
    router = property(lambda self: self.submit.router)

    def queue_blocks(self, export: BlockExport) -> None:
        """A step's exported blocks, onto the queue of each stream that sends them."""
        if export.local is not None and self.local_queue is not None:
            self.local_queue.put_nowait(export.local)
        if export.wan is not None:
            hashes, kv = export.wan
            self.md_queue.put_nowait(export.wan)
            self.wan_queued += kv.numel() * kv.element_size()
            self.md_pending.difference_update(hashes)
            self.close_wan_if_complete()

    def end_local_stream(self) -> None:
        """The relay's stream ends with the first token."""
        if self.local_queue is not None:
            self.local_queue.put_nowait(END)

    def close_wan_if_complete(self) -> None:
        """MD asked for an exact set of blocks: the WAN stream ends once all are queued."""
        if not self.md_pending and not self.md_end_queued:
            self.md_end_queued = True
            self.md_queue.put_nowait(END)

    def relay_start(self, traceparent: str | None) -> RelayStart:
        """What the relay decodes from, once it holds the prompt KV."""
        s = self.submit
        assert self.first_token is not None  # the local stream ends only after the first token
        return RelayStart(
            s.rid, s.prompt_ids, self.first_token, s.params, s.catchup_threshold, traceparent, router=s.router
        )
