"""Secured NATS on one machine, as `pdd up` runs it (mutual TLS, one user per service), for
tests and benchmarks: credentials in a directory, servers built from them, and clients that log
in as a service or as an all-subjects lab user (for measuring or testing the bus itself)."""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nats.aio.client import Client

from pdd.launch import SERVICES
from shared.bus.connection import connect
from shared.bus.nats_config import NatsUser, nats_users
from shared.bus.nats_server import NatsServer
from shared.security.credentials import Credentials
from shared.security.pki import client_context

TEST_USER = "test"


@dataclass
class NatsSecurity:
    """Use `NatsSecurity.create(directory)`."""

    creds: Credentials
    test_password: str

    def users(self) -> list[NatsUser]:
        return [*nats_users(self.creds, SERVICES), NatsUser(TEST_USER, self.test_password, None)]

    def server(self, name: str, identity: str = "nats-a", **kw: Any) -> NatsServer:
        return NatsServer(name, tls=self.creds.identity(identity), users=self.users(), **kw)

    def password(self, user: str) -> str:
        return self.test_password if user == TEST_USER else self.creds.password(user)

    async def connect(
        self, server: NatsServer | str, name: str, *, user: str = TEST_USER, **kw: Any
    ) -> Client:
        """A client with `user`'s password and certificate (options in kw override them);
        `server` is a NatsServer or its URL (from another process)."""
        opts = {
            "user": user,
            "password": self.password(user),
            "tls": client_context(self.creds.identity(user)),
        }
        return await connect(server if isinstance(server, str) else server.url, name, **{**opts, **kw})

    @classmethod
    def create(cls, directory: Path) -> NatsSecurity:
        creds = Credentials(Path(directory) / "secrets").ensure(SERVICES, [])
        creds.pki.ensure([TEST_USER], [])
        return cls(creds, secrets.token_urlsafe(16))
