"""One request's KV to one peer, whatever carries it: the TCP bulk channel (KVTransfer, to a
main decoder over the WAN or to the relay over the local path) or the RDMA path to a main
decoder (RdmaSender, which falls back to the TCP channel for what it cannot write).

send()* then finish(), or abort(); close() always."""

from __future__ import annotations

from typing import Protocol

import torch

from shared.config import PrefillSettings
from shared.kv.client import KVClient
from shared.kv.codec import EXACT
from shared.kv.pool import KVClientPool
from shared.kv.rdma_link import RdmaPeers, start_writer
from shared.kv.rdma_sender import RdmaSender
from shared.kv.transfer import KVTransfer


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
    """Opens prefill's senders; the settings pick the transport to a main decoder."""

    def __init__(self, settings: PrefillSettings, nc, pool: KVClientPool, local: KVClientPool | None = None):
        """`pool`: connections to main decoders; `local`: to relays (default: the same)."""
        self.settings, self.pool, self.local = settings, pool, local or pool
        rdma = settings.kv_transport == "rdma"
        self.rdma = RdmaPeers(nc, None, settings.rdma.control_timeout_s) if rdma else None

    async def start(self) -> None:
        """Start the RDMA path's engine when it is on (without one, every transfer takes TCP)."""
        if self.rdma is not None:
            self.rdma.writer = await start_writer(self.settings)

    def open(self, address: str, rid: str, missing: list[int] | None = None) -> KVSender:
        """A sender of rid's blocks to the peer at `address`. missing: the blocks a main decoder
        lacks, which it may take straight into its pool; None for a peer that cannot (the relay).
        Only a main decoder's (WAN) blocks go in settings.wan_kv_codec; the relay's are always
        exact. A lossy codec takes the TCP channel: the RDMA path writes raw blocks into the
        receiver's slots, with no step that could decode them."""
        codec = self.settings.wan_kv_codec if missing is not None else EXACT
        timeout = self.settings.request_timeout_s
        pool = self.pool if missing is not None else self.local
        transfer = KVTransfer(pool, address, rid, timeout=timeout, codec=codec)
        if self.rdma is None or missing is None or codec != EXACT:
            return transfer
        return RdmaSender(self.rdma, transfer, missing)
