"""Host buffers for KV copies between a device cache and the host, kept and reused.

Pinned (page-locked) where a CUDA device is at hand: only a copy between the device and pinned
memory is asynchronous (non_blocking=True), and pinning a large buffer costs milliseconds of
system calls, so buffers are made once and reused. A buffer is busy while its holder has not
released it, and until every copy that used it (its events) has finished.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

MIN_CAPACITY = 1 << 20  # a buffer holds at least 1 MiB; larger ones round up to a power of two


@dataclass(eq=False)
class HostBuffer:
    data: torch.Tensor  # uint8 [capacity]
    held: bool = False
    events: list[torch.cuda.Event] = field(default_factory=list)  # copies that use it

    @property
    def capacity(self) -> int:
        return self.data.numel()

    def free(self) -> bool:
        if self.held:
            return False
        self.events = [e for e in self.events if not e.query()]
        return not self.events

    def view(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The first bytes of the buffer as a contiguous tensor of `shape` and `dtype`."""
        nbytes = math.prod(shape) * dtype.itemsize
        return self.data[:nbytes].view(dtype).view(shape)

    def release(self) -> None:
        """The holder is done with it; it is reused once its copies have finished."""
        self.held = False


class HostBuffers:
    """A pool of host buffers; it grows to the number of copies held at once, never per call."""

    def __init__(self, pin: bool | None = None) -> None:
        self.pin = torch.cuda.is_available() if pin is None else pin
        self.buffers: list[HostBuffer] = []
        self.allocated = 0  # buffers made (for tests and stats)

    def take(self, nbytes: int) -> HostBuffer:
        """A held buffer of at least nbytes: a free one that fits, else a new one (which replaces
        the smallest free buffer, so the pool does not grow while sizes do)."""
        free = [b for b in self.buffers if b.free()]
        fits = [b for b in free if b.capacity >= nbytes]
        if fits:
            buf = min(fits, key=lambda b: b.capacity)
        else:
            if free:
                self.buffers.remove(min(free, key=lambda b: b.capacity))
            capacity = max(MIN_CAPACITY, 1 << max(nbytes - 1, 0).bit_length())
            buf = HostBuffer(torch.empty(capacity, dtype=torch.uint8, pin_memory=self.pin))
            self.buffers.append(buf)
            self.allocated += 1
        buf.held = True
        return buf

    def holding(self, tensor: torch.Tensor) -> HostBuffer | None:
        """The pool's buffer that `tensor` lies in, if any: a copy that reads or writes it notes
        its event there, so the buffer is not reused before the copy has finished."""
        start = tensor.untyped_storage().data_ptr()
        return next((b for b in self.buffers if b.data.untyped_storage().data_ptr() == start), None)
