"""KV block copies between a paged cache and host buffers, on the CPU (exact, synchronous)."""

from __future__ import annotations

import pytest
import torch

from shared.kv.device_blocks import DeviceBlocks
from shared.kv.host_buffers import MIN_CAPACITY, HostBuffers
from tests.kv_cache_util import BITS, cache, same_bits


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize(("block_size", "heads", "dim"), [(16, 1, 64), (32, 4, 32), (128, 2, 16)])
def test_gather_then_scatter_into_a_fresh_cache_is_bit_identical(dtype, layout, block_size, heads, dim):
    src = cache(layout, 3, 11, block_size, heads, dim, dtype)
    ids = [9, 2, 5, 0, 10]  # neither sorted nor contiguous
    copier = DeviceBlocks(layout)
    got = copier.gather(src, ids)
    assert got.done() and got.host.shape == (3, 2, 5, block_size, heads, dim) and got.host.is_contiguous()
    dst = [torch.zeros_like(t) for t in src]
    copier.scatter(got.host, dst, ids).wait()
    for s, d in zip(src, dst, strict=True):
        assert same_bits(s[:, ids], d[:, ids])
        others = [b for b in range(11) if b not in ids]
        assert not d[:, others].view(BITS[dtype]).any()  # nothing else written


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_host_layout_is_layer_then_k_v_then_block_in_id_order(layout):
    src = cache(layout, 2, 6, 16, 3, 8, torch.float32)
    ids = [4, 1]
    host = DeviceBlocks(layout).gather(src, ids).host
    for layer in range(2):
        nhd = src[layer] if layout == "NHD" else src[layer].transpose(2, 3)
        for kv in range(2):
            for j, block in enumerate(ids):
                assert same_bits(host[layer, kv, j], nhd[kv, block])  # [block_size, heads, dim]
    # flat: per layer, K then V, each the blocks in order: what the bulk channel sends
    flat = torch.cat(
        [
            (src[layer] if layout == "NHD" else src[layer].transpose(2, 3))[kv, b].reshape(-1)
            for layer in range(2)
            for kv in range(2)
            for b in ids
        ]
    )
    assert same_bits(host.reshape(-1), flat)


def test_heads_first_memory_behind_a_token_first_view():
    """vLLM's FlashAttention cache laid out HND hands out a permuted NHD view: it copies as NHD."""
    raw = cache("HND", 2, 5, 16, 4, 8, torch.bfloat16)
    views = [t.permute(0, 1, 3, 2, 4) for t in raw]
    got = DeviceBlocks("NHD").gather(views, [3, 1])
    assert same_bits(got.host[1, 0, 0], raw[1][0, 3].transpose(0, 1))
    dst_raw = [torch.zeros_like(t) for t in raw]
    DeviceBlocks("NHD").scatter(got.host, [t.permute(0, 1, 3, 2, 4) for t in dst_raw], [3, 1])
    assert all(same_bits(a[:, [3, 1]], b[:, [3, 1]]) for a, b in zip(raw, dst_raw, strict=True))


def test_block_ids_as_a_host_tensor_and_no_blocks():
    src = cache("NHD", 2, 4, 16, 1, 8, torch.float16)
    copier = DeviceBlocks()
    assert same_bits(copier.gather(src, torch.tensor([2, 0])).host, copier.gather(src, [2, 0]).host)
    empty = copier.gather(src, [])
    assert empty.host.shape == (2, 2, 0, 16, 1, 8)
    copier.scatter(empty.host, [torch.zeros_like(t) for t in src], [])


def test_the_host_buffer_is_reused_once_released():
    src = cache("NHD", 2, 8, 16, 2, 64, torch.float16)  # 16 KiB a block of both layers
    copier = DeviceBlocks(buffers=HostBuffers(pin=False))
    first = copier.gather(src, [0, 1, 2])
    held = copier.gather(src, [3])  # the first is still held: another buffer
    assert held.host.data_ptr() != first.host.data_ptr()
    first.release()
    again = copier.gather(src, [5, 6])  # smaller: fits the released buffer
    assert again.host.data_ptr() == first.host.data_ptr()
    assert copier.buffers.allocated == 2 and len(copier.buffers.buffers) == 2
    again.release()
    held.release()
    for _ in range(5):
        copier.gather(src, [7]).release()
    assert copier.buffers.allocated == 2


def test_a_larger_buffer_replaces_a_free_smaller_one():
    pool = HostBuffers(pin=False)
    small = pool.take(100)
    assert small.capacity == MIN_CAPACITY
    small.release()
    big = pool.take(3 * MIN_CAPACITY)
    assert big.capacity == 4 * MIN_CAPACITY and pool.buffers == [big]
    assert pool.take(10).capacity == MIN_CAPACITY  # big is held: a new small one


def test_bad_arguments_are_refused():
    src = cache("NHD", 2, 4, 16, 1, 8, torch.float16)
    copier = DeviceBlocks()
    host = copier.gather(src, [0, 1]).host
    with pytest.raises(ValueError, match="twice"):
        copier.scatter(host, src, [1, 1])
    with pytest.raises(ValueError, match="out of range"):
        copier.gather(src, [4])
    with pytest.raises(ValueError, match="out of range"):
        copier.gather(src, [-1])
    with pytest.raises(ValueError, match="does not match"):
        copier.scatter(host, src, [0, 1, 2])
    with pytest.raises(ValueError, match="does not match"):
        copier.scatter(host.float(), src, [0, 1])
    with pytest.raises(ValueError, match="same shape"):
        copier.gather([src[0], src[1].float()], [0])
    with pytest.raises(ValueError, match=r"\[2, num_blocks"):
        copier.gather([src[0][0]], [0])
    with pytest.raises(ValueError, match="no layers"):
        copier.gather([], [0])
    with pytest.raises(ValueError, match="layout"):
        DeviceBlocks("NDH")


class PendingCopy:
    """An event as the pool sees one: finished or not."""

    def __init__(self) -> None:
        self.finished = False

    def query(self) -> bool:
        return self.finished


def test_a_buffer_a_copy_still_reads_is_not_reused_even_released():
    pool = HostBuffers(pin=False)
    buf = pool.take(10)
    copy = PendingCopy()
    pool.holding(buf.view((2, 5), torch.uint8)[1]).events.append(copy)  # a view into it counts
    buf.release()
    other = pool.take(10)
    assert other is not buf
    copy.finished = True
    assert pool.take(10) is buf
    assert pool.holding(torch.zeros(3)) is None


def test_a_group_of_vllm_blocks_is_a_view_of_its_pdd_blocks():
    src = cache("NHD", 2, 6, 64, 2, 8, torch.bfloat16)  # vLLM blocks of 64 tokens: 4 pdd blocks each
    host = DeviceBlocks().gather(src, [5, 2]).host
    pdd = host.view(2, 2, 2 * 4, 16, 2, 8)  # no copy
    assert pdd.data_ptr() == host.data_ptr()
    for j, block in enumerate([5, 2]):
        for k in range(4):  # pdd block 4j + k is tokens [16k, 16k + 16) of vLLM block `block`
            assert same_bits(pdd[:, :, 4 * j + k], torch.stack(src)[:, :, block, 16 * k : 16 * (k + 1)])
