"""The KV bulk channel against hostile or misconfigured peers, over real sockets: mutual TLS,
the HMAC secret inside it, headers that do not match the receiver's model, and the caps on
what a sender can make the receiver hold."""

from __future__ import annotations

import asyncio
import logging
import ssl
from dataclasses import replace

import pytest
import torch

from shared.kv import KVTransferError, open_kv_client, start_kv_server
from shared.kv.auth import client_handshake
from shared.kv.caps import ReceiveCaps
from shared.kv.checksum import checksum
from shared.kv.frame import pack, read_header
from shared.kv.transport import transport_for
from shared.security import Pki, client_context, server_context
from tests.polling import until

from .test_kv_channel import BS, SECRET, D, H, L, MemorySink, blocks

MiB = 1 << 20
BLOCK_BYTES = L * 2 * BS * H * D * 2  # one float16 block: 8 KiB


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Pki:
    pki = Pki(tmp_path_factory.mktemp("pki"))
    pki.ensure(["receiver", "sender"], ["127.0.0.1"])
    return pki


@pytest.fixture(scope="module")
def foreign(tmp_path_factory) -> Pki:
    """Another CA, issuing the same names: what an outsider could make for itself."""
    pki = Pki(tmp_path_factory.mktemp("foreign"))
    pki.ensure(["receiver", "sender"], ["127.0.0.1"])
    return pki


def no_cert_context(pki: Pki) -> ssl.SSLContext:
    """A TLS 1.3 client that trusts our CA but presents no certificate."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.load_verify_locations(pki.ca_cert)
    return ctx


def rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("VmRSS:"))


def untouched(sink: MemorySink) -> bool:
    return not sink.held and not sink.done and not sink.aborts and not sink.groups


async def test_tls_carries_kv_bit_exact_and_neither_side_speaks_plaintext(pki) -> None:
    sink = MemorySink()
    server = await start_kv_server(
        "tcp://127.0.0.1:0", SECRET, sink, ssl=server_context(pki.identity("receiver"))
    )
    plain = await start_kv_server("tcp://127.0.0.1:0", SECRET, MemorySink())
    tls = client_context(pki.identity("sender"))
    try:
        client = await open_kv_client(server.address, SECRET, ssl=tls)
        assert client.checksum == "none"  # the records' AES-GCM tags prove the bytes instead
        src = blocks(300)  # several sub-frames and many TLS records
        await client.send_blocks("r1", list(range(300)), src)
        await client.finish("r1", payload=b"p")
        await client.close()
        assert torch.equal(sink.tensor("r1"), src) and sink.done == {"r1": b"p"}
        with pytest.raises(KVTransferError):  # a plaintext sender gets nothing from a TLS receiver
            await open_kv_client(server.address, SECRET, timeout=5)
        with pytest.raises(KVTransferError):  # and a TLS sender does not stream to a plaintext one
            await open_kv_client(plain.address, SECRET, ssl=tls, timeout=5)
    finally:
        await server.close()
        await plain.close()


@pytest.mark.parametrize("who", ["no certificate", "another CA"])
async def test_sender_without_our_certificate_is_refused_before_any_sink_call(
    pki, foreign, caplog, who
) -> None:
    caplog.set_level(logging.INFO, logger="shared.kv")  # a sender with no certificate is no attack
    sink = MemorySink()
    server = await start_kv_server(
        "tcp://127.0.0.1:0", SECRET, sink, ssl=server_context(pki.identity("receiver"))
    )
    outsider = foreign.identity(
        "sender"
    )  # it trusts our CA (so it accepts the receiver); its cert is foreign
    ctx = (
        no_cert_context(pki) if who == "no certificate" else client_context(replace(outsider, ca=pki.ca_cert))
    )
    try:
        with pytest.raises(KVTransferError):
            # TLS 1.3 completes the client's side first: the refusal may surface on the first read.
            client = await open_kv_client(server.address, SECRET, ssl=ctx, timeout=5)
            await client.send_blocks("r1", [1], blocks(1))
            await client.finish("r1", timeout=5)
        why = "no client certificate" if who == "no certificate" else "unknown CA"
        await until(
            lambda: "refused 127.0.0.1:" in caplog.text and why in caplog.text
        )  # once the alert is out
        assert untouched(sink) and server.in_flight == {}
    finally:
        await server.close()


async def test_receiver_with_a_foreign_certificate_gets_no_kv(pki, foreign) -> None:
    sink = MemorySink()
    impostor = await start_kv_server(
        "tcp://127.0.0.1:0", SECRET, sink, ssl=server_context(foreign.identity("receiver"))
    )
    try:
        with pytest.raises(KVTransferError, match="certificate verify failed"):
            await open_kv_client(
                impostor.address, SECRET, ssl=client_context(pki.identity("sender")), timeout=5
            )
        assert untouched(sink)
    finally:
        await impostor.close()


async def test_old_default_secret_is_refused_inside_tls(pki, caplog) -> None:
    sink = MemorySink()
    server = await start_kv_server(
        "tcp://127.0.0.1:0", "a-real-secret", sink, ssl=server_context(pki.identity("receiver"))
    )
    try:  # a valid certificate does not replace the secret: both must hold
        with pytest.raises(KVTransferError, match="authentication failed"):
            await open_kv_client(server.address, "pdd-dev-secret", ssl=client_context(pki.identity("sender")))
        assert "authentication failed" in caplog.text and untouched(sink)
    finally:
        await server.close()


@pytest.mark.parametrize(
    "dtype, head_dim", [(torch.bfloat16, D), (torch.float16, 2 * D)], ids=["dtype", "shape"]
)
async def test_group_of_another_model_is_refused_before_its_buffer_exists(dtype, head_dim) -> None:
    sink = MemorySink()
    expect = (torch.float16, (L, 2, BS, H, D))
    server = await start_kv_server("tcp://127.0.0.1:0", SECRET, sink, expect=expect)
    client = await open_kv_client(server.address, SECRET)
    try:
        wrong = torch.ones(L, 2, 1024 * D // head_dim, BS, H, head_dim, dtype=dtype)  # 64 MiB, 16 MiB frames
        before = rss()
        with pytest.raises(KVTransferError, match="receiver's model"):
            await client.send_blocks("bad", list(range(wrong.shape[2])), wrong)
            await client.finish("bad")
        assert rss() - before < 10 * MiB  # discarded through a small scratch buffer, never landed
        assert server.buffers.allocated == 0 and not sink.held and sink.aborts[0][0] == "bad"
        await client.send_blocks("good", [1, 2], blocks(2))  # the model's own blocks still pass
        await client.finish("good")
        assert sink.hashes("good") == [1, 2]
    finally:
        await client.close()
        await server.close()


async def _raw_sender(address: str):
    """A hand-rolled sender that passes the handshake, then sends the frames we build."""
    stream = await transport_for(address).connect(address)
    await client_handshake(stream, SECRET.encode())
    return stream


def _group_start(rid: str, shape: list[int]) -> dict:
    """The first sub-frame of a group, carrying no bytes: all it takes to make a receiver reserve it."""
    return {
        "kind": "blocks",
        "rid": rid,
        "seq": 0,
        "hashes": list(range(shape[2])),
        "layers": [0, 0],
        "dtype": "float16",
        "shape": shape,
        "nbytes": 0,
        "csum": ["xxh3", checksum("xxh3", b"")],
        "tp": None,
    }


async def _refusal(stream, rid: str) -> str:
    h = await asyncio.wait_for(read_header(stream, 1 << 20), 5)
    assert h["kind"] == "error" and h["rid"] == rid, h
    return h["reason"]


async def test_header_announcing_4_gib_is_refused_without_reserving_it() -> None:
    sink = MemorySink()
    server = await start_kv_server("tcp://127.0.0.1:0", SECRET, sink)  # default caps
    stream = await _raw_sender(server.address)
    try:
        before = rss()
        header = _group_start("huge", [16, 2, 8, 4096, 16, 128])  # 4 GiB of float16, ~100 bytes
        await stream.send(pack(header))
        assert "would pass its cap" in await _refusal(stream, "huge")
        assert server.inflight.bytes == 0 and server.buffers.allocated == 0
        assert rss() - before < 10 * MiB and not sink.held
        # The connection stays usable for a group that fits.
        kv = blocks(1)
        payload = bytes(kv.reshape(-1).view(torch.uint8).numpy())
        ok = {**_group_start("ok", list(kv.shape)), "layers": [0, L], "nbytes": len(payload)}
        await stream.send(pack({**ok, "csum": ["xxh3", checksum("xxh3", payload)]}), payload)
        await until(lambda: "ok" in sink.held)
        assert torch.equal(sink.tensor("ok"), kv)
    finally:
        stream.close()
        await server.close()


async def test_caps_on_bytes_groups_and_connections_refuse_and_release(caplog) -> None:
    caps = ReceiveCaps(
        connections=2, inflight_bytes=3 * MiB, conn_inflight_bytes=2 * MiB, groups=3, conn_groups=2
    )
    sink = MemorySink()
    server = await start_kv_server("tcp://127.0.0.1:0", SECRET, sink, caps=caps)
    n = MiB // BLOCK_BYTES  # blocks in 1 MiB
    a = await _raw_sender(server.address)
    b = await _raw_sender(server.address)
    try:
        with pytest.raises(KVTransferError):  # a third connection is closed at once
            await open_kv_client(server.address, SECRET, timeout=5)
        assert "connections open (cap)" in caplog.text
        await a.send(pack(_group_start("a1", [L, 2, n + n // 2, BS, H, D])))  # 1.5 MiB: fits
        await a.send(pack(_group_start("a2", [L, 2, n, BS, H, D])))  # 2.5 MiB on a: over
        assert "this connection would pass its cap" in await _refusal(a, "a2")
        await a.send(pack(_group_start("a3", [L, 2, 1, BS, H, D])))  # fits
        await a.send(pack(_group_start("a4", [L, 2, 1, BS, H, D])))  # a third group on a
        assert "this connection already receives 2 groups" in await _refusal(a, "a4")
        await b.send(pack(_group_start("b1", [L, 2, n + n // 2, BS, H, D])))  # 3 MiB in all: over
        assert "this receiver would pass its cap" in await _refusal(b, "b1")
        await b.send(pack(_group_start("b2", [L, 2, 1, BS, H, D])))  # the third group: fits
        await b.send(pack(_group_start("b3", [L, 2, 1, BS, H, D])))
        assert "this receiver already receives 3 groups" in await _refusal(b, "b3")
        await a.send(pack({"kind": "abort", "rid": "a1", "reason": "gone"}))  # frees 1.5 MiB
        await until(lambda: server.inflight.groups == 2)  # (another connection: wait for it)
        await a.send(pack(_group_start("a5", [L, 2, n, BS, H, D])))  # now fits on a, and in all
        await until(lambda: server.inflight.bytes == MiB + 2 * BLOCK_BYTES and server.inflight.groups == 3)
    finally:
        a.close()
        b.close()
    await until(lambda: server.inflight.bytes == 0 and server.inflight.groups == 0)  # all given back
    await server.close()
    assert not sink.held
