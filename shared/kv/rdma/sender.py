"""A KV sender over the RDMA path to a main decoder: the blocks MD gave slots for are written
one-sided into its pool, the rest (and whatever MD finds corrupt, or never confirms) go over an
inner TCP transfer."""

from __future__ import annotations

import asyncio

import torch

from shared.kv.client import KVClient
from shared.kv.rdma.link import RdmaLink, RdmaPeers
from shared.kv.transfer import TcpSender


class RdmaSender:
    def __init__(self, peers: RdmaPeers, inner: TcpSender, missing: list[int]):
        self.inner = inner
        # The offer to MD starts now, so that it overlaps prefill's compute.
        self._opening = asyncio.ensure_future(peers.open(inner.address, inner.rid, missing))
        self.link: RdmaLink | None = None
        self._traceparent: str | None = None  # the stream's, for the blocks resent at the end

    @property
    def client(self) -> KVClient | None:
        return self.inner.client

    @property
    def reconnects(self) -> int:
        return self.inner.reconnects

    @property
    def rdma_bytes(self) -> int:
        return self.link.bytes if self.link is not None else 0

    async def send(self, hashes: list[int], kv: torch.Tensor, traceparent: str | None = None) -> int:
        """One exported group: what MD gave RDMA slots for one-sided, the rest over TCP."""
        self._traceparent = traceparent
        link = await self._link()
        written, rest = await link.send(hashes, kv, traceparent) if link else (0, list(range(len(hashes))))
        if not rest:
            return written
        part = kv if len(rest) == len(hashes) else kv[:, :, rest]
        return written + await self.inner.send([hashes[i] for i in rest], part, traceparent)

    async def finish(self) -> int:
        """Blocks MD did not verify go again over TCP, then the TCP transfer finishes."""
        link = await self._link()
        again, kv = await link.settle() if link else ([], None)
        n = 0 if kv is None else await self.inner.send(again, kv, self._traceparent)
        await self.inner.finish()
        return n

    async def abort(self, reason: str) -> None:
        await self.inner.abort(reason)

    def close(self) -> None:
        self._opening.cancel()
        if self.link is not None:
            self.link.cancel()
        self.inner.close()

    async def _link(self) -> RdmaLink | None:
        if self.link is None:
            self.link = await self._opening
        return self.link
