"""Control messages that must arrive (shared/bus/delivery.py) over a real nats-server: a copy
nobody received is sent again until the receiver acks it, across a server restart too; a
message nobody ever acks gives up at its deadline."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from nats.aio.msg import Msg

from shared.bus import Message, NatsServer, flushed, subscribe
from shared.bus.delivery import deliver
from tests.fixtures_nats import NatsSecurity


@dataclass
class Note(Message):
    n: int


async def _receiver(nc, subject: str) -> asyncio.Queue:
    got: asyncio.Queue = asyncio.Queue()

    async def handler(msg: Note, raw: Msg) -> None:
        await got.put(msg.n)

    await subscribe(nc, subject, Note, handler, ack=True)
    await flushed(nc)
    return got


async def test_a_copy_nobody_heard_is_sent_again_until_acked(
    nats_server: NatsServer, nats_security: NatsSecurity
) -> None:
    tx = await nats_security.connect(nats_server, "tx")
    rx = await nats_security.connect(nats_server, "rx")
    try:
        t0 = time.monotonic()
        sent = asyncio.create_task(deliver(tx, "pdd.test.note", Note(1)))
        await asyncio.sleep(0.3)  # the first copies find nobody: lost, as in a server restart
        got = await _receiver(rx, "pdd.test.note")
        assert await asyncio.wait_for(sent, 5) is True
        assert time.monotonic() - t0 < 1.0  # repaired within about a second
        assert got.get_nowait() == 1
    finally:
        await tx.drain()
        await rx.drain()


async def test_an_acked_message_is_sent_once(nats_server: NatsServer, nats_security: NatsSecurity) -> None:
    tx = await nats_security.connect(nats_server, "tx")
    rx = await nats_security.connect(nats_server, "rx")
    try:
        got = await _receiver(rx, "pdd.test.once")
        assert await deliver(tx, "pdd.test.once", Note(2)) is True
        await asyncio.sleep(0.2)  # an absence: a second copy would have come by now
        assert got.qsize() == 1
    finally:
        await tx.drain()
        await rx.drain()


async def test_delivery_survives_a_server_restart(nats_security: NatsSecurity) -> None:
    server = nats_security.server("delivery")
    await server.start()
    tx = await nats_security.connect(server, "tx")
    rx = await nats_security.connect(server, "rx")
    try:
        got = await _receiver(rx, "pdd.test.restart")
        await server.stop()
        sent = asyncio.create_task(deliver(tx, "pdd.test.restart", Note(3)))
        await asyncio.sleep(0.5)  # the stimulus: copies sent while no server runs are lost
        server = nats_security.server("delivery", port=server.port)  # same address, new process
        await server.start()
        assert await asyncio.wait_for(sent, 10) is True
        assert await asyncio.wait_for(got.get(), 5) == 3
    finally:
        await tx.drain()
        await rx.drain()
        await server.stop()


async def test_a_message_nobody_acks_gives_up_at_its_deadline(
    nats_server: NatsServer, nats_security: NatsSecurity
) -> None:
    tx = await nats_security.connect(nats_server, "tx")
    try:
        t0 = time.monotonic()
        assert await deliver(tx, "pdd.test.nobody", Note(4), ack_timeout_s=0.1, deadline_s=0.6) is False
        assert 0.3 < time.monotonic() - t0 < 2.0  # copies until the next wait would pass the deadline
    finally:
        await tx.drain()
