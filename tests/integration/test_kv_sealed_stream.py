"""TLS streams over real sockets, below the KV protocol: the mutual-TLS handshake, then sealed
records; large sends arrive exact in reads of any size, the first records may ride with the
handshake, and a peer gone mid-frame or a byte changed on the wire is an error."""

from __future__ import annotations

import asyncio
import os
import socket

import pytest

from shared.kv.transport import TLSStream, transport_for
from shared.security import Pki, client_context, server_context

MiB = 1 << 20


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Pki:
    pki = Pki(tmp_path_factory.mktemp("pki"))
    pki.ensure(["receiver", "sender"], ["127.0.0.1"])
    return pki


async def pair(pki: Pki, address: str = "tcp://127.0.0.1:0", connect_to: str | None = None):
    """(listener, client stream, server stream) over loopback."""
    accepted: asyncio.Queue = asyncio.Queue()
    transport = transport_for(address)

    async def on_stream(stream) -> None:
        await accepted.put(stream)
        await asyncio.Event().wait()  # keep the connection task alive

    listener = await transport.listen(address, on_stream, ssl=server_context(pki.identity("receiver")))
    client = await transport.connect(
        connect_to or listener.address, ssl=client_context(pki.identity("sender"))
    )
    server = await asyncio.wait_for(accepted.get(), 5)
    return listener, client, server


async def test_large_sends_arrive_exact_in_reads_of_any_size_both_ways(pki) -> None:
    listener, client, server = await pair(pki)
    try:
        assert isinstance(client, TLSStream) and isinstance(server, TLSStream)
        assert server.identity.startswith("sender@")
        header, payload = os.urandom(333), os.urandom(9 * MiB + 7)
        sending = asyncio.create_task(client.send(header, payload))
        got = bytearray(len(header) + len(payload))
        view, pos = memoryview(got), 0
        for size in (4, 329, 100_000, 3 * MiB, len(got)):  # header in two reads, then the rest
            size = min(size, len(got) - pos)
            await server.recv_into(view[pos : pos + size])
            pos += size
        await sending
        assert bytes(got) == header + payload
        await server.send(b"ack")  # and back
        back = bytearray(3)
        await client.recv_into(memoryview(back))
        assert back == b"ack"
    finally:
        client.close()
        server.close()
        await listener.close()


async def test_peer_closing_mid_frame_is_a_connection_error(pki) -> None:
    listener, client, server = await pair(pki)
    try:
        await client.send(os.urandom(MiB))
        client.close()
        with pytest.raises(ConnectionError):
            await server.recv_into(memoryview(bytearray(2 * MiB)))
    finally:
        server.close()
        await listener.close()


async def test_a_byte_changed_on_the_wire_fails_the_stream(pki) -> None:
    """A relay that flips one byte of the bulk data, past the handshake."""
    up = socket.create_server(("127.0.0.1", 0))
    up.setblocking(False)
    loop = asyncio.get_running_loop()
    listener = None

    async def relay() -> None:
        down, _ = await loop.sock_accept(up)
        host, port = listener.address.removeprefix("tcp://").rsplit(":", 1)
        out = socket.create_connection((host, int(port)))
        out.setblocking(False)

        async def pipe(a: socket.socket, b: socket.socket, flip_at: int | None) -> None:
            seen = 0
            while data := await loop.sock_recv(a, 1 << 16):
                if flip_at is not None and seen <= flip_at < seen + len(data):
                    data = bytearray(data)
                    data[flip_at - seen] ^= 0x40
                seen += len(data)
                await loop.sock_sendall(b, bytes(data))

        await asyncio.gather(pipe(down, out, 200_000), pipe(out, down, None), return_exceptions=True)

    task = asyncio.create_task(relay())
    accepted: asyncio.Queue = asyncio.Queue()

    async def on_stream(stream) -> None:
        await accepted.put(stream)
        await asyncio.Event().wait()

    transport = transport_for("tcp://127.0.0.1:0")
    listener = await transport.listen(
        "tcp://127.0.0.1:0", on_stream, ssl=server_context(pki.identity("receiver"))
    )
    client = await transport.connect(
        f"tcp://127.0.0.1:{up.getsockname()[1]}",
        ssl=client_context(pki.identity("sender")),
        server_name="127.0.0.1",
    )
    server = await asyncio.wait_for(accepted.get(), 5)
    try:
        await client.send(os.urandom(MiB))
        with pytest.raises(ConnectionError, match="failed authentication"):
            await server.recv_into(memoryview(bytearray(MiB)))
    finally:
        client.close()
        server.close()
        task.cancel()
        up.close()
        await listener.close()
