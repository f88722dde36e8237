"""Receiver side of the bulk channel: accepts senders, lands blocks in tensors, feeds a KVSink."""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from shared.kv import auth
from shared.kv.buffers import RecvBuffers
from shared.kv.caps import InFlight, ReceiveCaps
from shared.kv.checksum import ALGOS, new_hasher
from shared.kv.codec import CODECS, EXACT, decode, mark_wire
from shared.kv.errors import FrameError
from shared.kv.frame import (
    DEFAULT_MAX_FRAME,
    DEFAULT_MAX_HEADER,
    BlocksHeader,
    byte_view,
    check_blocks,
    field,
    pack,
    read_header,
)
from shared.kv.pieces import SplitGroup, SplitGroups
from shared.kv.sink import CONNECTION_LOST, KVSink
from shared.kv.transport import Listener, OnRefused, Stream, transport_for
from shared.security.identity import refusal

if TYPE_CHECKING:
    from ssl import SSLContext

log = logging.getLogger(__name__)

AUTH_TIMEOUT_S = 5.0
SEND_TIMEOUT_S = 10.0
SINK_ABORT_TIMEOUT_S = 10.0
SINK_CALL_TIMEOUT_S = 30.0  # on_blocks / on_done: past this the request is rejected
IDLE_TIMEOUT_S = 60.0  # a connection with nothing in flight is closed after this long silent
RECONNECT_GRACE_S = 3.0  # a request whose connection dropped waits this long for its sender
FAILED_MEMORY = 4096  # failed rids remembered per connection, to discard their in-flight frames
MAX_GROUP_FRAMES = 16  # one send_blocks() group may be at most this many max-size frames

# What every group must be: (dtype, per-block shape [L, 2, block_size, kv_heads, head_dim]).
Layout = tuple[torch.dtype, tuple[int, ...]]


def layout_refusal(b: BlocksHeader, expect: Layout) -> str | None:
    """Why this group's dtype or shape is not the receiver's model's (None: it is)."""
    dtype, block_shape = expect
    got = (*b.shape[:2], *b.shape[3:])
    if b.dtype != dtype or got != tuple(block_shape):
        return f"blocks of {b.dtype} {got} per block, the receiver's model has {dtype} {tuple(block_shape)}"
    return None


def unknown_codec(name: str) -> str:
    return f"unknown KV codec {name!r} (this receiver decodes {', '.join(CODECS)})"


@dataclass
class _Group:
    """A send_blocks() group being received, sub-frame by sub-frame, into one tensor."""

    seq: int
    kv: torch.Tensor
    nbytes: int  # reserved against the caps until delivered or dropped
    hashes: list[int]
    traceparent: str | None
    end: int  # layers [0, end) come on this connection (all, unless split)
    split: tuple[tuple[str, int], SplitGroup] | None = None  # key and state of a split group
    next_layer: int = 0
    codec: str = EXACT  # kv holds the wire bytes; decoded before the sink sees them


@dataclass
class _Orphan:
    """A request whose connection dropped, until its sender continues it or the grace ends."""

    identity: str
    timer: asyncio.Task


class _Groups(dict[str, _Group]):
    """The groups being received on one connection, by rid, each reserved against the
    connection's and the receiver's caps until it is delivered or dropped."""

    def __init__(self, server: KVServer, identity: str) -> None:
        super().__init__()
        self.server, self.identity = server, identity
        self.inflight = InFlight(server.caps.conn_inflight_bytes, server.caps.conn_groups, "this connection")

    def of(self, b: BlocksHeader, h: dict[str, Any], expected: int) -> _Group | str:
        """The group this sub-frame belongs to (a new one when lo == 0, `expected` the rid's
        next seq), or why it is invalid."""
        if b.algo not in ALGOS:
            return f"unsupported checksum {b.algo!r}"
        if b.codec not in CODECS:
            return unknown_codec(b.codec)
        group = self.get(b.rid)
        if b.lo == 0:
            if group is not None or b.seq != expected:
                return f"frame seq={b.seq} out of order (expected {expected})"
            nbytes = b.held_nbytes
            if nbytes > MAX_GROUP_FRAMES * self.server.max_frame_bytes:
                return f"group of shape {b.shape} is too large"
            group = self._new(b, h, nbytes)
            if isinstance(group, _Group):
                self[b.rid] = group
            return group
        if (
            group is None
            or group.seq != b.seq
            or group.next_layer != b.lo
            or b.hi > group.end
            or list(group.kv.shape) != b.wire_shape
            or group.codec != b.codec
        ):
            return f"sub-frame seq={b.seq} layers [{b.lo}, {b.hi}) does not continue its group"
        return group

    def _new(self, b: BlocksHeader, h: dict[str, Any], nbytes: int) -> _Group | str:
        """A group's tensor, reserved against the caps; a split one's may exist already."""
        hashes, tp = list(h["hashes"]), h.get("tp")
        if b.split is not None:
            key = (self.identity, b.split[0])
            split = self.server.splits.get(key, b, self.inflight, lambda n: self.refusal(b, n))
            if isinstance(split, str):
                return split
            return _Group(b.seq, split.kv, 0, hashes, tp, b.split[1], (key, split), codec=b.codec)
        why = self.refusal(b, nbytes)  # before anything is allocated
        if why is not None:
            return why
        kv = self.server.buffers.tensor(b.wire_shape, b.wire_dtype)
        self.inflight.take(nbytes)
        self.server.inflight.take(nbytes)
        return _Group(b.seq, kv, nbytes, hashes, tp, b.shape[0], codec=b.codec)

    def refusal(self, b: BlocksHeader, nbytes: int) -> str | None:
        expect = self.server.expect
        why = layout_refusal(b, expect) if expect is not None else None
        return why or self.inflight.refusal(nbytes) or self.server.inflight.refusal(nbytes)

    def drop(self, rid: str) -> None:
        group = self.pop(rid, None)
        if group is not None and group.split is not None:
            self.server.splits.drop(group.split[0], f"{rid} dropped")  # gives its reservation back
        elif group is not None:
            self.inflight.give(group.nbytes)
            self.server.inflight.give(group.nbytes)


class _Receiver:
    """One authenticated sender connection; frames are handled strictly in order."""

    def __init__(self, server: KVServer, stream: Stream):
        self.server, self.stream, self.sink = server, stream, server.sink
        self.identity = stream.identity  # a dropped request may continue only from the same peer
        self.next_seq: dict[str, int] = {}  # rids in flight on this connection
        self.groups = _Groups(server, self.identity)
        self.failed: collections.OrderedDict[str, str] = collections.OrderedDict()
        self._scratch: memoryview | None = None

    async def run(self) -> None:
        reason, lost = "sender disconnected", False
        try:
            async with asyncio.timeout(AUTH_TIMEOUT_S):
                limits = {
                    "max_frame": self.server.max_frame_bytes,
                    "max_header": self.server.max_header_bytes,
                    "idle_timeout": self.server.idle_timeout,
                }
                if not await auth.server_handshake(
                    self.stream, self.server.secret, limits, self.server.peer_roles
                ):
                    return
            while True:
                h = await self._next_header()
                kind = h["kind"]
                if kind == "blocks":
                    await self._on_blocks(h)
                elif kind == "done":
                    await self._on_done(field(h, "rid", str), field(h, "payload", bytes))
                elif kind == "piece":
                    await self._on_piece(h)
                elif kind == "abort":
                    await self._on_abort(field(h, "rid", str), str(h.get("reason", "")))
                else:
                    raise FrameError(f"unexpected {kind!r} frame")
        except FrameError as e:
            reason = f"protocol error: {e}"
            log.error("kv: dropping %s: %s", self.stream.peer, e)
        except TimeoutError:
            reason = "handshake timeout"
            log.warning("kv: dropping %s: handshake timeout", self.stream.peer)
        except (ConnectionError, OSError) as e:  # reset, EOF, TLS error, idle
            log.info("kv: %s gone: %s", self.stream.peer, e)
            lost = True
        except asyncio.CancelledError:
            reason = "receiver closing"
            raise
        finally:
            self.stream.abort()
            rids = list(self.next_seq)
            self.next_seq.clear()
            for rid in list(self.groups):
                self.groups.drop(rid)
            for rid in rids:
                if lost:  # the sender may continue it on a new connection
                    self.server.orphan(rid, self.identity)
                else:
                    await self.server.sink_abort(rid, reason)
            self.stream.close()

    async def _next_header(self) -> dict[str, Any]:
        """The next frame's header; with nothing in flight, a sender silent for the idle
        timeout is dropped (its pool closes idle connections before that)."""
        if self.next_seq or self.groups:
            return await read_header(self.stream, self.server.max_header_bytes)
        try:
            async with asyncio.timeout(self.server.idle_timeout):
                return await read_header(self.stream, self.server.max_header_bytes)
        except TimeoutError:
            raise ConnectionAbortedError(f"idle for {self.server.idle_timeout}s") from None

    def release(self, rid: str) -> None:
        """rid continues on another connection of its sender: this one drops it silently."""
        self.next_seq.pop(rid, None)
        self.groups.drop(rid)
        self._remember_failed(rid, "continued on another connection")

    async def _on_blocks(self, h: dict[str, Any]) -> None:
        b = check_blocks(h, self.server.max_frame_bytes)
        if b.rid in self.failed:
            await self._discard(b.nbytes)
            return
        if b.lo == 0 and b.rid not in self.next_seq and not await self._claim(b.rid):
            await self._discard(b.nbytes)
            return
        group = self.groups.of(b, h, self.next_seq.get(b.rid, 0))
        if isinstance(group, _Group) and b.lo == 0:
            self.next_seq.setdefault(b.rid, 0)  # in flight from now on
        if isinstance(group, str):
            await self._discard(b.nbytes)
            await self._fail(b.rid, group)
            return
        hasher = new_hasher(b.algo)
        # Straight into the group's tensor, checksummed chunk by chunk while still in cache.
        await self.stream.recv_into(
            byte_view(group.kv)[b.lo * b.layer_bytes : b.hi * b.layer_bytes], hasher.update
        )
        if self.groups.get(b.rid) is not group:
            return  # taken over by another connection (release) while it was landing
        if hasher.value() != b.csum:
            await self._fail(b.rid, f"checksum mismatch in seq={b.seq} layers [{b.lo}, {b.hi})")
            return
        group.next_layer = b.hi
        if group.split is not None:
            self.server.splits.landed(group.split[0], b.lo, b.hi)
        if b.hi < group.end:
            return  # more sub-frames of this group follow
        if group.split is not None and not await self._pieces_in(b, group):
            return
        self.groups.drop(b.rid)  # the sink owns it from here
        self.next_seq[b.rid] = b.seq + 1
        kv, hashes, traceparent, codec = group.kv, group.hashes, group.traceparent, group.codec
        del group
        if codec != EXACT:
            try:  # off the loop: the other connections go on meanwhile
                wire = kv.numel()
                kv = mark_wire(await asyncio.to_thread(decode, codec, kv, b.shape, b.dtype), wire)
            except Exception as e:
                await self._fail(b.rid, f"undecodable {codec} group seq={b.seq}: {e!r}")
                return
        try:
            async with asyncio.timeout(SINK_CALL_TIMEOUT_S):
                await self.sink.on_blocks(b.rid, hashes, kv, traceparent)
        except Exception as e:
            log.warning("kv: sink rejected %s: %r", b.rid, e)
            await self._fail(b.rid, f"rejected by receiver: {e!r}")

    async def _pieces_in(self, b: BlocksHeader, group: _Group) -> bool:
        """Wait for the layers of a split group that other connections carry; False (rid
        failed) if they did not all arrive intact."""
        assert group.split is not None
        why = await self.server.splits.wait(group.split[1], group.end)
        if self.groups.get(b.rid) is not group:
            return False  # taken over by another connection (release) meanwhile
        if why is not None:
            await self._fail(b.rid, f"seq={b.seq}: {why}")
            return False
        return True

    async def _on_piece(self, h: dict[str, Any]) -> None:
        """Layers of a split group, straight into its tensor; failures are the group's
        (reported by the request's connection), never this connection's."""
        b = check_blocks(h, self.server.max_frame_bytes)
        key = (self.identity, field(h, "gid", int))
        if b.codec not in CODECS:  # its group fails on the request's connection, which says why
            await self._discard(b.nbytes)
            return
        split = self.server.splits.get(key, b, self.groups.inflight, lambda n: self.groups.refusal(b, n))
        if isinstance(split, str) or b.algo not in ALGOS:
            await self._discard(b.nbytes)
            return
        hasher = new_hasher(b.algo)
        await self.stream.recv_into(
            byte_view(split.kv)[b.lo * b.layer_bytes : b.hi * b.layer_bytes], hasher.update
        )
        if hasher.value() != b.csum:
            self.server.splits.drop(key, f"checksum mismatch in a piece, layers [{b.lo}, {b.hi})")
        else:
            self.server.splits.landed(key, b.lo, b.hi)

    async def _on_done(self, rid: str, payload: bytes) -> None:
        if rid not in self.next_seq and rid not in self.failed and not await self._claim(rid):
            return
        reason = self.failed.pop(rid, None)
        if reason is None and rid in self.groups:
            reason = "done before the last sub-frame"
        if reason is not None:  # (repeat the) error: the sender's finish() must not wait for an ack
            self.groups.drop(rid)
            if self.next_seq.pop(rid, None) is not None:
                await self.server.sink_abort(rid, reason)
            await self._send({"kind": "error", "rid": rid, "reason": reason})
            return
        try:
            async with asyncio.timeout(SINK_CALL_TIMEOUT_S):
                await self.sink.on_done(rid, payload)
        except Exception as e:
            log.warning("kv: sink failed on_done for %s: %r", rid, e)
            await self._fail(rid, f"rejected by receiver: {e!r}")
            self.failed.pop(rid, None)
            return
        self.next_seq.pop(rid, None)
        await self._send({"kind": "ack", "rid": rid})

    async def _on_abort(self, rid: str, reason: str) -> None:
        if rid not in self.next_seq and rid not in self.failed and not await self._claim(rid):
            return
        self.next_seq.pop(rid, None)
        self.groups.drop(rid)
        if self.failed.pop(rid, None) is None:  # not yet aborted on our side
            await self.server.sink_abort(rid, f"aborted by sender: {reason}")

    async def _claim(self, rid: str) -> bool:
        """rid starts on this connection; False (and the sender told) if another peer holds it."""
        why = self.server.claim(rid, self)
        if why is not None:
            self._remember_failed(rid, why)
            await self._send({"kind": "error", "rid": rid, "reason": why})
        return why is None

    async def _fail(self, rid: str, reason: str) -> None:
        self.next_seq.pop(rid, None)
        self.groups.drop(rid)
        self._remember_failed(rid, reason)
        await self.server.sink_abort(rid, reason)
        await self._send({"kind": "error", "rid": rid, "reason": reason})

    def _remember_failed(self, rid: str, reason: str) -> None:
        self.failed[rid] = reason
        while len(self.failed) > FAILED_MEMORY:
            self.failed.popitem(last=False)

    async def _discard(self, nbytes: int) -> None:
        if self._scratch is None:
            self._scratch = memoryview(bytearray(1 << 20))
        while nbytes:
            n = min(nbytes, len(self._scratch))
            await self.stream.recv_into(self._scratch[:n])
            nbytes -= n

    async def _send(self, header: dict[str, Any]) -> None:
        try:
            async with asyncio.timeout(SEND_TIMEOUT_S):
                await self.stream.send(pack(header))
        except TimeoutError:
            raise ConnectionError(f"{self.stream.peer} stopped reading our replies") from None


class KVServer:
    def __init__(
        self,
        sink: KVSink,
        secret: str | None,
        max_frame_bytes: int,
        max_header_bytes: int,
        caps: ReceiveCaps,
        expect: Layout | None,
        idle_timeout: float = IDLE_TIMEOUT_S,
        reconnect_grace: float = RECONNECT_GRACE_S,
        peer_roles: Collection[str] | None = None,
    ):
        self.sink = sink
        self.secret = secret.encode() if secret else None
        self.peer_roles = frozenset(peer_roles) if peer_roles else None
        self.max_frame_bytes = max_frame_bytes
        self.max_header_bytes = max_header_bytes
        self.caps = caps
        self.expect = expect
        self.idle_timeout = idle_timeout
        self.reconnect_grace = reconnect_grace
        self.inflight = InFlight(caps.inflight_bytes, caps.groups, "this receiver")
        self.buffers = RecvBuffers()
        self.splits = SplitGroups(self.buffers, self.inflight)  # groups sent over several connections
        self._listener: Listener | None = None
        self._receivers: set[_Receiver] = set()
        self._orphans: dict[str, _Orphan] = {}  # rids whose connection dropped, in their grace

    @property
    def address(self) -> str:
        assert self._listener is not None
        return self._listener.address

    @property
    def in_flight(self) -> dict[str, list[str]]:
        """{sender peer: rids with blocks received and no done/abort yet} (and partial groups)."""
        return {r.stream.peer: sorted(set(r.next_seq) | set(r.groups)) for r in self._receivers}

    @property
    def orphans(self) -> list[str]:
        """rids whose connection dropped, waiting for their sender to continue them."""
        return sorted(self._orphans)

    def orphan(self, rid: str, identity: str) -> None:
        """rid's connection dropped: its sender may continue it on a new one within the grace."""
        old = self._orphans.pop(rid, None)
        if old is not None:
            old.timer.cancel()
        self._orphans[rid] = _Orphan(identity, asyncio.create_task(self._expire(rid)))

    async def _expire(self, rid: str) -> None:
        await asyncio.sleep(self.reconnect_grace)
        if self._orphans.pop(rid, None) is not None:
            await self.sink_abort(rid, CONNECTION_LOST)

    def claim(self, rid: str, receiver: _Receiver) -> str | None:
        """rid starts on `receiver`: it takes rid over from a dropped (or dropping) connection of
        the same peer. Why not, when another peer holds it (None: it may go on)."""
        orphan = self._orphans.get(rid)
        if orphan is not None:
            if orphan.identity != receiver.identity:
                return f"request {rid} belongs to another sender"
            del self._orphans[rid]
            orphan.timer.cancel()
            return None
        for other in self._receivers:
            if other is not receiver and (rid in other.next_seq or rid in other.groups):
                if other.identity != receiver.identity:
                    return f"request {rid} belongs to another sender"
                other.release(rid)  # its connection is dead and not noticed yet
        return None

    async def sink_abort(self, rid: str, reason: str) -> None:
        try:
            async with asyncio.timeout(SINK_ABORT_TIMEOUT_S):
                await self.sink.on_abort(rid, reason)
        except Exception:
            log.exception("kv: sink.on_abort(%s) failed", rid)

    async def _serve(self, stream: Stream) -> None:
        if len(self._receivers) >= self.caps.connections:
            log.warning("kv: refused %s: %d connections open (cap)", stream.peer, len(self._receivers))
            stream.close()
            return
        receiver = _Receiver(self, stream)
        self._receivers.add(receiver)
        try:
            await receiver.run()
        finally:
            self._receivers.discard(receiver)

    async def close(self) -> None:
        """Stop accepting, drop every connection (the sink gets on_abort for rids in flight,
        those in their reconnect grace included)."""
        if self._listener is not None:
            await self._listener.close()
            self._listener = None
        self.splits.drop_all("receiver closing")
        orphans, self._orphans = self._orphans, {}
        for rid, orphan in orphans.items():
            orphan.timer.cancel()
            await self.sink_abort(rid, "receiver closing")


async def start_kv_server(
    address: str,
    secret: str | None,
    sink: KVSink,
    *,
    max_frame_bytes: int = DEFAULT_MAX_FRAME,
    max_header_bytes: int = DEFAULT_MAX_HEADER,
    ssl: SSLContext | None = None,
    expect: Layout | None = None,
    caps: ReceiveCaps | None = None,
    idle_timeout: float = IDLE_TIMEOUT_S,
    reconnect_grace: float = RECONNECT_GRACE_S,
    peer_roles: Collection[str] | None = None,
    on_refused: OnRefused | None = None,
) -> KVServer:
    """Listen on "tcp://host:port" (port 0 = any) or "unix:///path"; `server.address` is the bound one.
    ssl: TLS on tcp:// (a server context that requires client certificates). peer_roles: over
    TLS, senders are authenticated by their certificate's identity, which must be one of these
    roles (shared/kv/auth.py); every other connection by the HMAC handshake over `secret` (inside
    TLS too, where no roles are given). ValueError when some connection could not be
    authenticated at all. expect: refuse groups of another dtype or per-block shape
    before reserving them. caps: bounds on connections and on what is reserved (defaults).
    idle_timeout: a connection with nothing in flight is closed after this long silent (senders
    learn it in the handshake). reconnect_grace: when a connection drops, its requests wait this
    long to continue on a new connection from the same peer before the sink gets on_abort.
    on_refused: hears of each peer refused by its certificate's role (before anything was sent
    to it) that went on to talk: (its address, the PeerRefused)."""
    by_identity = bool(peer_roles) and ssl is not None and address.startswith("tcp://")
    if not secret and not by_identity:
        raise ValueError(f"kv receiver {address}: no secret, and no certificate identity to check instead")
    caps = caps or ReceiveCaps()
    server = KVServer(
        sink,
        secret,
        max_frame_bytes,
        max_header_bytes,
        caps,
        expect,
        idle_timeout,
        reconnect_grace,
        peer_roles,
    )
    check = (lambda der: refusal(der, server.peer_roles)) if by_identity and server.peer_roles else None
    server._listener = await transport_for(address).listen(
        address, server._serve, ssl=ssl, peer_check=check, on_refused=on_refused
    )
    log.info("kv receiver listening on %s", server.address)
    return server
