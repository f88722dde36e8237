"""The RDMA backend's row of the transport bench: the Mooncake transfer engine as the KV path
uses it (protocol from PDD_RDMA__PROTOCOL, "tcp" by default: no RDMA NIC needed), between two
engines of this process. Source and destination are registered once; a round is the one-sided
writes (one batch of `frames` writes, as a block group goes) plus a checksum of every frame at
the destination against the source's."""

from __future__ import annotations

import asyncio
import os
import time

import torch

from shared.kv.checksum import DEFAULT_ALGO, checksum
from shared.kv.rdma.engine import RdmaEngine, unavailable

HOST = "127.0.0.1"


def available() -> str | None:
    """None when usable, else why not."""
    return unavailable()


class RdmaRow:
    def __init__(self, nbytes: int, frames: int):
        protocol = os.environ.get("PDD_RDMA__PROTOCOL", "tcp")
        device = os.environ.get("PDD_RDMA__DEVICE", "")
        self.sender = RdmaEngine(HOST, protocol, device)
        self.receiver = RdmaEngine(HOST, protocol, device)
        self.frame = nbytes // frames
        self.frames = frames
        self.src = torch.randint(0, 256, (self.frame * frames,), dtype=torch.uint8)
        self.dst = torch.zeros_like(self.src)
        self.sender.register(self.src)
        self.receiver.register(self.dst)
        self.expect = [checksum(DEFAULT_ALGO, self._view(self.src, i)) for i in range(frames)]
        s, d = self.src.data_ptr(), self.dst.data_ptr()
        self.runs = [(s + i * self.frame, d + i * self.frame, self.frame) for i in range(frames)]

    def _view(self, t: torch.Tensor, i: int) -> memoryview:
        return memoryview(t[i * self.frame : (i + 1) * self.frame].numpy())

    async def round(self) -> float:
        """Seconds to move nbytes as `frames` writes, verified at the destination."""
        return await asyncio.to_thread(self._timed_round)

    def _timed_round(self) -> float:
        self.dst[:: self.frame] ^= 0xFF  # stale data at the destination would pass verification
        t0 = time.perf_counter()
        self.sender.write(self.receiver.session, self.runs)
        for i, want in enumerate(self.expect):
            if checksum(DEFAULT_ALGO, self._view(self.dst, i)) != want:
                raise RuntimeError(f"frame {i} arrived corrupt")
        return time.perf_counter() - t0

    async def close(self) -> None:
        self.sender.close()
        self.receiver.close()


async def open_rdma_row(nbytes: int, frames: int) -> RdmaRow:
    """Two engines, source and destination registered; raises RdmaError when unusable."""
    return await asyncio.to_thread(RdmaRow, nbytes, frames)
