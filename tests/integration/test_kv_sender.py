"""Prefill's KV senders: the factory's choice of transport, and the RDMA sender's split, on real
parts: a real KVServer over TCP, real RdmaPeers / RdmaLink / RdmaWriter on a real NATS server,
with main decode's answers given by the test and the one-sided write done by an in-process
engine that copies into a local "pool" tensor. What MD gave slots for is written into them;
the rest, and what MD finds corrupt, arrive over TCP bit-exact."""

from __future__ import annotations

import ctypes

import pytest
import torch
from prometheus_client import REGISTRY

from services.prefill.kv_stream import kv_senders
from shared.bus import subjects
from shared.bus.connection import flushed, respond, subscribe
from shared.bus.messages import RdmaOffer, RdmaSlots, RdmaVerdict, RdmaWritten
from shared.config import PrefillSettings
from shared.kv import KVClientPool, TcpSender, start_kv_server
from shared.kv.rdma.engine import RdmaError
from shared.kv.rdma.layout import region_of
from shared.kv.rdma.link import RdmaPeers
from shared.kv.rdma.sender import RdmaSender
from shared.kv.rdma.writer import RdmaWriter

from .test_kv_channel import SECRET, MemorySink, blocks

WAIT_S = 10.0
N = 8  # blocks of the request


class LoopbackEngine:
    """An RdmaEngine whose peer is this process: a write copies bytes to the peer address."""

    session = "loopback:1"

    def __init__(self, fail: bool = False):
        self.fail = fail
        self.written = 0

    def register(self, tensor: torch.Tensor) -> None:
        pass

    def write(self, session: str, runs: list[tuple[int, int, int]]) -> None:
        if self.fail:
            raise RdmaError("the peer refused the address")
        for src, dst, length in runs:
            ctypes.memmove(dst, src, length)
            self.written += length

    def close(self) -> None:
        pass


@pytest.fixture
async def md(nats_server, nats_security):
    """A TCP sink and a stand-in for MD's RDMA answers: slots for `slotted`, and `corrupt` as
    the verdict on them."""
    nc = await nats_security.connect(nats_server, "kv-sender-test")
    sink = MemorySink()
    server = await start_kv_server("tcp://127.0.0.1:0", SECRET, sink)
    pool = KVClientPool(SECRET)

    class MD:
        address = server.address
        slotted: list[int] = []
        corrupt: set[int] = set()
        offers: list[RdmaOffer] = []
        pool_kv = torch.zeros_like(blocks(16))  # MD's pool: 16 slots

    md = MD()
    md.sink, md.pool, md.nc = sink, pool, nc

    async def on_offer(msg: RdmaOffer, raw) -> None:
        md.offers.append(msg)
        r = region_of(md.pool_kv)
        slots = list(range(3, 3 + len(md.slotted)))  # not in the request's order of blocks
        await respond(
            raw,
            RdmaSlots(True, "md:1", r.base, r.num_blocks, r.planes, r.block_bytes, md.slotted, slots),
        )

    async def on_written(msg: RdmaWritten, raw) -> None:
        await respond(raw, RdmaVerdict(ok=True, corrupt=[h for h in msg.hashes if h in md.corrupt]))

    await subscribe(nc, subjects.md_rdma(server.address, "offer"), RdmaOffer, on_offer)
    await subscribe(nc, subjects.md_rdma(server.address, "written"), RdmaWritten, on_written)
    await flushed(nc)
    yield md
    await pool.close()
    await server.close()
    await nc.close()


def fallbacks(reason: str) -> float:
    return REGISTRY.get_sample_value("pdd_kv_rdma_fallbacks_total", {"reason": reason}) or 0.0


def per_block(kv: torch.Tensor) -> int:
    return kv[:, :, :1].numel() * kv.element_size()


async def ship(sender, hashes: list[int], kv: torch.Tensor) -> tuple[int, int]:
    """Two groups, then finish: (bytes the sends reported, bytes finish sent again)."""
    try:
        sent = await sender.send(hashes[:5], kv[:, :, :5], None)
        sent += await sender.send(hashes[5:], kv[:, :, 5:], None)
        return sent, await sender.finish()
    finally:
        sender.close()


def over_tcp(md, rid: str) -> dict[int, torch.Tensor]:
    got = {}
    for hashes, kv in md.sink.held.get(rid, []):
        got.update((h, kv[:, :, i]) for i, h in enumerate(hashes))
    return got


async def test_the_rdma_sender_writes_what_md_gave_slots_for_and_sends_the_rest_over_tcp(md) -> None:
    hashes, kv = list(range(100, 100 + N)), blocks(N, seed=3)
    md.slotted = [100, 101, 103, 106]  # across both groups
    md.corrupt = {103}  # written, but fails MD's checksum: comes again over TCP
    engine = LoopbackEngine()
    peers = RdmaPeers(md.nc, RdmaWriter(engine, 1 << 20), WAIT_S)
    sender = RdmaSender(peers, TcpSender(md.pool, md.address, "r1"), hashes)
    sent, again = await ship(sender, hashes, kv)

    assert md.offers[0].hashes == hashes
    for slot, h in enumerate(md.slotted, start=3):  # each slotted block lies in its slot
        assert torch.equal(md.pool_kv[:, :, slot], kv[:, :, hashes.index(h)])
    tcp = over_tcp(md, "r1")
    assert sorted(tcp) == sorted({*set(hashes) - set(md.slotted), *md.corrupt})
    for h, got in tcp.items():
        assert torch.equal(got, kv[:, :, hashes.index(h)])
    assert "r1" in md.sink.done
    assert sender.rdma_bytes == engine.written == len(md.slotted) * per_block(kv)
    assert again >= per_block(kv)  # the corrupt block, resent at the end
    assert sent >= sender.rdma_bytes + (N - len(md.slotted)) * per_block(kv)


async def test_a_failed_write_sends_that_group_and_every_later_one_over_tcp(md) -> None:
    hashes, kv = list(range(200, 200 + N)), blocks(N, seed=4)
    md.slotted = hashes[:]
    before = fallbacks("write")
    peers = RdmaPeers(md.nc, RdmaWriter(LoopbackEngine(fail=True), 1 << 20), WAIT_S)
    sender = RdmaSender(peers, TcpSender(md.pool, md.address, "r2"), hashes)
    _, again = await ship(sender, hashes, kv)
    assert sorted(over_tcp(md, "r2")) == hashes and sender.rdma_bytes == 0 and again == 0
    assert fallbacks("write") == before + 1


async def test_without_the_rdma_engine_everything_goes_over_tcp(md) -> None:
    hashes, kv = list(range(300, 300 + N)), blocks(N, seed=5)
    sender = RdmaSender(RdmaPeers(md.nc, None, WAIT_S), TcpSender(md.pool, md.address, "r3"), hashes)
    await ship(sender, hashes, kv)
    assert sorted(over_tcp(md, "r3")) == hashes and md.offers == [] and sender.rdma_bytes == 0


async def test_the_factory_picks_the_rdma_sender_only_toward_a_main_decoder_when_on(md) -> None:
    tcp = kv_senders(PrefillSettings(secret=SECRET, kv_transport="tcp"), md.nc, md.pool)
    rdma = kv_senders(PrefillSettings(secret=SECRET, kv_transport="rdma"), md.nc, md.pool)
    opened = [
        tcp.open(md.address, "a", [1]),
        rdma.open(md.address, "b"),  # the relay: no pool to write into
        rdma.open(md.address, "c", [1]),
    ]
    try:
        assert [type(s) for s in opened] == [TcpSender, TcpSender, RdmaSender]
    finally:
        for s in opened:
            s.close()
