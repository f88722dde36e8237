"""Why a bulk connection was refused before a byte of KV moved, and how loudly to say so.

A peer is checked in its TLS handshake (CA, expiry) and right after it (its certificate's role,
shared/security/identity.py), before either end sends anything of the channel's own: a peer
that fails learns nothing, not even the channel's banner. What the log says depends on what
happened: a certificate refused (wrong role, unknown CA, expired) is a warning, someone
presented credentials that are not good here; a connection that went away without presenting
any, or right after a handshake without a word (a port check, `pdd check`'s probe), is info.
"""

from __future__ import annotations

import logging
import ssl

from shared.kv.errors import KVTransferError

# Verification messages of OpenSSL that mean "not signed by a CA we trust".
_UNKNOWN_CA = (
    "unable to get local issuer certificate",
    "self-signed certificate",
    "self signed certificate",
    "unable to verify the first certificate",
    "unable to get issuer certificate",
)
_NOT_TLS = ("WRONG_VERSION_NUMBER", "HTTP_REQUEST", "UNKNOWN_PROTOCOL", "PACKET_LENGTH_TOO_LONG")


class PeerRefused(KVTransferError):
    """The peer's certificate names a party this end does not deal with (wrong role, no
    identity): refused before anything was sent. `spoke`: it went on to talk (a real attempt)
    rather than close without a word (a probe)."""

    def __init__(self, peer: str, reason: str, identity: str | None, spoke: bool = True) -> None:
        super().__init__(f"{peer}: {reason}")
        self.peer, self.reason, self.identity, self.spoke = peer, reason, identity, spoke


def handshake_refusal(e: BaseException) -> tuple[int, str]:
    """(log level, why) of a connection that failed in or right after its TLS handshake."""
    if isinstance(e, PeerRefused):
        if e.spoke:
            return logging.WARNING, e.reason
        return logging.INFO, f"{e.reason} (it closed without a word: a probe?)"
    if isinstance(e, ssl.SSLCertVerificationError):
        msg = str(e.verify_message or e.reason or e)
        if "expired" in msg:
            return logging.WARNING, f"expired certificate ({msg})"
        if "not yet valid" in msg:
            return logging.WARNING, f"certificate not yet valid ({msg}: a clock off?)"
        if any(m in msg for m in _UNKNOWN_CA):
            return logging.WARNING, f"unknown CA: its certificate is not signed by ours ({msg})"
        return logging.WARNING, f"certificate refused: {msg}"
    if isinstance(e, ssl.SSLError):
        reason = str(e.reason or "")
        if reason == "PEER_DID_NOT_RETURN_A_CERTIFICATE":
            return logging.INFO, "no client certificate (not a pdd service)"
        if reason in _NOT_TLS:
            return logging.INFO, f"not TLS ({reason.lower().replace('_', ' ')})"
        if reason.startswith(("TLSV1_ALERT_", "SSLV3_ALERT_")):
            alert = reason.split("ALERT_", 1)[1].lower().replace("_", " ")
            return logging.WARNING, f"it refused our certificate ({alert})"
        return logging.WARNING, f"TLS error: {reason or e}"
    if isinstance(e, ConnectionError) and "after the TLS handshake" in str(e):
        return logging.INFO, "hung up right after its TLS handshake, without a word (a probe?)"
    if isinstance(e, TimeoutError):
        return logging.INFO, "no TLS handshake in time"
    if isinstance(e, ConnectionError | OSError):
        return logging.INFO, f"went away: {e}"
    return logging.WARNING, f"{type(e).__name__}: {e}"
