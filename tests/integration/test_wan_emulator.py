"""The WAN emulator as a real TCP proxy: delay, bandwidth cap, runtime control, cut and restore."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
import torch

from shared.kv import KVTransferError, open_kv_client, start_kv_server
from shared.ports import free_port
from shared.wan import WanControl, WanEmulator, WanLink


async def _echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
        writer.write(b"<eof>")  # we saw the client's half-close
        await writer.drain()
    except ConnectionError:
        pass
    finally:
        writer.close()


@pytest.fixture
async def echo_wan():
    server = await asyncio.start_server(_echo, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    wan = WanEmulator([WanLink("echo", f"127.0.0.1:{free_port()}", f"127.0.0.1:{port}")])
    await wan.start()
    try:
        yield wan, WanControl(wan.control_url), wan.links["echo"].listen_port
    finally:
        await wan.stop()
        server.close()


async def _rtt(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int = 5) -> float:
    samples = []
    for _ in range(n):
        t0 = time.perf_counter()
        writer.write(b"x")
        await writer.drain()
        await asyncio.wait_for(reader.readexactly(1), 5)
        samples.append(time.perf_counter() - t0)
    return min(samples)  # every sample carries the delay; a stall of the busy box only adds to some


async def test_delay_is_added_per_direction_and_changes_at_runtime(echo_wan) -> None:
    wan, ctl, port = echo_wan
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        await ctl.set("echo", delay_ms=20)
        assert 0.039 <= await _rtt(reader, writer) < 0.060  # 2 x 20 ms, +- timer slop on a busy box
        await ctl.set("echo", delay_ms=5)
        assert 0.009 <= await _rtt(reader, writer) < 0.030
        writer.write_eof()  # half-close crosses the proxy too
        assert await asyncio.wait_for(reader.read(), 5) == b"<eof>"
        state = (await ctl.get())["echo"]
        assert state["delay_ms"] == 5 and state["bytes_up"] == 10 and state["bytes_down"] == 15
        assert state["connections"] == 1
    finally:
        writer.close()


async def test_bandwidth_cap() -> None:
    got: dict[str, float] = {}
    finished = asyncio.Event()

    async def count(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        n = 0
        while data := await reader.read(1 << 16):
            n += len(data)
        got["bytes"], got["t"] = n, time.perf_counter()
        finished.set()
        writer.close()

    server = await asyncio.start_server(count, "127.0.0.1", 0)
    link = WanLink(
        "one-way", "127.0.0.1:0", f"127.0.0.1:{server.sockets[0].getsockname()[1]}", bandwidth_mbps=20
    )
    wan = WanEmulator([link], control=None)
    await wan.start()
    try:
        payload = b"z" * 2_000_000  # 0.8 s at 20 Mbit/s
        reader, writer = await asyncio.open_connection("127.0.0.1", link.listen_port)
        t0 = time.perf_counter()
        writer.write(payload)
        writer.write_eof()
        await asyncio.wait_for(reader.read(), 10)
        writer.close()
        await asyncio.wait_for(finished.wait(), 5)
        mbps = got["bytes"] * 8 / (got["t"] - t0) / 1e6
        assert got["bytes"] == len(payload) and 16 <= mbps <= 21, (
            mbps
        )  # the cap holds; a stalled read only lowers
    finally:
        await wan.stop()
        server.close()


async def test_control_api_errors(echo_wan) -> None:
    wan, ctl, _ = echo_wan
    with pytest.raises(httpx.HTTPStatusError) as e:
        await ctl.set("nope", delay_ms=1)
    assert e.value.response.status_code == 404
    with pytest.raises(httpx.HTTPStatusError) as e:
        await ctl.set("echo", delay_ms=-1)
    assert e.value.response.status_code == 400
    with pytest.raises(httpx.HTTPStatusError) as e:
        await ctl.set("echo", cut=True, cut_mode="sideways")
    assert e.value.response.status_code == 400
    assert (await ctl.get())["echo"]["cut"] is False


# Raw bodies: JSON's Infinity/NaN extensions are what a client's float('inf') turns into.
BAD_BODIES = {
    b'{"delay_ms": Infinity}': "delay_ms",
    b'{"delay_ms": NaN}': "delay_ms",
    b'{"delay_ms": 1e308}': "delay_ms",
    b'{"delay_ms": -1}': "delay_ms",
    b'{"jitter_ms": -Infinity}': "jitter_ms",
    b'{"jitter_ms": 60001}': "jitter_ms",
    b'{"bandwidth_mbps": Infinity}': "bandwidth_mbps",
    b'{"bandwidth_mbps": -5}': "bandwidth_mbps",
    b'{"bandwidth_mbps": 1e7}': "bandwidth_mbps",
    b'{"delay_ms": "20"}': "delay_ms",  # a string, not a number
    b'{"delay_ms": true}': "delay_ms",
    b'{"delay_ms": null}': "delay_ms",  # only bandwidth has a null (unlimited)
    b'{"cut": "yes"}': "cut",
    b'{"cut": true, "cut_mode": "sideways"}': "cut_mode",
    b'{"delay": 20}': "delay",  # a misspelt key would otherwise change nothing, silently
    b'{"delay_ms": 20, "bandwidth_mbps": NaN}': "bandwidth_mbps",  # all or nothing
    b"[20]": "body",
    b"delay_ms=20": "body",
}


async def test_bad_control_values_get_400_and_change_nothing(echo_wan) -> None:
    wan, ctl, port = echo_wan
    before = await ctl.set("echo", delay_ms=3, jitter_ms=1, bandwidth_mbps=100)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        async with httpx.AsyncClient(base_url=ctl.base_url, timeout=5) as http:
            for body, field in BAD_BODIES.items():
                r = await http.post("/links/echo", content=body, headers={"content-type": "application/json"})
                assert r.status_code == 400, (body, r.status_code, r.text)
                assert field in r.json()["detail"], (body, r.text)
                state = (await ctl.get())["echo"]
                assert {k: state[k] for k in ("delay_ms", "jitter_ms", "bandwidth_mbps", "cut")} == {
                    k: before[k] for k in ("delay_ms", "jitter_ms", "bandwidth_mbps", "cut")
                }, body
                writer.write(b"x")  # the link still carries data, with its previous settings
                await writer.drain()
                assert await asyncio.wait_for(reader.readexactly(1), 5) == b"x", body
        assert (await ctl.set("echo", bandwidth_mbps=None))["bandwidth_mbps"] is None  # null = unlimited
        assert (await ctl.set("echo", bandwidth_mbps=0))["bandwidth_mbps"] == 0  # so is 0
    finally:
        writer.close()


async def test_cut_drop_resets_and_refuses_then_restore(echo_wan) -> None:
    wan, ctl, port = echo_wan
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    await _rtt(reader, writer, 1)
    await ctl.set("echo", cut=True, cut_mode="drop")
    with pytest.raises((ConnectionError, asyncio.IncompleteReadError)):
        for _ in range(3):
            writer.write(b"x")
            await writer.drain()
            await asyncio.wait_for(reader.readexactly(1), 2)
    writer.close()
    with pytest.raises(ConnectionRefusedError):
        await asyncio.open_connection("127.0.0.1", port)
    assert (await ctl.get())["echo"]["cut_mode"] == "drop"
    await ctl.set("echo", cut=False)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    assert await _rtt(reader, writer, 1) < 1
    writer.close()


async def test_cut_blackhole_holds_everything_until_restore(echo_wan) -> None:
    wan, ctl, port = echo_wan
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    await _rtt(reader, writer, 1)
    await ctl.set("echo", cut=True, cut_mode="blackhole")
    writer.write(b"held")
    await writer.drain()
    r2, w2 = await asyncio.open_connection("127.0.0.1", port)  # a new connection hangs silently
    w2.write(b"new")
    await w2.drain()
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(reader.readexactly(4), 0.3)
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(r2.readexactly(3), 0.1)
    await ctl.set("echo", cut=False)
    assert await asyncio.wait_for(reader.readexactly(4), 5) == b"held"
    assert await asyncio.wait_for(r2.readexactly(3), 5) == b"new"
    writer.close()
    w2.close()


class _Sink:
    async def on_blocks(self, rid, hashes, kv, traceparent) -> None:
        pass

    async def on_done(self, rid, payload) -> None:
        pass

    async def on_abort(self, rid, reason) -> None:
        pass


async def test_kv_channel_over_a_cut_wan_fails_within_its_timeout() -> None:
    server = await start_kv_server("tcp://127.0.0.1:0", "s", _Sink())
    link = WanLink("bulk", f"127.0.0.1:{free_port()}", server.address.removeprefix("tcp://"), delay_ms=2)
    wan = WanEmulator([link], control=None)
    await wan.start()
    kv = torch.zeros(2, 2, 4, 16, 2, 16, dtype=torch.float16)
    try:
        client = await open_kv_client(f"tcp://{link.listen}", "s")
        await client.send_blocks("r", [1, 2, 3, 4], kv)
        await client.finish("r", timeout=5)
        await link.cut("blackhole")  # silent: only a timeout can tell
        await client.send_blocks("r2", [1, 2, 3, 4], kv)
        t0 = time.perf_counter()
        with pytest.raises(KVTransferError, match="no ack"):
            await client.finish("r2", timeout=0.5)
        assert time.perf_counter() - t0 < 5  # its own timeout, not the channel's 30 s
        await link.restore()
        await client.close()

        client = await open_kv_client(f"tcp://{link.listen}", "s")
        await link.cut("drop")  # reset: every pending call fails at once
        with pytest.raises(KVTransferError):
            await client.send_blocks("r3", [1, 2, 3, 4], kv)
            await client.finish("r3", timeout=5)
        assert client.closed
        with pytest.raises(KVTransferError):
            await open_kv_client(f"tcp://{link.listen}", "s", timeout=2)  # refused while cut
        await client.close()
    finally:
        await wan.stop()
        await server.close()
