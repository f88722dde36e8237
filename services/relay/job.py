"""One relay request: its states and its handoff progress toward MD."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from enum import Enum, auto

from opentelemetry.trace import Span

from shared.bus.messages import HandoffMode
from shared.serving.state_machine import StateMachine, table_of


class RelayState(Enum):
    RELAYING = auto()  # decoding; MD's copy of the prompt KV is still crossing the WAN
    HANDING_OFF = auto()  # MD is ready: token-ID batches are on their way to MD
    HANDED = auto()  # the final batch is sent: MD owns the request
    SOLO = auto()  # MD is out of the picture: the relay finishes the request
    DONE = auto()  # the relay holds nothing more of the request


MOVES = table_of(
    RelayState,
    RELAYING=("HANDING_OFF", "SOLO", "DONE"),
    HANDING_OFF=("HANDED", "SOLO", "DONE"),
    HANDED=("DONE",),
    SOLO=("DONE",),
    DONE=(),
)
HOLDS_REQUEST = (RelayState.RELAYING, RelayState.HANDING_OFF, RelayState.SOLO)  # the relay may end it


@dataclass
class RelayJob:
    rid: str
    catchup_threshold: int
    state: StateMachine[RelayState] = field(default_factory=lambda: StateMachine(RelayState.RELAYING, MOVES))
    mode: HandoffMode | None = None
    handed: int = 0  # output tokens already sent to MD
    seq: int = 0  # next handoff batch number (= catch-up rounds done, before the final one)
    acked: int = -1  # the latest batch MD acked
    produced: int = 0  # tokens this relay generated (the first one came from prefill)
    handoff_at: float | None = None  # when MD's kv_ready started the handoff
    created: float = field(default_factory=time.monotonic)
    timers: list[asyncio.Task] = field(default_factory=list)
    span: Span | None = None  # relay.decode: from the local KV landing to handoff or finish
    router: str = ""  # the router that owns the request
    md_instance: str = ""  # the MD that said it is ready: the handoff goes to it
