"""A few bulk connections per peer, so one request's KV does not queue behind another's.

Requests on one TCP connection are served in order: a high-hit request with a few blocks
would otherwise wait behind tens of MB of a low-hit one. Each request takes the connection
with the fewest requests in flight; a new one is opened while all are busy, up to a cap.

A large group can also be split over several connections (PrfaaS-style, so one stream's
congestion window or one slow path does not cap the link): `parallel` lanes per peer, kept
apart from the request connections and carrying only pieces (shared/kv/pieces.py), so a
request connection waiting for its pieces never waits on itself.

Peers are learned from NATS messages, so nothing is kept for a peer once its connections
are gone: an idle connection is closed before the receiver's idle timeout would close it
under a request, and a peer left with no connection is forgotten.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Collection
from dataclasses import dataclass, field
from ssl import SSLContext

from shared.kv.client import KVClient, open_kv_client

# One request's group is split over this many connections (1: never split). Four streams let a
# lossy or long-fat WAN path fill a multi-Gbit link where one TCP stream's window would not;
# beyond that the gains are small and every connection costs a handshake and buffers.
PARALLEL_CONNECTIONS = 4
# Groups smaller than this go whole on one connection: splitting a few MiB buys nothing and
# costs a wait at the receiver. (A prefill chunk of 256 tokens of the small preset is 4 MiB.)
PARALLEL_MIN_BYTES = 16 << 20
IDLE_MARGIN_S = 5.0  # close an idle connection this long before the receiver would
PEER_IDLE_S = 600.0  # close an idle connection after this long even if the receiver would not


def keep_idle_for(receiver_idle_timeout: float | None) -> float:
    """How long an unused connection stays in the pool: a margin below the receiver's idle
    timeout (it closes the connection then, and a request must not be sent into that)."""
    if receiver_idle_timeout is None:
        return PEER_IDLE_S
    return min(PEER_IDLE_S, max(receiver_idle_timeout - IDLE_MARGIN_S, receiver_idle_timeout / 2))


@dataclass
class _Peer:
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    conns: list[KVClient] = field(default_factory=list)
    lanes: list[KVClient | None] = field(default_factory=list)  # connections that carry pieces
    acquiring: int = 0  # tasks inside acquire() for this peer: it must not be forgotten under them


class KVClientPool:
    def __init__(
        self,
        secret: str | None,
        per_peer: int = 4,
        timeout: float = 10.0,
        ssl: SSLContext | None = None,
        via: str | None = None,
        server_name: str | None = None,
        checksum: str | None = None,
        parallel: int = PARALLEL_CONNECTIONS,
        parallel_min_bytes: int = PARALLEL_MIN_BYTES,
        peer_roles: Collection[str] | None = None,
    ):
        """`parallel`: connections a group of at least `parallel_min_bytes` is split over
        (the request's own plus parallel - 1 lanes); 1 turns splitting off. `peer_roles`: the
        roles a TLS peer's certificate may name (open_kv_client)."""
        self.secret = secret
        self.checksum = checksum
        self.parallel = max(1, parallel)
        self.parallel_min_bytes = parallel_min_bytes
        self.ssl = ssl  # TLS for tcp:// peers
        self.via = via  # the WAN link tcp:// peers are reached through (unix:// ones never are)
        self.server_name = server_name  # the host tcp:// peers' certificates must name
        self.peer_roles = peer_roles
        self.per_peer = per_peer
        self.timeout = timeout
        self._peers: dict[str, _Peer] = {}
        self._active: dict[KVClient, int] = {}  # requests in flight per connection

    @property
    def peers(self) -> list[str]:
        return list(self._peers)

    async def acquire(self, address: str) -> KVClient:
        await self.forget_idle()
        peer = self._peers.setdefault(address, _Peer())
        peer.acquiring += 1
        try:
            async with peer.lock:
                conns = peer.conns  # changed in place only: forget_idle may run while we connect
                conns[:] = [c for c in conns if not c.closed]  # forget_idle closes them
                idle = min(conns, key=lambda c: self._active.get(c, 0), default=None)
                if idle is None or (self._active.get(idle, 0) > 0 and len(conns) < self.per_peer):
                    idle = await self._open(address)
                    conns.append(idle)
                self._active[idle] = self._active.get(idle, 0) + 1
                return idle
        finally:
            peer.acquiring -= 1

    async def lane(self, address: str, i: int) -> KVClient:
        """Lane i (0-based) to the peer: a live connection that carries only pieces."""
        peer = self._peers.setdefault(address, _Peer())
        peer.acquiring += 1
        try:
            async with peer.lock:
                peer.lanes.extend([None] * (i + 1 - len(peer.lanes)))
                lane = peer.lanes[i]
                if lane is None or lane.closed:
                    lane = peer.lanes[i] = await self._open(address)
                return lane
        finally:
            peer.acquiring -= 1

    async def _open(self, address: str) -> KVClient:
        return await open_kv_client(
            address,
            self.secret,
            timeout=self.timeout,
            ssl=self.ssl,
            via=self.via,
            server_name=self.server_name,
            checksum=self.checksum,
            peer_roles=self.peer_roles,
        )

    def release(self, client: KVClient) -> None:
        n = self._active.get(client, 0) - 1
        if n > 0:
            self._active[client] = n
        else:
            self._active.pop(client, None)
        client.last_used = max(client.last_used, time.monotonic())  # idle from now on

    async def forget_idle(self, now: float | None = None) -> None:
        """Close connections that failed or sat unused too long; forget peers left without one."""
        now = time.monotonic() if now is None else now
        doomed: list[KVClient] = []
        for address, peer in list(self._peers.items()):
            for c in [*peer.conns, *peer.lanes]:
                if c is None:
                    continue
                unused = c not in self._active and now - c.last_used > keep_idle_for(c.idle_timeout)
                if c.closed or unused:
                    doomed.append(c)
            peer.conns[:] = [c for c in peer.conns if c not in doomed]
            peer.lanes[:] = [None if c in doomed else c for c in peer.lanes]
            if not peer.conns and not any(peer.lanes) and not peer.acquiring:
                del self._peers[address]
        for c in doomed:  # after the bookkeeping: nothing above awaits
            await c.close()

    async def close(self) -> None:
        for peer in self._peers.values():
            for c in [*peer.conns, *peer.lanes]:
                if c is not None:
                    await c.close()
        self._peers.clear()
        self._active.clear()
