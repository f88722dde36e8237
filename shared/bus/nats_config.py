"""The text of a `nats-server` config: listeners, TLS, users with their permissions, cluster
routes, gateway.

`pdd up` writes one per server (shared/bus/nats_server.py); `pdd certs --compose` writes the
ones compose runs. With `tls`, clients must speak TLS and present a certificate from the CA,
and routes and the gateway run mutual TLS both ways; with `users`, a client without a valid user
and password is refused (there is no anonymous user).

A datacenter may run a cluster of servers: each node has `cluster` (the cluster's name, which is
also its gateway name, so the two datacenters form one supercluster) and `routes` to the others.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field

from shared.bus.permissions import PERMISSIONS, Permissions
from shared.security.credentials import Credentials
from shared.security.pki import Identity

TLS_TIMEOUT_S = 5  # handshake bound; the default 0.5 s is tight across a slow emulated WAN

q = json.dumps  # NATS config accepts JSON-quoted strings


@dataclass(frozen=True)
class NatsUser:
    name: str
    password: str
    permissions: Permissions | None  # None: everything (test clients only)


def nats_users(creds: Credentials, services: Iterable[str]) -> list[NatsUser]:
    """One NATS user per service, with its password and its row of shared/bus/permissions.py."""
    return [NatsUser(s, creds.password(s), PERMISSIONS[s]) for s in services]


@dataclass
class NatsConfig:
    name: str  # server name (unique); also the gateway name of a server outside a cluster
    listen: str  # host:port of client connections
    monitor: str  # host:port of the plain-HTTP monitoring endpoint
    tls: Identity | None = None
    users: list[NatsUser] = field(default_factory=list)
    gateway_listen: str | None = None
    gateway_advertise: str | None = None  # what peers should dial (e.g. a WAN proxy)
    gateways: dict[str, str | list[str]] = field(default_factory=dict)  # remote name -> URL(s)
    log_file: str | None = None  # None: stderr
    cluster: str | None = None  # cluster name: the same on every node of one datacenter
    cluster_listen: str | None = None  # host:port of routes from the other nodes
    routes: list[str] = field(default_factory=list)  # nats-route://host:port of the other nodes

    def render(self) -> str:
        lines = [f"server_name: {q(self.name)}", f"listen: {q(self.listen)}", f"http: {q(self.monitor)}"]
        if self.log_file:
            lines.append(f"log_file: {q(self.log_file)}")
        if self.tls:
            lines += _tls_block(self.tls, "")
        if self.users:
            lines += ["authorization {", "  users = ["]
            lines += [f"    {_user(u)}" for u in self.users]
            lines += ["  ]", "}"]
        if self.cluster:
            lines += self._cluster()
        if self.gateway_listen:
            lines += self._gateway()
        return "\n".join(lines) + "\n"

    def _cluster(self) -> list[str]:
        # no_advertise: clients keep to the URLs they were given (a gossiped listen address may
        # be one their certificate check or network cannot reach). Listed routes are redialled
        # forever, so a killed node rejoins when it is back and the others carry on meanwhile.
        lines = [
            "cluster {",
            f"  name: {q(self.cluster)}",
            f"  listen: {q(self.cluster_listen)}",
            "  no_advertise: true",
        ]
        if self.routes:
            lines.append(f"  routes: {q(self.routes)}")
        if self.tls:
            lines += _tls_block(self.tls, "  ")
        return lines + ["}"]

    def _gateway(self) -> list[str]:
        gateway_name = self.cluster or self.name  # NATS requires a cluster's gateway to bear its name
        lines = ["gateway {", f"  name: {q(gateway_name)}", f"  listen: {q(self.gateway_listen)}"]
        if self.gateway_advertise:
            lines.append(f"  advertise: {q(self.gateway_advertise)}")
        if self.tls:
            lines += _tls_block(self.tls, "  ")
        if self.gateways:
            remotes = ", ".join(f"{{name: {q(n)}, urls: {q(_urls(u))}}}" for n, u in self.gateways.items())
            lines.append(f"  gateways: [{remotes}]")
        return lines + ["}"]


def _urls(urls: str | list[str]) -> list[str]:
    return [urls] if isinstance(urls, str) else list(urls)


def _tls_block(ident: Identity, indent: str) -> list[str]:
    """Mutual TLS: our certificate, and peers must present one signed by the CA. (Our clients
    insist on TLS 1.3, which two nats-servers negotiate by themselves.)"""
    return [
        f"{indent}tls {{",
        f"{indent}  cert_file: {q(str(ident.cert))}",
        f"{indent}  key_file: {q(str(ident.key))}",
        f"{indent}  ca_file: {q(str(ident.ca))}",
        f"{indent}  verify: true",
        f"{indent}  timeout: {TLS_TIMEOUT_S}",
        f"{indent}}}",
    ]


def _user(user: NatsUser) -> str:
    entry = f"{{user: {q(user.name)}, password: {q(user.password)}"
    if user.permissions is not None:
        p = user.permissions
        entry += f", permissions: {{publish: {{allow: {q(list(p.publish))}}}"
        entry += f", subscribe: {{allow: {q(list(p.subscribe))}}}"
        entry += ", allow_responses: true}" if p.responds else "}"
    return entry + "}"
