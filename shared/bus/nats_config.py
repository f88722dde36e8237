"""The text of a `nats-server` config: listeners, TLS, users with their permissions, cluster
routes, gateway.

`pdd up` writes one per server (shared/bus/nats_server.py); `pdd certs --compose` and `pdd serve
nats` write the ones compose and a datacenter run. With `tls`, clients must speak TLS and present
a certificate from the CA, and routes and the gateway run mutual TLS both ways. With `users`, the
certificate is the credential: the server maps each client's certificate to the user named by
its subject (`verify_and_map`; identity.distinguished_name, "CN=main_decode,OU=dc-b,O=pdd"), so
a role's permissions go with its certificate and no password exists that could stand in for it.
A certificate no user is named for is refused (there is no anonymous user). Routes accept only
this DC's NATS servers' certificates and the gateway only the other DC's, mapped the same way.

A datacenter may run a cluster of servers: each node has `cluster` (the cluster's name, which is
also its gateway name, so the two datacenters form one supercluster) and `routes` to the others.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field

from shared.bus.permissions import PERMISSIONS, Permissions
from shared.security.identity import OTHER_DC, PeerIdentity, distinguished_name, identity_of, peer_identity
from shared.security.pki import Identity

TLS_TIMEOUT_S = 5  # handshake bound; the default 0.5 s is tight across a slow emulated WAN

q = json.dumps  # NATS config accepts JSON-quoted strings


@dataclass(frozen=True)
class NatsUser:
    name: str  # the subject (RFC 4514) of the certificates this user is mapped from
    permissions: Permissions | None  # None: everything (test clients only)


def service_user(service: str) -> NatsUser:
    """The user a service's certificate maps to, with its row of shared/bus/permissions.py."""
    ident = identity_of(service)
    if ident is None:
        raise ValueError(f"{service!r} is no service with an identity")
    return NatsUser(distinguished_name(ident), PERMISSIONS[service])


def nats_users(services: Iterable[str]) -> list[NatsUser]:
    """One NATS user per service (every instance of a role is the same user)."""
    return [service_user(s) for s in services]


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
            lines += _tls_block(self.tls, "", mapped=bool(self.users))
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
            lines += self._peer_tls(lambda own: own.dc)
        return lines + ["}"]

    def _peer_tls(self, peer_dc) -> list[str]:
        """TLS of a route or gateway block: the peer's certificate maps to the one user allowed,
        the NATS servers of `peer_dc(own identity)`. A server whose own certificate names no
        identity (a test's) checks the CA only."""
        assert self.tls is not None
        own = _own_identity(self.tls)
        if own is None or own.role != "nats":
            return _tls_block(self.tls, "  ")
        peer = distinguished_name(PeerIdentity(peer_dc(own), "nats"))
        return [*_tls_block(self.tls, "  ", mapped=True), f"  authorization {{ user: {q(peer)} }}"]

    def _gateway(self) -> list[str]:
        gateway_name = self.cluster or self.name  # NATS requires a cluster's gateway to bear its name
        lines = ["gateway {", f"  name: {q(gateway_name)}", f"  listen: {q(self.gateway_listen)}"]
        if self.gateway_advertise:
            lines.append(f"  advertise: {q(self.gateway_advertise)}")
        if self.tls:
            lines += self._peer_tls(lambda own: OTHER_DC[own.dc])
        if self.gateways:
            remotes = ", ".join(f"{{name: {q(n)}, urls: {q(_urls(u))}}}" for n, u in self.gateways.items())
            lines.append(f"  gateways: [{remotes}]")
        return lines + ["}"]


def _urls(urls: str | list[str]) -> list[str]:
    return [urls] if isinstance(urls, str) else list(urls)


def _own_identity(ident: Identity) -> PeerIdentity | None:
    from cryptography import x509

    try:
        return peer_identity(x509.load_pem_x509_certificate(ident.cert.read_bytes()))
    except (OSError, ValueError):  # not there (yet): the peers are checked against the CA only
        return None


def _tls_block(ident: Identity, indent: str, *, mapped: bool = False) -> list[str]:
    """Mutual TLS: our certificate, and peers must present one signed by the CA; `mapped`: the
    peer's certificate is also its user (verify_and_map). (Our clients insist on TLS 1.3, which
    two nats-servers negotiate by themselves.)"""
    return [
        f"{indent}tls {{",
        f"{indent}  cert_file: {q(str(ident.cert))}",
        f"{indent}  key_file: {q(str(ident.key))}",
        f"{indent}  ca_file: {q(str(ident.ca))}",
        f"{indent}  {'verify_and_map' if mapped else 'verify'}: true",
        f"{indent}  timeout: {TLS_TIMEOUT_S}",
        f"{indent}}}",
    ]


def _user(user: NatsUser) -> str:
    entry = f"{{user: {q(user.name)}"
    if user.permissions is not None:
        p = user.permissions
        entry += f", permissions: {{publish: {{allow: {q(list(p.publish))}}}"
        entry += f", subscribe: {{allow: {q(list(p.subscribe))}}}"
        entry += ", allow_responses: true}" if p.responds else "}"
    return entry + "}"
