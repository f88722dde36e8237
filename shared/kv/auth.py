"""Mutual HMAC-SHA256 challenge-response on connect; the secret itself never crosses the wire.

    server -> hello   {nonce_s}
    client -> auth    {nonce_c, mac = HMAC(secret, "client" | nonce_s | nonce_c)}
    server -> welcome {mac = HMAC(secret, "server" | nonce_c | nonce_s), limits}   or  denied
The client checks the server's mac too, so KV is never streamed to an impostor.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
from typing import Any

from shared.kv.errors import FrameError, KVTransferError
from shared.kv.frame import PREAUTH_MAX_HEADER, pack, read_header
from shared.kv.transport import Stream

log = logging.getLogger(__name__)

PROTOCOL = 2  # 2: "done" carries opaque payload bytes instead of a meta map


def _mac(secret: bytes, role: bytes, a: bytes, b: bytes) -> bytes:
    return hmac.new(secret, role + a + b, hashlib.sha256).digest()


async def server_handshake(stream: Stream, secret: bytes, limits: dict[str, Any]) -> bool:
    """True when the peer proved it knows the secret; otherwise it was told so and should be dropped."""
    nonce_s = os.urandom(16)
    await stream.send(pack({"kind": "hello", "proto": PROTOCOL, "nonce": nonce_s}))
    h = await read_header(stream, PREAUTH_MAX_HEADER)
    nonce_c, mac = h.get("nonce"), h.get("mac")
    if (
        h["kind"] != "auth"
        or not isinstance(nonce_c, bytes)
        or not isinstance(mac, bytes)
        or len(nonce_c) != 16
    ):
        raise FrameError("expected an auth frame")
    if not hmac.compare_digest(mac, _mac(secret, b"client", nonce_s, nonce_c)):
        log.warning("kv: refused %s: authentication failed", stream.peer)
        await stream.send(pack({"kind": "denied", "reason": "authentication failed"}))
        return False
    await stream.send(pack({"kind": "welcome", "mac": _mac(secret, b"server", nonce_c, nonce_s), **limits}))
    return True


async def client_handshake(stream: Stream, secret: bytes) -> dict[str, Any]:
    """Returns the server's welcome (its limits); raises KVTransferError when refused."""
    h = await read_header(stream, PREAUTH_MAX_HEADER)
    nonce_s = h.get("nonce")
    if h["kind"] != "hello" or h.get("proto") != PROTOCOL or not isinstance(nonce_s, bytes):
        raise KVTransferError(
            f"{stream.peer}: not a KV server (or protocol {h.get('proto')!r} != {PROTOCOL})"
        )
    nonce_c = os.urandom(16)
    await stream.send(
        pack({"kind": "auth", "nonce": nonce_c, "mac": _mac(secret, b"client", nonce_s, nonce_c)})
    )
    h = await read_header(stream, PREAUTH_MAX_HEADER)
    if h["kind"] == "denied":
        raise KVTransferError(f"{stream.peer}: refused: {h.get('reason')}")
    mac = h.get("mac")
    if h["kind"] != "welcome" or not isinstance(mac, bytes):
        raise KVTransferError(f"{stream.peer}: unexpected {h['kind']!r} during handshake")
    if not hmac.compare_digest(mac, _mac(secret, b"server", nonce_c, nonce_s)):
        raise KVTransferError(f"{stream.peer}: server failed authentication (wrong secret?)")
    return h
