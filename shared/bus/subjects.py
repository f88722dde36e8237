"""NATS subject names. Every subject starts with `pdd.`; ids become single tokens."""

from __future__ import annotations

import hashlib
from enum import StrEnum

PREFIX = "pdd"


class Req(StrEnum):
    """The kinds of per-request message. Tokens of a request no router owns go to
    `pdd.req.<rid>.tokens`; every other kind goes to the one instance that holds the request,
    `pdd.<role>.<instance>.<kind>` (to_instance), the request id inside the message."""

    TOKENS = "tokens"  # P / RLD / MD → whoever follows a request no router owns (router_tokens otherwise)
    KV_READY = "kv_ready"  # MD → RLD
    HANDOFF = "handoff"  # RLD (or P) → MD
    HANDOFF_ACK = "handoff_ack"  # MD → RLD
    MD_TARGET = "md_target"  # router → P
    MD_LOST = "md_lost"  # router → P, RLD
    RELAY_START = "relay_start"  # P → RLD


_ROLE_TOKEN = {"prefill": "prefill", "relay": "relay", "main_decode": "md"}


def _tok(value: str) -> str:
    # A dot, space or wildcard inside an id would silently change which subject we hit.
    s = str(value)
    if not s or any(c in s for c in ". *>\t\r\n"):
        raise ValueError(f"invalid subject token {value!r}")
    return s


def req(rid: str, kind: Req) -> str:
    return f"{PREFIX}.req.{_tok(rid)}.{Req(kind)}"


def all_req(kind: Req) -> str:
    """Every request's `kind` subject."""
    return f"{PREFIX}.req.*.{Req(kind)}"


def to_instance(role: str, inst: str, kind: Req) -> str:
    """`pdd.<prefill|relay|md>.<inst>.<kind>`: a per-request message addressed to the one
    instance that needs it, so no instance receives (and drops) the others' traffic."""
    return f"{PREFIX}.{_ROLE_TOKEN[role]}.{_tok(inst)}.{Req(kind)}"


def any_instance(role: str, kind: Req) -> str:
    """to_instance's subjects for every instance of a role (permissions)."""
    return f"{PREFIX}.{_ROLE_TOKEN[role]}.*.{Req(kind)}"


def router_tokens(router: str) -> str:
    """`pdd.router.<router>.tokens`: the token events of the requests one router owns (its
    identity, messages' `router` field), one TokenBatch per engine step and sender."""
    return f"{PREFIX}.router.{_tok(router)}.tokens"


def all_router_tokens() -> str:
    return f"{PREFIX}.router.*.tokens"


def abort(rid: str, source: str) -> str:
    """`pdd.req.<rid>.abort.<role>`: who gives up is part of the subject, so NATS permissions
    (each role may publish only its own) vouch for it; no field inside the message does."""
    return f"{PREFIX}.req.{_tok(rid)}.abort.{_tok(source)}"


def all_aborts() -> str:
    return f"{PREFIX}.req.*.abort.*"


def abort_source(subject: str) -> str:
    """The role that published an abort subject."""
    return subject.rsplit(".", 1)[-1]


def prefill_submit() -> str:
    """Any prefill instance (queue group), for clients that do not pick one."""
    return f"{PREFIX}.prefill.submit"


def prefill_submit_to(inst: str) -> str:
    """One prefill instance's own submit subject (the router picks the least loaded)."""
    return f"{PREFIX}.prefill.{_tok(inst)}.submit"


def md_prepare(inst: str) -> str:
    return f"{PREFIX}.md.{_tok(inst)}.prepare"


def md_rdma(bulk_address: str, kind: str) -> str:
    """`pdd.rdma.<key>.<offer|written>`: the RDMA path's exchanges with the main decoder that
    P knows by its bulk address (MainDecodeTarget names no instance); key: a digest of that address."""
    key = hashlib.sha256(bulk_address.encode()).hexdigest()[:20]
    return f"{PREFIX}.rdma.{key}.{_tok(kind)}"


def resume(role: str, inst: str) -> str:
    """`pdd.md.<inst>.resume` / `pdd.relay.<inst>.resume`: take over a request by token IDs."""
    return f"{PREFIX}.{_ROLE_TOKEN[role]}.{_tok(inst)}.resume"


def kv_events(role: str, inst: str) -> str:
    """`pdd.kv.events.<role>.<inst>`: one instance's prefix-cache events (instance ids repeat
    across roles)."""
    return f"{PREFIX}.kv.events.{_tok(role)}.{_tok(inst)}"


def all_kv_events(role: str = "*") -> str:
    """Every instance's cache events (of one role, or of every role)."""
    return f"{PREFIX}.kv.events.{role}.*"


def kv_events_source(subject: str) -> tuple[str, str]:
    """(role, instance) of a kv_events subject: who published it, as permissions vouch."""
    role, inst = subject.rsplit(".", 2)[1:]
    return role, inst


def kv_snapshot(role: str, inst: str) -> str:
    """`pdd.kv.<role>.<inst>.snapshot`: ask one instance for its whole prefix cache."""
    return f"{PREFIX}.kv.{_tok(role)}.{_tok(inst)}.snapshot"


def load(service: str, inst: str) -> str:
    return f"{PREFIX}.load.{_tok(service)}.{_tok(inst)}"


def router_heartbeats() -> str:
    """Every router's load report: backends drop the requests of a router that went silent."""
    return f"{PREFIX}.load.router.*"


def all_load() -> str:
    return f"{PREFIX}.load.*.*"


def identity_faults(reporter: str = "*") -> str:
    """A KV peer that failed an identity check, as reported by one role (each may publish only
    its own: the router knows who reported it from the subject)."""
    return f"{PREFIX}.fault.identity.{reporter}"


def traces_get(dc: str) -> str:
    """`pdd.traces.<dc>.get`: every engine instance of datacenter `dc` answers with the spans of
    one trace in its host's span store (the router gathers both DCs for `GET /v1/traces`)."""
    return f"{PREFIX}.traces.{_tok(dc)}.get"


def all_traces_get() -> str:
    return f"{PREFIX}.traces.*.get"
