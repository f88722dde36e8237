"""The writing side of the RDMA path: blocks go from one registered staging buffer (registered
once, reused) straight into a peer's pool slots, one-sided."""

from __future__ import annotations

import asyncio
import contextlib

import torch

from shared.kv.rdma.engine import RdmaEngine, RdmaError
from shared.kv.rdma.layout import Region, region_of, write_runs

WRITE_TIMEOUT_S = 60.0  # bound on one staged write; the engine's own calls cannot be interrupted


class RdmaWriter:
    def __init__(self, engine: RdmaEngine, staging_bytes: int):
        self.engine = engine
        self.staging = torch.empty(staging_bytes, dtype=torch.uint8)
        engine.register(self.staging)
        self._lock = asyncio.Lock()  # one staged write at a time: they share the buffer
        self.broken: str | None = None  # a write hung: the buffer may still be read, never reuse it

    async def write(self, session: str, dst: Region, slots: list[int], kv: torch.Tensor) -> int:
        """Write kv [layers, 2, n, ...] into the peer's blocks `slots` (one per block); bytes
        written. Larger than the staging buffer: in several rounds."""
        if kv.shape[2] != len(slots):
            raise ValueError(f"{kv.shape[2]} blocks for {len(slots)} slots")
        per_block = kv[:, :, :1].numel() * kv.element_size()
        fit = len(self.staging) // per_block
        if fit == 0:
            raise RdmaError(f"a block of {per_block} B does not fit the {len(self.staging)} B staging buffer")
        for lo in range(0, len(slots), fit):
            await self._write_round(session, dst, slots[lo : lo + fit], kv[:, :, lo : lo + fit])
        return per_block * len(slots)

    async def _write_round(self, session: str, dst: Region, slots: list[int], kv: torch.Tensor) -> None:
        async with self._lock:
            if self.broken:
                raise RdmaError(self.broken)
            n = kv.numel()
            staged = self.staging[: n * kv.element_size()].view(kv.dtype).view(kv.shape)
            staged.copy_(kv)
            runs = write_runs(region_of(staged), 0, dst, slots)
            # The engine's write cannot be interrupted: a cancelled caller still waits for it,
            # so the next round never overwrites the buffer under a write in flight.
            task = asyncio.ensure_future(asyncio.to_thread(self.engine.write, session, runs))
            try:
                await asyncio.wait_for(asyncio.shield(task), WRITE_TIMEOUT_S)
            except asyncio.CancelledError:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(task, WRITE_TIMEOUT_S)
                raise
            except TimeoutError:
                self.broken = f"a write to {session} took over {WRITE_TIMEOUT_S:g} s"
                raise RdmaError(self.broken) from None
