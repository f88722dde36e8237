"""NATS clusters: each datacenter's nodes routed over mutual TLS, the two clusters joined by gateways
across the WAN emulator (a supercluster); clients fail over to another node of their cluster."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import signal
from pathlib import Path

import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg

from shared.bus import NatsServer, connect, flushed
from shared.bus.nats_config import NatsConfig, NatsUser
from shared.bus.permissions import Permissions
from shared.ports import free_port
from shared.security.pki import Identity, Pki, client_context
from tests.fixtures_nats import TEST_USER, NatsSecurity, Supercluster, nats_supercluster  # noqa: F401
from tests.polling import until

SUBJECT = "pdd.test.cluster"


def _block(text: str, name: str, indent: str = "") -> str:
    """The lines of `name { ... }` at `indent` in a rendered config."""
    lines = text.splitlines()
    start = lines.index(f"{indent}{name} {{")
    return "\n".join(lines[start + 1 : lines.index(f"{indent}}}", start)])


# What a lone server renders (its certificate not readable here: the gateway checks the CA only).
LONE_SERVER = """\
server_name: "nats-a"
listen: "127.0.0.1:4222"
http: "127.0.0.1:8222"
log_file: "/w/nats-server.log"
tls {
  cert_file: "/s/nats-a.pem"
  key_file: "/s/nats-a.key"
  ca_file: "/s/ca.pem"
  verify_and_map: true
  timeout: 5
}
authorization {
  users = [
    {user: "CN=router,OU=dc-a,O=pdd", permissions: {publish: {allow: ["a.b"]}, subscribe: {allow: ["c.*"]}, allow_responses: true}}
    {user: "CN=test,O=pdd"}
  ]
}
gateway {
  name: "nats-a"
  listen: "127.0.0.1:7222"
  advertise: "127.0.0.1:17222"
  tls {
    cert_file: "/s/nats-a.pem"
    key_file: "/s/nats-a.key"
    ca_file: "/s/ca.pem"
    verify: true
    timeout: 5
  }
  gateways: [{name: "nats-b", urls: ["nats://127.0.0.1:17223"]}]
}
"""


def test_a_lone_server_renders_as_before(nats_security: NatsSecurity) -> None:
    ident = Identity(Path("/s/ca.pem"), Path("/s/nats-a.pem"), Path("/s/nats-a.key"))
    router = NatsUser("CN=router,OU=dc-a,O=pdd", Permissions(("a.b",), ("c.*",), True))
    users = [router, NatsUser("CN=test,O=pdd", None)]
    conf = NatsConfig(
        "nats-a",
        "127.0.0.1:4222",
        "127.0.0.1:8222",
        tls=ident,
        users=users,
        gateway_listen="127.0.0.1:7222",
        gateway_advertise="127.0.0.1:17222",
        gateways={"nats-b": "nats://127.0.0.1:17223"},
        log_file="/w/nats-server.log",
    )
    assert conf.render() == LONE_SERVER
    server = nats_security.server("dc-a", gateways={"dc-b": "nats://127.0.0.1:1"})
    assert server.cluster_url is None and "cluster" not in server.config_text()
    assert _block(server.config_text(), "gateway").startswith('  name: "dc-a"\n')


def test_a_clustered_node_routes_over_mutual_tls_and_gateways_as_its_cluster(
    nats_security: NatsSecurity,
) -> None:
    routes = [f"nats-route://127.0.0.1:{free_port()}" for _ in range(3)]
    remote = ["nats://127.0.0.1:17001", "nats://127.0.0.1:17002"]
    node = nats_security.server(
        "nats-a-1", "nats-a", cluster="nats-a", routes=routes, gateways={"nats-b": remote}
    )
    text = node.config_text()
    assert text.startswith('server_name: "nats-a-1"\n')
    assert node.cluster_url == f"nats-route://127.0.0.1:{node.cluster_port}" and node.cluster_port
    cluster = _block(text, "cluster")
    assert cluster.startswith(f'  name: "nats-a"\n  listen: "127.0.0.1:{node.cluster_port}"\n')
    assert f"  routes: {json.dumps(routes)}" in cluster.splitlines()
    tls = _block(cluster, "tls", "  ")  # routes: the node's own certificate, peers must present one
    assert f'cert_file: "{nats_security.creds.identity("nats-a").cert}"' in tls
    assert "verify_and_map: true" in tls  # and only dc-a's NATS servers' certificates are let in
    assert '  authorization { user: "CN=nats,OU=dc-a,O=pdd" }' in cluster.splitlines()
    gateway = _block(text, "gateway")
    assert gateway.startswith('  name: "nats-a"\n')  # the gateway name is the cluster's, not the node's
    assert f'  gateways: [{{name: "nats-b", urls: {json.dumps(remote)}}}]' in gateway.splitlines()


class CarelessNode(NatsServer):
    """A fake for a fault no real node has: it dials routes without checking the peer's
    certificate, so that only the peer it dials can refuse it."""

    def config_text(self) -> str:
        return super().config_text().replace("\n  tls {\n", "\n  tls {\n    insecure: true\n")


async def test_a_node_refuses_a_route_from_a_node_with_a_foreign_certificate(
    nats_security: NatsSecurity, tmp_path: Path
) -> None:
    foreign = Pki(tmp_path / "foreign")
    foreign.ensure(["nats-a"], ["127.0.0.1"])  # same name and hosts, another CA
    node = nats_security.server("nats-a-0", "nats-a", cluster="nats-a")
    intruder = CarelessNode(
        "nats-a-9",
        tls=foreign.identity("nats-a"),
        users=nats_security.users(),
        cluster="nats-a",
        routes=[node.cluster_url or ""],
    )
    assert "insecure: true" in _block(intruder.config_text(), "cluster")
    await node.start()
    try:
        await intruder.start()
        # Refused either way: a foreign CA of our CA's name gets its leaf sent and found unknown;
        # one of another name gets none sent (the node names the CAs it accepts).
        refusals = ("certificate signed by unknown authority", "client didn't provide a certificate")
        await until(lambda: any(r in node.log_path.read_text() for r in refusals), 10)
        with pytest.raises(TimeoutError):  # a route that came up would stay until a node stops
            await node.wait_routes(1, timeout=0.5)
    finally:
        await intruder.stop()
        await node.stop()


# ---- a supercluster: failover --------------------------------------------------------------------------


async def _connect_any(sec: NatsSecurity, nodes: list[NatsServer], name: str) -> Client:
    return await connect([n.url for n in nodes], name, tls=client_context(sec.creds.identity(TEST_USER)))


def _node_of(nc: Client, nodes: list[NatsServer]) -> NatsServer:
    assert nc.connected_url is not None
    (node,) = [n for n in nodes if n.port == nc.connected_url.port]
    return node


async def _delivered(pub: Client, got: asyncio.Queue, tag: str, timeout: float) -> None:
    """Publish messages tagged `tag` until one arrives (interest crosses the gateway, clients
    reconnect, all asynchronously); messages sent before, still on their way, do not count."""
    async with asyncio.timeout(timeout):
        for n in itertools.count():
            await pub.publish(SUBJECT, f"{tag} {n}".encode())
            await asyncio.sleep(0.1)
            while not got.empty():
                if got.get_nowait().startswith(f"{tag} ".encode()):
                    return


async def _sigkill(node: NatsServer) -> None:
    assert node.pid is not None
    os.kill(node.pid, signal.SIGKILL)
    await until(lambda: node.returncode is not None, 5)
    assert node.returncode == -signal.SIGKILL
    await node.stop()  # cleans its directory up


async def test_a_client_fails_over_within_its_cluster_and_keeps_receiving_across_the_wan(
    nats_supercluster: Supercluster,  # noqa: F811
    nats_security: NatsSecurity,
) -> None:
    sc = nats_supercluster
    got: asyncio.Queue = asyncio.Queue()

    async def on_msg(msg: Msg) -> None:
        await got.put(msg.data)

    sub = await _connect_any(nats_security, sc.b, "subscriber in dc-b")
    pub = await _connect_any(nats_security, sc.a, "publisher in dc-a")
    try:
        await sub.subscribe(SUBJECT, cb=on_msg)
        await flushed(sub)
        await _delivered(pub, got, "before", 20)
        links = await sc.wan.get()
        assert sum(links[f"gw-nats-b-{i}"]["bytes_up"] for i in range(len(sc.b))) > 0  # A -> B via the WAN

        dead = [_node_of(sub, sc.b), _node_of(pub, sc.a)]
        for node in dead:
            await _sigkill(node)
        await _delivered(pub, got, "after", 20)
        assert _node_of(sub, sc.b) not in dead and _node_of(pub, sc.a) not in dead
        assert sub.stats["reconnects"] >= 1 and pub.stats["reconnects"] >= 1
        survivors = [n for n in [*sc.a, *sc.b] if n not in dead]
        await asyncio.gather(*(n.wait_routes(len(sc.a) - 2, 10) for n in survivors))
        await asyncio.gather(*(n.wait_gateways(10) for n in survivors))
    finally:
        await sub.close()
        await pub.close()
