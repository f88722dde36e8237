"""How much memory the KV pool gets: an explicit size, or a fraction of what is available
(host RAM on the CPU, free device memory after the weights on CUDA)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from shared.engine.errors import EngineError


def kv_pool_bytes(kv_memory_mb: float | None, fraction: float, available: Callable[[], int]) -> int:
    """The pool's budget: kv_memory_mb if given, else `fraction` of `available()` bytes."""
    if kv_memory_mb is not None:
        return int(kv_memory_mb * 2**20)
    if not 0 < fraction <= 1:
        raise EngineError(f"kv_memory_fraction must be in (0, 1], got {fraction}")
    return int(available() * fraction)


def available_bytes(device: torch.device) -> int:
    """Memory a new KV pool could take now on `device`."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return free
    return host_available_bytes()


def host_available_bytes(meminfo: str = "/proc/meminfo") -> int:
    """MemAvailable: what the kernel can hand out without swapping (page cache included)."""
    with open(meminfo) as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no MemAvailable in {meminfo}")
