"""NATS fixtures, secured as `pdd up` runs them: mutual TLS, one user per service.

`nats_security` holds a private CA and the services' credentials (made once per session), and
builds servers and client connections from them; `nats_server`, `nats_pair` and
`nats_pair_via_wan` are servers made by it. Its `connect` logs in as the test user, which may
use any subject (these fixtures serve tests of the bus, not of the permissions), or as a service.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from shared.bus import NatsServer
from shared.bus.nats_server import free_port
from shared.security.nats_lab import TEST_USER, NatsSecurity  # noqa: F401 (tests import them from here)
from shared.wan import WanControl, WanEmulator, WanLink


@pytest.fixture(scope="session")
def nats_security(tmp_path_factory: pytest.TempPathFactory) -> NatsSecurity:
    return NatsSecurity.create(tmp_path_factory.mktemp("nats-secrets"))


@pytest_asyncio.fixture
async def nats_server(nats_security: NatsSecurity) -> AsyncIterator[NatsServer]:
    server = nats_security.server("test")
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


async def _pair(
    sec: NatsSecurity, gw_a_dials: str, gw_a_port: int, gw_b_port: int, advertise_a: str | None
) -> tuple[NatsServer, NatsServer]:
    # B only listens; A dials B at `gw_a_dials`, and B dials A back at A's advertised gateway address.
    b = sec.server("dc-b", "nats-b", gateway_port=gw_b_port)
    a = sec.server("dc-a", gateway_port=gw_a_port, gateways={"dc-b": gw_a_dials}, gateway_advertise=advertise_a)
    await b.start()
    try:
        await a.start()
        await a.wait_gateways(15)
        await b.wait_gateways(15, names=["dc-a"])
    except BaseException:
        await a.stop()
        await b.stop()
        raise
    return a, b


@pytest_asyncio.fixture
async def nats_pair(nats_security: NatsSecurity) -> AsyncIterator[tuple[NatsServer, NatsServer]]:
    gw_b = free_port()
    a, b = await _pair(nats_security, f"nats://127.0.0.1:{gw_b}", free_port(), gw_b, None)
    try:
        yield a, b
    finally:
        await a.stop()
        await b.stop()


@pytest_asyncio.fixture
async def nats_pair_via_wan(nats_security: NatsSecurity) -> AsyncIterator[tuple[NatsServer, NatsServer, WanControl]]:
    """Both gateway directions cross the emulator: link "gw-ab" (A dials B) and "gw-ba" (B dials A)."""
    gw_a, gw_b = free_port(), free_port()
    ab = WanLink("gw-ab", "127.0.0.1:0", f"127.0.0.1:{gw_b}")
    ba = WanLink("gw-ba", "127.0.0.1:0", f"127.0.0.1:{gw_a}")
    wan = WanEmulator([ab, ba])
    await wan.start()
    try:
        a, b = await _pair(nats_security, f"nats://{ab.listen}", gw_a, gw_b, ba.listen)
        try:
            assert wan.control_url is not None
            yield a, b, WanControl(wan.control_url)
        finally:
            await a.stop()
            await b.stop()
    finally:
        await wan.stop()
