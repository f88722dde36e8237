"""Token events leave an engine step as one TokenBatch per owning router, on that router's own
subject, in the order they were produced; outside a step, and for a request no router owns,
they leave at once. Real NATS: one publishing connection, so arrival order is sending order."""

from __future__ import annotations

import asyncio

from shared.bus import subjects
from shared.bus.connection import flushed, publish, subscribe
from shared.bus.messages import Role, TokenBatch, TokenEvent
from shared.bus.subjects import Req
from shared.serving.token_outbox import TokenOutbox

MARK = subjects.router_tokens("marker")


async def test_a_step_sends_one_batch_per_router_in_order(nats_server, nats_security) -> None:
    sender = await nats_security.connect(nats_server, "engine")
    listener = await nats_security.connect(nats_server, "routers")
    got: asyncio.Queue[tuple[str, object]] = asyncio.Queue()

    async def on(msg, raw) -> None:
        await got.put((raw.subject, msg))

    try:
        for subject in (subjects.router_tokens("r1"), subjects.router_tokens("r2"), MARK):
            await subscribe(listener, subject, TokenBatch, on)
        await subscribe(listener, subjects.req("solo", Req.TOKENS), TokenEvent, on)
        await flushed(listener)
        outbox = TokenOutbox(sender)
        a0, b0, a1 = (
            TokenEvent("a", Role.RELAY, 0, [1]),
            TokenEvent("b", Role.RELAY, 3, [2]),
            TokenEvent("a", Role.RELAY, 1, [5]),
        )
        other, solo = TokenEvent("c", Role.MAIN_DECODE, 0, [9]), TokenEvent("solo", Role.RELAY, 0, [4])
        async with outbox.collecting():
            await outbox.send("r1", a0)
            await outbox.send("r2", other)
            async with outbox.collecting():  # nested: still the same step
                await outbox.send("r1", b0)
            await outbox.send("", solo)  # nobody owns it: at once, on its own subject
            await outbox.send("r1", a1)
            await publish(sender, MARK, TokenBatch([]))  # sent before the step's batches leave
        await outbox.send("r2", other)  # outside a step: at once, alone
        arrived = [await asyncio.wait_for(got.get(), 10) for _ in range(5)]
        assert arrived == [
            (subjects.req("solo", Req.TOKENS), solo),
            (MARK, TokenBatch([])),
            (subjects.router_tokens("r1"), TokenBatch([a0, b0, a1])),
            (subjects.router_tokens("r2"), TokenBatch([other])),
            (subjects.router_tokens("r2"), TokenBatch([other])),
        ]
    finally:
        await sender.close()
        await listener.close()
