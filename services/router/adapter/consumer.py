"""The client's side of a stream: the deltas the request life delivered, in order, until the
request finishes, fails or runs out of time."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from opentelemetry.trace import Status, StatusCode

from shared.config import RouterSettings

from ..core.errors import APIError
from ..core.request_life import RequestLife
from ..core.request_stream import Delta, Failure, RequestStream
from .effects import Effects


class Consumer:
    def __init__(self, settings: RouterSettings, requests: RequestLife, effects: Effects) -> None:
        self.settings, self.requests, self.effects = settings, requests, effects

    async def deltas(self, stream: RequestStream) -> AsyncIterator[Delta]:
        """Ordered new tokens until the request finishes; raises APIError on failure."""
        inbox = self.effects.inboxes.get(stream.rid) or asyncio.Queue()  # (none: closed already)
        try:
            while True:
                delta = await self._next(stream, inbox)
                yield delta
                if delta.finished:
                    return
        except APIError as e:
            stream.fail(str(e))
            if stream.span:
                stream.span.set_status(Status(StatusCode.ERROR, str(e)))
            raise
        finally:
            self.close(stream)

    async def _next(self, stream: RequestStream, inbox: asyncio.Queue[Delta | Failure]) -> Delta:
        deadline = stream.created + self.settings.request_timeout_s
        timeout = min(self.settings.token_timeout_s, deadline - time.monotonic())
        if timeout <= 0:
            raise APIError("request timed out", 504, "timeout")
        try:
            item = await asyncio.wait_for(inbox.get(), timeout=timeout)
        except TimeoutError as e:
            raise APIError("no progress from the serving instances before the timeout", 504, "timeout") from e
        if isinstance(item, Failure):
            raise APIError(item.message, item.status, item.type_)
        return item

    def close(self, stream: RequestStream) -> None:
        """The stream ended (finished, failed or abandoned): record it and free it everywhere."""
        self.effects.perform(self.requests.close(stream))

    def release(self, stream: RequestStream) -> None:
        """Free a stream whose deltas() never ran to its end (e.g. the client left before the
        first one was asked for); a no-op once the stream is closed."""
        self.effects.perform(self.requests.release(stream))
