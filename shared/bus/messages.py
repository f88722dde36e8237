"""The control messages of the PDD protocol (msgpack maps with a schema version `v`).

Token indices are output positions: index 0 is the first generated token (sampled by
prefill), whatever instance produced it. KV bytes never travel in these messages.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from shared.bus.codec import Message

if TYPE_CHECKING:
    from shared.engine.outputs import EngineStats


@dataclass
class PrepareRequest(Message):
    """router → MD (request/reply): expect the KV of this prompt."""

    rid: str
    prompt_ids: list[int]
    params: dict[str, Any]
    block_hashes: list[int]
    pipeline: str  # "p-md" | "p-rld-md"


@dataclass
class PrepareReply(Message):
    ok: bool
    missing: list[int] = field(default_factory=list)  # block hashes MD lacks: only these cross the WAN
    bulk_address: str = ""
    error: str | None = None


@dataclass
class PrefillSubmit(Message):
    """router → P (queue group, request/reply)."""

    rid: str
    prompt_ids: list[int]
    params: dict[str, Any]
    pipeline: str
    md_instance: str
    md_bulk_address: str = ""  # with md_missing None: both follow in an MDTarget
    md_missing: list[int] | None = None
    relay_instance: str | None = None
    relay_address: str | None = None
    options: dict[str, Any] = field(default_factory=dict)  # per-request operator overrides (e.g. catchup_threshold)


@dataclass
class MDTarget(Message):
    """router → P: MD's answer to prepare, sent once it is in. The router asks MD and P at
    the same time, so prefill never waits a WAN round trip for it."""

    rid: str
    md_bulk_address: str
    md_missing: list[int]


@dataclass
class SubmitReply(Message):
    ok: bool
    instance: str = ""
    error: str | None = None


@dataclass
class TokenEvent(Message):
    """P / RLD / MD → router: tokens[i] has output index `index + i`.

    `finished` means no token follows the last one carried here.
    """

    rid: str
    source: str  # "prefill" | "relay" | "main_decode"
    index: int
    tokens: list[int]
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None
    stats: dict[str, Any] = field(default_factory=dict)


@dataclass
class KVReady(Message):
    """MD → RLD, router: MD holds the whole prompt KV and can take the handoff."""

    rid: str
    md_instance: str
    wan_bytes: int = 0


@dataclass
class HandoffBatch(Message):
    """RLD (or P on P→MD) → MD: generated token IDs, never their KV."""

    rid: str
    seq: int
    start_index: int
    tokens: list[int]
    final: bool
    mode: str  # "prefill" | "one-shot" | "catch-up"


@dataclass
class HandoffAck(Message):
    """MD → RLD: batch `seq` is extended (its KV is in MD)."""

    rid: str
    seq: int
    ok: bool = True
    error: str | None = None


# The pipelines a request can take (x-pdd-pipeline). RLD_ONLY is never a routing choice: only
# the anomalous-traffic filter or a fault fallback ends a request there.
P_MD, P_RLD_MD, RLD_ONLY = "p-md", "p-rld-md", "rld-only"

MD_LOST = "md_lost"  # Abort reason: the request's MD stopped reporting; a relay still holding it finishes it


@dataclass
class Abort(Message):
    """anyone → all: stop work on `rid` and free what it holds (but see MD_LOST)."""

    rid: str
    reason: str
    source: str = ""


@dataclass
class KVEvents(Message):
    """MD / P → router: blocks that entered or left an instance's prefix cache."""

    instance: str
    stored: list[int] = field(default_factory=list)
    evicted: list[int] = field(default_factory=list)
    reset: bool = False  # the sender restarted: forget what it held


@dataclass
class LoadReport(Message):
    """Periodic health and load of one instance."""

    service: str
    instance: str
    running: int = 0
    waiting: int = 0
    num_blocks: int = 0
    used_blocks: int = 0
    free_blocks: int = 0
    address: str | None = None  # MD: bulk address to dial; RLD: local fast-path address
    links: dict[str, Any] = field(default_factory=dict)  # P: peer -> {"bandwidth": B/s, "rtt": s}
    model_id: str = ""


def load_report(service: str, instance: str, stats: EngineStats, **extra: Any) -> LoadReport:
    """A LoadReport from an engine's stats()."""
    return LoadReport(
        service=service, instance=instance, running=stats.running, waiting=stats.waiting,
        num_blocks=stats.num_blocks, used_blocks=stats.used_blocks, free_blocks=stats.free_blocks, **extra,
    )
