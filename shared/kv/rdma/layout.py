"""Where a block's bytes lie in a KV pool, for one-sided writes and their verification.

A pool tensor is [layers, 2, blocks, block_size, kv_heads, head_dim]: block b is not one
piece but `planes` = layers × 2 segments of `block_bytes`, segment p at
base + (p × blocks + b) × block_bytes. Consecutive blocks make one longer run per plane.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shared.kv.checksum import new_hasher

Run = tuple[int, int, int]  # (source address, destination address, length)


@dataclass(frozen=True)
class Region:
    """A registered pool-shaped tensor, as a peer addresses it."""

    base: int
    num_blocks: int
    planes: int
    block_bytes: int

    def address(self, plane: int, block: int) -> int:
        return self.base + (plane * self.num_blocks + block) * self.block_bytes


def region_of(kv: torch.Tensor) -> Region:
    """The region of a contiguous [layers, 2, blocks, ...] tensor."""
    layers, two, blocks, *_ = kv.shape
    return Region(kv.data_ptr(), blocks, layers * two, kv[0, 0, 0].numel() * kv.element_size())


def block_runs(blocks: list[int]) -> list[tuple[int, int, int]]:
    """(start index in `blocks`, first block, count) of each run of consecutive block ids."""
    runs: list[tuple[int, int, int]] = []
    for i, b in enumerate(blocks):
        if runs and runs[-1][1] + runs[-1][2] == b:
            start, first, count = runs[-1]
            runs[-1] = (start, first, count + 1)
        else:
            runs.append((i, b, 1))
    return runs


def write_runs(src: Region, src_first: int, dst: Region, slots: list[int]) -> list[Run]:
    """Runs that copy src blocks src_first, src_first+1, ... into dst blocks `slots` (in order):
    one run per plane per stretch of consecutive slots."""
    if (src.planes, src.block_bytes) != (dst.planes, dst.block_bytes):
        raise ValueError(
            f"block layouts differ: {src.planes}×{src.block_bytes} B here, {dst.planes}×{dst.block_bytes} B there"
        )
    out = []
    for start, first, count in block_runs(slots):
        for plane in range(src.planes):
            out.append(
                (src.address(plane, src_first + start), dst.address(plane, first), count * src.block_bytes)
            )
    return out


def block_checksum(kv: torch.Tensor, block: int, algo: str) -> int:
    """Checksum of block `block` of a pool-shaped tensor, over its planes in order."""
    hasher = new_hasher(algo)
    for layer in kv[:, :, block]:
        for plane in layer:
            hasher.update(memoryview(plane.contiguous().reshape(-1).view(torch.uint8).numpy()))
    return hasher.value()
