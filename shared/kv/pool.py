"""A few bulk connections per peer, so one request's KV does not queue behind another's.

Requests on one TCP connection are served in order: a high-hit request with a few blocks
would otherwise wait behind tens of MB of a low-hit one. Each request takes the connection
with the fewest requests in flight; a new one is opened while all are busy, up to a cap.
"""

from __future__ import annotations

import asyncio
from ssl import SSLContext

from shared.kv.client import KVClient, open_kv_client


class KVClientPool:
    def __init__(self, secret: str, per_peer: int = 4, timeout: float = 10.0, ssl: SSLContext | None = None):
        self.secret = secret
        self.ssl = ssl  # TLS for tcp:// peers
        self.per_peer = per_peer
        self.timeout = timeout
        self._conns: dict[str, list[KVClient]] = {}
        self._active: dict[KVClient, int] = {}  # requests in flight per connection
        self._locks: dict[str, asyncio.Lock] = {}

    async def acquire(self, address: str) -> KVClient:
        async with self._locks.setdefault(address, asyncio.Lock()):
            conns = []
            for c in self._conns.get(address, []):
                if c.closed:  # failed: free its socket and its count
                    self._active.pop(c, None)
                    await c.close()
                else:
                    conns.append(c)
            idle = min(conns, key=lambda c: self._active.get(c, 0), default=None)
            if idle is None or (self._active.get(idle, 0) > 0 and len(conns) < self.per_peer):
                idle = await open_kv_client(address, self.secret, timeout=self.timeout, ssl=self.ssl)
                conns.append(idle)
            self._conns[address] = conns
            self._active[idle] = self._active.get(idle, 0) + 1
            return idle

    def release(self, client: KVClient) -> None:
        n = self._active.get(client, 0) - 1
        if n > 0:
            self._active[client] = n
        else:
            self._active.pop(client, None)

    async def close(self) -> None:
        for conns in self._conns.values():
            for c in conns:
                await c.close()
        self._conns.clear()
