"""The relay starts a request once it holds both halves: the local KV (its sink's on_done) and
prefill's RelayStart (on the relay's own bus subject), in either order; the first is kept for
a bounded time. A real relay on a real NATS server with a tiny engine; its KV sink is called
directly, the RelayStart published as prefill does."""

from __future__ import annotations

import asyncio

import pytest
import torch

from services.relay.service import RelayService
from shared.bus import subjects
from shared.bus.connection import flushed, publish, subscribe
from shared.bus.messages import Abort, AbortReason, RelayStart, TokenEvent
from shared.bus.subjects import Req
from shared.config import RelaySettings
from tests.engine_util import greedy, make_engine
from tests.polling import until

WAIT_S = 30
PROMPT = list(range(1, 33))  # two full KV blocks
MAX_TOKENS = 4


@pytest.fixture
async def relay(nats_server, nats_security, tmp_path):
    nc = await nats_security.connect(nats_server, "relay-start-test")  # the test user may say anything
    settings = RelaySettings(
        nats_url=nats_server.url, local_address=f"unix://{tmp_path}/relay.sock", secret="s", instance="0"
    )
    relay = RelayService(settings, nc, make_engine())
    await relay.start()
    yield relay, nc
    await relay.stop()
    await nc.close()


async def land(relay: RelayService, rid: str) -> None:
    """The local KV stream of rid, as prefill's sender delivers it."""
    hashes = relay.engine.block_hashes(PROMPT)
    layers, two, _, *block = relay.engine.kv_cache.shape
    await relay.on_blocks(rid, hashes, torch.zeros(layers, two, len(hashes), *block), None)
    await relay.on_done(rid, b"")


async def send_start(nc, rid: str) -> None:
    start = RelayStart(rid, PROMPT, 7, greedy(MAX_TOKENS))
    await publish(nc, subjects.to_instance("relay", "0", Req.RELAY_START), start)
    await flushed(nc)


async def tokens(nc, rid: str) -> asyncio.Queue[TokenEvent]:
    events: asyncio.Queue[TokenEvent] = asyncio.Queue()
    await subscribe(nc, subjects.req(rid, Req.TOKENS), TokenEvent, lambda ev, raw: events.put(ev))
    await flushed(nc)
    return events


async def decoded(events: asyncio.Queue[TokenEvent]) -> list[int]:
    out: list[int] = []
    async with asyncio.timeout(WAIT_S):
        while True:
            ev = await events.get()
            assert ev.error is None, ev.error
            out += ev.tokens
            if ev.outcome is not None:
                return out


async def test_the_relay_decodes_whichever_half_comes_first(relay) -> None:
    relay, nc = relay
    kv_first, start_first = await tokens(nc, "kv-first"), await tokens(nc, "start-first")

    await land(relay, "kv-first")
    assert "kv-first" in relay.early.landed and "kv-first" not in relay.jobs
    await send_start(nc, "kv-first")

    await send_start(nc, "start-first")
    await until(lambda: "start-first" in relay.early.start, WAIT_S)
    assert "start-first" not in relay.jobs
    await land(relay, "start-first")
    assert "start-first" in relay.jobs

    a, b = await decoded(kv_first), await decoded(start_first)
    assert a == b and len(a) == MAX_TOKENS - 1  # the first token was prefill's
    assert len(relay.early.landed) == len(relay.early.start) == 0


async def test_a_second_relay_start_or_landing_changes_nothing(relay) -> None:
    relay, nc = relay
    events = await tokens(nc, "twice")
    await land(relay, "twice")
    await send_start(nc, "twice")
    await until(lambda: "twice" in relay.jobs, WAIT_S)
    job = relay.jobs["twice"]
    await send_start(nc, "twice")
    await relay.on_done("twice", b"")  # a finish resent after a dropped ack
    assert len(await decoded(events)) == MAX_TOKENS - 1
    assert relay.jobs.get("twice") in (None, job) and "twice" not in relay.early.start


async def test_local_kv_whose_relay_start_never_comes_is_unpinned(relay) -> None:
    relay, nc = relay
    relay.early.landed.ttl_s = 0.2
    await land(relay, "no-start")
    assert "no-start" in relay.engine.exchange.pins
    await until(lambda: "no-start" not in relay.early.landed, WAIT_S)
    await until(lambda: "no-start" not in relay.engine.exchange.pins, WAIT_S)
    assert "no-start" not in relay.jobs


async def test_an_abort_drops_a_kept_relay_start(relay) -> None:
    relay, nc = relay
    await send_start(nc, "gone")
    await until(lambda: "gone" in relay.early.start, WAIT_S)
    await publish(nc, subjects.abort("gone", "prefill"), Abort("gone", AbortReason.FAILED))
    await flushed(nc)
    await until(lambda: "gone" not in relay.early.start, WAIT_S)
    with pytest.raises(ValueError, match="aborted"):
        await land(relay, "gone")
    assert "gone" not in relay.jobs


async def test_a_relay_start_the_engine_refuses_ends_the_request_with_an_error(relay) -> None:
    relay, nc = relay
    events = await tokens(nc, "too-long")
    aborts: asyncio.Queue[Abort] = asyncio.Queue()
    await subscribe(nc, subjects.abort("too-long", "relay"), Abort, lambda msg, raw: aborts.put(msg))
    await land(relay, "too-long")
    start = RelayStart("too-long", PROMPT, 7, greedy(100_000))  # more than the whole pool holds
    await publish(nc, subjects.to_instance("relay", "0", Req.RELAY_START), start)
    ev = await asyncio.wait_for(events.get(), WAIT_S)
    assert "could not start" in (ev.error or "")
    assert (await asyncio.wait_for(aborts.get(), WAIT_S)).reason is AbortReason.FAILED
    await until(lambda: "too-long" not in relay.engine.exchange.pins, WAIT_S)
    assert "too-long" not in relay.jobs
