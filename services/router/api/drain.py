"""A router that is told to stop (SIGTERM) drains: it takes no new work (503 with Retry-After,
and /health answers 503 `draining`, so load balancers and clients go to another router),
finishes the requests it is serving, then exits. Plain ASGI in front of everything, so a
streamed response counts until its last byte is sent."""

from __future__ import annotations

import asyncio
import time

from fastapi.responses import JSONResponse

from shared.telemetry import metrics

from ..core.errors import error_body

RETRY_AFTER_S = 1  # another router takes the request at once


class Drain:
    """The in-flight work of one router and whether it is leaving (event loop only)."""

    def __init__(self) -> None:
        self.since: float | None = None  # when the drain began (None: serving)
        self.in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def draining(self) -> bool:
        return self.since is not None

    def begin(self) -> None:
        if self.since is None:
            self.since = time.monotonic()

    def enter(self) -> None:
        self.in_flight += 1
        self._idle.clear()

    def leave(self) -> None:
        self.in_flight -= 1
        if self.in_flight <= 0:
            self.in_flight = 0
            self._idle.set()

    async def wait(self, timeout_s: float) -> bool:
        """Until nothing is in flight (True) or timeout_s passed (False)."""
        try:
            async with asyncio.timeout(max(timeout_s, 0.0)):
                await self._idle.wait()
        except TimeoutError:
            return False
        return True


def counts(scope) -> bool:
    """Work a drain waits for and refuses: everything but reads (health, metrics, models...)."""
    return scope["method"] not in ("GET", "HEAD")


def draining_response() -> JSONResponse:
    body = error_body(
        "this router is shutting down; send the request to another router",
        type_="server_error",
        code="draining",
    )
    return JSONResponse(body, 503, headers={"Retry-After": str(RETRY_AFTER_S)})


class DrainGate:
    def __init__(self, app, drain: Drain):
        self.app, self.drain = app, drain

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or not counts(scope):
            return await self.app(scope, receive, send)
        if self.drain.draining:
            metrics.REQUESTS.labels(pipeline="none", outcome="rejected").inc()
            return await draining_response()(scope, receive, send)
        self.drain.enter()
        try:
            await self.app(scope, receive, send)
        finally:
            self.drain.leave()
