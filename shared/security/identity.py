"""Workload identities: who a certificate belongs to, as one SPIFFE-style URI SAN.

    spiffe://pdd/<dc>/<role>             every instance of a role in a DC
    spiffe://pdd/<dc>/<role>/<instance>  one instance (`pdd certs add-instance`)

A certificate's DNS and IP names say where a party may be reached; this URI says what it is,
so a peer can insist on a role (prefill accepts KV receivers only with a main_decode identity,
those accept only prefill's) whatever address it dialed.
"""

from __future__ import annotations

import re
from collections.abc import Collection
from typing import NamedTuple

from cryptography import x509

TRUST_DOMAIN = "pdd"
ROLES = ("prefill", "relay", "main_decode", "router", "nats")
# Where each role runs; a NATS server's instance is its name.
ROLE_DC = {"prefill": "dc-a", "relay": "dc-a", "router": "dc-a", "main_decode": "dc-b"}
NATS_DC = {"nats-a": "dc-a", "nats-b": "dc-b"}
OTHER_DC = {"dc-a": "dc-b", "dc-b": "dc-a"}
_PART = re.compile(r"[a-z0-9][a-z0-9_.-]{0,62}")


class PeerIdentity(NamedTuple):
    dc: str
    role: str
    instance: str | None = None

    @property
    def uri(self) -> str:
        parts = [self.dc, self.role, *([self.instance] if self.instance else [])]
        return f"spiffe://{TRUST_DOMAIN}/" + "/".join(parts)


def distinguished_name(ident: PeerIdentity) -> str:
    """The subject of every certificate of `ident`'s role in its DC (an instance's too), as
    RFC 4514 writes it: "CN=main_decode,OU=dc-b,O=pdd". NATS maps a client's certificate to the
    user of this name, so a role's permissions on the bus go with its certificate."""
    return f"CN={ident.role},OU={ident.dc},O={TRUST_DOMAIN}"


def parse_identity(uri: str) -> PeerIdentity:
    """The identity a URI names; ValueError if it is not a well-formed pdd identity."""
    prefix = f"spiffe://{TRUST_DOMAIN}/"
    if not uri.startswith(prefix):
        raise ValueError(f"{uri!r} is not a {prefix} identity")
    parts = uri[len(prefix) :].split("/")
    if len(parts) not in (2, 3) or not all(_PART.fullmatch(p) for p in parts):
        raise ValueError(f"{uri!r}: expected {prefix}<dc>/<role>[/<instance>]")
    if parts[1] not in ROLES:
        raise ValueError(f"{uri!r}: unknown role {parts[1]!r}")
    return PeerIdentity(parts[0], parts[1], parts[2] if len(parts) == 3 else None)


def peer_identity(cert: bytes | x509.Certificate) -> PeerIdentity:
    """The identity a certificate (DER bytes or parsed) names in its one pdd URI SAN.
    ValueError when it names none, or more than one (a certificate is one party)."""
    if isinstance(cert, bytes):
        cert = x509.load_der_x509_certificate(cert)
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        uris = [u for u in san.get_values_for_type(x509.UniformResourceIdentifier) if u.startswith("spiffe:")]
    except x509.ExtensionNotFound:
        uris = []
    if len(uris) != 1:
        raise ValueError(f"certificate names {len(uris)} pdd identities, not one")
    return parse_identity(uris[0])


def refusal(cert: bytes | None, roles: Collection[str]) -> str | None:
    """Why a peer presenting `cert` (DER; None: none) is not one of `roles` (None: it is)."""
    if cert is None:
        return "peer presented no certificate"
    try:
        ident = peer_identity(cert)
    except ValueError as e:
        return f"peer identity unknown: {e}"
    if ident.role not in roles:
        return f"peer identity {ident.uri} is not {' or '.join(sorted(roles))}"
    return None


def mismatch(ident: PeerIdentity, role: str, dc: str | None = None) -> str | None:
    """How `ident` differs from what a party of `role` (in `dc`, when given) must present;
    None when it does not. Both sides are named: "wrong role (relay, expected main_decode)"."""
    if ident.role != role:
        return f"wrong role ({ident.role}, expected {role})"
    if dc is not None and ident.dc != dc:
        return f"wrong datacenter ({ident.dc}, expected {dc})"
    return None


def own_identity_refusal(cert_pem: bytes, role: str, dc: str) -> str | None:
    """Why a service of `role` in `dc` must not start with this certificate (None: it may)."""
    try:
        ident = peer_identity(x509.load_pem_x509_certificate(cert_pem))
    except ValueError as e:
        return f"{e}: reissue it (pdd certs bundle)"
    why = mismatch(ident, role, dc)
    return f"it names {ident.uri}: {why}" if why else None


def identity_of(name: str) -> PeerIdentity | None:
    """The role-wide identity of a credential named like the secrets directory's files: a
    service (prefill) or a NATS server (nats-a); None for any other name."""
    if name in NATS_DC:
        return PeerIdentity(NATS_DC[name], "nats", name)
    if name in ROLE_DC:
        return PeerIdentity(ROLE_DC[name], name)
    return None
