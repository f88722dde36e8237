"""A router's drain: the work in flight it waits for, and what it answers once draining (503
with Retry-After to new work; reads such as /health still pass, to say so)."""

from __future__ import annotations

import asyncio
import json

from services.router.api.drain import RETRY_AFTER_S, Drain, DrainGate
from tests.polling import until


async def test_a_drain_waits_for_the_work_in_flight_and_no_longer():
    drain = Drain()
    assert not drain.draining and await drain.wait(0)  # nothing in flight: at once
    drain.enter()
    drain.enter()
    drain.begin()
    assert drain.draining and drain.in_flight == 2
    assert not await drain.wait(0.05)  # bounded
    waiting = asyncio.ensure_future(drain.wait(5))
    drain.leave()
    await asyncio.sleep(0.01)  # an absence: one request is still in flight, the wait goes on
    assert not waiting.done()
    drain.leave()
    assert await asyncio.wait_for(waiting, 1) and drain.in_flight == 0


class App:
    """A stand-in for the API: holds each request until told to answer."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.calls = 0

    async def __call__(self, scope, receive, send) -> None:
        self.calls += 1
        await self.release.wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})


async def call(gate: DrainGate, method: str, path: str) -> list[dict]:
    sent: list[dict] = []

    async def receive() -> dict:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "method": method, "path": path, "headers": [], "query_string": b""}
    await gate(scope, receive, send)
    return sent


async def test_draining_new_work_gets_a_503_with_retry_after_and_the_started_one_ends():
    app, drain = App(), Drain()
    gate = DrainGate(app, drain)
    started = asyncio.ensure_future(call(gate, "POST", "/v1/completions"))
    await until(lambda: drain.in_flight == 1, 5)
    drain.begin()
    refused = await call(gate, "POST", "/v1/chat/completions")
    assert refused[0]["status"] == 503
    assert (b"retry-after", str(RETRY_AFTER_S).encode()) in refused[0]["headers"]
    assert json.loads(refused[1]["body"])["error"]["code"] == "draining"
    assert app.calls == 1 and not await drain.wait(0.01)
    app.release.set()  # the request in flight runs to its end
    assert (await asyncio.wait_for(started, 1))[0]["status"] == 200
    assert await drain.wait(0) and drain.in_flight == 0
    assert (await call(gate, "GET", "/health"))[0]["status"] == 200  # reads pass (/health says draining)
