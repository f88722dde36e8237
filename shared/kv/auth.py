"""Who is at the other end of a bulk connection, checked on connect, one of two ways:

- **identity**, over TLS when this end names the roles it accepts (`peer_roles`): the peer's
  certificate must carry one of them (shared/security/identity.py). prefill accepts only a
  main_decode receiver, receivers accept only prefill. No key is shared across DCs.
- **hmac** otherwise (the local unix:// path between prefill and the relay): a mutual
  HMAC-SHA256 challenge-response over a key both ends hold; the key never crosses the wire.

    server -> hello   {nonce_s, auth: "identity" | "hmac"}
    client -> auth    {nonce_c, [mac = HMAC(secret, "client" | nonce_s | nonce_c)]}
    server -> welcome {[mac = HMAC(secret, "server" | nonce_c | nonce_s)], limits}   or  denied
The server picks the method; the client checks the server too (the identity it asks for
before it sends anything, and the mac), so KV is never streamed to an impostor.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
from collections.abc import Collection
from typing import Any

from shared.kv.errors import FrameError, KVTransferError
from shared.kv.frame import PREAUTH_MAX_HEADER, pack, read_header
from shared.kv.transport import Stream
from shared.security.identity import refusal

log = logging.getLogger(__name__)

PROTOCOL = 3  # 3: identity-authenticated connections; 2: "done" carries opaque payload bytes
IDENTITY, HMAC = "identity", "hmac"


def method(stream: Stream, peer_roles: Collection[str] | None) -> str:
    """How this end authenticates the peer on `stream`."""
    return IDENTITY if peer_roles and stream.peer_certificate is not None else HMAC


def peer_refusal(stream: Stream, peer_roles: Collection[str]) -> str | None:
    """Why the peer on this TLS stream is not one of `peer_roles` (None: it is)."""
    return refusal(stream.peer_certificate, peer_roles)


def _mac(secret: bytes, role: bytes, a: bytes, b: bytes) -> bytes:
    return hmac.new(secret, role + a + b, hashlib.sha256).digest()


async def server_handshake(
    stream: Stream, secret: bytes | None, limits: dict[str, Any], peer_roles: Collection[str] | None = None
) -> bool:
    """True when the peer proved who it is; otherwise it was told why and should be dropped."""
    how = method(stream, peer_roles)
    nonce_s = os.urandom(16)
    await stream.send(pack({"kind": "hello", "proto": PROTOCOL, "nonce": nonce_s, "auth": how}))
    h = await read_header(stream, PREAUTH_MAX_HEADER)
    nonce_c, mac = h.get("nonce"), h.get("mac")
    if h["kind"] != "auth" or not isinstance(nonce_c, bytes) or len(nonce_c) != 16:
        raise FrameError("expected an auth frame")
    if how == IDENTITY:
        assert peer_roles
        why = peer_refusal(stream, peer_roles)
    elif secret is None:
        why = "this receiver has no KV key for an unauthenticated connection"
    elif not isinstance(mac, bytes) or not hmac.compare_digest(
        mac, _mac(secret, b"client", nonce_s, nonce_c)
    ):
        why = "authentication failed"
    else:
        why = None
    if why is not None:
        log.warning("kv: refused %s: %s", stream.peer, why)
        await stream.send(pack({"kind": "denied", "reason": why}))
        return False
    proof = {"mac": _mac(secret, b"server", nonce_c, nonce_s)} if how == HMAC and secret else {}
    await stream.send(pack({"kind": "welcome", **proof, **limits}))
    return True


async def client_handshake(
    stream: Stream, secret: bytes | None, peer_roles: Collection[str] | None = None
) -> dict[str, Any]:
    """Returns the server's welcome (its limits); raises KVTransferError when refused. With
    `peer_roles` the server's identity is checked before a byte of ours is sent; a client that
    names no roles takes the server's method over TLS (its CA and host name were checked)."""
    tls = stream.peer_certificate is not None
    if tls and peer_roles:
        why = peer_refusal(stream, peer_roles)
        if why is not None:
            raise KVTransferError(f"{stream.peer}: {why}")
    h = await read_header(stream, PREAUTH_MAX_HEADER)
    nonce_s, how = h.get("nonce"), h.get("auth")
    if h["kind"] != "hello" or h.get("proto") != PROTOCOL or not isinstance(nonce_s, bytes):
        raise KVTransferError(
            f"{stream.peer}: not a KV server (or protocol {h.get('proto')!r} != {PROTOCOL})"
        )
    if how not in (IDENTITY, HMAC) or (how == IDENTITY and not tls):
        raise KVTransferError(f"{stream.peer}: cannot authenticate by {how!r} on this connection")
    if how == HMAC and secret is None:
        raise KVTransferError(
            f"{stream.peer}: the receiver asks for the KV key; this sender holds none for it"
        )
    nonce_c = os.urandom(16)
    auth: dict[str, Any] = {"kind": "auth", "nonce": nonce_c}
    if how == HMAC:
        assert secret is not None
        auth["mac"] = _mac(secret, b"client", nonce_s, nonce_c)
    await stream.send(pack(auth))
    h = await read_header(stream, PREAUTH_MAX_HEADER)
    if h["kind"] == "denied":
        raise KVTransferError(f"{stream.peer}: refused: {h.get('reason')}")
    if h["kind"] != "welcome":
        raise KVTransferError(f"{stream.peer}: unexpected {h['kind']!r} during handshake")
    if how == HMAC:
        assert secret is not None
        mac = h.get("mac")
        if not isinstance(mac, bytes) or not hmac.compare_digest(
            mac, _mac(secret, b"server", nonce_c, nonce_s)
        ):
            raise KVTransferError(f"{stream.peer}: server failed authentication (wrong secret?)")
    return h
