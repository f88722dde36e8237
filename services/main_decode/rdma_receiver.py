"""Main decode's side of the RDMA path: its KV pool registered once with the transfer engine
(shared/kv/rdma/receive.py); for a request it prepared, pool slots for exactly the blocks it
still lacks (set aside, not cached), where prefill writes them one-sided; each written block
is checked against prefill's checksum before it is cached. A block that fails is never cached: its slot goes back to the
request and prefill resends the block over the TCP channel."""

from __future__ import annotations

import asyncio
import logging
from typing import Protocol

from shared.bus.connection import respond
from shared.bus.messages import RdmaOffer, RdmaSlots, RdmaVerdict, RdmaWritten
from shared.config import MainDecodeSettings
from shared.engine import Engine
from shared.kv.checksum import ALGOS
from shared.kv.rdma.engine import RdmaEngine
from shared.kv.rdma.layout import region_of
from shared.kv.rdma.receive import adopt_verified, start_engine
from shared.serving.engine_loop import EngineLoop
from shared.serving.runtime import Lifecycle

log = logging.getLogger(__name__)


class ReceivingJob(Protocol):
    missing: set[int]  # the prompt blocks it lacked
    received: set[int]  # those in its pool so far


class PromptKV(Protocol):
    """The receiving end's requests, as the RDMA path needs them (main decode's prompt KV sink)."""

    def receiving_job(self, rid: str) -> ReceivingJob | None:
        """The request if it awaits its prompt KV here (the same object while it does)."""
        ...

    async def received(
        self, job, hashes: list[int], nbytes: int, traceparent: str | None, transport: str
    ) -> None:
        """Blocks of the request are cached and pinned for it."""
        ...


class RdmaReceiver:
    def __init__(
        self,
        settings: MainDecodeSettings,
        prompt_kv: PromptKV,
        engine_loop: EngineLoop,
        llm_engine: Engine,
        life: Lifecycle,
        nc,
    ):
        self.settings = settings
        self.prompt_kv = prompt_kv
        self.engine_loop = engine_loop
        self.llm_engine = llm_engine
        self.life, self.nc = life, nc
        self.pool = None  # the engine's slot memory, registered whole when the path is on
        self.engine: RdmaEngine | None = None  # the transfer engine
        self.offered: dict[str, dict[int, int]] = {}  # rid -> hash -> slot given to prefill, not yet written
        self.quarantined: dict[str, dict[int, int]] = {}  # the same, of requests that ended

    async def start(self, address: str) -> None:
        """Start the engine and register the pool when the path is on; answer offers either way
        (a refusal at once sends prefill to the TCP channel). address: this MD's bulk address,
        which names its subjects."""
        if self.settings.kv_transport == "rdma":
            self.pool = self.llm_engine.slot_memory()  # prefill writes into its slots
            self.engine = await asyncio.to_thread(start_engine, self.settings.rdma, address, self.pool)

    # ---- offers: slots for exactly the blocks the request lacks -------------------------
    async def on_offer(self, msg: RdmaOffer, raw) -> None:
        await respond(raw, await self._offer(msg))

    async def _offer(self, msg: RdmaOffer) -> RdmaSlots:
        if self.engine is None:
            return RdmaSlots(ok=False, error="no RDMA path on this main decoder")
        refused = RdmaSlots(ok=False, session=self.engine.session)
        job = self.prompt_kv.receiving_job(msg.rid)
        if job is None or msg.rid in self.offered:
            refused.error = f"request {msg.rid} is not awaiting KV here"
            return refused
        hashes = [h for h in dict.fromkeys(msg.hashes) if h in job.missing and h not in job.received]
        loop = self.engine_loop
        slots = await loop.call(self.llm_engine.take_spare, msg.rid, len(hashes))
        if self.prompt_kv.receiving_job(msg.rid) is not job:  # dropped meanwhile: nothing was written yet
            await loop.call(self.llm_engine.release_blocks, slots, must_run=True)
            refused.error = f"request {msg.rid} ended"
            return refused
        hashes = hashes[: len(slots)]
        self.offered[msg.rid] = dict(zip(hashes, slots, strict=True))
        r = region_of(self.pool)
        return RdmaSlots(
            True, self.engine.session, r.base, r.num_blocks, r.planes, r.block_bytes, hashes, slots
        )

    # ---- written: verify, then cache ------------------------------------------------------
    async def on_written(self, msg: RdmaWritten, raw) -> None:
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
        job = self.prompt_kv.receiving_job(msg.rid)
        if job is None:
            await self.engine_loop.call(self.llm_engine.release_blocks, slots, must_run=True)
            return RdmaVerdict(ok=False, error=f"request {msg.rid} ended")
        checks = list(zip(msg.hashes, slots, msg.checksums, strict=True))
        good, corrupt = await self.engine_loop.call(self._verify, msg.rid, checks, msg.algo, must_run=True)
        r = region_of(self.pool)
        await self.prompt_kv.received(
            job, good, r.planes * r.block_bytes * len(good), msg.traceparent, "rdma"
        )
        return RdmaVerdict(ok=True, corrupt=corrupt)

    def _verify(self, rid: str, checks: list[tuple[int, int, int]], algo: str) -> tuple[list[int], list[int]]:
        return adopt_verified(self.llm_engine, rid, checks, algo)  # engine thread

    # ---- the request's other ends ---------------------------------------------------------
    async def take_back(self, rid: str, hashes: list[int]) -> None:
        """Blocks coming over TCP instead: their slots are the request's spare again (prefill
        wrote none of them, or its write ended: it falls back only then)."""
        offered = self.offered.get(rid, {})
        slots = [offered.pop(h) for h in hashes if h in offered]
        for slot in slots:
            await self.engine_loop.call(self.llm_engine.return_spare, rid, slot, must_run=True)

    def forget(self, rid: str) -> None:
        """The request ended: slots still offered may yet be written by a late one-sided
        write, so they stay out of use until prefill says they are written, or for the
        quarantine, before going back to the pool."""
        slots = self.offered.pop(rid, {})
        if slots:
            self.quarantined[rid] = slots
            self.life.spawn(self._release_later(rid))

    async def _release_later(self, rid: str) -> None:
        await asyncio.sleep(self.settings.rdma.quarantine_s)
        await self._release(rid, list(self.quarantined.get(rid, {})))

    async def _release(self, rid: str, hashes: list[int]) -> None:
        held = self.quarantined.get(rid, {})
        slots = [held.pop(h) for h in hashes if h in held]
        if not held:
            self.quarantined.pop(rid, None)
        if slots:
            await self.engine_loop.call(self.llm_engine.release_blocks, slots, must_run=True)

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
