"""Each service's credentials: created once by `pdd up` (or `pdd certs`), read by the services.

One directory (0700, files 0600) holds the private CA and a certificate per identity (the two
NATS servers and the four services, each naming its role: shared/security/identity.py) and the
key of the local KV path between prefill and the relay (dc-a only: KV over TCP is authenticated
by the certificates' identities, so main decode holds no KV key). The certificate is also the
NATS credential (the servers map it to its role's user), so there are no NATS passwords.
Services get file *paths* in their settings (`PDD_<SVC>_SECRET_FILE`, `PDD_<SVC>_TLS_CA/CERT/KEY`),
so no secret sits in an environment or in compose.yaml; `SECRET` given directly works too. A
service without them does not start, nor with another role's certificate: there is no insecure
mode.
"""

from __future__ import annotations

import json
import secrets
import ssl
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from shared.security.identity import own_identity_refusal
from shared.security.pki import Identity, Pki, client_context, write_private

NATS_SERVERS = ("nats-a", "nats-b")
LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")
# Compose service names are hostnames there; `wan` fronts the gateways and the KV channel.
COMPOSE_HOSTNAMES = ("nats-a", "nats-b", "wan", "main_decode", "prefill", "relay", "router")
REQUIRED = ("tls_ca", "tls_cert", "tls_key")
LOCAL_KV_SERVICES = ("prefill", "relay")  # the ends of the local KV path hold its key
LOCAL_SECRET = "kv-local-secret"
OLD_SECRET = "kv-secret"  # the one KV key every DC held, before identities: removed
OLD_PASSWORD = ".nats-password"  # NATS passwords, before certificates were the NATS credential: removed
FILES = ("tls_ca", "tls_cert", "tls_key")


class Credentials:
    """The layout of the secrets directory."""

    def __init__(self, directory: Path) -> None:
        self.dir = Path(directory)
        self.pki = Pki(self.dir)

    def identity(self, name: str) -> Identity:
        return self.pki.identity(name)

    @property
    def secret_file(self) -> Path:
        """The local KV path's key (prefill <-> relay, in dc-a)."""
        return self.dir / LOCAL_SECRET

    def ensure(self, services: Iterable[str], hosts: Iterable[str], *, renew: bool = False) -> Credentials:
        """Create what is missing (everything anew with renew). Certificates are reissued from
        the same CA when they would not name a host asked for now."""
        services, hosts = list(services), sorted({*LOCAL_HOSTS, *COMPOSE_HOSTNAMES, *hosts})
        hosts_file = self.dir / "hosts.json"
        reissue = not hosts_file.exists() or not set(hosts) <= set(json.loads(hosts_file.read_text()))
        self.pki.ensure([*NATS_SERVERS, *services], hosts, renew=renew, reissue=reissue)
        write_private(hosts_file, json.dumps(hosts).encode())
        (self.dir / OLD_SECRET).unlink(missing_ok=True)
        for old in self.dir.glob(f"*{OLD_PASSWORD}"):
            old.unlink()
        if renew or not self.secret_file.exists():
            write_private(self.secret_file, secrets.token_urlsafe(32).encode())
        return self


def require_credentials(settings: Any, service: str, env_prefix: str, *, kv: bool | None = None) -> Any:
    """Read the secret file into `settings`; exit 2 naming what is missing, or when the
    certificate is another party's.
    `kv`: the service is an end of the local KV path, so it needs that path's key (default:
    prefill and the relay)."""
    kv = service in LOCAL_KV_SERVICES if kv is None else kv
    required = [*REQUIRED, "secret"] if kv else REQUIRED
    for name in ("secret",):
        path = getattr(settings, f"{name}_file", None)
        if not getattr(settings, name) and path:
            try:
                setattr(settings, name, Path(path).read_text().strip())
            except OSError as e:
                _refuse(service, f"{env_prefix}{name.upper()}_FILE: {e.strerror}: {path}")
    missing = [
        f"{env_prefix}{n.upper()}{'[_FILE]' if hasattr(settings, f'{n}_file') else ''}"
        for n in required
        if not getattr(settings, n)
    ]
    if missing:
        _refuse(service, f"missing setting {', '.join(missing)} (`pdd up` / `pdd certs` create them)")
    for name in FILES:
        if not Path(getattr(settings, name)).is_file():
            _refuse(service, f"{env_prefix}{name.upper()}: no such file {getattr(settings, name)}")
    require_own_identity(settings, service, env_prefix)
    return settings


def require_own_identity(settings: Any, service: str, env_prefix: str) -> None:
    """Exit 2 unless this service's certificate names its role and datacenter: a service never
    runs under another party's identity (peers would take it for that party, or refuse it)."""
    try:
        why = own_identity_refusal(Path(settings.tls_cert).read_bytes(), service, settings.datacenter)
    except (OSError, ValueError) as e:
        why = f"unreadable: {e}"
    if why:
        _refuse(
            service,
            f"{env_prefix}TLS_CERT {settings.tls_cert}: {why}; this is {service} in {settings.datacenter}",
        )


def _refuse(service: str, why: str) -> None:
    print(f"{service}: {why}", file=sys.stderr)
    raise SystemExit(2)


def tls_context(settings: Any) -> ssl.SSLContext:
    """The client side of mutual TLS with this service's certificate."""
    return client_context(Identity(Path(settings.tls_ca), Path(settings.tls_cert), Path(settings.tls_key)))


def nats_options(settings: Any) -> dict[str, Any]:
    """Keyword arguments for shared.bus.connection.connect: this service's certificate, which
    the server maps to its role's user (no user name or password is sent)."""
    return {"tls": tls_context(settings)}
