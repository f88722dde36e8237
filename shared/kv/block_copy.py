"""A copy of KV blocks between a device cache and host memory, in flight or done
(shared/kv/device_blocks.py makes them)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shared.kv.host_buffers import HostBuffer


@dataclass(eq=False)
class BlockCopy:
    """One gather or scatter; `host` is the [L, 2, n, block_size, kv_heads, head_dim] buffer."""

    host: torch.Tensor
    event: torch.cuda.Event | None = None  # None: done on return (CPU)
    buffer: HostBuffer | None = None  # the pool's buffer behind host (a gather's)
    stream: torch.cuda.Stream | None = None  # the engine's stream the copy was ordered against

    def done(self) -> bool:
        return self.event is None or self.event.query()

    def wait(self) -> None:
        """Block this thread (not any stream) until the copy is done."""
        if self.event is not None:
            self.event.synchronize()

    def order_before(self, stream: torch.cuda.Stream | None = None) -> None:
        """Work queued on `stream` (the engine's, by default) from now on waits for the copy."""
        if self.event is not None:
            (stream or self.stream).wait_event(self.event)

    def release(self) -> None:
        """The caller is done with a gather's buffer: the next copies may reuse it."""
        if self.buffer is not None:
            self.buffer.release()
            self.buffer = None
