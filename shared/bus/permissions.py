"""Who may publish and subscribe to what on NATS: one row per service identity, generated from
the services' declared tables (shared/bus/contract.py): a role subscribes to what its table
routes, and publishes what another role's table says it sends.

The NATS servers' `authorization` block is generated from these rows (shared/bus/nats_config.py). A subject outside a service's
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

from collections.abc import Iterable
from dataclasses import dataclass

from shared.bus import subjects
from shared.bus.contract import ENGINES, EVERY_ROLE, TABLES, own_load
from shared.bus.subjects import Req

__all__ = ["PERMISSIONS", "Permissions", "allows", "own_load", "permissions_of"]


@dataclass(frozen=True)
class Permissions:
    publish: tuple[str, ...]
    subscribe: tuple[str, ...]
    responds: bool = False  # may reply to requests it received (NATS `allow_responses`)


INBOX = "_INBOX.>"  # where the replies to this client's requests arrive
DISCOVERY = "$SRV.>"  # nats.micro PING / INFO / STATS
# Published for a request no router owns: whoever asked for it listens there (no table routes it).
UNOWNED_TOKENS = subjects.all_req(Req.TOKENS)


def permissions_of(role: str) -> Permissions:
    """The role's row: its table's subjects and what the others' tables say it sends."""
    engine = role in ENGINES
    subscribe = [r.pattern for r in TABLES.get(role, ())] + ([DISCOVERY] if engine else []) + [INBOX]
    publish = [r.published_by(role) for table in TABLES.values() for r in table if role in r.senders]
    publish += [UNOWNED_TOKENS] if engine else []
    return Permissions(tuple(dict.fromkeys(publish)), tuple(dict.fromkeys(subscribe)), responds=engine)


def allows(patterns: Iterable[str], subject: str) -> bool:
    """Whether a subject (wildcards allowed) lies within one of the permission patterns."""
    want = subject.split(".")
    for pattern in patterns:
        have = pattern.split(".")
        for i, tok in enumerate(have):
            if tok == ">":
                return True
            if i >= len(want) or (tok != "*" and tok != want[i]) or (tok == "*" and want[i] == ">"):
                break
        else:
            if len(have) == len(want):
                return True
    return False


PERMISSIONS: dict[str, Permissions] = {role: permissions_of(role) for role in EVERY_ROLE}
