"""Where a block's bytes lie for one-sided writes (pure functions, no transfer engine)."""

from __future__ import annotations

import pytest
import torch

from shared.kv.checksum import checksum
from shared.kv.rdma.layout import Region, block_checksum, block_runs, region_of, write_runs


def test_consecutive_slots_make_one_run() -> None:
    assert block_runs([4, 5, 6, 9, 2, 3]) == [(0, 4, 3), (3, 9, 1), (4, 2, 2)]
    assert block_runs([]) == []


def test_write_runs_address_every_plane_of_every_slot() -> None:
    src, dst = Region(1000, 3, 2, 10), Region(50_000, 8, 2, 10)
    # src blocks 0, 1, 2 -> dst slots 5, 6, 1: per plane one run for 5-6 and one for 1
    assert write_runs(src, 0, dst, [5, 6, 1]) == [
        (1000, 50_000 + 5 * 10, 20),
        (1000 + 3 * 10, 50_000 + (8 + 5) * 10, 20),
        (1000 + 2 * 10, 50_000 + 1 * 10, 10),
        (1000 + (3 + 2) * 10, 50_000 + (8 + 1) * 10, 10),
    ]
    with pytest.raises(ValueError, match="layouts differ"):
        write_runs(src, 0, Region(0, 8, 4, 10), [0])


def test_runs_copy_exactly_the_blocks_into_their_slots() -> None:
    """Carried out with memmove on real tensors, the runs put each block in its slot, nothing else."""
    import ctypes

    src = torch.randn(2, 2, 3, 4, 1, 2)
    dst = torch.zeros(2, 2, 8, 4, 1, 2)
    slots = [5, 6, 1]
    for s, d, n in write_runs(region_of(src), 0, region_of(dst), slots):
        ctypes.memmove(d, s, n)
    for i, slot in enumerate(slots):
        assert torch.equal(dst[:, :, slot], src[:, :, i])
    assert dst[:, :, [0, 2, 3, 4, 7]].abs().sum() == 0


def test_a_block_checksum_covers_its_planes_in_order() -> None:
    kv = torch.randn(2, 2, 3, 4, 1, 2).to(torch.bfloat16)
    whole = b"".join(
        kv[layer, k, 1].contiguous().view(torch.uint8).numpy().tobytes()
        for layer in range(2)
        for k in range(2)
    )
    assert block_checksum(kv, 1, "crc32") == checksum("crc32", whole)
    flipped = kv.clone()
    flipped[1, 1, 1].view(-1)[3] += 1
    assert block_checksum(flipped, 1, "crc32") != block_checksum(kv, 1, "crc32")
    assert block_checksum(flipped, 0, "crc32") == block_checksum(kv, 0, "crc32")
