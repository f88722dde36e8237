"""The control messages of the PDD protocol (msgpack maps with a schema version `v`).

Every field that crosses a service boundary is declared here, typed; the codec validates it
at the edge, so a handler only ever sees a well-formed object. Token indices are output
positions: index 0 is the first generated token (sampled by prefill), whatever instance
produced it. KV bytes never travel in these messages.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from shared.bus.codec import Message
from shared.engine.logprobs import TokenLogprobs
from shared.engine.sampling_params import SamplingParams


class Pipeline(StrEnum):
    """The path a request takes (x-pdd-pipeline). RLD_ONLY is never a routing choice: only
    the anomalous-traffic filter or a fault fallback ends a request there."""

    P_MD = "p-md"
    P_RLD_MD = "p-rld-md"
    RLD_ONLY = "rld-only"


class HandoffMode(StrEnum):
    PREFILL = "prefill"  # P→MD: prefill hands over its one token
    ONE_SHOT = "one-shot"
    CATCH_UP = "catch-up"


class Role(StrEnum):
    ROUTER = "router"
    PREFILL = "prefill"
    RELAY = "relay"
    MAIN_DECODE = "main_decode"


class Outcome(StrEnum):
    """How a request's token stream ended."""

    STOP = "stop"  # EOS or a stop string
    LENGTH = "length"  # max_tokens or the context limit
    ERROR = "error"  # see TokenEvent.error


class AbortReason(StrEnum):
    FINISHED = "finished"  # the client got every token: free what is left
    CLIENT_GONE = "client_gone"
    DISPATCH_FAILED = "dispatch_failed"
    ROUTER_SHUTDOWN = "router_shutdown"
    FINISHED_AT_PREFILL = "finished_at_prefill"  # the first token ended the request
    RELAY_FINISHED = "relay_finished"  # anomalous-traffic filter: the relay ended it first
    MD_UNAVAILABLE = "md_unavailable"  # the relay gave up on MD and finishes the request itself
    FAILED = "failed"  # the sender failed the request (TokenEvent.error says why)
    SHUTDOWN = "shutdown"  # the sender is stopping
    MIGRATED = "migrated"  # the router moved the request to another instance (by token IDs)
    ROUTER_LOST = "router_lost"  # the router that owns the request stopped heartbeating
    STALE = "stale"  # tokens for a request the router no longer has: stop producing them

    @property
    def span_name(self) -> str:
        """What a trace calls sending (or acting on) it: "release" when the request finished
        and what is left is freed, "abort" when it is given up."""
        finished = (AbortReason.FINISHED, AbortReason.FINISHED_AT_PREFILL, AbortReason.RELAY_FINISHED)
        return "release" if self in finished else "abort"


@dataclass
class PrepareRequest(Message):
    """router → MD (request/reply): expect the KV of this prompt."""

    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    block_hashes: list[int]
    pipeline: Pipeline
    router: str = ""  # the router instance that owns the request (its heartbeat keeps it alive)
    relay: str = ""  # on P→RLD→MD, the relay instance MD tells it is ready and acknowledges


@dataclass
class PrepareReply(Message):
    ok: bool
    missing: list[int] = field(default_factory=list)  # block hashes MD lacks: only these cross the WAN
    bulk_address: str = ""
    error: str | None = None
    busy: bool = False  # refused for now (MD's KV memory is taken): another try may succeed


@dataclass
class PrefillSubmit(Message):
    """router → P (request/reply). MD's target follows in an MainDecodeTarget."""

    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    pipeline: Pipeline
    relay_address: str | None = None  # P→RLD→MD: the relay's local fast-path address
    catchup_threshold: int | None = None  # operator override of the relay's handoff threshold
    router: str = ""  # the router instance that owns the request
    relay: str = ""  # P→RLD→MD: the relay instance (its RelayStart goes there)


@dataclass
class SubmitReply(Message):
    ok: bool
    instance: str = ""
    error: str | None = None
    epoch: str = ""  # the prefill process that took it (LoadReport.epoch)


@dataclass
class ResumeRequest(Message):
    """router → MD or RLD (request/reply): migration by token IDs. Run `prompt_ids` +
    `generated` (the tokens the client already has) and stream from output index
    len(generated); whatever the prefix cache lacks is recomputed."""

    rid: str
    prompt_ids: list[int]
    generated: list[int]
    params: SamplingParams
    router: str = ""


@dataclass
class ResumeReply(Message):
    ok: bool
    error: str | None = None


@dataclass
class MainDecodeTarget(Message):
    """router → P: MD's answer to prepare, sent once it is in. The router asks MD and P at
    the same time, so prefill never waits a WAN round trip for it."""

    rid: str
    md_bulk_address: str
    md_missing: list[int]
    md_instance: str = ""  # where P→MD hands its token over


@dataclass
class RdmaOffer(Message):
    """P → MD (request/reply on subjects.md_rdma(MD's bulk address, "offer")): P can write the
    blocks MD lacks straight into MD's KV pool. MD answers only for a request it prepared, and only for
    blocks of it that it still lacks."""

    rid: str
    hashes: list[int]  # the blocks P will write (a subset of MD's missing ones)


@dataclass
class RdmaSlots(Message):
    """MD → P: where each offered block goes. Block `slots[i]` of MD's pool holds `planes`
    segments (layer × K/V) of `block_bytes` each, segment p of slot s at
    `base + (p * num_blocks + s) * block_bytes`. Not ok: use the TCP channel."""

    ok: bool
    session: str = ""  # MD's transfer engine, host:port
    base: int = 0
    num_blocks: int = 0
    planes: int = 0
    block_bytes: int = 0
    hashes: list[int] = field(default_factory=list)  # the offered blocks MD takes this way
    slots: list[int] = field(default_factory=list)  # pool block ids, one per hash
    error: str | None = None


@dataclass
class RdmaWritten(Message):
    """P → MD (request/reply on md_rdma(address, "written")): these blocks are written into their slots; MD verifies the
    checksums and only then caches them."""

    rid: str
    hashes: list[int]
    checksums: list[int]  # one per block, over its planes in order
    algo: str
    traceparent: str | None = None


@dataclass
class RdmaVerdict(Message):
    """MD → P: the blocks that failed verification (never cached; P resends them over TCP)."""

    ok: bool
    corrupt: list[int] = field(default_factory=list)
    error: str | None = None


@dataclass
class RelayStart(Message):
    """P → RLD, on the relay's own subject once the local KV stream is acked: decode from here."""

    rid: str
    prompt_ids: list[int]
    first_token: int
    params: SamplingParams
    catchup_threshold: int | None = None
    traceparent: str | None = None
    router: str = ""  # the router instance that owns the request


@dataclass
class RelayReport(Message):
    """The relay's part of a request, sent when it lets go of it."""

    handed_over: bool  # False: the relay finished the request itself (rld-only)
    rld_tokens: int  # tokens the relay generated
    handoff_mode: HandoffMode | None = None
    handoff_batches: int = 0


@dataclass
class DecodeReport(Message):
    """MD's part of a request, sent with its last token."""

    md_instance: str
    md_tokens: int
    wan_bytes: int


@dataclass
class TokenEvent(Message):
    """P / RLD / MD → router: tokens[i] has output index `index + i`.

    `outcome` set means no token follows the last one carried here. `logprobs[i]` goes with
    tokens[i] when the request asked for logprobs (else None: nothing extra on the wire);
    `prompt_logprobs` (prompt tokens 1.., the first has none) comes with output index 0.
    """

    rid: str
    source: Role
    index: int
    tokens: list[int]
    outcome: Outcome | None = None
    error: str | None = None
    relay: RelayReport | None = None
    decode: DecodeReport | None = None
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs] | None = None

    @property
    def finished(self) -> bool:
        return self.outcome is not None


@dataclass
class TokenBatch(Message):
    """P / RLD / MD → one router, on subjects.router_tokens(router): the token events of one
    engine step for the requests that router owns, in the order they were produced."""

    events: list[TokenEvent]


@dataclass
class KVReady(Message):
    """MD → RLD: MD holds the whole prompt KV and can take the handoff."""

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
    mode: HandoffMode


@dataclass
class HandoffAck(Message):
    """MD → RLD: catch-up batch `seq` is extended (its KV is in MD). MD refuses a batch by
    aborting the request instead."""

    rid: str
    seq: int


@dataclass
class Abort(Message):
    """anyone → all, on `subjects.abort(rid, role)`: stop work on `rid` and free what it holds.
    The sender's role is the subject's last token; each role ignores its own."""

    rid: str
    reason: AbortReason
    detail: str = ""


@dataclass
class MainDecodeLost(Message):
    """router → P, RLD: the request's MD stopped reporting. P stops the WAN stream; a relay
    that still holds the request finishes it."""

    rid: str
    md_instance: str


@dataclass
class IdentityFault(Message):
    """P / MD → router: a KV peer failed the identity check (its certificate names another
    role, or no pdd identity), so it was refused before anything was sent. An instance-level
    fault: the router sets `role`/`instance` aside until it restarts. `instance` is "" when the
    reporter cannot tell which instance it was (a receiver refusing an unknown sender)."""

    role: Role  # the role the peer was supposed to have (prefill dialed a main_decode)
    instance: str
    reason: str  # e.g. "peer identity spiffe://pdd/dc-a/relay is not main_decode"
    reporter: str = ""  # the reporting instance
    peer: str = ""  # the address it was refused at


@dataclass
class KVEvents(Message):
    """P / MD → router: blocks that entered or left one instance's prefix cache. Each message
    of a process (`epoch`, new at every start) has `seq` one more than the one before, so a
    router that missed one knows it and asks for a KVSnapshot. A message may be empty (a tick
    sent when nothing changed for a while): it still takes a seq, so a lost last change shows."""

    role: Role
    instance: str
    epoch: str
    seq: int
    stored: list[int] = field(default_factory=list)  # hashes whose last change was to enter the cache
    evicted: list[int] = field(default_factory=list)  # hashes whose last change was to leave it


@dataclass
class KVSnapshotRequest(Message):
    """router → P / MD (request/reply): send your whole prefix cache."""

    router: str = ""


@dataclass
class KVSnapshot(Message):
    """The whole prefix cache of one instance, as of its KVEvents message `seq` (the last one
    it includes; 0: none was sent yet)."""

    role: Role
    instance: str
    epoch: str
    seq: int
    stored: list[int] = field(default_factory=list)


@dataclass
class LinkReport(Message):
    """P's view of its link toward one MD bulk address."""

    peer: str
    backlog: int = 0  # KV bytes queued toward the peer
    bandwidth: float | None = None  # B/s, once a transfer was measured
    rtt: float | None = None  # s


@dataclass
class LoadReport(Message):
    """Periodic health and load of one instance."""

    service: Role
    instance: str
    running: int = 0
    waiting: int = 0
    num_blocks: int = 0
    used_blocks: int = 0
    free_blocks: int = 0
    address: str | None = None  # MD: bulk address to dial; RLD: local fast-path address
    links: list[LinkReport] = field(default_factory=list)  # P only
    model_id: str = ""
    held: list[str] = field(default_factory=list)  # request ids this instance holds (heartbeat)
    draining: bool = False  # leaving: it finishes what it holds and takes nothing new
    epoch: str = ""  # this process, new at every start: a restart under the same name shows


@dataclass
class TraceQuery(Message):
    """The router asks a datacenter's engine instances for one trace (pdd.traces.<dc>.get)."""

    trace_id: str = ""  # 32 hex digits; "" = the trace of request_id in the responder's store
    request_id: str = ""


@dataclass
class TraceSpans(Message):
    """One instance's answer: the trace's spans in its host's span store, size-bounded."""

    datacenter: str
    service: Role
    instance: str
    spans: list[str] = field(default_factory=list)  # each one span, a line of the span store (JSON)
    truncated: bool = False  # more spans than one reply may carry: the latest were left out
    now_ns: int = 0  # the responder's clock as it answered (`pdd check` compares the DCs' clocks)
