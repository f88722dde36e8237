"""Receive buffers, recycled once the sink has let go of them.

A fresh 64 MiB tensor costs ~16k page faults while the kernel copies into it, which halved
loopback goodput. Large frames are therefore received into anonymous mmaps (transparent huge
pages where allowed) that are reused as soon as nothing references them any more: the tensor
handed to the sink keeps its mmap alive, so reuse never touches memory a sink still holds.
"""

from __future__ import annotations

import math
import mmap
import sys

import torch

SMALL = 256 << 10  # below this, malloc recycles memory well enough
ALIGN = 2 << 20  # huge page size


class RecvBuffers:
    def __init__(self, max_buffers: int = 8, max_cached_bytes: int = 512 << 20):
        self.max_buffers = max_buffers
        self.max_cached_bytes = max_cached_bytes
        self._bufs: list[mmap.mmap] = []
        self.allocated = 0  # new mmaps made (for tests / stats)
        self.reused = 0

    def tensor(self, shape: list[int], dtype: torch.dtype) -> torch.Tensor:
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes < SMALL:
            return torch.empty(shape, dtype=dtype)
        buf = self._take(nbytes)
        return torch.frombuffer(buf, dtype=torch.uint8, count=nbytes).view(dtype).view(shape)

    def _free(self, i: int) -> bool:
        # Referenced only by our list and getrefcount's argument: no tensor/view uses it.
        return sys.getrefcount(self._bufs[i]) <= 2

    def _take(self, nbytes: int) -> mmap.mmap:
        for i in range(len(self._bufs)):
            if nbytes <= len(self._bufs[i]) <= max(2 * nbytes, nbytes + ALIGN) and self._free(i):
                self.reused += 1
                return self._bufs[i]
        size = -(-nbytes // ALIGN) * ALIGN
        buf = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if hasattr(mmap, "MADV_HUGEPAGE"):
            buf.madvise(mmap.MADV_HUGEPAGE)
        self.allocated += 1
        # Keep the cache small: forget buffers the sinks hold (they own them now) or that do not fit.
        keep = [i for i in range(len(self._bufs)) if self._free(i)]
        self._bufs = [self._bufs[i] for i in keep]
        while self._bufs and (
            len(self._bufs) >= self.max_buffers or sum(map(len, self._bufs)) + size > self.max_cached_bytes
        ):
            self._bufs.pop(0)
        if size <= self.max_cached_bytes:
            self._bufs.append(buf)
        return buf
