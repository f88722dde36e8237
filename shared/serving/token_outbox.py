"""Token events on their way to the routers: one message per engine step per owning router.

While a step's outputs are handled (`collecting`), events gather per router and leave together
as one TokenBatch on that router's own subject, so a router hears only its own requests and
a step of B requests costs one publish, not B. Outside a step an event leaves at once. A
request no router owns (one driven directly) gets its events on its own subject.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

from shared.bus import subjects
from shared.bus.connection import publish
from shared.bus.messages import TokenBatch, TokenEvent
from shared.bus.subjects import Req


class TokenOutbox:
    def __init__(self, nc: Any) -> None:
        self.nc = nc
        self._pending: dict[str, list[TokenEvent]] = {}  # router -> its events, in order
        self._depth = 0  # collecting() calls under way

    @contextlib.asynccontextmanager
    async def collecting(self) -> AsyncIterator[None]:
        """Hold events back until the block ends (the outermost one, if nested)."""
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
            if self._depth == 0:
                await self.flush()

    async def send(self, router: str, event: TokenEvent) -> None:
        if not router:
            await publish(self.nc, subjects.req(event.rid, Req.TOKENS), event)
            return
        self._pending.setdefault(router, []).append(event)
        if self._depth == 0:
            await self.flush()

    async def flush(self) -> None:
        pending, self._pending = self._pending, {}
        for router, events in pending.items():
            await publish(self.nc, subjects.router_tokens(router), TokenBatch(events))
