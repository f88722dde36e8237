"""Secured NATS on one machine, as `pdd up` runs it (mutual TLS, each certificate mapped to its
role's user), for tests and benchmarks: credentials in a directory, servers built from them, and
clients that log in as a service or as an all-subjects lab user (for measuring or testing the
bus itself), each with its own certificate."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nats.aio.client import Client

from pdd.launch import SERVICES
from shared.bus.connection import connect
from shared.bus.nats_config import NatsUser, nats_users
from shared.bus.nats_server import NatsServer
from shared.security.credentials import Credentials
from shared.security.pki import client_context, leaf_subject

TEST_USER = "test"  # a certificate of no role, mapped to a user that may use every subject


@dataclass
class NatsSecurity:
    """Use `NatsSecurity.create(directory)`."""

    creds: Credentials

    def users(self) -> list[NatsUser]:
        return [*nats_users(SERVICES), NatsUser(leaf_subject(TEST_USER, None).rfc4514_string(), None)]

    def server(self, name: str, identity: str = "nats-a", **kw: Any) -> NatsServer:
        return NatsServer(name, tls=self.creds.identity(identity), users=self.users(), **kw)

    async def connect(
        self, server: NatsServer | str, name: str, *, user: str = TEST_USER, **kw: Any
    ) -> Client:
        """A client with `user`'s certificate, which the server maps to that user (options in
        kw override it); `server` is a NatsServer or its URL (from another process)."""
        opts = {"tls": client_context(self.creds.identity(user))}
        return await connect(server if isinstance(server, str) else server.url, name, **{**opts, **kw})

    @classmethod
    def create(cls, directory: Path) -> NatsSecurity:
        creds = Credentials(Path(directory) / "secrets").ensure(SERVICES, [])
        creds.pki.ensure([TEST_USER], [])
        return cls(creds)
