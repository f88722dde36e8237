"""Main decode's side of the RDMA path: its KV pool registered once with the transfer engine;
for a request it prepared, pool slots for exactly the blocks it still lacks (set aside, not
cached), where prefill writes them one-sided; each written block is checked against prefill's
checksum before it is cached. A block that fails is never cached: its slot goes back to the
request and prefill resends the block over the TCP channel."""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from shared.bus import subjects
from shared.bus.connection import respond
from shared.bus.messages import RdmaOffer, RdmaSlots, RdmaVerdict, RdmaWritten
from shared.kv.checksum import ALGOS
from shared.kv.rdma_engine import RdmaEngine, RdmaError
from shared.kv.rdma_layout import block_checksum, region_of
from shared.telemetry import metrics

if TYPE_CHECKING:
    from .job import MDJob
    from .service import MainDecodeService

log = logging.getLogger(__name__)


class RdmaIntake:
    def __init__(self, service: MainDecodeService):
        self.service = service
        self.engine: RdmaEngine | None = None
        self.offered: dict[str, dict[int, int]] = {}  # rid -> hash -> slot given to prefill, not yet written
        self.quarantined: dict[str, dict[int, int]] = {}  # the same, of requests that ended
        service.track("rdma_offered", lambda: len(self.offered))
        service.track("rdma_quarantined", lambda: len(self.quarantined))

    async def start(self) -> None:
        """Start the engine and register the pool when the path is on; answer offers either way
        (a refusal at once sends prefill to the TCP channel)."""
        s = self.service
        if s.settings.kv_transport == "rdma":
            self.engine = await asyncio.to_thread(self._start_engine)
        for kind, cls, handler in (
            ("offer", RdmaOffer, self._on_offer),
            ("written", RdmaWritten, self._on_written),
        ):
            await s.life.endpoint(s.nc, subjects.md_rdma(s.advertise_address, kind), cls, handler)

    def _start_engine(self) -> RdmaEngine | None:
        rdma, kv = self.service.settings.rdma, self.service.engine.kv_cache
        try:
            engine = RdmaEngine(
                rdma.host or urlsplit(self.service.advertise_address).hostname or "",
                rdma.protocol,
                rdma.device,
            )
            engine.register(kv)  # the whole pool, once
        except (RdmaError, ValueError, OSError) as e:
            log.warning("RDMA path off, KV comes over the TCP channel: %s", e)
            return None
        log.info(
            "RDMA path on: %s engine %s, %d B of KV pool registered",
            rdma.protocol,
            engine.session,
            kv.numel() * kv.element_size(),
        )
        return engine

    # ---- offers: slots for exactly the blocks the request lacks -------------------------
    async def _on_offer(self, msg: RdmaOffer, raw) -> None:
        await respond(raw, await self._offer(msg))

    async def _offer(self, msg: RdmaOffer) -> RdmaSlots:
        if self.engine is None:
            return RdmaSlots(ok=False, error="no RDMA path on this main decoder")
        refused = RdmaSlots(ok=False, session=self.engine.session)
        job = self.service.prompt_kv.receiving_job(msg.rid)
        if job is None or msg.rid in self.offered:
            refused.error = f"request {msg.rid} is not awaiting KV here"
            return refused
        hashes = [h for h in dict.fromkeys(msg.hashes) if h in job.missing and h not in job.received]
        loop = self.service.engine_loop
        slots = await loop.call(self.service.engine.exchange.take_spare, msg.rid, len(hashes))
        if (
            self.service.prompt_kv.receiving_job(msg.rid) is not job
        ):  # dropped meanwhile: nothing was written yet
            await loop.call(self.service.engine.exchange.release_blocks, slots, must_run=True)
            refused.error = f"request {msg.rid} ended"
            return refused
        hashes = hashes[: len(slots)]
        self.offered[msg.rid] = dict(zip(hashes, slots, strict=True))
        r = region_of(self.service.engine.kv_cache)
        return RdmaSlots(
            True, self.engine.session, r.base, r.num_blocks, r.planes, r.block_bytes, hashes, slots
        )

    # ---- written: verify, then cache ------------------------------------------------------
    async def _on_written(self, msg: RdmaWritten, raw) -> None:
        await respond(raw, await self._written(msg))

    async def _written(self, msg: RdmaWritten) -> RdmaVerdict:
        if msg.rid in self.quarantined:  # ended: these slots are written, so free now
            await self._release(msg.rid, msg.hashes)
            return RdmaVerdict(ok=False, error=f"request {msg.rid} ended")
        offered = self.offered.get(msg.rid, {})
        if (
            len(msg.checksums) != len(msg.hashes)
            or msg.algo not in ALGOS
            or not all(h in offered for h in msg.hashes)
        ):
            return RdmaVerdict(ok=False, error="blocks not offered to this request")
        slots = [offered.pop(h) for h in msg.hashes]  # written: out of quarantine's reach
        job, transfer = self.service.prompt_kv.receiving_job(msg.rid), self.service.engine.exchange
        if job is None:
            await self.service.engine_loop.call(transfer.release_blocks, slots, must_run=True)
            return RdmaVerdict(ok=False, error=f"request {msg.rid} ended")
        checks = list(zip(msg.hashes, slots, msg.checksums, strict=True))
        good, corrupt = await self.service.engine_loop.call(
            self._verify, msg.rid, checks, msg.algo, must_run=True
        )
        per_block = (
            self.service.engine.kv_cache[:, :, 0].numel() * self.service.engine.kv_cache.element_size()
        )
        self.service.prompt_kv.received(job, good, per_block * len(good), msg.traceparent, "rdma")
        return RdmaVerdict(ok=True, corrupt=corrupt)

    def _verify(
        self, rid: str, checks: list[tuple[int, int, int]], algo: str
    ) -> tuple[list[int], list[int]]:  # engine thread
        """Cache each block whose slot holds what prefill wrote; hand back the others' slots."""
        kv, transfer = self.service.engine.kv_cache, self.service.engine.exchange
        good, corrupt = [], []
        for h, slot, expected in checks:
            if block_checksum(kv, slot, algo) == expected:
                transfer.adopt(rid, h, slot)
                good.append(h)
            else:
                transfer.return_spare(rid, slot)  # the TCP resend lands in it
                corrupt.append(h)
        if corrupt:
            metrics.KV_RDMA_CORRUPT_BLOCKS.inc(len(corrupt))
            log.warning(
                "request %s: %d blocks written over RDMA failed their checksum (not cached)",
                rid,
                len(corrupt),
            )
        return good, corrupt

    # ---- the request's other ends ---------------------------------------------------------
    async def take_back(self, job: MDJob, hashes: list[int]) -> None:
        """Blocks coming over TCP instead: their slots are the request's spare again (prefill
        wrote none of them, or its write ended: it falls back only then)."""
        offered = self.offered.get(job.rid, {})
        slots = [offered.pop(h) for h in hashes if h in offered]
        transfer = self.service.engine.exchange
        for slot in slots:
            await self.service.engine_loop.call(transfer.return_spare, job.rid, slot, must_run=True)

    def forget(self, rid: str) -> None:
        """The request ended: slots still offered may yet be written by a late one-sided
        write, so they stay out of use until prefill says they are written, or for the
        quarantine, before going back to the pool."""
        slots = self.offered.pop(rid, {})
        if slots:
            self.quarantined[rid] = slots
            self.service.life.spawn(self._release_later(rid))

    async def _release_later(self, rid: str) -> None:
        await asyncio.sleep(self.service.settings.rdma.quarantine_s)
        await self._release(rid, list(self.quarantined.get(rid, {})))

    async def _release(self, rid: str, hashes: list[int]) -> None:
        held = self.quarantined.get(rid, {})
        slots = [held.pop(h) for h in hashes if h in held]
        if not held:
            self.quarantined.pop(rid, None)
        if slots:
            await self.service.engine_loop.call(
                self.service.engine.exchange.release_blocks, slots, must_run=True
            )

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
