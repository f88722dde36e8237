"""Groups split over several TLS connections: intact and in order, and a group is the sender's
own: a piece from a peer with another certificate never completes it."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch

from shared.kv import KVClientPool, TcpSender, open_kv_client, start_kv_server
from shared.security import Pki, client_context, server_context
from tests.polling import until

from .test_kv_channel import SECRET, MemorySink, blocks

PARALLEL = 3


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Pki:
    pki = Pki(tmp_path_factory.mktemp("pki"))
    pki.ensure(["main_decode", "prefill", "relay"], ["127.0.0.1"])
    return pki


@pytest.fixture
async def tls_server(pki):
    sink = MemorySink()
    server = await start_kv_server(
        "tcp://127.0.0.1:0", SECRET, sink, ssl=server_context(pki.identity("main_decode"))
    )
    try:
        yield sink, server
    finally:
        await server.close()


async def test_a_split_group_over_tls_arrives_intact_and_in_order(pki, tls_server) -> None:
    sink, server = tls_server
    pool = KVClientPool(
        SECRET, ssl=client_context(pki.identity("prefill")), parallel=PARALLEL, parallel_min_bytes=0
    )
    src = blocks(40, seed=5)
    transfer = TcpSender(pool, server.address, "r")
    try:
        for lo, hi in ((0, 24), (24, 40)):
            await transfer.send_blocks(list(range(lo, hi)), src[:, :, lo:hi])
        await transfer.finish(b"end")
    finally:
        transfer.close()
        lanes = list(pool._peers[server.address].lanes)
        await pool.close()
    assert sink.hashes("r") == list(range(40)) and sink.done["r"] == b"end"
    assert torch.equal(sink.tensor("r"), src)
    assert len(lanes) == PARALLEL - 1 and all(lane.bytes_sent > 0 for lane in lanes)


async def test_a_piece_from_another_certificate_does_not_complete_a_group(pki, tls_server) -> None:
    sink, server = tls_server
    src, forged = blocks(8, seed=1), blocks(8, seed=2)
    half = src.shape[0] // 2
    gid = random.getrandbits(63)
    owner = await open_kv_client(server.address, SECRET, ssl=client_context(pki.identity("prefill")))
    owner_lane = await open_kv_client(server.address, SECRET, ssl=client_context(pki.identity("prefill")))
    other = await open_kv_client(server.address, SECRET, ssl=client_context(pki.identity("relay")))
    try:
        sending = asyncio.create_task(owner.send_blocks("r", list(range(8)), src, split=(gid, half)))
        await other.send_piece("r", gid, forged, half, src.shape[0])  # same gid, another identity
        await until(lambda: len(server.splits) == 2)  # the forged piece landed in a group of its own
        assert "r" not in sink.held  # the owner's group still waits for its owner's piece
        await owner_lane.send_piece("r", gid, src, half, src.shape[0])
        await asyncio.wait_for(sending, 10)
        await owner.finish("r")
    finally:
        for c in (owner, owner_lane, other):
            await c.close()
    assert torch.equal(sink.tensor("r"), src)  # the owner's layers, not the forged ones
