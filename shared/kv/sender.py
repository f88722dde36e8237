"""One request's KV to one peer, whatever carries it: the TCP bulk channel (TcpSender, to a
main decoder over the WAN or to the relay over the local path) or the RDMA path to a main
decoder (RdmaSender, which falls back to the TCP channel for what it cannot write).

send()* then finish(), or abort(); close() always."""

from __future__ import annotations

from typing import Protocol

import torch

from shared.config import RdmaSettings
from shared.kv.client import KVClient
from shared.kv.codec import EXACT
from shared.kv.pool import KVClientPool
from shared.kv.rdma.link import RdmaPeers, start_writer
from shared.kv.rdma.sender import RdmaSender
from shared.kv.transfer import TcpSender


class KVSender(Protocol):
    # What the link estimator needs: the TCP connection in use and whether it ever dropped.
    client: KVClient | None
    reconnects: int

    @property
    def rdma_bytes(self) -> int:
        """Bytes written one-sided over the RDMA path (part of what send() returned)."""
        ...

    async def send(self, hashes: list[int], kv: torch.Tensor, traceparent: str | None = None) -> int:
        """One group of blocks: the bytes it took, however they went."""
        ...

    async def finish(self) -> int:
        """Every block is delivered and the peer acked: the bytes sent again on the way."""
        ...

    async def abort(self, reason: str) -> None:
        """Tell the peer to drop what it got."""
        ...

    def close(self) -> None:
        """Let go of the connection and whatever is kept for a resend."""
        ...


class KVSenders:
    """Opens prefill's senders: the TCP channel, or the RDMA path to a main decoder when `rdma`
    names its settings (None: every transfer takes TCP)."""

    def __init__(
        self,
        nc,
        pool: KVClientPool,
        local: KVClientPool | None = None,
        *,
        wan_codec: str = EXACT,
        timeout_s: float,
        rdma: RdmaSettings | None = None,
    ):
        """`pool`: connections to main decoders; `local`: to relays (default: the same).
        `wan_codec`: how a main decoder's blocks are coded; `timeout_s`: each transfer's bound."""
        self.pool, self.local = pool, local or pool
        self.wan_codec, self.timeout_s, self.rdma_settings = wan_codec, timeout_s, rdma
        self.rdma = RdmaPeers(nc, None, rdma.control_timeout_s) if rdma is not None else None

    async def start(self) -> None:
        """Start the RDMA path's engine when it is on (without one, every transfer takes TCP)."""
        if self.rdma is not None and self.rdma_settings is not None:
            self.rdma.writer = await start_writer(self.rdma_settings)

    def open(self, address: str, rid: str, missing: list[int] | None = None) -> KVSender:
        """A sender of rid's blocks to the peer at `address`. missing: the blocks a main decoder
        lacks, which it may take straight into its pool; None for a peer that cannot (the relay).
        Only a main decoder's (WAN) blocks go in the WAN codec; the relay's are always exact. A
        lossy codec takes the TCP channel: the RDMA path writes raw blocks into the receiver's
        slots, with no step that could decode them."""
        codec = self.wan_codec if missing is not None else EXACT
        pool = self.pool if missing is not None else self.local
        transfer = TcpSender(pool, address, rid, timeout=self.timeout_s, codec=codec)
        if self.rdma is None or missing is None or codec != EXACT:
            return transfer
        return RdmaSender(self.rdma, transfer, missing)
