"""The router's request to one instance over a real nats-server: "no responders" from an
instance still alive (its NATS node died and it is subscribing again elsewhere) is tried again
until it answers; a request (or answer) lost on the way is sent again; a lost instance, or the
timeout, ends the wait."""

from __future__ import annotations

import asyncio
import time

import pytest
from nats.errors import NoRespondersError

from services.router.adapter.dispatch import RESEND_FIRST_S, ask
from shared.bus import NatsServer
from shared.bus.connection import flushed, respond, subscribe
from shared.bus.messages import Role
from tests.fixtures_nats import NatsSecurity
from tests.integration.test_bus_nats import Ping, Pong, _serve_pongs


class Heard:
    """The router's liveness registry reduced to the one question ask() puts to it: how long
    since the instance was heard (set by the test: liveness is not under test here)."""

    def __init__(self, silent_s: float = 0.0) -> None:
        self.silent_s = silent_s

    def silent_for(self, role: Role, instance: str) -> float:
        return self.silent_s


class Fleet:
    def __init__(self, registry: Heard) -> None:
        self.registry = registry


PEER = (Role.PREFILL, "0")


async def test_no_responders_from_a_live_instance_is_tried_again_until_it_answers(
    nats_server: NatsServer, nats_security: NatsSecurity
) -> None:
    asker = await nats_security.connect(nats_server, "t")
    late = await nats_security.connect(nats_server, "t")
    try:
        asking = asyncio.ensure_future(
            ask(asker, Fleet(Heard()), 2.0, PEER, "pdd.test.late", Ping(1), Pong, 5.0)
        )
        await asyncio.sleep(0.35)  # a few tries meet nobody
        assert not asking.done()
        await _serve_pongs(late, "pdd.test.late")
        assert (await asyncio.wait_for(asking, 5)).n == 2
    finally:
        await late.drain()
        await asker.drain()


async def test_no_responders_gives_up_on_a_lost_instance_and_at_the_timeout(
    nats_server: NatsServer, nats_security: NatsSecurity
) -> None:
    nc = await nats_security.connect(nats_server, "t")
    try:
        with pytest.raises(NoRespondersError):  # lost: the first "no responders" is the answer
            await ask(nc, Fleet(Heard(silent_s=9.0)), 2.0, PEER, "pdd.test.none", Ping(1), Pong, 5.0)
        t0 = time.monotonic()
        with pytest.raises(NoRespondersError):  # alive but never subscribing: bounded by the timeout
            await ask(nc, Fleet(Heard()), 2.0, PEER, "pdd.test.none", Ping(1), Pong, 0.6)
        assert 0.4 < time.monotonic() - t0 < 2.0
    finally:
        await nc.drain()


async def test_a_request_lost_on_the_way_is_sent_again_and_the_first_answer_taken(
    nats_server: NatsServer, nats_security: NatsSecurity
) -> None:
    # The loss is made by the responder ignoring the first copy: NATS loses one only while a
    # server restarts or a gateway reconnects (the e2e NATS-restart tests cover that).
    asker = await nats_security.connect(nats_server, "t")
    responder = await nats_security.connect(nats_server, "t")
    copies: list[int] = []

    async def handler(msg: Ping, raw) -> None:
        copies.append(msg.n)
        if len(copies) == 2:  # the first copy is "lost", and so is all after the second
            await respond(raw, Pong(msg.n + 1))

    try:
        await subscribe(responder, "pdd.test.lossy", Ping, handler)
        await flushed(responder)
        t0 = time.monotonic()
        reply = await ask(asker, Fleet(Heard()), 2.0, PEER, "pdd.test.lossy", Ping(7), Pong, 10.0)
        assert reply == Pong(8) and copies == [7, 7]
        assert RESEND_FIRST_S <= time.monotonic() - t0 < RESEND_FIRST_S + 1.0
        t0 = time.monotonic()
        with pytest.raises(ConnectionError, match="was lost"):  # silence from a lost instance
            await ask(asker, Fleet(Heard(silent_s=9.0)), 2.0, PEER, "pdd.test.lossy", Ping(1), Pong, 10.0)
        assert time.monotonic() - t0 < 1.0
    finally:
        await responder.drain()
        await asker.drain()
