"""Paged KV caches of random bit patterns, for tests of block copies."""

from __future__ import annotations

import torch

BITS = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float32: torch.int32}


def cache(layout: str, layers: int, blocks: int, block_size: int, heads: int, dim: int, dtype, seed=0):
    """Layers of random bit patterns (NaNs and infinities included: copies must keep every bit),
    [2, blocks, block_size, heads, dim] (NHD) or [2, blocks, heads, block_size, dim] (HND)."""
    g = torch.Generator().manual_seed(seed)
    shape = (2, blocks, block_size, heads, dim) if layout == "NHD" else (2, blocks, heads, block_size, dim)
    bits = BITS[dtype]
    info = torch.iinfo(bits)
    return [
        torch.randint(info.min, info.max, shape, dtype=bits, generator=g).view(dtype) for _ in range(layers)
    ]


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(BITS[a.dtype]), b.view(BITS[b.dtype]))
