"""One request's KV to one peer, carried over a dropped connection.

When the connection under a transfer drops (reset, EOF, TLS error: not a refusal by the
receiver), every group sent so far goes again on a fresh connection, then the rest. The
receiver keeps the request through a grace period and takes a block it already holds as a
no-op, so a resend is safe. Groups are kept (hashes and CPU tensor) until finish() is acked.

A large group is split along its layers over the pool's lanes to the peer (pool.parallel
connections in all, the request's own included). A lane that drops has its piece sent again
on a fresh lane (the retry policy, a budget per piece); a dropped request connection resends the whole group,
split afresh under a new id, so stale pieces never mix with the new ones.

With a lossy codec (shared/kv/codec.py) each group is encoded once, off the event loop, and
kept encoded: a resend costs no second encode and the pieces are cut from the encoded bytes.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import torch

from shared.kv.client import KVClient, sendable
from shared.kv.codec import EXACT, Encoded, check_codec, encode
from shared.kv.errors import KVConnectionLost, KVTransferError
from shared.kv.pool import KVClientPool

log = logging.getLogger(__name__)

_BACKGROUND: set[asyncio.Future] = set()  # pieces still being sent for a call that gave up


@dataclass(frozen=True)
class RetryPolicy:
    attempts: int = 5  # fresh connections tried after drops, over the whole transfer
    backoff_s: float = 0.1  # before the first retry; doubles on each one
    max_backoff_s: float = 1.0
    deadline_s: float = 3.0  # no retry starts later than this after the first drop


def retry_delay(policy: RetryPolicy, retry: int, since_first_drop: float) -> float | None:
    """Seconds to wait before retry number `retry` (0-based), or None when the transfer
    must give up: out of attempts, or the wait would end past the deadline."""
    if retry >= policy.attempts:
        return None
    delay = min(policy.backoff_s * 2**retry, policy.max_backoff_s)
    if since_first_drop + delay > policy.deadline_s:
        return None
    return delay


def split_layers(kv: torch.Tensor | Encoded, parallel: int, min_bytes: int) -> list[tuple[int, int]]:
    """Layer ranges [lo, hi) of a group over up to `parallel` connections, as even as whole
    layers allow; one range when the group is smaller than min_bytes."""
    n_layers = kv.shape[0]
    if parallel <= 1 or kv.nbytes < max(min_bytes, 1):
        return [(0, n_layers)]
    n = min(parallel, n_layers)
    cuts = [round(i * n_layers / n) for i in range(n + 1)]
    return [(cuts[i], cuts[i + 1]) for i in range(n)]


@dataclass
class _Group:
    hashes: list[int]
    kv: torch.Tensor | Encoded  # contiguous CPU copy: a resend costs no device copy
    traceparent: str | None


class TcpSender:
    """send_blocks()* then finish(), or abort(); close() always (it returns the connection).
    A KVSender (shared/kv/sender.py) over the TCP channel alone."""

    rdma_bytes = 0

    def __init__(
        self,
        pool: KVClientPool,
        address: str,
        rid: str,
        *,
        timeout: float = 60.0,
        policy: RetryPolicy | None = None,
        codec: str = EXACT,
    ):
        self.pool, self.address, self.rid = pool, address, rid
        self.codec = check_codec(codec)
        self.timeout = timeout  # each send_blocks / finish on one connection
        self.policy = policy or RetryPolicy()
        self.client: KVClient | None = None  # the connection in use now
        self.reconnects = 0  # fresh connections after a drop
        self.bytes_sent = 0  # resends included
        self._groups: list[_Group] = []
        self._retries = 0
        self._first_drop: float | None = None

    async def send_blocks(
        self, hashes: list[int], kv: torch.Tensor, *, traceparent: str | None = None
    ) -> int:
        """Bytes sent for this group (KVClient.send_blocks), plus any resend it took."""
        before = self.bytes_sent
        wire = sendable(kv, hashes)
        if self.codec != EXACT:
            wire = await asyncio.to_thread(encode, self.codec, wire)
        group = _Group(list(hashes), wire, traceparent)
        self._groups.append(group)
        await self._deliver(lambda client: self._send(client, group), after_resend=False)
        return self.bytes_sent - before

    async def send(self, hashes: list[int], kv: torch.Tensor, traceparent: str | None = None) -> int:
        return await self.send_blocks(hashes, kv, traceparent=traceparent)

    async def finish(self, payload: bytes = b"") -> int:
        """KVClient.finish; once acked the kept groups are let go. Returns 0: what a drop here
        makes it send again shows in bytes_sent only."""
        await self._deliver(
            lambda client: client.finish(self.rid, payload=payload, timeout=self.timeout), after_resend=True
        )
        self._groups.clear()
        return 0

    async def abort(self, reason: str) -> None:
        self._groups.clear()
        if self.client is not None and not self.client.closed:
            await self.client.abort(self.rid, reason)

    def close(self) -> None:
        self._groups.clear()
        if self.client is not None:
            self.pool.release(self.client)
            self.client = None

    # -- internals --

    async def _deliver(self, op: Callable[[KVClient], Awaitable[object]], after_resend: bool) -> None:
        """op on the connection; if it drops, a fresh one gets every group so far (op's own
        group included) and, when after_resend, op once more."""
        while True:
            if self.client is not None:
                try:
                    await op(self.client)
                    return
                except KVConnectionLost as e:
                    self._dropped(e)
            await self._reconnect()
            if not after_resend:
                return

    async def _send(self, client: KVClient, group: _Group) -> None:
        kw = {"traceparent": group.traceparent, "timeout": self.timeout}
        ranges = split_layers(group.kv, self.pool.parallel, self.pool.parallel_min_bytes)
        if len(ranges) == 1:
            self.bytes_sent += await client.send_blocks(self.rid, group.hashes, group.kv, **kw)
            return
        gid = random.getrandbits(63)
        # Pieces run on even if this call fails or is cancelled: the receiver's request
        # connection waits for them, and would otherwise wait until its split timeout.
        pieces = asyncio.gather(
            *(self._send_piece(i, gid, group.kv, lo, hi) for i, (lo, hi) in enumerate(ranges[1:])),
            return_exceptions=True,
        )
        _BACKGROUND.add(pieces)
        pieces.add_done_callback(_BACKGROUND.discard)
        self.bytes_sent += await client.send_blocks(
            self.rid, group.hashes, group.kv, split=(gid, ranges[0][1]), **kw
        )
        done = await asyncio.shield(pieces)
        failed = [e for e in done if isinstance(e, BaseException)]
        if failed:
            await client.abort(self.rid, f"a piece could not be sent: {failed[0]}")
            raise KVTransferError(f"kv transfer of {self.rid} to {self.address}: {failed[0]}")
        self.bytes_sent += sum(done)

    async def _send_piece(self, lane: int, gid: int, kv: torch.Tensor | Encoded, lo: int, hi: int) -> int:
        """Layers [lo, hi) on a lane; again on a fresh lane under the retry policy (a budget of
        its own: lane drops must not delay the request connection's reconnect)."""
        retries, first_drop = 0, 0.0
        while True:
            try:
                client = await self.pool.lane(self.address, lane)
                return await client.send_piece(self.rid, gid, kv, lo, hi, timeout=self.timeout)
            except KVConnectionLost as e:
                log.warning("kv transfer of %s to %s: lane %d dropped: %s", self.rid, self.address, lane, e)
                first_drop = first_drop or time.monotonic()
                delay = retry_delay(self.policy, retries, time.monotonic() - first_drop)
                if delay is None:
                    raise KVTransferError(f"lane {lane} lost, {retries} retries failed") from None
                retries += 1
                self.reconnects += 1
                await asyncio.sleep(delay)

    def _dropped(self, e: Exception) -> None:
        log.warning("kv transfer of %s to %s: connection dropped: %s", self.rid, self.address, e)
        if self._first_drop is None:
            self._first_drop = time.monotonic()
        if self.client is not None:
            self.pool.release(self.client)
            self.client = None

    async def _reconnect(self) -> None:
        """A connection with every group so far on it; raises KVTransferError when out of tries."""
        while True:
            if self._first_drop is not None:
                delay = retry_delay(self.policy, self._retries, time.monotonic() - self._first_drop)
                if delay is None:
                    raise KVTransferError(
                        f"kv transfer of {self.rid} to {self.address}: connection lost, {self._retries} retries failed"
                    )
                self._retries += 1
                await asyncio.sleep(delay)
            try:
                self.client = await self.pool.acquire(self.address)
                if self._first_drop is not None:
                    self.reconnects += 1
                for group in self._groups:
                    await self._send(self.client, group)
                return
            except KVConnectionLost as e:
                self._dropped(e)
