"""The KV bulk channel over real sockets: integrity, multiplexing, auth, faults, limits."""

from __future__ import annotations

import asyncio
import time

import msgpack
import pytest
import torch

import shared.kv.client as kv_client
import shared.kv.server as kv_server
from shared.kv import KVTransferError, open_kv_client, start_kv_server
from shared.kv.auth import client_handshake
from shared.kv.checksum import ALGOS, checksum, new_hasher
from shared.kv.frame import PREFIX, byte_view, pack, read_header
from shared.kv.transport import transport_for
from tests.polling import until

SECRET = "test-secret"
L, BS, H, D = 4, 16, 2, 16  # one block: 4 layers x 2 x 16 tokens x 2 heads x 16 dims fp16 = 8 KiB


def blocks(n: int, seed: int = 0, dtype: torch.dtype = torch.float16) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(L, 2, n, BS, H, D, generator=g).to(dtype)


class MemorySink:
    """Keeps what arrives; frees on abort; records every callback."""

    def __init__(self, reject_at: int | None = None) -> None:
        self.held: dict[str, list[tuple[list[int], torch.Tensor]]] = {}
        self.done: dict[str, bytes] = {}
        self.aborts: list[tuple[str, str]] = []
        self.traceparents: list[str | None] = []
        self.groups: dict[str, int] = {}  # groups delivered per rid, rejected ones included
        self.reject_at = reject_at  # reject each rid's group with this index
        self.got_blocks = asyncio.Event()

    async def on_blocks(self, rid: str, hashes: list[int], kv: torch.Tensor, traceparent: str | None) -> None:
        seq = self.groups[rid] = self.groups.get(rid, -1) + 1
        if seq == self.reject_at:
            raise RuntimeError("pool full")
        self.held.setdefault(rid, []).append((hashes, kv))
        self.traceparents.append(traceparent)
        self.got_blocks.set()

    async def on_done(self, rid: str, payload: bytes) -> None:
        self.done[rid] = payload

    async def on_abort(self, rid: str, reason: str) -> None:
        self.aborts.append((rid, reason))
        self.held.pop(rid, None)

    def tensor(self, rid: str) -> torch.Tensor:
        return torch.cat([kv for _, kv in self.held[rid]], dim=2)

    def hashes(self, rid: str) -> list[int]:
        return [h for hs, _ in self.held[rid] for h in hs]


@pytest.fixture
async def kv_pair():
    sink = MemorySink()
    server = await start_kv_server("tcp://127.0.0.1:0", SECRET, sink)
    client = await open_kv_client(server.address, SECRET)
    try:
        yield sink, server, client
    finally:
        await client.close()
        await server.close()


def test_one_shot_checksum_equals_the_receivers_chunked_one() -> None:
    """The sender hashes a frame at once, the receiver chunk by chunk as it lands."""
    data = byte_view(blocks(3, seed=7))
    for algo in ALGOS:
        hasher = new_hasher(algo)
        for i in range(0, len(data), 1000):
            hasher.update(data[i : i + 1000])
        assert checksum(algo, data) == hasher.value(), algo
    flipped = bytearray(data)
    flipped[5] ^= 1
    assert all(checksum(a, flipped) != checksum(a, data) for a in ALGOS if a != "none")


async def test_thousand_blocks_bit_exact(kv_pair) -> None:
    sink, server, client = kv_pair
    src = blocks(1000)
    sent = 0
    for i in range(0, 1000, 25):  # as a producer would: a few blocks at a time, sent at once
        sent += await client.send_blocks(
            "r1", list(range(i, i + 25)), src[:, :, i : i + 25], traceparent="00-tp"
        )
    await client.finish("r1", payload=b"\x00prompt_len=16000\xff")
    assert torch.equal(sink.tensor("r1"), src)
    assert sink.hashes("r1") == list(range(1000))
    assert sink.done["r1"] == b"\x00prompt_len=16000\xff"
    assert [kv.shape[2] for _, kv in sink.held["r1"]] == [25] * 40  # one on_blocks per group, in order
    assert sink.traceparents == ["00-tp"] * 40
    assert sent == client.bytes_sent - len(pack({"kind": "done", "rid": "r1", "payload": sink.done["r1"]}))
    assert sent > src.numel() * 2
    assert server.in_flight == {next(iter(server.in_flight)): []}


async def test_many_requests_multiplexed_on_one_connection(kv_pair) -> None:
    sink, _, client = kv_pair
    srcs = {
        f"r{i}": blocks(40, seed=i, dtype=dt)
        for i, dt in enumerate([torch.float16, torch.bfloat16, torch.float32])
    }

    async def stream(rid: str, src: torch.Tensor) -> None:
        for i in range(0, 40, 4):
            await client.send_blocks(rid, list(range(i, i + 4)), src[:, :, i : i + 4])
            await asyncio.sleep(0)
        await client.finish(rid)

    await asyncio.gather(*(stream(rid, src) for rid, src in srcs.items()))
    for rid, src in srcs.items():
        got = sink.tensor(rid)
        assert got.dtype == src.dtype and torch.equal(got, src)


async def test_unix_fast_path_and_large_groups_split_by_layer(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(kv_client, "SUBFRAME_BYTES", 3000)  # force many sub-frames per group
    sink = MemorySink()
    server = await start_kv_server(f"unix://{tmp_path}/kv.sock", SECRET, sink)
    assert server.address == f"unix://{tmp_path}/kv.sock"
    client = await open_kv_client(server.address, SECRET)
    try:
        src = blocks(3)  # 4 layers x 6 KiB: one sub-frame per layer
        await client.send_blocks("u", [7, 8, 9], src)
        await client.finish("u")
        assert torch.equal(sink.tensor("u"), src) and sink.hashes("u") == [7, 8, 9]
        assert len(sink.held["u"]) == 1 and sink.done["u"] == b""  # the sub-frames land as one group
    finally:
        await client.close()
        await server.close()
    assert not (tmp_path / "kv.sock").exists()


async def test_wrong_secret_is_refused() -> None:
    sink = MemorySink()
    server = await start_kv_server("tcp://127.0.0.1:0", SECRET, sink)
    try:
        with pytest.raises(KVTransferError, match="authentication failed"):
            await open_kv_client(server.address, "not-the-secret", timeout=5)
        with pytest.raises(KVTransferError):
            await open_kv_client("tcp://127.0.0.1:1", SECRET, timeout=5)  # nobody listens
        # A server with another secret: the client refuses to stream to it (mutual auth).
        impostor = await start_kv_server("tcp://127.0.0.1:0", "other", MemorySink())
        try:
            with pytest.raises(KVTransferError):
                await open_kv_client(impostor.address, SECRET, timeout=5)
        finally:
            await impostor.close()
        assert server.in_flight == {}
    finally:
        await server.close()


async def test_silent_peer_is_dropped_after_handshake_timeout(monkeypatch, caplog) -> None:
    monkeypatch.setattr(kv_server, "AUTH_TIMEOUT_S", 0.2)
    server = await start_kv_server("tcp://127.0.0.1:0", SECRET, MemorySink())
    try:
        reader, writer = await asyncio.open_connection(*server.address[6:].rsplit(":", 1))
        async with asyncio.timeout(3):  # bounds a hang only: the server must hang up by itself
            got = await reader.read()  # all the server sends us until EOF; we never answer
        writer.close()
        (n,) = PREFIX.unpack(got[: PREFIX.size])
        assert msgpack.unpackb(got[PREFIX.size :])["kind"] == "hello" and len(got) == PREFIX.size + n
        assert "handshake timeout" in caplog.text  # dropped for its silence, not for something else
        await until(lambda: server.in_flight == {})  # and forgotten
    finally:
        await server.close()


async def _raw_authenticated(address: str):
    """A hand-rolled sender: real handshake, then frames we build ourselves (to inject faults)."""
    stream = await transport_for(address).connect(address)
    await client_handshake(stream, SECRET.encode())
    return stream


def _blocks_frame(rid: str, kv: torch.Tensor, seq: int = 0) -> tuple[dict, bytearray]:
    """A valid single-frame group, as KVClient would send it: header and payload."""
    payload = bytearray(byte_view(kv))
    header = {
        "kind": "blocks",
        "rid": rid,
        "seq": seq,
        "hashes": list(range(kv.shape[2])),
        "layers": [0, L],
        "dtype": "float16",
        "shape": list(kv.shape),
        "nbytes": len(payload),
        "csum": ["xxh3", checksum("xxh3", payload)],
        "tp": None,
    }
    return header, payload


async def test_flipped_byte_is_detected_and_reported(kv_pair) -> None:
    # Fault injection: a raw client speaks the protocol but corrupts one payload byte after
    # computing the checksum over the original bytes.
    sink, server, client = kv_pair
    stream = await _raw_authenticated(server.address)
    try:
        header, payload = _blocks_frame("bad", blocks(2))
        payload[1234] ^= 0x01
        await stream.send(pack(header), payload)
        reply = await asyncio.wait_for(read_header(stream, 1 << 20), 5)
        assert reply["kind"] == "error" and reply["rid"] == "bad" and "checksum mismatch" in reply["reason"]
        assert sink.aborts == [("bad", reply["reason"])] and "bad" not in sink.held
        # The connection stays usable, and the rid's later frames are discarded; done repeats the error.
        await stream.send(pack({**header, "seq": 1, "csum": ["xxh3", checksum("xxh3", payload)]}), payload)
        await stream.send(pack({"kind": "done", "rid": "bad", "payload": b""}))
        reply = await asyncio.wait_for(read_header(stream, 1 << 20), 5)
        assert reply["kind"] == "error" and "checksum mismatch" in reply["reason"]
        assert "bad" not in sink.held and "bad" not in sink.done
    finally:
        stream.close()
    # The same fault through KVClient: its finish() raises with the receiver's reason.
    real_send = client._stream.send

    async def corrupting_send(*bufs, **kw):
        if len(bufs) == 2:
            bad = bytearray(bufs[1])
            bad[-1] ^= 0x80
            bufs = (bufs[0], bad)
        await real_send(*bufs, **kw)

    client._stream.send = corrupting_send
    await client.send_blocks("bad2", [1, 2], blocks(2))
    client._stream.send = real_send
    with pytest.raises(KVTransferError, match="checksum mismatch"):
        await client.finish("bad2", timeout=5)
    with pytest.raises(KVTransferError):  # an errored rid cannot be continued
        await client.send_blocks("bad2", [3], blocks(1))
    await client.send_blocks("good", [1], blocks(1))  # others are unaffected
    await client.finish("good", timeout=5)


@pytest.mark.parametrize(
    "payload",
    [b"", bytes(range(256)), msgpack.packb({"prompt_ids": [1, 2], "first_token": 3}), b"x" * 70000],
    ids=["empty", "every-byte-value", "msgpack-map", "70kB"],
)
async def test_done_payload_reaches_on_done_as_is(kv_pair, payload: bytes) -> None:
    sink, _, client = kv_pair
    await client.send_blocks("p", [1], blocks(1))
    await client.finish("p", payload=payload)
    assert sink.done == {"p": payload} and type(sink.done["p"]) is bytes


async def test_bad_payload_is_refused_before_sending_and_loses_nothing() -> None:
    sink = MemorySink()
    server = await start_kv_server("tcp://127.0.0.1:0", SECRET, sink, max_header_bytes=1024)
    client = await open_kv_client(server.address, SECRET)
    try:
        await client.send_blocks("r", [1], blocks(1))
        await client.send_blocks("other", [2], blocks(2, seed=1)[:, :, 1:])
        sent = client.bytes_sent
        with pytest.raises(TypeError, match="payload must be bytes, not dict"):
            await client.finish("r", payload={"prompt_ids": [1]})
        with pytest.raises(TypeError, match="payload must be bytes, not str"):
            await client.finish("r", payload="text")
        # 997 bytes make a 1025-byte done header: one over the receiver's limit.
        with pytest.raises(KVTransferError, match="1025-byte header, over the receiver's limit of 1024"):
            await client.finish("r", payload=b"x" * 997)
        assert client.bytes_sent == sent and not client.closed  # nothing went out
        assert sink.aborts == [] and sink.done == {}
        # The request is still open: it finishes with a payload that exactly fits, the other too.
        await client.finish("r", payload=b"x" * 996)
        await client.finish("other")
        assert sink.done == {"r": b"x" * 996, "other": b""} and sink.aborts == []
        assert torch.equal(sink.tensor("r"), blocks(1)) and sink.hashes("other") == [2]
    finally:
        await client.close()
        await server.close()


@pytest.mark.parametrize(
    ("kind", "bad", "why"),
    [
        ("done", {"payload": {"prompt_ids": [1]}}, "done frame: bad or missing 'payload'"),
        ("done", {"payload": "text"}, "done frame: bad or missing 'payload'"),
        ("done", {"payload": None, "meta": {}}, "done frame: bad or missing 'payload'"),
        ("blocks", {"tp": 5}, "blocks frame: tp must be a string or nil"),
    ],
    ids=["done-payload-map", "done-payload-str", "done-payload-nil", "blocks-tp-int"],
)
async def test_bad_header_field_drops_only_its_connection(
    kv_pair, caplog, kind: str, bad: dict, why: str
) -> None:
    # Fault injection: a raw sender puts a field of the wrong type in a header KVClient builds right.
    sink, server, client = kv_pair
    await client.send_blocks("ok", [1], blocks(1))  # another sender's request, in flight meanwhile
    stream = await _raw_authenticated(server.address)
    try:
        header, payload = _blocks_frame("raw", blocks(1))
        await stream.send(pack(header), payload)
        if kind == "done":
            await stream.send(pack({"kind": "done", "rid": "raw", "payload": b"", **bad}))
        else:
            header, payload = _blocks_frame("raw", blocks(1), seq=1)
            await stream.send(pack({**header, **bad}), payload)
        with pytest.raises(ConnectionError):  # dropped, not answered
            await asyncio.wait_for(read_header(stream, 1 << 20), 5)
    finally:
        stream.close()
    assert why in caplog.text
    await until(lambda: sink.aborts)
    assert [rid for rid, _ in sink.aborts] == ["raw"] and "raw" not in sink.held and "raw" not in sink.done
    await client.finish("ok", payload=b"fine")  # the other connection is unaffected
    assert sink.done == {"ok": b"fine"} and torch.equal(sink.tensor("ok"), blocks(1))


async def test_sink_rejection_fails_the_senders_finish() -> None:
    sink = MemorySink(reject_at=1)
    server = await start_kv_server("tcp://127.0.0.1:0", SECRET, sink)
    client = await open_kv_client(server.address, SECRET)
    try:
        await client.send_blocks("r", [1], blocks(1))
        await client.send_blocks("r", [2], blocks(1))  # rejected by the sink
        with pytest.raises(KVTransferError, match="pool full"):
            await client.finish("r", timeout=5)
        assert [rid for rid, _ in sink.aborts] == ["r"] and "r" not in sink.held
        assert client._rids == {}
    finally:
        await client.close()
        await server.close()


async def test_abort_mid_stream_frees_both_sides(kv_pair) -> None:
    sink, server, client = kv_pair
    src = blocks(200)

    async def producer() -> None:
        for i in range(200):
            await client.send_blocks("a", [i], src[:, :, i : i + 1])
            await asyncio.sleep(0.001)

    task = asyncio.create_task(producer())
    await until(lambda: len(sink.held.get("a", [])) >= 5)
    await client.abort("a", "relay finished first")
    with pytest.raises(KVTransferError, match="aborted"):
        await asyncio.wait_for(task, 5)  # the producer's next send raises: it stops sending
    await until(lambda: sink.aborts)
    assert sink.aborts == [("a", "aborted by sender: relay finished first")]
    assert "a" not in sink.held and "a" not in sink.done
    assert client._rids == {}
    await until(lambda: all(not rids for rids in server.in_flight.values()))
    with pytest.raises(KVTransferError, match="aborted"):
        await client.finish("a")


async def test_receiver_vanishing_fails_pending_calls_within_timeout() -> None:
    sink = MemorySink()
    server = await start_kv_server("tcp://127.0.0.1:0", SECRET, sink)
    client = await open_kv_client(server.address, SECRET)

    in_done = asyncio.Event()

    async def never_done(rid: str, payload: bytes) -> None:
        in_done.set()
        await asyncio.sleep(3600)  # the stimulus: a receiver that never answers

    sink.on_done = never_done
    try:
        await client.send_blocks("v", [1], blocks(1))
        pending = asyncio.create_task(client.finish("v", timeout=30))
        await asyncio.wait_for(in_done.wait(), 5)  # the request is in flight at the receiver
        t0 = time.perf_counter()
        await server.close()  # the receiver goes away with the request in flight
        with pytest.raises(KVTransferError):
            await asyncio.wait_for(pending, 5)
        assert time.perf_counter() - t0 < 1  # well inside finish()'s own 30 s timeout
        assert client.closed
        with pytest.raises(KVTransferError):
            await client.send_blocks("w", [1], blocks(1))
        assert sink.aborts and sink.aborts[0][0] == "v"
    finally:
        await client.close()


async def test_sender_vanishing_aborts_its_requests_after_the_grace(kv_pair) -> None:
    sink, server, client = kv_pair
    server.reconnect_grace = 0.2
    await client.send_blocks("x", [1], blocks(1))
    await client.send_blocks("y", [1], blocks(1))
    await until(lambda: len(sink.held) == 2)
    client._stream.abort()  # the sender's socket dies without a goodbye
    await until(lambda: len(sink.aborts) == 2)
    assert sorted(sink.aborts) == [("x", "connection lost"), ("y", "connection lost")] and not sink.held


async def test_finish_times_out_when_the_receiver_hangs(kv_pair) -> None:
    sink, _, client = kv_pair

    async def slow_done(rid: str, payload: bytes) -> None:
        await asyncio.sleep(3600)  # the stimulus: a receiver that hangs

    sink.on_done = slow_done
    t0 = time.perf_counter()
    with pytest.raises(KVTransferError, match="no ack"):
        await client.finish("slow", timeout=0.3)
    assert 0.25 < time.perf_counter() - t0 < 2


async def test_send_blocks_times_out_when_the_receiver_stops_reading(kv_pair) -> None:
    """A send that waits on a full socket, and one queued behind it, each give up at their own
    deadline (no timer is armed while nothing waits, so this is where the timeouts live)."""
    sink, _, client = kv_pair
    stuck = asyncio.Event()

    async def stuck_sink(rid: str, hashes: list[int], kv: torch.Tensor, traceparent: str | None) -> None:
        stuck.set()
        await asyncio.sleep(3600)  # the receiver reads nothing more on this connection

    sink.on_blocks = stuck_sink
    await client.send_blocks("a", [1], blocks(1))
    await asyncio.wait_for(stuck.wait(), 5)
    big = blocks(4096)  # 32 MiB: more than the socket buffers hold
    blocked = asyncio.create_task(client.send_blocks("b", list(range(4096)), big, timeout=1.5))
    await until(lambda: client._wlock.locked())  # "b" holds the write lock, waiting for room
    # Queued behind "b": its own timeout, not the channel failing when "b" gives up.
    with pytest.raises(KVTransferError, match=r"send_blocks\(c\): timed out after 0.3s"):
        await asyncio.wait_for(client.send_blocks("c", [1], blocks(1), timeout=0.3), 5)
    with pytest.raises(KVTransferError, match=r"send_blocks\(b\): timed out after 1.5s"):
        await asyncio.wait_for(blocked, 5)
    assert client.closed  # a frame cut short leaves the stream unusable


async def test_oversized_header_and_frame_drop_the_connection() -> None:
    sink = MemorySink()
    server = await start_kv_server(
        "tcp://127.0.0.1:0", SECRET, sink, max_frame_bytes=64 << 10, max_header_bytes=1024
    )
    try:
        stream = await _raw_authenticated(server.address)
        await stream.send(PREFIX.pack(1 << 30))  # a 1 GiB header
        with pytest.raises(ConnectionError):
            await asyncio.wait_for(read_header(stream, 1 << 20), 5)
        stream.close()

        stream = await _raw_authenticated(server.address)
        shape = [L, 2, 64, BS, H, D]  # 512 KiB > 64 KiB limit
        header = {
            "kind": "blocks",
            "rid": "big",
            "seq": 0,
            "hashes": list(range(64)),
            "layers": [0, L],
            "dtype": "float16",
            "shape": shape,
            "nbytes": 512 << 10,
            "csum": ["xxh3", 0],
            "tp": None,
        }
        await stream.send(pack(header))
        with pytest.raises(ConnectionError):
            await asyncio.wait_for(read_header(stream, 1 << 20), 5)
        stream.close()
        # KVClient knows the receiver's limit and refuses locally instead of being dropped.
        client = await open_kv_client(server.address, SECRET)
        try:
            with pytest.raises(KVTransferError, match="frame limit"):
                await client.send_blocks("big", list(range(64)), torch.zeros(shape, dtype=torch.float16))
        finally:
            await client.close()
        assert not sink.held
    finally:
        await server.close()


async def test_receive_buffers_are_recycled_once_released() -> None:
    sink = MemorySink()
    server = await start_kv_server("tcp://127.0.0.1:0", SECRET, sink)
    client = await open_kv_client(server.address, SECRET)
    try:
        big = torch.ones(L, 2, 64, BS, H, D, dtype=torch.float16)  # 512 KiB: pooled size
        for i in range(3):
            await client.send_blocks(f"b{i}", list(range(64)), big)
            await client.finish(f"b{i}")
            kept = sink.held.pop(f"b{i}")  # the sink lets go...
            assert torch.equal(kept[0][1], big)
            del kept
        assert server.buffers.allocated == 1 and server.buffers.reused == 2  # ...so memory is reused
        await client.send_blocks("keep", list(range(64)), big)
        await client.send_blocks("keep", list(range(64)), big * 2)
        await client.finish("keep")
        held = sink.held["keep"]  # kept by the sink: never overwritten
        assert torch.equal(held[0][1], big) and torch.equal(held[1][1], big * 2)
    finally:
        await client.close()
        await server.close()
