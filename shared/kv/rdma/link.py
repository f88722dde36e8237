"""Prefill's side of the RDMA path to main decode. Per WAN transfer: offer MD to write the
blocks it lacks straight into its pool; write each group one-sided and tell MD its checksums
over NATS. What MD does not take this way, what fails to write and what MD finds corrupt goes
over the TCP channel instead (a log line and pdd_kv_rdma_fallbacks): never an error to the client."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass, field

import torch

from shared.bus import subjects
from shared.bus.connection import request
from shared.bus.messages import RdmaOffer, RdmaSlots, RdmaVerdict, RdmaWritten
from shared.config import RdmaSettings
from shared.kv.checksum import DEFAULT_ALGO
from shared.kv.rdma.engine import RdmaEngine, RdmaError
from shared.kv.rdma.layout import Region, block_checksum
from shared.kv.rdma.writer import RdmaWriter
from shared.kv.transport import advertised_address
from shared.telemetry import metrics

log = logging.getLogger(__name__)
REFUSAL_KEPT_S = 30.0  # a main decoder without the RDMA path is asked again after this


def fell_back(rid: str, reason: str, detail: object) -> None:
    log.warning("kv of %s goes over TCP instead of RDMA (%s): %s", rid, reason, detail)
    metrics.KV_RDMA_FALLBACKS.labels(reason=reason).inc()


async def start_writer(rdma: RdmaSettings) -> RdmaWriter | None:
    """The process's engine and staging buffer; None when it cannot start (logged: every
    transfer then takes the TCP channel)."""
    try:
        host = await rdma_host(rdma)
        engine = await asyncio.to_thread(RdmaEngine, host, rdma.protocol, rdma.device)
        writer = RdmaWriter(engine, int(rdma.staging_mb * 2**20))
    except (RdmaError, OSError) as e:
        log.warning("RDMA path off, KV goes over the TCP channel: %s", e)
        return None
    log.info("RDMA path on: %s engine %s", rdma.protocol, engine.session)
    return writer


async def rdma_host(rdma: RdmaSettings) -> str:
    """The address MD reaches prefill's engine at: rdma.host, else this host's IP."""
    bare = (await advertised_address("tcp://0.0.0.0:0")).removeprefix("tcp://").rsplit(":", 1)[0]
    return rdma.host or bare


@dataclass
class RdmaLink:
    """One request's RDMA transfer to one MD: the slots MD gave, the verdicts awaited."""

    nc: object
    writer: RdmaWriter
    address: str  # MD's bulk address: it names MD's subjects
    rid: str
    offer: RdmaSlots
    timeout: float
    slots: dict[int, int] = field(default_factory=dict)  # hash -> MD's pool block
    verdicts: list[asyncio.Task] = field(default_factory=list)
    kept: dict[int, torch.Tensor] = field(default_factory=dict)  # hash -> its KV, until MD's verdict
    bytes: int = 0
    failed: str | None = None  # why the rest goes over TCP

    def __post_init__(self) -> None:
        self.slots = dict(zip(self.offer.hashes, self.offer.slots, strict=True))
        o = self.offer
        self.region = Region(o.base, o.num_blocks, o.planes, o.block_bytes)

    async def send(self, hashes: list[int], kv: torch.Tensor, tp: str | None) -> tuple[int, list[int]]:
        """Write the group's blocks MD gave slots for: (bytes written, indices left for TCP)."""
        idx = [i for i, h in enumerate(hashes) if h in self.slots] if self.failed is None else []
        chosen = set(idx)
        rest = [i for i in range(len(hashes)) if i not in chosen]
        if not idx:
            return 0, rest
        mine = [hashes[i] for i in idx]
        part = kv if len(idx) == len(hashes) else kv[:, :, idx]
        try:
            n = await self.writer.write(
                self.offer.session, self.region, [self.slots.pop(h) for h in mine], part
            )
        except (RdmaError, ValueError) as e:
            self.failed = f"write: {e}"
            fell_back(self.rid, "write", e)
            return 0, list(range(len(hashes)))
        self.bytes += n
        metrics.KV_RDMA_BYTES.inc(n)
        self.kept.update((h, part[:, :, i : i + 1]) for i, h in enumerate(mine))
        sums = await asyncio.to_thread(
            lambda: [block_checksum(part, i, DEFAULT_ALGO) for i in range(len(mine))]
        )
        note = RdmaWritten(self.rid, mine, sums, DEFAULT_ALGO, tp)
        self.verdicts.append(asyncio.ensure_future(self._verdict(note)))
        return n, rest

    async def _verdict(self, note: RdmaWritten) -> list[int]:
        """The blocks of one written group to send again over TCP."""
        try:
            verdict = await request(
                self.nc, subjects.md_rdma(self.address, "written"), note, RdmaVerdict, timeout=self.timeout
            )
        except Exception as e:  # timeout, no responder: MD's word is missing, resending is harmless
            fell_back(self.rid, "verdict", e)
            return note.hashes
        if not verdict.ok:
            fell_back(self.rid, "verdict", verdict.error)
            return note.hashes
        if verdict.corrupt:
            fell_back(self.rid, "corrupt", f"{len(verdict.corrupt)} blocks failed MD's checksum")
        return verdict.corrupt

    async def settle(self) -> tuple[list[int], torch.Tensor | None]:
        """Wait for every verdict: the blocks to resend over TCP, and their KV."""
        again = [h for got in await asyncio.gather(*self.verdicts) for h in got]
        self.verdicts.clear()
        kv = torch.cat([self.kept[h] for h in again], dim=2) if again else None
        self.kept.clear()
        return again, kv

    def cancel(self) -> None:
        for task in self.verdicts:
            task.cancel()
        self.kept.clear()


class RdmaPeers:
    """Which main decoders take RDMA: one that refused (it runs without the path, or its engine
    is unreachable) is not asked again for a while; its transfers take TCP meanwhile."""

    def __init__(self, nc, writer: RdmaWriter | None, timeout: float, retry_s: float = REFUSAL_KEPT_S):
        self.nc, self.writer, self.timeout, self.retry_s = nc, writer, timeout, retry_s
        self.refused: dict[str, float] = {}  # MD bulk address -> when it refused

    async def open(self, address: str, rid: str, hashes: list[int]) -> RdmaLink | None:
        """Ask MD for slots for `hashes`; None (logged, counted) when this transfer takes TCP."""
        if self.writer is None or self.writer.broken:
            metrics.KV_RDMA_FALLBACKS.labels(reason="unavailable").inc()
            return None
        if not hashes or time.monotonic() - self.refused.get(address, -math.inf) < self.retry_s:
            return None
        try:
            msg = RdmaOffer(rid, hashes)
            offer = await request(
                self.nc, subjects.md_rdma(address, "offer"), msg, RdmaSlots, timeout=self.timeout
            )
        except Exception as e:  # no MD answers
            offer = RdmaSlots(ok=False, error=repr(e))
        if not offer.ok or not offer.slots:
            if offer.session == "":  # MD has no RDMA path: the whole link takes TCP
                self.refused[address] = time.monotonic()
            fell_back(rid, "refused", offer.error or "MD offered no slot")
            return None
        return RdmaLink(self.nc, self.writer, address, rid, offer, self.timeout)
