"""NATS fixtures, secured as `pdd up` runs them: mutual TLS, one user per service.

`nats_security` holds a private CA and the services' credentials (made once per session), and
builds servers and client connections from them; `nats_server`, `nats_pair`,
`nats_pair_via_wan` and `nats_supercluster` are servers made by it. Its `connect` logs in as the test user, which may
use any subject (these fixtures serve tests of the bus, not of the permissions), or as a service.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest
import pytest_asyncio

from pdd.benchkit.nats_lab import TEST_USER, NatsSecurity  # noqa: F401 (tests import them from here)
from shared.bus import NatsServer
from shared.ports import free_port
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
    a = sec.server(
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
async def nats_pair(nats_security: NatsSecurity) -> AsyncIterator[tuple[NatsServer, NatsServer]]:
    gw_b = free_port()
    a, b = await _pair(nats_security, f"nats://127.0.0.1:{gw_b}", free_port(), gw_b, None)
    try:
        yield a, b
    finally:
        await a.stop()
        await b.stop()


@pytest_asyncio.fixture
async def nats_pair_via_wan(
    nats_security: NatsSecurity,
) -> AsyncIterator[tuple[NatsServer, NatsServer, WanControl]]:
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


CLUSTER_NODES = 3


@dataclass
class Supercluster:
    a: list[NatsServer]  # cluster "nats-a", nodes "nats-a-0"...
    b: list[NatsServer]
    wan: WanControl  # link "gw-nats-a-0" fronts node nats-a-0's gateway, and so on


def _cluster(
    sec: NatsSecurity, name: str, links: list[WanLink], gw_ports: list[int], remote: dict
) -> list[NatsServer]:
    """Nodes of cluster `name` (identity `name`), each advertising its WAN link as its gateway."""
    route_ports = [free_port() for _ in gw_ports]
    routes = [f"nats-route://127.0.0.1:{p}" for p in route_ports]
    return [
        sec.server(
            f"{name}-{i}",
            name,
            cluster=name,
            cluster_port=route_ports[i],
            routes=routes,
            gateway_port=gw_ports[i],
            gateway_advertise=links[i].listen,
            gateways=remote,
        )
        for i in range(len(gw_ports))
    ]


@pytest_asyncio.fixture
async def nats_supercluster(nats_security: NatsSecurity) -> AsyncIterator[Supercluster]:
    """Clusters "nats-a" and "nats-b" of CLUSTER_NODES nodes, routed, joined by gateways that cross the
    emulator: every node dials the other cluster's nodes through their links, and advertises its own."""
    names = ("nats-a", "nats-b")
    gw_ports = {c: [free_port() for _ in range(CLUSTER_NODES)] for c in names}
    links = {
        c: [WanLink(f"gw-{c}-{i}", "127.0.0.1:0", f"127.0.0.1:{p}") for i, p in enumerate(gw_ports[c])]
        for c in names
    }
    wan = WanEmulator([*links["nats-a"], *links["nats-b"]])
    await wan.start()
    urls = {c: [f"nats://{link.listen}" for link in links[c]] for c in names}
    a = _cluster(nats_security, "nats-a", links["nats-a"], gw_ports["nats-a"], {"nats-b": urls["nats-b"]})
    b = _cluster(nats_security, "nats-b", links["nats-b"], gw_ports["nats-b"], {"nats-a": urls["nats-a"]})
    try:
        for server in [*a, *b]:
            await server.start()
        await asyncio.gather(*(s.wait_routes(CLUSTER_NODES - 1, 15) for s in [*a, *b]))
        await asyncio.gather(*(s.wait_gateways(15) for s in [*a, *b]))
        assert wan.control_url is not None
        yield Supercluster(a, b, WanControl(wan.control_url))
    finally:
        for server in [*a, *b]:
            await server.stop()
        await wan.stop()
