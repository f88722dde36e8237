"""Groups split over several connections of one sender, over real sockets: intact and in
order, a corrupted piece caught, abort mid-transfer, a dropped lane retried, the receiver's
reservation given back."""

from __future__ import annotations

import asyncio

import pytest
import torch

from shared.kv import KVClientPool, KVTransferError, TcpSender, open_kv_client, start_kv_server
from shared.kv.transfer import split_layers
from shared.ports import free_port
from shared.wan import WanLink
from tests.polling import until

from .test_kv_channel import SECRET, MemorySink, blocks
from .test_kv_reconnect import GROUP, HashSink

PARALLEL = 3


def test_split_layers_is_even_and_only_for_large_groups() -> None:
    kv = torch.empty(32, 2, 1, 16, 8, 64, dtype=torch.float16)  # 1 MiB
    assert split_layers(kv, 4, 0) == [(0, 8), (8, 16), (16, 24), (24, 32)]
    assert split_layers(kv, 3, 0) == [(0, 11), (11, 21), (21, 32)]
    assert split_layers(kv, 4, 2 << 20) == [(0, 32)]  # below the minimum: whole
    assert split_layers(kv, 1, 0) == [(0, 32)]
    assert split_layers(kv[:2], 4, 0) == [(0, 1), (1, 2)]  # no more pieces than layers


@pytest.fixture
async def split_pair():
    sink = MemorySink()
    server = await start_kv_server("tcp://127.0.0.1:0", SECRET, sink)
    pool = KVClientPool(SECRET, parallel=PARALLEL, parallel_min_bytes=0)
    try:
        yield sink, server, pool
    finally:
        await pool.close()
        await server.close()


def _released(server) -> bool:
    return not len(server.splits) and server.inflight.bytes == 0 and server.inflight.groups == 0


async def test_large_groups_over_several_connections_arrive_intact_and_in_order(split_pair) -> None:
    sink, server, pool = split_pair
    src = blocks(48, seed=3)
    transfer = TcpSender(pool, server.address, "r")
    try:
        for lo, hi in ((0, 16), (16, 17), (17, 48)):
            await transfer.send_blocks(list(range(lo, hi)), src[:, :, lo:hi])
        await transfer.finish(b"end")
    finally:
        transfer.close()
    assert sink.hashes("r") == list(range(48)) and sink.done["r"] == b"end"
    assert torch.equal(sink.tensor("r"), src)
    lanes = pool._peers[server.address].lanes
    assert len(lanes) == PARALLEL - 1 and all(lane.bytes_sent > 0 for lane in lanes)  # pieces went there
    assert _released(server)


async def test_corrupted_piece_is_detected_and_nothing_delivered(split_pair) -> None:
    sink, server, pool = split_pair
    lane = await pool.lane(server.address, 1)
    real_send = lane._stream.send

    async def corrupting_send(*bufs, **kw):  # a bit flipped on the wire, after the checksum
        if len(bufs) == 2:
            bad = bytearray(bufs[1])
            bad[len(bad) // 2] ^= 0x10
            bufs = (bufs[0], bad)
        await real_send(*bufs, **kw)

    lane._stream.send = corrupting_send
    transfer = TcpSender(pool, server.address, "bad")
    try:
        await transfer.send_blocks(list(range(8)), blocks(8))
        with pytest.raises(KVTransferError, match="checksum mismatch in a piece"):
            await transfer.finish()
    finally:
        transfer.close()
    assert "bad" not in sink.held and "bad" not in sink.done
    assert sink.aborts and sink.aborts[0][0] == "bad"
    await until(lambda: _released(server))


async def test_abort_mid_transfer_across_connections_frees_both_sides(split_pair) -> None:
    sink, server, pool = split_pair
    src = blocks(200)
    transfer = TcpSender(pool, server.address, "a")

    async def producer() -> None:
        for i in range(0, 200, 4):
            await transfer.send_blocks(list(range(i, i + 4)), src[:, :, i : i + 4])

    task = asyncio.create_task(producer())
    try:
        await until(lambda: len(sink.held.get("a", [])) >= 3)
        task.cancel()  # as the service does: stop the producer, then abort the request
        await asyncio.gather(task, return_exceptions=True)
        await transfer.abort("relay finished first")
    finally:
        transfer.close()
    await until(lambda: sink.aborts)
    assert sink.aborts[0][0] == "a" and "a" not in sink.held and "a" not in sink.done
    await until(lambda: all(not rids for rids in server.in_flight.values()) and _released(server))
    # The pool's connections are still good for the next request.
    again = TcpSender(pool, server.address, "b")
    await again.send_blocks(list(range(8)), src[:, :, :8])
    await again.finish()
    again.close()
    assert torch.equal(sink.tensor("b"), src[:, :, :8])


async def test_dropped_lane_is_retried_on_a_fresh_one(split_pair) -> None:
    sink, server, pool = split_pair
    lane = await pool.lane(server.address, 0)
    real_send = lane._stream.send

    async def dropping_send(*bufs, **kw):  # the connection dies half-way through a piece
        await real_send(bufs[0], memoryview(bufs[1])[: len(bufs[1]) // 2], **kw)
        lane._stream.abort()
        raise ConnectionResetError("connection reset by peer")

    lane._stream.send = dropping_send
    src = blocks(16, seed=5)
    transfer = TcpSender(pool, server.address, "r")
    try:
        await transfer.send_blocks(list(range(16)), src)
        await transfer.finish()
    finally:
        transfer.close()
    assert transfer.reconnects == 1 and lane.closed
    assert pool._peers[server.address].lanes[0] is not lane  # a fresh lane carried the piece
    assert torch.equal(sink.tensor("r"), src) and not sink.aborts
    await until(lambda: _released(server))


async def test_pieces_that_never_come_fail_the_request_and_free_the_reservation(split_pair) -> None:
    sink, server, _ = split_pair
    server.splits.wait_s = 0.3
    client = await open_kv_client(server.address, SECRET)
    try:
        kv = blocks(4)
        await client.send_blocks("r", list(range(4)), kv, split=(7, 2))  # layers [2, 4) never sent
        with pytest.raises(KVTransferError, match="nothing landed"):
            await client.finish("r", timeout=5)
    finally:
        await client.close()
    assert "r" not in sink.held and sink.aborts[0][0] == "r"
    await until(lambda: _released(server))


async def test_link_cut_under_split_groups_resends_them_whole() -> None:
    """Every connection (request's and lanes) reset mid-transfer by a real WAN link in drop mode."""
    sink = HashSink()
    server = await start_kv_server("tcp://127.0.0.1:0", SECRET, sink, reconnect_grace=2.0)
    server.splits.wait_s = 3.0  # leftover pieces of the cut connections go sooner than by default
    link = WanLink(
        "bulk", f"127.0.0.1:{free_port()}", server.address.removeprefix("tcp://"), bandwidth_mbps=40
    )
    await link.start()
    pool = KVClientPool(SECRET, parallel=PARALLEL, parallel_min_bytes=0)
    kv = blocks(8 * GROUP, seed=1)
    transfer = TcpSender(pool, f"tcp://{link.listen}", "r")
    try:
        for g in range(8):
            lo = g * GROUP
            await transfer.send_blocks(list(range(lo, lo + GROUP)), kv[:, :, lo : lo + GROUP])
            if g == 3:
                await until(lambda: sink.imports, timeout=10)
                await link.cut("drop")
                asyncio.get_running_loop().call_later(0.3, lambda: asyncio.ensure_future(link.restore()))
        await transfer.finish(b"ok")
        await until(lambda: _released(server), timeout=10)
    finally:
        transfer.close()
        await pool.close()
        await link.stop()
        await server.close()
    assert transfer.reconnects >= 1 and sink.done == {"r": b"ok"} and sink.aborts == []
    assert sink.imports == {h: 1 for h in range(8 * GROUP)}
    order = torch.tensor(sink.hashes("r")).argsort()
    assert torch.equal(sink.tensor("r")[:, :, order], kv)
