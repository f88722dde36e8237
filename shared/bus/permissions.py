"""Who may publish and subscribe to what on NATS: one row per service identity.

The NATS servers' `authorization` block is generated from this table (shared/bus/nats_config.py),
so it is the one place that says which service may say what. A subject outside a service's
publish list is refused by the server (the client gets a permissions-violation error and nobody
receives the message); a subscription outside its subscribe list never sees a message.

    service      publishes                                              subscribes
    router       md prepare, prefill submit, md/relay resume,           router tokens, kv events, load,
                 kv snapshot (requests), md_target, md_lost,            its request inboxes
                 abort.router, load.router (its heartbeat),
                 traces get (requests)
    prefill      tokens, handoff, relay_start, kv events.prefill,      prefill submit, md_target,
                 abort.prefill, load.prefill, rdma offer / written      md_lost, kv snapshot.prefill,
                                                                        every abort, router heartbeats,
                                                                        traces get, its request inboxes
    relay        tokens, handoff, abort.relay, load.relay               relay_start, kv_ready,
                                                                        handoff_ack, md_lost, relay resume,
                                                                        every abort, router heartbeats,
                                                                        traces get, its request inboxes
    main_decode  tokens, kv_ready, handoff_ack, kv events.main_decode,  md prepare, md resume, handoff,
                 abort.main_decode, load.main_decode                    kv snapshot.main_decode,
                                                                        rdma offer / written,
                                                                        every abort, router heartbeats,
                                                                        traces get, its request inboxes

"tokens" is both subjects a token event may take: a router's (`pdd.router.<router>.tokens`,
the requests it owns) and a request's own (`pdd.req.<rid>.tokens`, a request no router owns).

An abort's last subject token is its sender's role (a kv event's role token too), and each
role may publish only its own, so a receiver knows who sent it from the subject, never from a
field a peer could forge.

Services that answer requests (prefill submit, md prepare, kv snapshot, traces get, `nats.micro` discovery,
and the acks of control messages sent by shared/bus/delivery.py) may publish one reply to the
reply subject of a request they received (`allow_responses`), nothing else under `_INBOX`;
every service that sends such requests subscribes to its `_INBOX`. Every service but the router registers with `nats.micro`, hence `$SRV.>`.
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.bus import subjects
from shared.bus.subjects import PREFIX, Req


@dataclass(frozen=True)
class Permissions:
    publish: tuple[str, ...]
    subscribe: tuple[str, ...]
    responds: bool = False  # may reply to requests it received (NATS `allow_responses`)


ABORTS = subjects.all_aborts()  # every role hears every abort; the subject names who sent it
INBOX = "_INBOX.>"  # where the replies to this client's requests arrive
DISCOVERY = "$SRV.>"  # nats.micro PING / INFO / STATS
# Wildcard forms of the per-instance subjects in shared/bus/subjects.py.
ANY_MD_PREPARE = f"{PREFIX}.md.*.prepare"
ANY_PREFILL_SUBMIT = f"{PREFIX}.prefill.*.submit"
ANY_MD_RESUME = f"{PREFIX}.md.*.resume"
ANY_RELAY_RESUME = f"{PREFIX}.relay.*.resume"
ANY_MD_RDMA = f"{PREFIX}.rdma.*.*"  # subjects.md_rdma: offers and written-notes to a main decoder
ROUTER_HEARTBEATS = subjects.router_heartbeats()
TRACES = subjects.all_traces_get()  # the router asks each DC's span stores; engines answer
TOKENS = (subjects.all_router_tokens(), subjects.all_req(Req.TOKENS))  # what P, RLD and MD stream


def own_load(service: str) -> str:
    """The load reports a service may publish: its own, any instance."""
    return f"{PREFIX}.load.{service}.*"


def kv_snapshots(service: str) -> str:
    """The snapshot requests of one role's instances (named per role: a wildcard over the role
    would also match a kv events subject of an instance called "snapshot")."""
    return f"{PREFIX}.kv.{service}.*.snapshot"


def own_abort(service: str) -> str:
    """The aborts a service may publish: signed with its own role (subjects.abort)."""
    return f"{PREFIX}.req.*.abort.{service}"


PERMISSIONS: dict[str, Permissions] = {
    "router": Permissions(
        publish=(
            ANY_MD_PREPARE,
            subjects.prefill_submit(),
            ANY_PREFILL_SUBMIT,
            ANY_MD_RESUME,
            ANY_RELAY_RESUME,
            subjects.any_instance("prefill", Req.MD_TARGET),
            subjects.any_instance("prefill", Req.MD_LOST),
            subjects.any_instance("relay", Req.MD_LOST),
            own_abort("router"),
            own_load("router"),
            kv_snapshots("prefill"),
            kv_snapshots("main_decode"),
            TRACES,
        ),
        subscribe=(subjects.all_router_tokens(), subjects.all_kv_events(), subjects.all_load(), INBOX),
    ),
    "prefill": Permissions(
        publish=(
            *TOKENS,
            subjects.any_instance("main_decode", Req.HANDOFF),
            subjects.any_instance("relay", Req.RELAY_START),
            own_abort("prefill"),
            own_load("prefill"),
            subjects.all_kv_events("prefill"),
            ANY_MD_RDMA,
        ),
        subscribe=(
            subjects.prefill_submit(),
            ANY_PREFILL_SUBMIT,
            subjects.any_instance("prefill", Req.MD_TARGET),
            subjects.any_instance("prefill", Req.MD_LOST),
            ABORTS,
            ROUTER_HEARTBEATS,
            DISCOVERY,
            kv_snapshots("prefill"),
            TRACES,
            INBOX,
        ),
        responds=True,
    ),
    "relay": Permissions(
        publish=(
            *TOKENS,
            subjects.any_instance("main_decode", Req.HANDOFF),
            own_abort("relay"),
            own_load("relay"),
        ),
        subscribe=(
            subjects.any_instance("relay", Req.RELAY_START),
            subjects.any_instance("relay", Req.KV_READY),
            subjects.any_instance("relay", Req.HANDOFF_ACK),
            subjects.any_instance("relay", Req.MD_LOST),
            ANY_RELAY_RESUME,
            ABORTS,
            ROUTER_HEARTBEATS,
            DISCOVERY,
            TRACES,
            INBOX,
        ),
        responds=True,
    ),
    "main_decode": Permissions(
        publish=(
            *TOKENS,
            subjects.any_instance("relay", Req.KV_READY),
            subjects.any_instance("relay", Req.HANDOFF_ACK),
            subjects.all_kv_events("main_decode"),
            own_abort("main_decode"),
            own_load("main_decode"),
        ),
        subscribe=(
            ANY_MD_PREPARE,
            ANY_MD_RESUME,
            subjects.any_instance("main_decode", Req.HANDOFF),
            ABORTS,
            ROUTER_HEARTBEATS,
            DISCOVERY,
            kv_snapshots("main_decode"),
            ANY_MD_RDMA,
            TRACES,
            INBOX,
        ),
        responds=True,
    ),
}
