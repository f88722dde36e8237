"""The KV bulk channel across dropped connections, over real sockets: a real WanLink (the WAN
emulator's TCP proxy) in front of a real KVServer is cut in "drop" mode (both sides reset)
in the middle of a transfer; plus the channel's own deadlines and the maps that must not grow."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

import shared.kv.server as kv_server
from shared.kv import (
    KVClientPool,
    KVTransferError,
    LinkEstimator,
    RetryPolicy,
    TcpSender,
    open_kv_client,
    start_kv_server,
)
from shared.kv.pool import keep_idle_for
from shared.kv.transfer import retry_delay
from shared.ports import free_port
from shared.wan import WanLink
from tests.polling import until

from .test_kv_channel import SECRET, MemorySink, blocks
from .test_kv_md_trust import md, prepare  # noqa: F401 (md is a fixture)

GROUP = 64  # blocks per group: 512 KiB


class HashSink(MemorySink):
    """Like main decode: a block it already holds for the request is a no-op."""

    def __init__(self) -> None:
        super().__init__()
        self.imports: dict[int, int] = {}  # block hash -> times imported

    async def on_blocks(self, rid: str, hashes: list[int], kv: torch.Tensor, traceparent: str | None) -> None:
        fresh = [i for i, h in enumerate(hashes) if h not in self.imports]
        for i in fresh:
            self.imports[hashes[i]] = 1
        if fresh:
            self.held.setdefault(rid, []).append(([hashes[i] for i in fresh], kv[:, :, fresh]))
        self.got_blocks.set()


@pytest.fixture
async def wan_kv():
    sink = HashSink()
    server = await start_kv_server("tcp://127.0.0.1:0", SECRET, sink, reconnect_grace=2.0)
    link = WanLink(
        "bulk", f"127.0.0.1:{free_port()}", server.address.removeprefix("tcp://"), bandwidth_mbps=40
    )
    await link.start()
    pool = KVClientPool(SECRET)
    try:
        yield sink, server, link, pool, f"tcp://{link.listen}"
    finally:
        await pool.close()
        await link.stop()
        await server.close()


def test_retry_delays_double_up_to_a_cap_within_attempts_and_deadline() -> None:
    p = RetryPolicy(attempts=4, backoff_s=0.1, max_backoff_s=0.3, deadline_s=1.0)
    assert [retry_delay(p, i, 0.0) for i in range(5)] == [0.1, 0.2, 0.3, 0.3, None]
    assert retry_delay(p, 1, 0.75) == 0.2
    assert retry_delay(p, 1, 0.85) is None  # would end past the deadline


async def test_reset_mid_transfer_resends_on_a_fresh_connection(wan_kv) -> None:
    sink, server, link, pool, address = wan_kv
    kv = blocks(8 * GROUP, seed=1)
    transfer = TcpSender(pool, address, "r")
    try:
        for g in range(8):
            lo = g * GROUP
            await transfer.send_blocks(list(range(lo, lo + GROUP)), kv[:, :, lo : lo + GROUP])
            if g == 3:  # the link is still carrying earlier groups: cut it under them
                await until(lambda: sink.imports, timeout=10)
                await link.cut("drop")
                asyncio.get_running_loop().call_later(0.3, lambda: asyncio.ensure_future(link.restore()))
        await transfer.finish(b"ok")
    finally:
        transfer.close()
    assert transfer.reconnects >= 1 and link.connections >= 2
    assert sink.done == {"r": b"ok"} and sink.aborts == []
    assert sink.imports == {h: 1 for h in range(8 * GROUP)}  # every block, exactly once
    order = torch.tensor(sink.hashes("r")).argsort()
    assert torch.equal(sink.tensor("r")[:, :, order], kv)
    assert server.orphans == []


async def test_receiver_that_never_comes_back(wan_kv) -> None:
    sink, server, link, pool, address = wan_kv
    policy = RetryPolicy(attempts=3, backoff_s=0.1, max_backoff_s=0.2, deadline_s=0.6)
    transfer = TcpSender(pool, address, "gone", policy=policy)
    try:
        await transfer.send_blocks(list(range(GROUP)), blocks(GROUP))
        await until(lambda: sink.imports, timeout=10)
        await link.cut("drop")  # and never restored
        await until(lambda: server.orphans == ["gone"])
        assert sink.aborts == []  # the grace (2 s) is running: the request is still held
        t0 = time.monotonic()
        with pytest.raises(KVTransferError, match="connection lost"):
            await transfer.send_blocks(list(range(GROUP, 2 * GROUP)), blocks(GROUP, seed=2))
        assert time.monotonic() - t0 < 5  # its own retry deadline, not a 60 s send timeout
        assert transfer.reconnects == 0
    finally:
        transfer.close()
    await until(lambda: sink.aborts)
    assert sink.aborts == [("gone", "connection lost")] and server.orphans == []


async def test_rejection_is_not_retried_and_no_rid_is_kept() -> None:
    sink = MemorySink(reject_at=0)
    server = await start_kv_server("tcp://127.0.0.1:0", SECRET, sink)
    pool = KVClientPool(SECRET)
    transfer = TcpSender(pool, server.address, "no")
    try:
        await transfer.send_blocks([1], blocks(1))
        client = transfer.client
        assert client is not None
        await until(lambda: "no" not in client._rids)  # the receiver's error alone drops it
        with pytest.raises(KVTransferError, match="rejected"):
            await transfer.finish()
        assert transfer.reconnects == 0 and not client.closed
        with pytest.raises(ValueError):  # a failed call leaves nothing behind either
            await client.send_blocks("bad", [1, 2], blocks(1))
        assert client._rids == {}
    finally:
        transfer.close()
        await pool.close()
        await server.close()


@pytest.mark.parametrize("callback", ["on_blocks", "on_done"])
async def test_a_sink_callback_that_hangs_is_bounded(monkeypatch, callback) -> None:
    monkeypatch.setattr(kv_server, "SINK_CALL_TIMEOUT_S", 0.2)
    sink = MemorySink()

    async def hang(*args) -> None:
        await asyncio.sleep(3600)  # the stimulus: a callback that hangs

    setattr(sink, callback, hang)
    server = await start_kv_server("tcp://127.0.0.1:0", SECRET, sink)
    client = await open_kv_client(server.address, SECRET)
    try:
        await client.send_blocks("h", [1], blocks(1))
        with pytest.raises(KVTransferError, match="rejected by receiver"):
            await client.finish("h", timeout=10)
        assert [rid for rid, _ in sink.aborts] == ["h"]
    finally:
        await client.close()
        await server.close()


async def test_idle_connection_is_closed_by_the_receiver_and_not_reused_by_the_pool() -> None:
    server = await start_kv_server("tcp://127.0.0.1:0", SECRET, MemorySink(), idle_timeout=0.3)
    pool = KVClientPool(SECRET)
    try:
        a = await pool.acquire(server.address)
        assert a.idle_timeout == 0.3
        pool.release(a)
        await until(lambda: a.closed)  # the receiver closed it: nothing was in flight
        b = await pool.acquire(server.address)
        assert not b.closed and b is not a
        pool.release(b)
        b.last_used -= keep_idle_for(b.idle_timeout) + 0.01  # idle past the pool's margin
        c = await pool.acquire(server.address)
        assert c is not b and b.closed  # closed by the pool before the receiver would have
        pool.release(c)
    finally:
        await pool.close()
        await server.close()


def test_pool_keeps_idle_connections_a_margin_below_the_receivers_timeout() -> None:
    assert keep_idle_for(60.0) == 55.0
    assert keep_idle_for(4.0) == 2.0
    assert keep_idle_for(None) == 600.0


async def test_pool_forgets_a_peer_once_its_connections_are_gone() -> None:
    server = await start_kv_server("tcp://127.0.0.1:0", SECRET, MemorySink())
    pool = KVClientPool(SECRET)
    try:
        busy = await pool.acquire(server.address)
        await pool.forget_idle(now=time.monotonic() + 3600)
        assert pool.peers == [server.address] and not busy.closed  # in use: kept
        pool.release(busy)
        await pool.forget_idle(now=time.monotonic() + 3600)
        assert pool.peers == [] and busy.closed
    finally:
        await pool.close()
        await server.close()


def test_link_estimator_forgets_peers_not_seen_for_a_while() -> None:
    est = LinkEstimator(forget_after_s=600)
    est.observe_rtt("tcp://new:1", 0.05)
    est.observe_rtt("tcp://old:1", 0.2)
    est._peers["tcp://old:1"].updated -= 601
    est.observe_rtt("tcp://new:1", 0.05)  # any observation sweeps
    assert est.rtt("tcp://old:1") == est.default_rtt  # forgotten: back to the prior
    assert list(est.snapshot()) == ["tcp://new:1"]
    est.forget_idle(now=time.time() + 601)
    assert est.snapshot() == {} and est.rtt("tcp://new:1") == est.default_rtt


async def test_main_decode_takes_a_resent_block_as_a_no_op(md) -> None:  # noqa: F811
    service, nc, pki = md
    engine = service.engine
    layers, two, _, *block = engine.kv_cache.shape
    prompt = [(5 * i) % 200 + 1 for i in range(40)]
    hashes = engine.block_hashes(prompt)
    reply = await prepare(nc, "again", prompt, hashes)
    assert reply.ok and reply.missing == hashes
    kv = torch.randn(layers, two, len(hashes), *block).to(engine.kv_cache.dtype)
    await service.prompt_kv.on_blocks("again", hashes[:1], kv[:, :, :1], None)
    await service.prompt_kv.on_blocks(
        "again", hashes, kv, None
    )  # a resend: the first block again, plus the rest
    await service.prompt_kv.on_blocks("again", hashes, kv, None)
    await service.prompt_kv.on_done("again", b"")
    await service.prompt_kv.on_done("again", b"")  # its ack was lost: done once more
    pinned = await service.engine_loop.call(lambda: list(engine.exchange.pins["again"]))
    assert len(pinned) == len(set(pinned)) == len(hashes)  # one reference per block, none twice
    assert service.jobs["again"].wan_bytes == kv.numel() * kv.element_size()
