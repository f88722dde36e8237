"""NATS fixtures: one server, two DCs joined by a gateway, and the same through the WAN emulator."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest_asyncio

from shared.bus import NatsServer
from shared.bus.nats_server import free_port
from shared.wan import WanControl, WanEmulator, WanLink


@pytest_asyncio.fixture
async def nats_server() -> AsyncIterator[NatsServer]:
    server = NatsServer("test")
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


async def _pair(
    gw_a_dials: str, gw_a_port: int, gw_b_port: int, advertise_a: str | None
) -> tuple[NatsServer, NatsServer]:
    # B only listens; A dials B at `gw_a_dials`, and B dials A back at A's advertised gateway address.
    b = NatsServer("dc-b", gateway_port=gw_b_port)
    a = NatsServer(
        "dc-a", gateway_port=gw_a_port, gateways={"dc-b": gw_a_dials}, gateway_advertise=advertise_a
    )
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
async def nats_pair() -> AsyncIterator[tuple[NatsServer, NatsServer]]:
    gw_b = free_port()
    a, b = await _pair(f"nats://127.0.0.1:{gw_b}", free_port(), gw_b, None)
    try:
        yield a, b
    finally:
        await a.stop()
        await b.stop()


@pytest_asyncio.fixture
async def nats_pair_via_wan() -> AsyncIterator[tuple[NatsServer, NatsServer, WanControl]]:
    """Both gateway directions cross the emulator: link "gw-ab" (A dials B) and "gw-ba" (B dials A)."""
    gw_a, gw_b = free_port(), free_port()
    ab = WanLink("gw-ab", "127.0.0.1:0", f"127.0.0.1:{gw_b}")
    ba = WanLink("gw-ba", "127.0.0.1:0", f"127.0.0.1:{gw_a}")
    wan = WanEmulator([ab, ba])
    await wan.start()
    try:
        a, b = await _pair(f"nats://{ab.listen}", gw_a, gw_b, ba.listen)
        try:
            assert wan.control_url is not None
            yield a, b, WanControl(wan.control_url)
        finally:
            await a.stop()
            await b.stop()
    finally:
        await wan.stop()
