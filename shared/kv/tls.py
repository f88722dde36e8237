"""TLS contexts of the bulk channel, from a service's settings (tls_ca, tls_cert, tls_key)."""

from __future__ import annotations

from pathlib import Path
from ssl import SSLContext
from typing import Any

from shared.security import Identity, client_context, server_context


def _identity(settings: Any) -> Identity | None:
    """The service's certificate files; None when TLS is not configured at all."""
    paths = [getattr(settings, name, None) for name in ("tls_ca", "tls_cert", "tls_key")]
    if not any(paths):
        return None
    if not all(paths):  # half a configuration must not fall back to plaintext
        raise ValueError("tls_ca, tls_cert and tls_key must be set together")
    ca, cert, key = (Path(p) for p in paths)
    return Identity(ca, cert, key)


def server_tls(settings: Any) -> SSLContext | None:
    ident = _identity(settings)
    return server_context(ident) if ident else None


def client_tls(settings: Any, check_hostname: bool = True) -> SSLContext | None:
    """check_hostname=False: for a caller that checks the peer's identity instead."""
    ident = _identity(settings)
    return client_context(ident, check_hostname) if ident else None
