"""The KV bulk channel to main decoders at any address: through one dial-on-demand WAN link
(the sender names each receiver in a first line, TLS runs end to end), trusting a receiver by
the main_decode identity its certificate names rather than by the address it was found at."""

from __future__ import annotations

import asyncio
import socket

import pytest
import torch

from shared.kv import KVClientPool, KVTransferError, open_kv_client, start_kv_server
from shared.kv.transport import advertised_address
from shared.security import Pki, client_context, server_context
from shared.wan import WanLink

from .test_kv_channel import SECRET, MemorySink, blocks

MD = "main_decode"


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Pki:
    """Certificates naming no host at all: made before anyone knew where receivers would run."""
    pki = Pki(tmp_path_factory.mktemp("pki"))
    pki.ensure([MD, "prefill", "relay"], [])
    return pki


async def _receivers(pki: Pki, n: int, identity: str = MD) -> list:
    tls = server_context(pki.identity(identity))
    return [await start_kv_server("tcp://127.0.0.1:0", SECRET, MemorySink(), ssl=tls) for _ in range(n)]


def _port(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


async def test_two_receivers_through_one_via_link_bit_exact(pki) -> None:
    servers = await _receivers(pki, 2)
    ports = sorted(_port(s.address) for s in servers)
    link = WanLink("bulk", "127.0.0.1:0", f"127.0.0.1:{ports[0]}-{ports[1]}")
    await link.start()
    pool = KVClientPool(
        SECRET, ssl=client_context(pki.identity("prefill")), via=f"tcp://{link.listen}", server_name=MD
    )
    try:
        for i, server in enumerate(servers):
            src = blocks(20, seed=i)
            client = await pool.acquire(server.address)
            await client.send_blocks(f"r{i}", list(range(20)), src)
            await client.finish(f"r{i}")
            pool.release(client)
            assert torch.equal(server.sink.tensor(f"r{i}"), src)
        assert link.connections == 2 and link.refused == 0
        assert link.bytes_up > 2 * blocks(20).numel() * 2  # every byte crossed the one link
    finally:
        await pool.close()
        await link.stop()
        for s in servers:
            await s.close()


@pytest.mark.parametrize("identity", ["prefill", "relay"])
async def test_a_receiver_of_another_identity_is_refused(pki, identity) -> None:
    (impostor,) = await _receivers(pki, 1, identity)  # same CA, wrong name
    try:
        with pytest.raises(KVTransferError, match="certificate verify failed"):
            await open_kv_client(
                impostor.address,
                SECRET,
                ssl=client_context(pki.identity("prefill")),
                server_name=MD,
                timeout=5,
            )
        assert not impostor.sink.groups
    finally:
        await impostor.close()


async def test_identity_not_address_is_what_is_checked(pki) -> None:
    (server,) = await _receivers(pki, 1)
    tls = client_context(pki.identity("prefill"))
    try:
        with pytest.raises(KVTransferError):  # by address: 127.0.0.1 is in no certificate here
            await open_kv_client(server.address, SECRET, ssl=tls, timeout=5)
        client = await open_kv_client(server.address, SECRET, ssl=tls, server_name=MD, timeout=5)
        await client.close()
    finally:
        await server.close()


async def test_unix_peers_never_go_via(tmp_path) -> None:
    sink = MemorySink()
    server = await start_kv_server(f"unix://{tmp_path}/relay.sock", SECRET, sink)
    pool = KVClientPool(SECRET, via="tcp://127.0.0.1:1", server_name=MD)  # nobody listens there
    try:
        client = await pool.acquire(server.address)  # dialing the via address would fail here
        await client.send_blocks("u", [1], blocks(1))
        await client.finish("u")
        await asyncio.wait_for(sink.got_blocks.wait(), 10)
        assert [hashes for hashes, _ in sink.held["u"]] == [[1]]
    finally:
        await pool.close()
        await server.close()


async def test_advertised_address() -> None:
    assert await advertised_address("tcp://127.0.0.1:7400") == "tcp://127.0.0.1:7400"
    assert await advertised_address("tcp://md-3:7400") == "tcp://md-3:7400"
    assert await advertised_address("unix:///tmp/x.sock") == "unix:///tmp/x.sock"
    ip = socket.gethostbyname(socket.gethostname())
    assert await advertised_address("tcp://0.0.0.0:7400") == f"tcp://{ip}:7400"
