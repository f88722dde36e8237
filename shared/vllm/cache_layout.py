"""A vLLM CPU backend's per-layer KV cache against the bulk channel's block groups.

vLLM 0.32's CPU attention hands out each layer as [num_blocks, kv_heads, block_size,
2 * head_dim] and reads it as [num_blocks, kv_heads, 2 * block_size, head_dim] cut in two: in a
block, each head holds its keys, then its values, block_size * head_dim values each. With the
`vec` kernels (x86 without AMX, fp32/bf16/fp16, block sizes a multiple of 32, head_dim a
multiple of 32) a head's values are [block_size, head_dim], token-major, but its keys are
[head_dim, block_size]: transposed.

nhd_view shows the layer's memory as [2, num_blocks, block_size, kv_heads, head_dim] (a permuted
view, no copy) for DeviceBlocks(layout="NHD"); it is right for the values, and for the keys it
carries each head's block_size * head_dim keys in vLLM's order. keys_to_pdd and keys_from_pdd
turn the keys of a gathered host group into token-major order and back (one host copy of the
keys), so the stored groups are pdd's layout: [L, 2, n, block_size, kv_heads, head_dim].
"""

from __future__ import annotations

import torch

KNOWN_ISAS = ("vec",)  # the kernels whose block interior is known here


def nhd_view(layer: torch.Tensor) -> torch.Tensor:
    """One layer's cache as [2, num_blocks, block_size, kv_heads, head_dim], sharing its memory."""
    if layer.dim() != 4 or layer.shape[-1] % 2:
        raise ValueError(f"unknown vLLM CPU KV cache shape {tuple(layer.shape)}")
    num_blocks, heads, block_size, both = layer.shape
    return layer.view(num_blocks, heads, 2, block_size, both // 2).permute(2, 0, 3, 1, 4)


def keys_to_pdd(group: torch.Tensor) -> None:
    """In place: a group gathered through nhd_view gets its keys token-major."""
    k = group[:, 0]  # [L, n, block_size, heads, head_dim], each head's keys in vLLM's order
    layers, n, block_size, heads, head_dim = k.shape
    # a copy (never a view of k, which it overwrites), then each head's memory read as [head_dim, block_size]
    flat = k.permute(0, 1, 3, 2, 4).clone(memory_format=torch.contiguous_format)
    per_head = flat.view(layers, n, heads, head_dim, block_size)
    k.copy_(per_head.permute(0, 1, 4, 2, 3))


def keys_from_pdd(group: torch.Tensor) -> torch.Tensor:
    """A pdd group with its keys in vLLM's order, for a scatter through nhd_view (a new tensor)."""
    out = group.clone()
    k = group[:, 0]
    layers, n, block_size, heads, head_dim = k.shape
    per_head = k.permute(0, 1, 3, 4, 2).reshape(layers, n, heads, block_size, head_dim)
    out[:, 0].copy_(per_head.permute(0, 1, 3, 2, 4))
    return out
