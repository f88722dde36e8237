"""Lossy-codec groups over real sockets: decoded at the receiver, split over lanes like exact
ones, fewer bytes on the wire; an exact group's frames carry no codec; an unknown codec fails
its request only."""

from __future__ import annotations

import pytest
import torch

from shared.kv import KVClientPool, KVTransferError, TcpSender, open_kv_client, start_kv_server
from shared.kv.codec import Encoded, encode, round_trip
from shared.kv.frame import pack

from .test_kv_channel import SECRET, MemorySink, blocks


@pytest.fixture
async def receiver():
    sink = MemorySink()
    server = await start_kv_server("tcp://127.0.0.1:0", SECRET, sink)
    try:
        yield sink, server
    finally:
        await server.close()


async def _send(pool: KVClientPool, address: str, rid: str, src: torch.Tensor, codec: str) -> int:
    transfer = TcpSender(pool, address, rid, codec=codec)
    try:
        sent = 0
        for lo, hi in ((0, 8), (8, 24)):
            sent += await transfer.send_blocks(list(range(lo, hi)), src[:, :, lo:hi])
        await transfer.finish(b"end")
        return sent
    finally:
        transfer.close()


@pytest.mark.parametrize("parallel", [1, 3])
@pytest.mark.parametrize("codec", ["int8", "fp8", "int4"])
async def test_a_lossy_group_arrives_decoded_in_fewer_bytes(receiver, codec: str, parallel: int) -> None:
    sink, server = receiver
    src = blocks(24, seed=1, dtype=torch.float32)
    pool = KVClientPool(SECRET, parallel=parallel, parallel_min_bytes=0)
    try:
        exact = await _send(pool, server.address, "exact", src, "exact")
        lossy = await _send(pool, server.address, "lossy", src, codec)
    finally:
        await pool.close()
    assert torch.equal(sink.tensor("exact"), src)
    got = sink.tensor("lossy")
    assert got.dtype == src.dtype and got.shape == src.shape
    expect = torch.cat([round_trip(codec, src[:, :, lo:hi]) for lo, hi in ((0, 8), (8, 24))], dim=2)
    assert torch.equal(got, expect)
    assert sink.hashes("lossy") == list(range(24)) and sink.done["lossy"] == b"end"
    assert lossy < exact / (3.5 if codec != "int4" else 7.0)
    assert server.inflight.bytes == 0 and not len(server.splits)


async def test_exact_frames_name_no_codec(receiver, monkeypatch) -> None:
    sink, server = receiver
    headers: list[dict] = []
    real_pack = pack

    def spy(header: dict) -> bytes:
        headers.append(header)
        return real_pack(header)

    monkeypatch.setattr("shared.kv.client.pack", spy)
    client = await open_kv_client(server.address, SECRET)
    try:
        await client.send_blocks("e", [1, 2], blocks(2, dtype=torch.float32))
        await client.send_blocks("q", [1, 2], encode("int8", blocks(2, dtype=torch.float32)))
        await client.finish("e")
        await client.finish("q")
    finally:
        await client.close()
    by_rid = {h["rid"]: h for h in headers if h["kind"] == "blocks"}
    assert "codec" not in by_rid["e"] and by_rid["q"]["codec"] == "int8"
    assert by_rid["q"]["dtype"] == "float32" and by_rid["q"]["shape"] == list(blocks(2).shape)


async def test_an_unknown_codec_fails_its_request_and_nothing_else(receiver) -> None:
    sink, server = receiver
    src = blocks(2, dtype=torch.float32)
    good = encode("int8", src)
    client = await open_kv_client(server.address, SECRET)
    try:
        await client.send_blocks("bad", [1, 2], Encoded("zstd", good.shape, good.dtype, good.data))
        with pytest.raises(KVTransferError, match="unknown KV codec 'zstd'"):
            await client.finish("bad")
        await client.send_blocks("ok", [1, 2], good)  # the same connection goes on
        await client.finish("ok")
    finally:
        await client.close()
    assert "bad" not in sink.held and any(rid == "bad" for rid, _ in sink.aborts)
    assert torch.equal(sink.tensor("ok"), round_trip("int8", src))
    assert server.inflight.bytes == 0
