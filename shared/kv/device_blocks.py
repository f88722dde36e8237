"""Copies of KV blocks between a paged device cache (one tensor a layer) and host memory.

Cache layouts, each layer's tensor as the engine hands it out (dim 0: K, then V):
    NHD  [2, num_blocks, block_size, kv_heads, head_dim]  vLLM's FlashAttention backend (this shape
         even where the memory is heads-first: vLLM hands out a permuted view)
    HND  [2, num_blocks, kv_heads, block_size, head_dim]  vLLM's CPU backend

The host buffer is the bulk channel's block group (shared/kv/frame.py), one contiguous tensor
[L, 2, n, block_size, kv_heads, head_dim], layer-major: layer 0's K of the n blocks (in block_ids
order), layer 0's V, then layer 1, ...; in a block its tokens in order, each token's heads, each
head's values, whatever the cache layout. KVClient.send_blocks sends a gathered buffer as it is.
A group of vLLM blocks of r x 16 tokens is, as a view, the group of its r x n pdd blocks:
host.view(L, 2, n * r, 16, kv_heads, head_dim), in the order of shared/kv/vllm_blocks.pdd_blocks_of.

On CUDA both copies run on side streams and return at once; neither stalls the engine's stream
(the forward's: the current one unless given) nor the calling thread:
    gather   the side stream waits (on the device) for the work queued so far, selects the blocks
             into a device staging tensor and copies that to a pinned buffer; the caller polls or
             waits on the returned copy, reads the buffer, then releases it.
    scatter  the buffer goes to the device and into the blocks on a side stream; the engine's
             stream waits for it (on the device) before the work queued next, unless the caller
             orders that itself (wait=False, then copy.order_before() before the blocks are read).
The blocks must stay the caller's (not freed nor reused) until the copy is done. On the CPU both
copies run at once and are done on return.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from shared.kv.block_copy import BlockCopy
from shared.kv.host_buffers import HostBuffers

LAYOUTS = ("NHD", "HND")
STAGE_BYTES = 64 << 20  # device staging of one step of a copy: this many bytes of layers at most


class DeviceBlocks:
    def __init__(
        self, layout: str = "NHD", buffers: HostBuffers | None = None, stage_bytes: int = STAGE_BYTES
    ) -> None:
        if layout not in LAYOUTS:
            raise ValueError(f"unknown KV cache layout {layout!r}; known: {', '.join(LAYOUTS)}")
        self.layout = layout
        self.buffers = buffers or HostBuffers()
        self.stage_bytes = stage_bytes
        self._streams: dict[tuple[torch.device, str], torch.cuda.Stream] = {}

    def gather(
        self,
        layers: Sequence[torch.Tensor],
        block_ids: Sequence[int],
        *,
        stream: torch.cuda.Stream | None = None,
    ) -> BlockCopy:
        """The blocks `block_ids` of every layer into a host buffer (reused across calls). On CUDA
        it is ordered after the work queued so far on `stream`: the engine's, by default this
        thread's current stream."""
        block_ids = _host_ids(block_ids)
        views, shape = self._views(layers, block_ids)
        buf = self.buffers.take(math.prod(shape) * views[0].dtype.itemsize)
        host = buf.view(shape, views[0].dtype)
        device = views[0].device
        if device.type != "cuda":
            index = torch.tensor(block_ids, dtype=torch.long, device=device)
            for i, view in enumerate(views):
                torch.index_select(view, 1, index, out=host[i])
            return BlockCopy(host, buffer=buf)
        engine = stream or torch.cuda.current_stream(device)
        side = self._stream(device, "gather")
        side.wait_stream(engine)  # the blocks' KV is written first
        with torch.cuda.stream(side):
            index = _device_index(block_ids, device)
            for lo, hi in self._steps(shape, host.dtype):
                stage = torch.empty((hi - lo, *shape[1:]), dtype=host.dtype, device=device)
                for i in range(lo, hi):
                    torch.index_select(views[i], 1, index, out=stage[i - lo])
                host[lo:hi].copy_(stage, non_blocking=True)
            event = _record(side)
        buf.events.append(event)
        return BlockCopy(host, event, buf, engine)

    def scatter(
        self,
        host: torch.Tensor,
        layers: Sequence[torch.Tensor],
        block_ids: Sequence[int],
        *,
        wait: bool = True,
        stream: torch.cuda.Stream | None = None,
    ) -> BlockCopy:
        """A host buffer (as gather makes it) into the blocks `block_ids` of every layer. On CUDA
        it is ordered after the work queued so far on `stream` (as gather's) and, with wait, before
        the work queued on it next. The caller leaves `host` untouched until the copy is done (a
        buffer that is not pinned is first copied into a pinned one, and is the caller's again). A
        buffer of a gather not done yet is read once the gather is (ordered on the device)."""
        block_ids = _host_ids(block_ids)
        views, shape = self._views(layers, block_ids)
        if len(set(block_ids)) != len(block_ids):
            raise ValueError("scatter: a block id appears twice")
        if tuple(host.shape) != shape or host.dtype != views[0].dtype or host.device.type != "cpu":
            raise ValueError(
                f"scatter: host buffer {tuple(host.shape)} {host.dtype} on {host.device} does not match "
                f"the cache's {shape} {views[0].dtype} on the CPU"
            )
        device = views[0].device
        if device.type != "cuda":
            index = torch.tensor(block_ids, dtype=torch.long, device=device)
            for i, view in enumerate(views):
                view.index_copy_(1, index, host[i])
            return BlockCopy(host)
        staged = None
        if not (host.is_pinned() and host.is_contiguous()):
            staged = self.buffers.take(host.numel() * host.element_size())
            host = staged.view(shape, host.dtype).copy_(host)
        engine = stream or torch.cuda.current_stream(device)
        side = self._stream(device, "scatter")
        side.wait_stream(engine)  # earlier work on those blocks first
        pooled = self.buffers.holding(host)
        for earlier in pooled.events if pooled else []:
            side.wait_event(earlier)  # a gather still writing the buffer
        with torch.cuda.stream(side):
            index = _device_index(block_ids, device)
            for lo, hi in self._steps(shape, host.dtype):
                stage = host[lo:hi].to(device, non_blocking=True)
                for i in range(lo, hi):
                    views[i].index_copy_(1, index, stage[i - lo])
            event = _record(side)
        if pooled is not None:
            pooled.events.append(event)
        if staged is not None:
            staged.release()  # reused once the copy has read it
        copy = BlockCopy(host, event, stream=engine)
        if wait:
            copy.order_before()
        return copy

    def _views(
        self, layers: Sequence[torch.Tensor], block_ids: Sequence[int]
    ) -> tuple[list[torch.Tensor], tuple[int, ...]]:
        """Each layer as [2, num_blocks, block_size, kv_heads, head_dim] and the group's shape."""
        if not layers:
            raise ValueError("no layers")
        views = [t.transpose(2, 3) if self.layout == "HND" else t for t in layers]
        first = views[0]
        for t in views:
            if t.dim() != 5 or t.shape[0] != 2:
                raise ValueError(f"a layer's KV must be [2, num_blocks, ...], not {tuple(t.shape)}")
            if t.shape != first.shape or t.dtype != first.dtype or t.device != first.device:
                raise ValueError("every layer must have the same shape, dtype and device")
        if first.is_cuda and not self.buffers.pin:
            raise ValueError("copies with a CUDA cache need pinned host buffers (HostBuffers(pin=True))")
        bad = [b for b in block_ids if not 0 <= b < first.shape[1]]
        if bad:
            raise ValueError(f"block ids {bad[:4]} out of range for {first.shape[1]} blocks")
        _, _, block_size, heads, head_dim = first.shape
        return views, (len(views), 2, len(block_ids), block_size, heads, head_dim)

    def _steps(self, shape: tuple[int, ...], dtype: torch.dtype) -> list[tuple[int, int]]:
        """Layer ranges whose staging stays within stage_bytes (one layer at least)."""
        per = max(1, self.stage_bytes // max(1, math.prod(shape[1:]) * dtype.itemsize))
        return [(lo, min(lo + per, shape[0])) for lo in range(0, shape[0], per)]

    def _stream(self, device: torch.device, role: str) -> torch.cuda.Stream:
        if (device, role) not in self._streams:
            self._streams[device, role] = torch.cuda.Stream(device=device)
        return self._streams[device, role]


def _host_ids(block_ids: Sequence[int] | torch.Tensor) -> list[int]:
    if isinstance(block_ids, torch.Tensor):
        if block_ids.device.type != "cpu":
            raise ValueError("block ids must be on the host (reading them off the device would wait)")
        return block_ids.tolist()
    return [int(b) for b in block_ids]


def _device_index(block_ids: Sequence[int], device: torch.device) -> torch.Tensor:
    """Block ids on the device without a synchronizing copy: through pinned memory, which the
    host allocator keeps until the copy on the current (side) stream has read it."""
    return torch.tensor(block_ids, dtype=torch.long).pin_memory().to(device, non_blocking=True)


def _record(stream: torch.cuda.Stream) -> torch.cuda.Event:
    event = torch.cuda.Event(blocking=True)  # wait() sleeps instead of spinning a core
    event.record(stream)
    return event
