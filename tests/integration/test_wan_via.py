"""Dial-on-demand WAN links over real sockets: one emulated line reaches every target its
pattern allows, each named in the client's first line, shaped and cut like any connection;
anything else is refused, so the emulator is never an open proxy."""

from __future__ import annotations

import asyncio
import time

import pytest

from shared.ports import free_port_block
from shared.wan import WanControl, WanEmulator, WanLink, via
from shared.wan.cli import parse_link
from shared.wan.via import ViaPattern, ViaRefused, parse_pattern, parse_via_line, via_line


def test_patterns() -> None:
    assert parse_pattern("*:7400") == ViaPattern("*", 7400, 7400)
    assert parse_pattern("127.0.0.1:7400-7409") == ViaPattern("127.0.0.1", 7400, 7409)
    assert parse_pattern("[::1]:7400-7401") == ViaPattern("[::1]", 7400, 7401)
    assert parse_pattern("md-0:7400") is None and parse_pattern("127.0.0.1:7400") is None  # plain: one target
    for bad in ("*:7409-7400", "*:x", "*:0", "*:70000", "a b:1-2", "*:*"):
        with pytest.raises(ValueError):
            parse_pattern(bad)
    assert str(ViaPattern("*", 7400, 7400)) == "*:7400" and str(ViaPattern("h", 1, 2)) == "h:1-2"


def test_first_lines() -> None:
    ranged, anyhost = ViaPattern("127.0.0.1", 7400, 7409), ViaPattern("*", 7400, 7400)
    assert via_line("10.0.0.7", 7400) == b"PDD-VIA 10.0.0.7:7400\n"
    assert via_line("::1", 7400) == b"PDD-VIA [::1]:7400\n"
    assert parse_via_line(b"PDD-VIA 127.0.0.1:7409", ranged) == ("127.0.0.1", 7409)
    assert parse_via_line(b"PDD-VIA main_decode-2:7400", anyhost) == ("main_decode-2", 7400)
    assert parse_via_line(b"PDD-VIA [::1]:7400", anyhost) == ("::1", 7400)
    refused = [
        b"PDD-VIA 127.0.0.1:7410",  # port outside the range
        b"PDD-VIA 10.0.0.1:7400",  # another host
        b"PDD-VIA 127.0.0.1:7400 x",
        b"PDD-VIA 127.0.0.1",
        b"PDD-VIA a/b:7400",
        b"GET / HTTP/1.1\r",
        b"",
        "PDD-VIA 127.0.0.1:74\u0660\u0660".encode(),  # not ASCII
        b"PDD-VIA " + b"a" * 300 + b":7400",  # too long
    ]
    for line in refused:
        with pytest.raises(ViaRefused):
            parse_via_line(line, ranged)


def test_cli_accepts_patterns() -> None:
    link = parse_link("bulk=127.0.0.1:0>*:7400-7409,delay_ms=5", {})
    assert link.via == ViaPattern("*", 7400, 7409) and link.fixed is None and link.settings.delay_ms == 5
    assert parse_link("bulk=127.0.0.1:0>127.0.0.1:7400", {}).via is None
    with pytest.raises(ValueError):
        parse_link("bulk=127.0.0.1:0>*:7400-", {})


class Targets:
    """Echo servers on consecutive ports; each answers with its own tag first."""

    def __init__(self) -> None:
        self.servers: list[asyncio.Server] = []
        self.accepted: list[int] = []

    async def start(self, n: int) -> int:
        base = free_port_block(n + 1)
        for i in range(n):
            self.servers.append(await asyncio.start_server(self._echo(base + i), "127.0.0.1", base + i))
        return base

    def _echo(self, port: int):
        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            self.accepted.append(port)
            writer.write(f"<{port}>".encode())
            try:
                while data := await reader.read(65536):
                    writer.write(data)
                    await writer.drain()
            except ConnectionError:
                pass
            finally:
                writer.close()

        return serve

    def close(self) -> None:
        for s in self.servers:
            s.close()


@pytest.fixture
async def via_wan():
    targets = Targets()
    base = await targets.start(2)
    link = WanLink("bulk", "127.0.0.1:0", f"127.0.0.1:{base}-{base + 1}", delay_ms=20)
    wan = WanEmulator([link])
    await wan.start()
    try:
        yield wan, link, base, targets
    finally:
        await wan.stop()
        targets.close()


async def _open(link: WanLink, first: bytes) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", link.listen_port)
    writer.write(first)
    await writer.drain()
    return reader, writer


async def _closed(reader: asyncio.StreamReader) -> bool:
    """The emulator closed (or reset) the connection without a byte from any target."""
    try:
        return await asyncio.wait_for(reader.read(), 10) == b""
    except ConnectionResetError:
        return True


async def test_named_targets_are_reached_through_one_shaped_link(via_wan) -> None:
    wan, link, base, targets = via_wan
    for port in (base + 1, base):
        t0 = time.perf_counter()
        reader, writer = await _open(link, via_line("127.0.0.1", port) + b"hello")
        got = await asyncio.wait_for(reader.readexactly(len(f"<{port}>hello")), 5)
        assert got == f"<{port}>hello".encode()  # the line itself is not forwarded
        assert time.perf_counter() - t0 >= 0.039  # 20 ms each way, as on any connection of the link
        writer.close()
    state = (await WanControl(wan.control_url).get())["bulk"]
    assert state["target"] == f"127.0.0.1:{base}-{base + 1}"  # the pattern
    assert (state["connections"], state["refused"]) == (2, 0)
    assert state["bytes_up"] == 10 and state["bytes_down"] == 2 * 5 + 2 * len(f"<{base}>")
    assert sorted(targets.accepted) == [base, base + 1]


@pytest.mark.parametrize(
    "first",
    [
        "other port",  # the port outside the range: the emulator's own free port
        "other host",
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
        b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + bytes(300),  # a TLS ClientHello, no line
        b"PDD-VIA " + b"9" * 400,  # too long
    ],
)
async def test_anything_else_is_refused_and_counted(via_wan, first, monkeypatch) -> None:
    wan, link, base, targets = via_wan
    monkeypatch.setattr(via, "TIMEOUT_S", 60)  # refused for what was sent, not for running out of time
    if first == "other port":
        first = via_line("127.0.0.1", base + 2)
    elif first == "other host":
        first = via_line("localhost", base)
    reader, writer = await _open(link, first)
    assert await _closed(reader)  # at once: a line came, or more bytes than a line may have
    writer.close()
    assert link.refused == 1 and targets.accepted == []


async def test_silence_and_early_close_are_refused_within_the_timeout(via_wan, monkeypatch) -> None:
    wan, link, base, targets = via_wan
    monkeypatch.setattr(via, "TIMEOUT_S", 0.3)  # the real 5 s would only slow the test
    t0 = time.perf_counter()  # before the emulator accepts, where its timer starts
    reader, writer = await _open(link, b"PDD-VIA 127.0.0.1:")  # half a line, then nothing
    assert await _closed(reader)
    assert 0.25 <= time.perf_counter() - t0 < 5
    writer.close()
    reader, writer = await _open(link, b"PDD-VIA 127.0")
    writer.write_eof()  # gone before the line is complete
    assert await _closed(reader)
    writer.close()
    assert link.refused == 2 and targets.accepted == []


async def test_cut_applies_to_dialed_connections(via_wan) -> None:
    wan, link, base, targets = via_wan
    ctl = WanControl(wan.control_url)
    reader, writer = await _open(link, via_line("127.0.0.1", base) + b"a")
    assert await asyncio.wait_for(reader.readexactly(len(f"<{base}>a")), 5) == f"<{base}>a".encode()
    await ctl.set("bulk", cut=True, cut_mode="blackhole")
    writer.write(b"held")
    late_reader, late_writer = await _open(link, via_line("127.0.0.1", base + 1) + b"b")
    with pytest.raises(TimeoutError):  # nothing moves either way, no target is dialed
        await asyncio.wait_for(reader.readexactly(4), 0.3)
    assert targets.accepted == [base]
    await ctl.set("bulk", cut=False)
    assert await asyncio.wait_for(reader.readexactly(4), 5) == b"held"
    want = f"<{base + 1}>b".encode()
    assert await asyncio.wait_for(late_reader.readexactly(len(want)), 5) == want
    await ctl.set("bulk", cut=True, cut_mode="drop")
    assert await _closed(reader) and await _closed(late_reader)
    with pytest.raises(ConnectionError):
        await asyncio.open_connection("127.0.0.1", link.listen_port)
    await ctl.set("bulk", cut=False)
    reader, writer2 = await _open(link, via_line("127.0.0.1", base) + b"c")
    assert await asyncio.wait_for(reader.readexactly(len(f"<{base}>c")), 5) == f"<{base}>c".encode()
    for w in (writer, late_writer, writer2):
        w.close()
    assert link.refused == 0
