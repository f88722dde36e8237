"""KV block copies on a CUDA device: exact, on side streams, ordered against the current stream
without stalling it. Skipped where torch sees no CUDA device; run on a GPU host."""

from __future__ import annotations

import pytest
import torch

from shared.kv.device_blocks import DeviceBlocks
from tests.kv_cache_util import cache, same_bits

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")

SLEEP_CYCLES = 200_000_000  # ~0.1 s of the current stream busy on any recent GPU


def _cuda(layers: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t.cuda() for t in layers]


def _warm(copier: DeviceBlocks, layers: list[torch.Tensor], ids: list[int]) -> None:
    """Make streams, the host buffer and the device staging now: allocating pinned or device
    memory later may wait for the device, which would hide whether a copy does."""
    copy = copier.gather(layers, ids)
    copy.wait()
    copy.release()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("block_size", [16, 128])
def test_round_trip_is_bit_identical(dtype, layout, block_size):
    src = cache(layout, 4, 40, block_size, 2, 64, dtype)
    ids = [31, 3, 17, 0, 39, 8]
    copier = DeviceBlocks(layout, stage_bytes=1)  # one layer a staging step: the chunked path
    layers, dst = _cuda(src), _cuda([torch.zeros_like(t) for t in src])
    torch.cuda._sleep(SLEEP_CYCLES // 4)  # both copies start late, together but for their order
    got = copier.gather(layers, ids)
    copier.scatter(got.host, dst, ids)  # not waiting for the gather: ordered after it on the device
    got.wait()
    assert got.done() and got.host.is_pinned()
    assert same_bits(got.host, DeviceBlocks(layout).gather(src, ids).host)  # the CPU's bytes
    back = [t.cpu() for t in dst]
    for s, d in zip(src, back, strict=True):
        assert same_bits(s[:, ids], d[:, ids])
        assert (d[:, [b for b in range(40) if b not in ids]] == 0).all()
    got.release()


def test_gather_returns_without_waiting_for_the_current_stream_and_sees_its_writes():
    layers = _cuda(cache("NHD", 2, 8, 16, 2, 64, torch.float16))
    copier = DeviceBlocks()
    _warm(copier, layers, [1, 2])
    current = torch.cuda.current_stream()
    torch.cuda._sleep(SLEEP_CYCLES)
    for t in layers:
        t[:, 5].fill_(7.0)  # queued behind the sleep
    got = copier.gather(layers, [5, 2])
    assert not current.query(), "gather waited for the current stream"
    assert not got.done()
    got.wait()
    assert (got.host[:, :, 0] == 7.0).all()  # the writes queued before the gather are in


def test_scatter_orders_the_current_stream_after_it():
    src = cache("HND", 3, 10, 16, 2, 32, torch.bfloat16)
    dst = _cuda([torch.zeros_like(t) for t in src])
    copier = DeviceBlocks("HND")
    host = copier.gather(src, [6, 1]).host.clone()  # not pinned: staged through a pinned buffer
    copier.scatter(host, dst, [6, 1]).wait()  # staging made
    dst = _cuda([torch.zeros_like(t) for t in src])
    torch.cuda._sleep(SLEEP_CYCLES)
    copy = copier.scatter(host, dst, [6, 1])
    host.zero_()  # the caller's again on return
    read = [(t[:, 6].clone(), t[:, 1].clone()) for t in dst]  # queued after the scatter
    copy.wait()
    for (six, one), s in zip(read, src, strict=True):
        assert same_bits(six.cpu(), s[:, 6]) and same_bits(one.cpu(), s[:, 1])


def test_scatter_without_wait_leaves_ordering_to_the_caller():
    src = cache("NHD", 2, 6, 16, 1, 64, torch.float16)
    layers, dst = _cuda(src), _cuda([torch.zeros_like(t) for t in src])
    copier = DeviceBlocks()
    gathered = copier.gather(layers, [2, 4])  # the pool's first buffer
    _warm(copier, layers, [0])  # a second one, free
    gathered.wait()
    copier.scatter(gathered.host, dst, [2, 4]).wait()  # the scatter stream made
    torch.cuda._sleep(SLEEP_CYCLES)  # the scatter waits for the current stream: still running below
    copy = copier.scatter(gathered.host, dst, [2, 4], wait=False)
    gathered.release()
    again = copier.gather(layers, [0])
    assert not copy.done()
    assert again.host.data_ptr() != gathered.host.data_ptr(), "reused a buffer a scatter still reads"
    copy.order_before()
    assert all(same_bits(d[:, [2, 4]].cpu(), s[:, [2, 4]]) for d, s in zip(dst, src, strict=True))


def test_block_ids_on_the_device_are_refused():
    layers = _cuda(cache("NHD", 1, 4, 16, 1, 64, torch.float16))
    with pytest.raises(ValueError, match="on the host"):
        DeviceBlocks().gather(layers, torch.tensor([1], device="cuda"))


def test_copies_follow_the_engine_stream_given():
    layers = _cuda(cache("NHD", 2, 8, 16, 2, 64, torch.float16))
    copier = DeviceBlocks()
    _warm(copier, layers, [1])
    copier.scatter(copier.gather(layers, [6]).host, layers, [6]).wait()  # ordered after the gather
    engine = torch.cuda.Stream()
    engine.wait_stream(torch.cuda.current_stream())  # the layers are written
    with torch.cuda.stream(engine):
        torch.cuda._sleep(SLEEP_CYCLES)
        for t in layers:
            t[:, 2].fill_(3.0)
    got = copier.gather(layers, [2], stream=engine)
    assert not got.done()
    got.wait()
    assert (got.host == 3.0).all()
    back = copier.scatter(got.host, layers, [6], stream=engine)  # engine waits for it
    with torch.cuda.stream(engine):
        read = layers[0][:, 6].clone()
    back.wait()
    engine.synchronize()
    assert (read == 3.0).all()
