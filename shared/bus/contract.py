"""What each service hears on NATS: one declared table per role of (subject, message type,
handler, how it is delivered, who sends it). The services subscribe from these tables
(shared/serving/subscriptions.py) and the NATS permissions are generated from them
(shared/bus/permissions.py), so a subject is named once.

A handler is named by its attribute path on the object that serves the table (the service):
"prepare", or "rdma.on_offer" for a part the service holds. Each takes (message, raw NATS
message)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

from shared.bus import subjects
from shared.bus.messages import (
    Abort,
    HandoffAck,
    HandoffBatch,
    IdentityFault,
    KVEvents,
    KVReady,
    KVSnapshotRequest,
    LoadReport,
    MainDecodeLost,
    MainDecodeTarget,
    PrefillSubmit,
    PrepareReply,
    PrepareRequest,
    RdmaOffer,
    RdmaWritten,
    RelayStart,
    ResumeReply,
    ResumeRequest,
    SubmitReply,
    TokenBatch,
    TraceQuery,
)
from shared.bus.subjects import PREFIX, Req

PREFILL, RELAY, MAIN_DECODE, ROUTER = "prefill", "relay", "main_decode", "router"
ENGINES = (PREFILL, RELAY, MAIN_DECODE)
EVERY_ROLE = (*ENGINES, ROUTER)


class Delivery(Enum):
    EVENT = "event"  # fire and forget (a plain subscription)
    ACKED = "acked"  # a control message sent with shared/bus/delivery.py: acked on arrival, resent
    ANSWER = "answer"  # a request answered by the handler (a nats.micro endpoint)
    ADMIT = "admit"  # a request that creates a job: through the service's admission gate


@dataclass(frozen=True)
class At:
    """Where a service instance listens: what its own subjects are made of."""

    instance: str
    datacenter: str = ""
    address: str = ""  # its KV bulk address (names the RDMA path's subjects)


@dataclass(frozen=True)
class Route:
    handler: str  # its attribute path on the serving object
    message: type
    pattern: str  # the subject for every instance: what the permissions allow
    subject: Callable[[At], str] | None = None  # this instance's own subject (None: the pattern)
    delivery: Delivery = Delivery.EVENT
    senders: tuple[str, ...] = ()  # the roles that publish it
    sent_as: Callable[[str], str] | None = None  # a sender's own subjects (None: the pattern)
    reply: type | None = None  # ADMIT: the reply type its refusals take
    queue: str = ""  # a queue group: one instance of the role gets each message
    if_aborted: str = ""  # ADMIT: the handler that answers a request aborted before it came

    def subject_at(self, at: At) -> str:
        return self.subject(at) if self.subject else self.pattern

    def published_by(self, role: str) -> str:
        return self.sent_as(role) if self.sent_as else self.pattern


def own_load(role: str) -> str:
    """The load reports a role may publish: its own, any instance."""
    return f"{PREFIX}.load.{role}.*"


def own_abort(role: str) -> str:
    """The aborts a role may publish: signed with its own role (subjects.abort)."""
    return f"{PREFIX}.req.*.abort.{role}"


def kv_snapshots(role: str) -> str:
    """The snapshot requests of one role's instances (named per role: a wildcard over the role
    would also match a kv events subject of an instance called "snapshot")."""
    return f"{PREFIX}.kv.{role}.*.snapshot"


def md_rdma_any(kind: str) -> str:
    """subjects.md_rdma for every main decoder."""
    return f"{PREFIX}.rdma.*.{kind}"


def _to(role: str, kind: Req, handler: str, message: type, senders: tuple[str, ...]) -> Route:
    """A control message addressed to one instance of `role` (subjects.to_instance)."""
    return Route(
        handler,
        message,
        subjects.any_instance(role, kind),
        lambda at: subjects.to_instance(role, at.instance, kind),
        Delivery.ACKED,
        senders,
    )


def _snapshot(role: str) -> Route:
    return Route(
        "cache_events.answer",
        KVSnapshotRequest,
        kv_snapshots(role),
        lambda at: subjects.kv_snapshot(role, at.instance),
        Delivery.ANSWER,
        (ROUTER,),
    )


def _resume(role: str) -> Route:
    return Route(
        "resume",
        ResumeRequest,
        f"{PREFIX}.{'md' if role == MAIN_DECODE else role}.*.resume",
        lambda at: subjects.resume(role, at.instance),
        Delivery.ADMIT,
        (ROUTER,),
        reply=ResumeReply,
    )


# What every engine service hears: aborts (each role signs its own), the routers' heartbeats
# (a router's requests are dropped when it goes silent), and the trace queries of its DC.
ENGINE_COMMON: tuple[Route, ...] = (
    Route("on_bus_abort", Abort, subjects.all_aborts(), senders=EVERY_ROLE, sent_as=own_abort),
    Route("on_router_heartbeat", LoadReport, subjects.router_heartbeats()),
    Route(
        "traces.on_query",
        TraceQuery,
        subjects.all_traces_get(),
        lambda at: subjects.traces_get(at.datacenter),
        senders=(ROUTER,),
    ),
)

TABLES: dict[str, tuple[Route, ...]] = {
    PREFILL: (
        # The router picks the least loaded instance; the queue group serves clients that do not.
        Route(
            "submit",
            PrefillSubmit,
            f"{PREFIX}.prefill.*.submit",
            lambda at: subjects.prefill_submit_to(at.instance),
            Delivery.ADMIT,
            (ROUTER,),
            reply=SubmitReply,
        ),
        Route(
            "submit",
            PrefillSubmit,
            subjects.prefill_submit(),
            delivery=Delivery.ADMIT,
            senders=(ROUTER,),
            reply=SubmitReply,
            queue=PREFILL,
        ),
        _to(PREFILL, Req.MD_TARGET, "on_md_target", MainDecodeTarget, (ROUTER,)),
        _to(PREFILL, Req.MD_LOST, "on_md_lost", MainDecodeLost, (ROUTER,)),
        _snapshot(PREFILL),
        *ENGINE_COMMON,
    ),
    RELAY: (
        _to(RELAY, Req.RELAY_START, "on_relay_start", RelayStart, (PREFILL,)),
        _to(RELAY, Req.KV_READY, "on_kv_ready", KVReady, (MAIN_DECODE,)),
        _to(RELAY, Req.HANDOFF_ACK, "on_ack", HandoffAck, (MAIN_DECODE,)),
        _to(RELAY, Req.MD_LOST, "on_md_lost", MainDecodeLost, (ROUTER,)),
        _resume(RELAY),
        *ENGINE_COMMON,
    ),
    MAIN_DECODE: (
        Route(
            "prepare",
            PrepareRequest,
            f"{PREFIX}.md.*.prepare",
            lambda at: subjects.md_prepare(at.instance),
            Delivery.ADMIT,
            (ROUTER,),
            reply=PrepareReply,
            if_aborted="takes_no_part",
        ),
        _resume(MAIN_DECODE),
        # From the relay, or from prefill on P→MD (its one token).
        _to(MAIN_DECODE, Req.HANDOFF, "on_handoff", HandoffBatch, (RELAY, PREFILL)),
        _snapshot(MAIN_DECODE),
        # The RDMA path's exchanges, by MD's bulk address (prefill knows no MD instance).
        Route(
            "rdma.on_offer",
            RdmaOffer,
            md_rdma_any("offer"),
            lambda at: subjects.md_rdma(at.address, "offer"),
            Delivery.ANSWER,
            (PREFILL,),
        ),
        Route(
            "rdma.on_written",
            RdmaWritten,
            md_rdma_any("written"),
            lambda at: subjects.md_rdma(at.address, "written"),
            Delivery.ANSWER,
            (PREFILL,),
        ),
        *ENGINE_COMMON,
    ),
    ROUTER: (
        # One batch per engine step, addressed to this router alone.
        Route(
            "on_token_batch",
            TokenBatch,
            subjects.all_router_tokens(),
            lambda at: subjects.router_tokens(at.instance),
            senders=ENGINES,
        ),
        Route(
            "cache_sync.on_kv_events",
            KVEvents,
            subjects.all_kv_events(),
            senders=(PREFILL, MAIN_DECODE),
            sent_as=subjects.all_kv_events,
        ),
        Route("on_load", LoadReport, subjects.all_load(), senders=EVERY_ROLE, sent_as=own_load),
        # A KV peer refused for its identity: the router sets the instance aside.
        Route(
            "on_identity_fault",
            IdentityFault,
            subjects.identity_faults(),
            senders=(PREFILL, MAIN_DECODE),
            sent_as=subjects.identity_faults,
        ),
    ),
}
