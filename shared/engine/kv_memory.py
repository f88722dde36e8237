"""How much memory the KV pool gets. As vLLM sizes its pool: on the CPU a fixed space (its
VLLM_CPU_KVCACHE_SPACE, 4 GiB by default), on CUDA a share of the device's memory
(gpu_memory_utilization, 0.9) less what is in use once the weights are loaded. Or an explicit
size, or a fraction of the memory available at start."""

from __future__ import annotations

from collections.abc import Callable

import torch

from shared.engine.errors import EngineError


def kv_pool_bytes(
    kv_memory_mb: float | None,
    fraction: float | None,
    available: Callable[[], int],
    default: Callable[[], int] | None = None,
) -> int:
    """The pool's budget: kv_memory_mb if given, else `fraction` of `available()` bytes, else
    `default()` (the vLLM-style size, vllm_pool_bytes)."""
    if kv_memory_mb is not None:
        return int(kv_memory_mb * 2**20)
    if fraction is None:
        if default is None:
            raise EngineError("no KV pool size: give kv_memory_mb or kv_memory_fraction")
        return default()
    if not 0 < fraction <= 1:
        raise EngineError(f"kv_memory_fraction must be in (0, 1], got {fraction}")
    return int(available() * fraction)


def vllm_pool_bytes(device: torch.device, cpu_space_gib: float, gpu_utilization: float) -> int:
    """CPU: cpu_space_gib. CUDA: gpu_utilization x the device's memory, less what is in use now
    (this engine's weights, and whatever else holds memory there)."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = int(total * gpu_utilization) - (total - free)
        if budget <= 0:
            raise EngineError(
                f"no room for a KV pool: {(total - free) / 2**30:.1f} GiB of {total / 2**30:.1f} GiB in use "
                f"is over gpu_memory_utilization {gpu_utilization}"
            )
        return budget
    return int(cpu_space_gib * 2**30)


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
