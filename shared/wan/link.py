"""One emulated WAN link: a TCP proxy listen -> target with delay, jitter, bandwidth and cut.

Built on asyncio Protocols and loop timers rather than streams: a proxy that must carry
1 Gbit/s in Python cannot afford a task wake-up and two buffer copies per chunk.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import socket
import struct
from dataclasses import asdict, replace
from typing import Literal, get_args

from shared.wan import via
from shared.wan.shaper import LinkSettings, Shaper

log = logging.getLogger(__name__)

CutMode = Literal["drop", "blackhole"]
CUT_MODES: tuple[str, ...] = get_args(CutMode)
TIMER_SLACK_S = 0.0004  # asyncio timers fire ~0.5 ms late on average: aim a little early


def split_hostport(hp: str) -> tuple[str, int]:
    host, _, port = hp.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"expected host:port, got {hp!r}")
    return host.strip("[]"), int(port)


class _Direction:
    """Bytes in flight from one socket to the other, each chunk with its release time."""

    def __init__(self, link: WanLink, shaper: Shaper, counter: str):
        self.link, self.shaper, self.counter = link, shaper, counter
        self.src: _Side | None = None
        self.dst: _Side | None = None
        self.items: collections.deque[tuple[float, bytes]] = collections.deque()
        self.nbytes = 0
        self.last_release = 0.0
        self.timer: asyncio.TimerHandle | None = None
        self.eof = False

    def push(self, data: bytes) -> None:
        loop = asyncio.get_running_loop()
        now = loop.time()
        if data:
            self.last_release = self.shaper.propagate(
                self.shaper.serialize(len(data), now), self.last_release
            )
        else:  # EOF rides the delay line too, behind the data
            self.last_release = max(now + self.shaper.settings.delay_ms / 1000.0, self.last_release)
        self.items.append((self.last_release, data))
        self.nbytes += len(data)
        if self.nbytes >= self.shaper.queue_limit() and self.src is not None:
            self.src.pause_in(self)  # backpressure: the sender's TCP window closes, as on a full link
        self.schedule()

    def schedule(self) -> None:
        if self.timer is not None or not self.items or not self.link.is_open:
            return
        if self.dst is None or self.dst.out_paused:
            return  # resumed by the destination's resume_writing / connection_made
        loop = asyncio.get_running_loop()
        self.timer = loop.call_at(self.items[0][0] - TIMER_SLACK_S, self.flush)

    def flush(self) -> None:
        self.timer = None
        if not self.link.is_open or self.dst is None:
            return
        now = asyncio.get_running_loop().time() + TIMER_SLACK_S
        while self.items and self.items[0][0] <= now and not self.dst.out_paused:
            _, data = self.items.popleft()
            self.nbytes -= len(data)
            if not data:
                self.dst.send_eof()
                continue
            setattr(self.link, self.counter, getattr(self.link, self.counter) + len(data))
            self.dst.transport.write(data)
        if self.src is not None and self.nbytes < self.shaper.queue_limit() // 2:
            self.src.resume_in(self)
        self.schedule()

    def cancel(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None


class _Side(asyncio.Protocol):
    """One socket of a proxied connection: feeds `inbound`, drains `outbound`."""

    def __init__(self, conn: _Conn, inbound: _Direction, outbound: _Direction):
        self.conn, self.inbound, self.outbound = conn, inbound, outbound
        self.transport: asyncio.Transport | None = None
        self.out_paused = False
        self._in_paused_by: set[object] = set()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        sock = transport.get_extra_info("socket")
        with contextlib.suppress(OSError, AttributeError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if not self.conn.link.is_open:
            self.pause_in("cut")

    def data_received(self, data: bytes) -> None:
        self.inbound.push(data)

    def eof_received(self) -> bool:
        self.inbound.push(b"")
        return True  # keep the other half open until our EOF has been delivered

    def connection_lost(self, exc: Exception | None) -> None:
        self.conn.close(reset=exc is not None)

    def pause_writing(self) -> None:
        self.out_paused = True

    def resume_writing(self) -> None:
        self.out_paused = False
        self.outbound.schedule()

    def pause_in(self, why: object) -> None:
        if not self._in_paused_by and self.transport is not None and not self.transport.is_closing():
            self.transport.pause_reading()
        self._in_paused_by.add(why)

    def resume_in(self, why: object) -> None:
        if why in self._in_paused_by:
            self._in_paused_by.discard(why)
            if not self._in_paused_by and self.transport is not None and not self.transport.is_closing():
                self.transport.resume_reading()

    def send_eof(self) -> None:
        if self.transport is not None and not self.transport.is_closing() and self.transport.can_write_eof():
            try:
                self.transport.write_eof()
            except OSError:  # the peer is already gone
                self.conn.close(reset=True)
                return
        self.conn.eofs += 1
        if self.conn.eofs == 2:  # both directions finished
            self.conn.close()


class _ViaSide(_Side):
    """The client socket of a dial-on-demand link: its first line names the target and is
    not forwarded; what follows it is, like any connection's bytes."""

    def __init__(self, conn: _Conn, inbound: _Direction, outbound: _Direction):
        super().__init__(conn, inbound, outbound)
        self.head: bytearray | None = bytearray()  # None once the first line is in
        self.named: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()

    def data_received(self, data: bytes) -> None:
        if self.head is None:
            self.inbound.push(data)
            return
        self.head += data
        end = self.head.find(b"\n", 0, via.MAX_LINE)
        if end < 0 and len(self.head) < via.MAX_LINE:
            return  # more to come
        head, self.head = self.head, None
        if end < 0:  # too long: refused as it is, and nothing more is read
            self.pause_in("via")
            self.named.set_result(bytes(head[: via.MAX_LINE]))
            return
        self.named.set_result(bytes(head[:end]))
        if len(head) > end + 1:
            self.inbound.push(bytes(head[end + 1 :]))

    def eof_received(self) -> bool:
        if self.head is None:
            return super().eof_received()
        self._gone()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._gone()
        super().connection_lost(exc)

    def _gone(self) -> None:
        """The client left before its first line was complete: what came is refused."""
        if self.head is not None:
            head, self.head = self.head, None
            self.named.set_result(bytes(head))

    async def first_line(self) -> bytes:
        """The first line without its newline, due within via.TIMEOUT_S of the link being open
        (a blackhole restarts the clock once restored: nothing could arrive meanwhile)."""
        while True:
            await self.conn.link.opened.wait()
            try:
                async with asyncio.timeout(via.TIMEOUT_S):
                    return await asyncio.shield(self.named)
            except TimeoutError:
                if self.conn.link.is_open:
                    raise via.ViaRefused(f"no PDD-VIA line within {via.TIMEOUT_S:g}s") from None


class _Conn:
    def __init__(self, link: WanLink):
        self.link = link
        self.up = _Direction(link, link.up, "bytes_up")
        self.down = _Direction(link, link.down, "bytes_down")
        self.client = (_Side if link.via is None else _ViaSide)(self, inbound=self.up, outbound=self.down)
        self.target = _Side(self, inbound=self.down, outbound=self.up)
        self.up.src, self.down.dst = self.client, self.client
        self.down.src = self.target  # up.dst is set once the target connection exists
        self.eofs = 0
        self.closed = False

    async def dial(self) -> None:
        loop = asyncio.get_running_loop()
        while not self.link.is_open:  # blackholed: the new connection hangs until restore
            await self.link.opened.wait()
        target = self.link.fixed or await self._named_target()
        if target is None:
            return
        try:
            async with asyncio.timeout(10):
                await loop.create_connection(lambda: self.target, *target)
        except (OSError, TimeoutError) as e:
            log.info("wan link %s: cannot reach %s:%s: %s", self.link.name, *target, e)
            self.close(reset=True)
            return
        if self.closed:  # the client left while we dialed
            if self.target.transport is not None:
                self.target.transport.close()
            return
        self.up.dst = self.target
        self.up.schedule()

    async def _named_target(self) -> tuple[str, int] | None:
        """Where the client's first line asks to go; None (connection refused) unless allowed."""
        assert isinstance(self.client, _ViaSide) and self.link.via is not None
        try:
            return via.parse_via_line(await self.client.first_line(), self.link.via)
        except via.ViaRefused as e:
            self.link.refused += 1
            peer = self.client.transport.get_extra_info("peername") if self.client.transport else None
            log.warning("wan link %s: refused a connection from %s: %s", self.link.name, peer, e)
            self.close()
            return None

    def resume(self) -> None:
        for side in (self.client, self.target):
            side.resume_in("cut")
        self.up.schedule()
        self.down.schedule()

    def pause(self) -> None:
        for side in (self.client, self.target):
            side.pause_in("cut")

    def close(self, reset: bool = False) -> None:
        if self.closed:
            return
        self.closed = True
        self.up.cancel()
        self.down.cancel()
        for side in (self.client, self.target):
            t = side.transport
            if t is None or t.is_closing():
                continue
            if reset:  # RST, like a middlebox dropping the flow
                with contextlib.suppress(OSError, AttributeError):
                    t.get_extra_info("socket").setsockopt(
                        socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
                    )
                t.abort()
            else:
                t.close()
        self.link.conns.discard(self)


class WanLink:
    def __init__(
        self,
        name: str,
        listen: str,
        target: str,
        delay_ms: float = 0,
        jitter_ms: float = 0,
        bandwidth_mbps: float | None = None,
    ):
        self.name = name
        self.listen_host, self.listen_port = split_hostport(listen)
        self.target = target
        # A pattern: dial on demand (shared/wan/via.py); else the one fixed target.
        self.via = via.parse_pattern(target)
        self.fixed = split_hostport(target) if self.via is None else None
        self.settings = LinkSettings(float(delay_ms), float(jitter_ms), bandwidth_mbps)
        self.settings.validate()
        # Both directions share one settings object: a runtime change applies to both at once.
        self.up = Shaper(self.settings)  # listen side -> target
        self.down = Shaper(self.settings)  # target -> listen side
        self.cut_mode: str | None = None
        self.opened = asyncio.Event()
        self.opened.set()
        self.conns: set[_Conn] = set()
        self._server: asyncio.Server | None = None
        self._dials: set[asyncio.Task] = set()
        self.bytes_up = 0
        self.bytes_down = 0
        self.connections = 0
        self.refused = 0  # connections whose first line named no allowed target

    @property
    def is_open(self) -> bool:
        return self.cut_mode is None

    @property
    def listen(self) -> str:
        return f"{self.listen_host}:{self.listen_port}"

    def state(self) -> dict:
        return {
            "listen": self.listen,
            "target": self.target,
            **asdict(self.settings),
            "cut": self.cut_mode is not None,
            "cut_mode": self.cut_mode,
            "bytes_up": self.bytes_up,
            "bytes_down": self.bytes_down,
            "connections": self.connections,
            "refused": self.refused,
            "active": len(self.conns),
        }

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(self._accept, self.listen_host, self.listen_port)
        self.listen_port = self._server.sockets[0].getsockname()[1]  # resolve port 0

    def _accept(self) -> asyncio.Protocol:
        conn = _Conn(self)
        self.conns.add(conn)
        self.connections += 1
        task = asyncio.get_running_loop().create_task(conn.dial())
        self._dials.add(task)
        task.add_done_callback(self._dials.discard)
        return conn.client

    async def stop(self) -> None:
        await self._close_listener()
        for t in list(self._dials):
            t.cancel()
        for conn in list(self.conns):
            conn.close(reset=True)

    async def _close_listener(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.close()

    def configure(self, **changes: float | None) -> None:
        """Change the named settings of both directions, e.g. configure(delay_ms=40) or
        configure(bandwidth_mbps=None) for unlimited. A bad value raises ValueError and changes nothing."""
        new = replace(self.settings, **changes)
        new.validate()
        self.settings.delay_ms, self.settings.jitter_ms = new.delay_ms, new.jitter_ms
        self.settings.bandwidth_mbps = new.bandwidth_mbps

    async def cut(self, mode: CutMode = "drop") -> None:
        """drop: reset every connection and refuse new ones. blackhole: hold everything silent
        (no byte moves either way, new connections hang) until restore(). A drop releases the
        listening port and restore() binds it again: a port in the kernel's ephemeral range (one
        picked by binding to 0) may be taken meanwhile, so links that are cut get one from
        shared.ports."""
        if mode not in CUT_MODES:
            raise ValueError(f"cut mode must be one of {CUT_MODES}")
        self.cut_mode = mode
        self.opened.clear()
        if mode == "drop":
            await self._close_listener()
            for t in list(self._dials):
                t.cancel()
            for conn in list(self.conns):
                conn.close(reset=True)
        else:
            for conn in list(self.conns):
                conn.pause()
        log.warning("wan link %s cut (%s)", self.name, mode)

    async def restore(self) -> None:
        if self.cut_mode is None:
            return
        if self._server is None:
            await self.start()
        self.cut_mode = None
        self.opened.set()
        for conn in list(self.conns):
            conn.resume()
        log.warning("wan link %s restored", self.name)
