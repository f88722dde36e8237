"""Typed messages over a real nats-server: round trips, malformed input, tracing, micro, gateways."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass

import pytest
from nats.aio.msg import Msg
from nats.errors import NoRespondersError
from opentelemetry import context, trace
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags
from prometheus_client import REGISTRY

from shared.bus import (
    MALFORMED,
    Message,
    NatsServer,
    flushed,
    publish,
    register_service,
    request,
    respond,
    subscribe,
)
from tests.fixtures_nats import NatsSecurity
from tests.polling import until, until_async


@dataclass
class Ping(Message):
    n: int
    text: str = ""


@dataclass
class Pong(Message):
    n: int
    trace_id: int = 0


async def _collect(nc, subject: str, cls: type[Message]) -> asyncio.Queue:
    q: asyncio.Queue = asyncio.Queue()

    async def handler(msg: Message, raw: Msg) -> None:
        await q.put((msg, trace.get_current_span().get_span_context().trace_id))

    await subscribe(nc, subject, cls, handler)
    await flushed(nc)
    return q


async def test_publish_subscribe_round_trip_with_trace_context(
    nats_server: NatsServer, nats_security: NatsSecurity
) -> None:
    nc = await nats_security.connect(nats_server, "t")
    try:
        q = await _collect(nc, "pdd.test.ping", Ping)
        await publish(nc, "pdd.test.ping", Ping(1, "a"))  # no current span: no traceparent
        span = NonRecordingSpan(SpanContext(0xABC, 0xDEF, is_remote=False, trace_flags=TraceFlags(1)))
        token = context.attach(trace.set_span_in_context(span))
        try:
            await publish(nc, "pdd.test.ping", Ping(2, "b"))
        finally:
            context.detach(token)
        assert await asyncio.wait_for(q.get(), 5) == (Ping(1, "a"), 0)
        assert await asyncio.wait_for(q.get(), 5) == (Ping(2, "b"), 0xABC)
    finally:
        await nc.drain()


async def test_malformed_is_dropped_counted_and_the_subscriber_survives(
    nats_server: NatsServer, nats_security: NatsSecurity
) -> None:
    nc = await nats_security.connect(nats_server, "t")
    subject = "pdd.test.malformed"
    try:
        q = await _collect(nc, subject, Ping)
        before = MALFORMED[subject]
        for junk in (
            b"\xc1",
            b"not msgpack at all",
            b"\x81\xa1v\x01",
            b"\x93\x01\x02\x03",
        ):  # last two: map w/o n, array
            await nc.publish(subject, junk)
        await publish(nc, subject, Pong(5))  # a different (unknown to this subscriber) message type
        await publish(nc, subject, Ping(9))
        assert (await asyncio.wait_for(q.get(), 5))[0] == Ping(9)
        assert q.empty()
        assert MALFORMED[subject] - before == 5
        assert REGISTRY.get_sample_value("pdd_bus_malformed_total", {"subject": subject}) >= 5
    finally:
        await nc.drain()


async def test_handler_exception_is_contained(nats_server: NatsServer, nats_security: NatsSecurity) -> None:
    nc = await nats_security.connect(nats_server, "t")
    seen: list[int] = []
    both = asyncio.Event()

    async def handler(msg: Ping, raw: Msg) -> None:
        seen.append(msg.n)
        if len(seen) == 2:
            both.set()
        if msg.n == 1:
            raise RuntimeError("boom")

    try:
        await subscribe(nc, "pdd.test.boom", Ping, handler)
        for n in (1, 2):
            await publish(nc, "pdd.test.boom", Ping(n))
        await asyncio.wait_for(both.wait(), 5)
        assert seen == [1, 2] and nc.is_connected
    finally:
        await nc.drain()


async def _serve_pongs(nc, subject: str) -> None:
    async def handler(msg: Ping, raw: Msg) -> None:
        await respond(raw, Pong(msg.n + 1, trace.get_current_span().get_span_context().trace_id))

    await subscribe(nc, subject, Ping, handler, queue="q")
    await flushed(nc)


async def test_request_reply_and_timeout(nats_server: NatsServer, nats_security: NatsSecurity) -> None:
    nc = await nats_security.connect(nats_server, "t")
    try:
        await _serve_pongs(nc, "pdd.test.rr")
        assert await request(nc, "pdd.test.rr", Ping(1), Pong, timeout=2) == Pong(2, 0)
        with pytest.raises(NoRespondersError):
            await request(nc, "pdd.test.nobody", Ping(1), Pong, timeout=2)

        async def silent(msg: Ping, raw: Msg) -> None:
            pass

        await subscribe(nc, "pdd.test.silent", Ping, silent)
        with pytest.raises(asyncio.TimeoutError):
            await request(nc, "pdd.test.silent", Ping(1), Pong, timeout=0.2)
    finally:
        await nc.drain()


async def test_micro_service_discovery(nats_server: NatsServer, nats_security: NatsSecurity) -> None:
    nc = await nats_security.connect(nats_server, "svc")

    async def echo(req) -> None:
        await req.respond(req.data)

    svc = await register_service(
        nc,
        "pdd-test",
        "1.2.3",
        "test service",
        endpoints={"pdd.test.echo": echo},
        metadata={"dc": "dc-a", "n": 1},
    )
    try:
        ping = json.loads((await nc.request("$SRV.PING.pdd-test", b"", timeout=2)).data)
        info = json.loads((await nc.request("$SRV.INFO.pdd-test", b"", timeout=2)).data)
        assert ping["name"] == "pdd-test" and ping["version"] == "1.2.3"
        assert info["metadata"] == {"dc": "dc-a", "n": "1"}
        assert [e["subject"] for e in info["endpoints"]] == ["pdd.test.echo"]
        assert (await nc.request("pdd.test.echo", b"hi", timeout=2)).data == b"hi"
        stats = json.loads((await nc.request("$SRV.STATS.pdd-test", b"", timeout=2)).data)
        assert stats["endpoints"][0]["num_requests"] == 1
    finally:
        await svc.stop()
        await nc.drain()


async def _request_when_interest_arrives(nc, subject: str, msg: Message, timeout: float) -> Pong:
    # Subscription interest crosses a gateway asynchronously: retry until it has.
    async def answered() -> Pong | None:
        try:
            return await request(nc, subject, msg, Pong, timeout=0.5)
        except Exception:
            return None

    return await until_async(answered, timeout, 0.05, f"an answer on {subject} across the gateway")


async def test_round_trip_across_the_gateway(
    nats_pair: tuple[NatsServer, NatsServer], nats_security: NatsSecurity
) -> None:
    a, b = nats_pair
    nc_a, nc_b = await nats_security.connect(a, "a"), await nats_security.connect(b, "b")
    try:
        await _serve_pongs(nc_b, "pdd.test.xdc")
        assert await _request_when_interest_arrives(nc_a, "pdd.test.xdc", Ping(41), 10) == Pong(42, 0)
        q = await _collect(nc_a, "pdd.test.back", Ping)  # and B -> A, plain publish

        async def arrived() -> bool:  # each try publishes again: interest crosses asynchronously
            await publish(nc_b, "pdd.test.back", Ping(7))
            return not q.empty()

        await until_async(arrived, 10, 0.05)
        assert (await q.get())[0] == Ping(7)
    finally:
        await nc_a.drain()
        await nc_b.drain()


async def test_gateway_through_the_wan_emulator(nats_pair_via_wan, nats_security: NatsSecurity) -> None:
    a, b, wan = nats_pair_via_wan
    nc_a, nc_b = await nats_security.connect(a, "a"), await nats_security.connect(b, "b")
    try:
        await _serve_pongs(nc_b, "pdd.test.wan")
        assert await _request_when_interest_arrives(nc_a, "pdd.test.wan", Ping(1), 10) == Pong(2, 0)
        for link in ("gw-ab", "gw-ba"):
            await wan.set(link, delay_ms=25)
        t0 = time.perf_counter()
        assert await request(nc_a, "pdd.test.wan", Ping(2), Pong, timeout=5) == Pong(3, 0)
        assert time.perf_counter() - t0 >= 0.045  # request crosses A->B, the reply B->A
        links = await wan.get()
        assert links["gw-ab"]["bytes_up"] > 0 and links["gw-ba"]["bytes_up"] > 0
    finally:
        await nc_a.drain()
        await nc_b.drain()


async def test_server_stop_leaves_no_process(nats_security: NatsSecurity) -> None:
    server = nats_security.server("lonely")
    await server.start()
    proc = server._proc
    assert server.running and proc is not None
    await server.stop()
    assert proc.returncode is not None and not server.running and not server.workdir.exists()


async def test_client_reconnects_and_resubscribes_after_a_server_restart(nats_security: NatsSecurity) -> None:
    server = nats_security.server("restart")
    await server.start()
    nc = await nats_security.connect(server, "t")
    try:
        q = await _collect(nc, "pdd.test.again", Ping)
        await server.stop()
        server = nats_security.server("restart", port=server.port)  # same address, new process
        await server.start()
        await until(lambda: nc.is_connected, 10, 0.05)  # the client's own reconnect loop (backoff)
        await publish(nc, "pdd.test.again", Ping(3))
        assert (await asyncio.wait_for(q.get(), 5))[0] == Ping(3)
        assert nc.stats["reconnects"] >= 1
    finally:
        await nc.drain()
        await server.stop()
