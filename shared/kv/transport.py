"""Byte streams under the bulk channel, chosen by URL scheme.

`tcp://host:port` for the WAN path, `unix:///path` for the co-located fast path (P -> RLD).
Both are plain non-blocking sockets (`loop.sock_sendall`, and a reader callback doing `recv_into`):
sends go straight from the tensor's memory and receives land straight in the destination
tensor (no StreamReader/transport buffer copies). Given an SSLContext, a tcp stream runs the
TLS 1.3 handshake, then AES-GCM records keyed inside that session on the same socket pump,
decrypted straight into the destination (shared/kv/sealed.py; unix:// stays plaintext: it
never leaves the host). An RDMA backend would register its own scheme with a `Transport`
whose streams offer the same four methods.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import ssl
from collections.abc import Awaitable, Callable
from ssl import SSLContext
from typing import Protocol
from urllib.parse import urlsplit

from shared.kv.refusal import PeerRefused, handshake_refusal
from shared.kv.sealed import RecordReader, RecordWriter, batches, exchange_shares
from shared.wan.via import via_line

log = logging.getLogger(__name__)

RECV_CHUNK = 512 << 10  # checksum each piece while it is still in cache
SNDBUF = 4 << 20  # Linux doubles it; larger than the default autotuning cap (4 MiB)
TLS_HANDSHAKE_TIMEOUT_S = 5.0
FIRST_WORD_S = 1.0  # how long a refused peer has to show it is a real attempt, not a probe
SENDMSG_BUFS = 64  # buffers per sendmsg call (IOV_MAX is 1024)


class Stream(Protocol):
    peer: str
    sealed: bool  # its records carry an AEAD tag: bytes arrive as sent or the stream fails

    @property
    def identity(self) -> str:
        """Who the peer is, the same on each of its connections (`peer` names one connection)."""

    @property
    def peer_certificate(self) -> bytes | None:
        """The peer's certificate (DER) on a TLS stream, checked against the CA; None otherwise."""

    async def send(self, *bufs: bytes | memoryview, deadline: float | None = None) -> None:
        """Write all bytes, in order (returns once they are in the kernel: TCP backpressure).
        `deadline`: the loop time (loop.time()) past which a send still waiting raises
        TimeoutError, the stream then unusable (None: no limit)."""

    async def recv_into(self, view: memoryview, on_chunk: Callable[[memoryview], None] | None = None) -> None:
        """Fill `view` exactly; raises ConnectionError at EOF."""

    def abort(self) -> None:
        """Make pending and future send/recv fail now (safe to call from any task)."""

    def close(self) -> None:
        """Release the stream; call once no send/recv is pending."""


class Listener(Protocol):
    address: str

    async def close(self) -> None: ...


OnStream = Callable[[Stream], Awaitable[None]]
# Why the peer's certificate (DER, None: none) is not one this end deals with; None: it is.
PeerCheck = Callable[[bytes | None], str | None]
# A connection refused before it became a stream: (peer, why, the refusal) -> None.
OnRefused = Callable[[str, BaseException], None]


class Transport(Protocol):
    async def listen(
        self,
        address: str,
        on_stream: OnStream,
        ssl: SSLContext | None = None,
        peer_check: PeerCheck | None = None,
        on_refused: OnRefused | None = None,
    ) -> Listener: ...
    async def connect(
        self,
        address: str,
        ssl: SSLContext | None = None,
        via: str | None = None,
        server_name: str | None = None,
        peer_check: PeerCheck | None = None,
    ) -> Stream: ...


class SocketStream:
    sealed = False

    def __init__(self, sock: socket.socket, peer: str):
        self._sock = sock
        self._fd = sock.fileno()
        self._loop = asyncio.get_running_loop()
        self.peer = peer
        # state of the one pending recv_into
        self._view = memoryview(b"")
        self._got = 0
        self._on_chunk: Callable[[memoryview], None] | None = None
        self._waiter: asyncio.Future | None = None
        self._watching = False  # the loop calls _on_readable when the socket is readable

    async def send(self, *bufs: bytes | memoryview, deadline: float | None = None) -> None:
        # One sendmsg for header and payload (a header sent alone is a packet and a receiver
        # wakeup of its own with TCP_NODELAY), straight from the tensor's memory.
        views = [memoryview(b).cast("B") for b in bufs if len(b)]
        while views:
            try:
                n = self._sock.sendmsg(views[:SENDMSG_BUFS])
            except (BlockingIOError, InterruptedError):
                await self._writable(deadline)
                continue
            while n:
                k = min(n, len(views[0]))
                views[0] = views[0][k:]
                n -= k
                if not views[0]:
                    views.pop(0)

    async def _writable(self, deadline: float | None) -> None:
        # The deadline's timer is armed only here, when a send has to wait: on a fast link
        # most never do, and a timer per frame would cost more than the rest of its Python.
        waiter = self._loop.create_future()
        self._loop.add_writer(self._fd, lambda: waiter.done() or waiter.set_result(None))
        try:
            async with asyncio.timeout_at(deadline):
                await waiter
        finally:
            self._loop.remove_writer(self._fd)

    async def recv_into(self, view: memoryview, on_chunk: Callable[[memoryview], None] | None = None) -> None:
        # Reads until EAGAIN on every readiness event: loop.sock_recv_into would pay a future +
        # two epoll_ctl per chunk, ~20% of loopback goodput. The reader stays registered after
        # a call, so a receiver waiting for frame after frame pays no epoll_ctl at all; it is
        # removed only when the socket turns readable with no call waiting.
        self._view, self._got, self._on_chunk = view, 0, on_chunk
        if self._pump():
            return
        self._waiter = self._loop.create_future()
        if not self._watching:
            self._loop.add_reader(self._fd, self._on_readable)
            self._watching = True
        try:
            await self._waiter
        finally:
            self._waiter = None

    def _unwatch(self) -> None:
        if self._watching:
            self._loop.remove_reader(self._fd)
            self._watching = False

    def _on_readable(self) -> None:
        waiter = self._waiter
        if waiter is None or waiter.done():
            self._unwatch()  # level-triggered: it would fire again on every turn of the loop
            return
        try:
            if self._pump():
                waiter.set_result(None)
        except Exception as e:
            waiter.set_exception(e)

    def _pump(self) -> bool:
        """Read what the kernel has; True once the view is full."""
        view, n = self._view, len(self._view)
        while self._got < n:
            try:
                k = self._recv_some(view[self._got : min(n, self._got + RECV_CHUNK)])
            except (BlockingIOError, InterruptedError):
                return False
            if k == 0:
                raise ConnectionResetError(f"{self.peer} closed the connection")
            if self._on_chunk is not None:
                self._on_chunk(view[self._got : self._got + k])
            self._got += k
        return True

    def _recv_some(self, view: memoryview) -> int:
        return self._sock.recv_into(view)

    @property
    def identity(self) -> str:
        """The peer's host (the port changes with each connection)."""
        return self.peer.rsplit(":", 1)[0] if self._sock.family != socket.AF_UNIX else self.peer

    @property
    def peer_certificate(self) -> bytes | None:
        return None

    def abort(self) -> None:
        # shutdown wakes any task blocked in recv_into/sock_sendall; close() would not.
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.abort()
        self._unwatch()  # before the fd number can be reused by another socket
        self._sock.close()


class TLSStream(SocketStream):
    """After its TLS 1.3 handshake (mutual certificates), the bytes go as AES-256-GCM records
    keyed inside that TLS session (shared/kv/sealed.py): the same socket pump, records sealed
    from the caller's memory and opened straight into the receive view."""

    sealed = True

    def __init__(
        self,
        sock: socket.socket,
        peer: str,
        tls: ssl.SSLObject,
        keys: tuple[bytes, bytes],
        early: bytes = b"",
    ):
        super().__init__(sock, peer)
        self._tls = tls  # kept for the peer certificate
        self._writer = RecordWriter(keys[0])
        self._reader = RecordReader(keys[1], sock.recv_into, early)

    @property
    def identity(self) -> str:
        """The peer certificate's identity URI (else its common name) at the peer's host."""
        cert = self._tls.getpeercert() or {}
        uris = [v for k, v in cert.get("subjectAltName", ()) if k == "URI" and v.startswith("spiffe:")]
        subject = dict(rdn[0] for rdn in cert.get("subject", ()))
        return f"{uris[0] if uris else subject.get('commonName', '?')}@{super().identity}"

    @property
    def peer_certificate(self) -> bytes | None:
        return self._tls.getpeercert(binary_form=True)

    def _recv_some(self, view: memoryview) -> int:
        return self._reader.read_into(view)

    async def send(self, *bufs: bytes | memoryview, deadline: float | None = None) -> None:
        # Sealed on this thread, a batch per sendmsg, while the batch's bytes are in cache
        # (a worker thread sealing a batch ahead measured slower on 2 cores: hand-offs and
        # cache lines moving between cores cost more than the overlap gained).
        for batch in batches(memoryview(b).cast("B") for b in bufs if len(b)):
            await super().send(self._writer.seal(batch), deadline=deadline)


async def _tls_handshake(
    sock: socket.socket,
    peer: str,
    tls: SSLContext,
    server_hostname: str | None,
    peer_check: PeerCheck | None = None,
) -> TLSStream:
    """Certificates are checked here; a refusal's alert still reaches the peer. `peer_check`
    runs on the verified peer certificate before this end sends anything of its own (the key
    share): a peer of the wrong role learns nothing but that the connection closed."""
    loop = asyncio.get_running_loop()
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    obj = tls.wrap_bio(
        incoming, outgoing, server_side=server_hostname is None, server_hostname=server_hostname
    )
    async with asyncio.timeout(TLS_HANDSHAKE_TIMEOUT_S):
        while True:
            try:
                obj.do_handshake()
                break
            except ssl.SSLWantReadError:
                await loop.sock_sendall(sock, outgoing.read())
                data = await loop.sock_recv(sock, 1 << 16)
                if not data:
                    raise ConnectionResetError(
                        f"{peer} closed the connection during the TLS handshake"
                    ) from None
                incoming.write(data)
            except ssl.SSLError:
                with contextlib.suppress(OSError):
                    await loop.sock_sendall(sock, outgoing.read())
                raise
        await loop.sock_sendall(sock, outgoing.read())
        if peer_check is not None:
            der = obj.getpeercert(binary_form=True)
            if (why := peer_check(der)) is not None:
                spoke = server_hostname is not None or await _first_word(sock, obj, incoming)
                raise PeerRefused(peer, why, _uri_of(obj), spoke)
        send_key, recv_key, early = await exchange_shares(sock, peer, obj, incoming, outgoing)
    return TLSStream(sock, peer, obj, (send_key, recv_key), early)


def _uri_of(tls: ssl.SSLObject) -> str | None:
    cert = tls.getpeercert() or {}
    return next(
        (v for k, v in cert.get("subjectAltName", ()) if k == "URI" and v.startswith("spiffe:")), None
    )


async def _first_word(sock: socket.socket, tls: ssl.SSLObject, incoming: ssl.MemoryBIO) -> bool:
    """Whether a peer that was just refused goes on to talk (a real attempt: ours sends its key
    share at once) rather than close without a word (a probe). Nothing is sent to it."""
    loop = asyncio.get_running_loop()
    try:
        async with asyncio.timeout(FIRST_WORD_S):
            while True:
                try:
                    return bool(tls.read(1))
                except ssl.SSLWantReadError:
                    pass
                data = await loop.sock_recv(sock, 1 << 16)
                if not data:
                    return False
                incoming.write(data)
    except TimeoutError:
        return True  # it holds the connection open, silent: not a probe that is done
    except (ssl.SSLZeroReturnError, OSError):  # its close_notify, or a reset
        return False


async def _stream_of(
    sock: socket.socket,
    peer: str,
    tls: SSLContext | None,
    server_hostname: str | None = None,
    peer_check: PeerCheck | None = None,
) -> SocketStream:
    """A plaintext stream, or a TLS one once the handshake (certificates checked) is through."""
    if tls is None:
        return SocketStream(sock, peer)
    return await _tls_handshake(sock, peer, tls, server_hostname, peer_check)


def _tune(sock: socket.socket) -> None:
    sock.setblocking(False)
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for opt, val in (("TCP_KEEPIDLE", 10), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 3)):
            if hasattr(socket, opt):
                sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, opt), val)
    # Receive buffers are left to kernel autotuning (it may grow past rmem_max; a fixed
    # SO_RCVBUF would cap a long-fat WAN pipe). Send buffers are raised explicitly.
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SNDBUF)


def _parse(address: str) -> tuple[str, tuple | str]:
    u = urlsplit(address)
    if u.scheme == "tcp":
        if not u.hostname or u.port is None:
            raise ValueError(f"expected tcp://host:port, got {address!r}")
        return "tcp", (u.hostname, u.port)
    if u.scheme == "unix":
        path = (u.netloc + u.path) if u.netloc else u.path
        if not path:
            raise ValueError(f"expected unix:///path, got {address!r}")
        return "unix", path
    raise ValueError(f"unsupported address {address!r}")


def _tcp(address: str) -> tuple[str, int]:
    kind, where = _parse(address)
    if kind != "tcp":
        raise ValueError(f"expected tcp://host:port, got {address!r}")
    assert isinstance(where, tuple)
    return where


async def advertised_address(bound: str) -> str:
    """What peers dial to reach a listener bound at `bound`: a wildcard host (0.0.0.0, ::)
    becomes this host's primary IP, its hostname's address (what a container's peers reach,
    whatever it is); any other address is itself."""
    kind, where = _parse(bound)
    if kind != "tcp" or where[0] not in ("0.0.0.0", "::"):
        return bound
    family = socket.AF_INET6 if where[0] == "::" else socket.AF_INET
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(socket.gethostname(), None, family=family, type=socket.SOCK_STREAM)
    ip = infos[0][4][0]
    return f"tcp://{f'[{ip}]' if family == socket.AF_INET6 else ip}:{where[1]}"


class SocketListener:
    def __init__(
        self,
        sock: socket.socket,
        address: str,
        on_stream: OnStream,
        tls: SSLContext | None,
        peer_check: PeerCheck | None = None,
        on_refused: OnRefused | None = None,
    ):
        self.address = address
        self._sock = sock
        self._on_stream = on_stream
        self._tls = tls
        self._peer_check, self._on_refused = peer_check, on_refused
        self._conns: set[asyncio.Task] = set()
        self._accepting = asyncio.create_task(self._accept_loop())

    async def _accept_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, addr = await loop.sock_accept(self._sock)
            except OSError as e:  # e.g. EMFILE: back off instead of spinning
                log.error("kv listener %s: accept failed: %s", self.address, e)
                await asyncio.sleep(0.1)
                continue
            _tune(conn)
            peer = f"{addr[0]}:{addr[1]}" if isinstance(addr, tuple) and len(addr) >= 2 else self.address
            task = asyncio.create_task(self._serve(conn, peer))
            self._conns.add(task)
            task.add_done_callback(self._conns.discard)

    async def _serve(self, conn: socket.socket, peer: str) -> None:
        try:
            stream = await _stream_of(conn, peer, self._tls, peer_check=self._peer_check)
        except (OSError, TimeoutError, PeerRefused) as e:  # ssl.SSLError is an OSError
            conn.close()
            level, why = handshake_refusal(e)
            who = f"{e.identity}@{peer}" if isinstance(e, PeerRefused) and e.identity else peer
            log.log(level, "kv listener %s: refused %s: %s", self.address, who, why)
            if self._on_refused is not None and isinstance(e, PeerRefused) and e.spoke:
                self._on_refused(peer, e)
            return
        await self._on_stream(stream)

    async def close(self) -> None:
        self._accepting.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._accepting
        self._sock.close()
        for t in list(self._conns):
            t.cancel()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(5):
                await asyncio.gather(*self._conns, return_exceptions=True)
        if self.address.startswith("unix://"):
            with contextlib.suppress(OSError):
                os.unlink(_parse(self.address)[1])


class SocketTransport:
    """TCP or Unix sockets; `ssl` turns on TLS for tcp:// (unix:// stays plaintext)."""

    async def listen(
        self,
        address: str,
        on_stream: OnStream,
        ssl: SSLContext | None = None,
        peer_check: PeerCheck | None = None,
        on_refused: OnRefused | None = None,
    ) -> Listener:
        """`peer_check` (TLS only): refuse peers by their certificate before anything is sent;
        `on_refused` hears of each such refusal of a peer that went on to talk."""
        kind, where = _parse(address)
        if kind == "unix":
            assert isinstance(where, str)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(where)  # a stale socket file from a previous run
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.bind(where)
            bound = f"unix://{where}"
        else:
            host, port = where
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            sock = socket.socket(family, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
            h = f"[{host}]" if family == socket.AF_INET6 else host
            bound = f"tcp://{h}:{sock.getsockname()[1]}"
        sock.listen(128)
        sock.setblocking(False)
        tls = ssl if kind == "tcp" else None
        return SocketListener(sock, bound, on_stream, tls, peer_check if tls else None, on_refused)

    async def connect(
        self,
        address: str,
        ssl: SSLContext | None = None,
        via: str | None = None,
        server_name: str | None = None,
        peer_check: PeerCheck | None = None,
    ) -> Stream:
        """`via` (tcp://host:port of a dial-on-demand WAN link, shared/wan/via.py): connect
        there and name `address` in a first line; TLS still runs end to end with `address`.
        `server_name`: the name the server's certificate must hold (default: the address's
        host). `peer_check`: refuse the server by its certificate (PeerRefused) before sending
        it anything. unix:// ignores all four."""
        kind, where = _parse(address)
        loop = asyncio.get_running_loop()
        dial = where
        if kind == "unix":
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        else:
            infos = await loop.getaddrinfo(*(_tcp(via) if via else where), type=socket.SOCK_STREAM)
            family, _, _, _, dial = infos[0]
            sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            _tune(sock)
            await loop.sock_connect(sock, dial)
            if kind == "tcp" and via is not None:
                await loop.sock_sendall(sock, via_line(*where))
            if kind == "tcp" and ssl is not None:
                return await _stream_of(sock, address, ssl, server_name or where[0], peer_check)
        except BaseException:
            sock.close()
            raise
        return SocketStream(sock, address)


_TRANSPORTS: dict[str, Transport] = {"tcp": SocketTransport(), "unix": SocketTransport()}


def register_transport(scheme: str, transport: Transport) -> None:
    """Plug in another backend (e.g. "rdma") without touching the services."""
    _TRANSPORTS[scheme] = transport


def transport_for(address: str) -> Transport:
    scheme = urlsplit(address).scheme
    if scheme not in _TRANSPORTS:
        raise ValueError(f"no KV transport for {address!r} (known: {', '.join(sorted(_TRANSPORTS))})")
    return _TRANSPORTS[scheme]
