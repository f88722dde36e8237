"""Sender side of the bulk channel: one connection per peer, many requests multiplexed on it."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import Collection, Iterator
from dataclasses import dataclass, field
from ssl import SSLCertVerificationError, SSLContext
from typing import Any

import torch
from opentelemetry import propagate

from shared.kv import auth
from shared.kv.checksum import checksum, frame_algo
from shared.kv.codec import Encoded
from shared.kv.errors import FrameError, KVConnectionLost, KVTransferError
from shared.kv.frame import DEFAULT_MAX_HEADER, PREFIX, byte_view, dtype_name, pack, read_header
from shared.kv.transport import Stream, transport_for
from shared.security.identity import refusal

log = logging.getLogger(__name__)

SUBFRAME_BYTES = 4 << 20  # a group is cut along layers into frames of about this size
CONTROL_TIMEOUT_S = 10.0
ABORTED_MEMORY = 4096  # aborted rids remembered, so a producer still running gets an error


@dataclass
class _Rid:
    groups: int = 0
    error: str | None = None
    lost: bool = False  # the error is the connection's loss, not the receiver's refusal
    ack: asyncio.Future | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one group at a time per rid


@dataclass
class _Layers:
    """One group's bytes, cut along the layer dim into sub-frames of about SUBFRAME_BYTES."""

    data: memoryview
    n_layers: int
    layer_bytes: int
    step: int  # layers per sub-frame

    @classmethod
    def of(cls, kv: torch.Tensor) -> _Layers:
        data = byte_view(kv)
        n_layers = kv.shape[0]
        layer_bytes = len(data) // n_layers if n_layers else 0
        return cls(data, n_layers, layer_bytes, max(1, SUBFRAME_BYTES // max(layer_bytes, 1)))

    @property
    def subframe_bytes(self) -> int:
        return self.step * self.layer_bytes

    def ranges(self, lo: int = 0, hi: int | None = None) -> list[tuple[int, int]]:
        """[lo, hi) of each sub-frame of layers [lo, hi) (default: all); an empty group is one
        empty sub-frame."""
        hi = self.n_layers if hi is None else hi
        return [(i, min(hi, i + self.step)) for i in range(lo, hi, self.step)] or [(lo, lo)]

    def slice(self, lo: int, hi: int) -> memoryview:
        return self.data[lo * self.layer_bytes : hi * self.layer_bytes]

    def frames(
        self, base: dict[str, Any], first: dict[str, Any] | None, ranges: list, algo: str
    ) -> Iterator[tuple[dict[str, Any], memoryview]]:
        """(header, bytes) of the sub-frames `ranges`, `first` added to the lo == 0 one. Lazy:
        each slice is hashed only when the next frame is asked for, right before it is sent."""
        for lo, hi in ranges:
            data = self.slice(lo, hi)
            header = {**base, "layers": [lo, hi], "nbytes": len(data), "csum": [algo, checksum(algo, data)]}
            if lo == 0 and first is not None:
                header.update(first)
            yield header, data


def sendable(kv: torch.Tensor | Encoded, hashes: list[int]) -> torch.Tensor | Encoded:
    """kv checked against its hashes, as a contiguous CPU tensor (an encoded group as it is)."""
    if len(kv.shape) != 6 or kv.shape[2] != len(hashes):
        raise ValueError(f"kv shape {tuple(kv.shape)} does not match {len(hashes)} block hashes")
    if isinstance(kv, Encoded):
        return kv
    if kv.requires_grad:
        kv = kv.detach()
    if not kv.is_cpu:
        kv = kv.cpu()
    return kv.contiguous()


def _current_traceparent() -> str | None:
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return carrier.get("traceparent")


async def _take(lock: asyncio.Lock, deadline: float | None) -> None:
    """Acquire `lock`, giving up (TimeoutError) at loop time `deadline`. The timer is armed only
    while the lock is held: one per frame cost more than the rest of the frame's Python. (A lock
    just handed to a waiter is waited for without one; that waiter's own deadline bounds it.)"""
    if not lock.locked():
        await lock.acquire()
        return
    async with asyncio.timeout_at(deadline):
        await lock.acquire()


def _error(st: _Rid) -> KVTransferError:
    return (KVConnectionLost if st.lost else KVTransferError)(st.error or "failed")


class _Rids(dict[str, _Rid]):
    """The requests in flight on one channel, by rid, and the last ABORTED_MEMORY that failed
    (their later calls keep raising). A failed rid leaves the live ones at once (see drop)."""

    def __init__(self) -> None:
        super().__init__()
        self.failed: collections.OrderedDict[str, str] = collections.OrderedDict()  # bounded memory

    def state(self, rid: str) -> _Rid:
        if rid in self.failed:
            raise KVTransferError(f"{rid}: {self.failed[rid]}")
        return self.setdefault(rid, _Rid())

    def remember_failed(self, rid: str, reason: str) -> None:
        self.failed[rid] = reason
        while len(self.failed) > ABORTED_MEMORY:
            self.failed.popitem(last=False)

    def drop(self, rid: str, st: _Rid, reason: str | None = None) -> bool:
        """Forget a failed rid (later calls for it keep raising); False if already forgotten
        (by abort(), the receiver's error or a channel failure)."""
        if self.get(rid) is not st:
            return False
        del self[rid]
        self.remember_failed(rid, st.error or reason or "failed")
        return True

    def acked(self, rid: object) -> None:
        st = self.get(rid) if isinstance(rid, str) else None
        if st is not None and st.ack is not None and not st.ack.done():
            st.ack.set_result(None)

    def refused(self, rid: object, reason: object) -> None:
        """The receiver failed rid."""
        st = self.get(rid) if isinstance(rid, str) else None
        if st is not None:
            st.error = f"receiver failed {rid}: {reason}"
            self.drop(rid, st)
            if st.ack is not None and not st.ack.done():
                st.ack.set_exception(KVTransferError(st.error))

    def fail_all(self, reason: str, lost: bool) -> None:
        """The channel failed: every pending call raises."""
        for rid, st in self.items():
            st.error, st.lost = f"{rid}: {reason}", lost
            if st.ack is not None and not st.ack.done():
                st.ack.set_exception(_error(st))
        self.clear()


def _described(kv: torch.Tensor | Encoded) -> dict[str, Any]:
    """The header fields that say what the payload is (an exact group's carry no codec: its
    frames are what they were before codecs)."""
    fields = {"dtype": dtype_name(kv.dtype), "shape": list(kv.shape)}
    return {**fields, "codec": kv.codec} if isinstance(kv, Encoded) else fields


def _layers_for(rid: str, kv: torch.Tensor | Encoded, n_hashes: int, max_frame: int | None) -> _Layers:
    """kv cut into sub-frames, each of which (with its header) fits the receiver's frame limit."""
    layers = _Layers.of(kv.data if isinstance(kv, Encoded) else kv)
    if max_frame and layers.subframe_bytes + (64 << 10) + 9 * n_hashes > max_frame:
        raise KVTransferError(f"send_blocks({rid}): one layer is larger than the receiver's frame limit")
    return layers


def _done_frame(rid: str, payload: bytes, max_header: int | None) -> dict[str, Any]:
    """finish()'s frame, refused before anything is sent if it cannot be."""
    if not isinstance(payload, bytes):
        raise TypeError(f"finish({rid}): payload must be bytes, not {type(payload).__name__}")
    done = {"kind": "done", "rid": rid, "payload": payload}
    size = len(pack(done)) - PREFIX.size
    if max_header and size > max_header:
        raise KVTransferError(
            f"finish({rid}): a payload of {len(payload)} bytes makes a {size}-byte header,"
            f" over the receiver's limit of {max_header}"
        )
    return done


class KVClient:
    """`closed` turns True when the channel is unusable; every call then raises KVTransferError
    (KVConnectionLost when the connection dropped). `rtt` is the handshake round trip in seconds;
    `idle_timeout` the receiver's (it closes a connection idle that long); `last_used` the
    monotonic time of the last frame sent or ack received."""

    def __init__(
        self, stream: Stream, address: str, welcome: dict[str, Any], rtt: float, checksum: str | None = None
    ):
        self.address = address
        self.checksum = frame_algo(checksum, stream.sealed)
        self.closed = False
        self.rtt = rtt
        self.max_frame = int(welcome.get("max_frame", 0)) or None
        self.max_header = int(welcome.get("max_header", 0)) or None
        self.idle_timeout = float(welcome.get("idle_timeout", 0)) or None
        self.last_used = time.monotonic()
        self.bytes_sent = 0
        self._stream = stream
        self._wlock = asyncio.Lock()
        self._rids = _Rids()
        self._close_reason = "closed"
        self._lost = False  # closed because the connection dropped
        self._reader = asyncio.create_task(self._read_loop())

    async def send_blocks(
        self,
        rid: str,
        hashes: list[int],
        kv: torch.Tensor | Encoded,
        *,
        traceparent: str | None = None,
        timeout: float = 60.0,
        split: tuple[int, int] | None = None,
    ) -> int:
        """Send blocks of rid (kv: [L, 2, n, block_size, kv_heads, head_dim], n == len(hashes),
        or such a group in a lossy codec: shared/kv/codec.py). Returns bytes sent. CUDA /
        non-contiguous tensors are copied to contiguous CPU first.
        `traceparent` defaults to the current OpenTelemetry context's. On any failure rid is
        forgotten here (later calls for it raise) and, unless the call was cancelled, at the receiver.
        `split` (gid, upto): send layers [0, upto) only; the rest goes as send_piece(gid) on other
        connections of this sender, and the receiver delivers the group once all are in."""
        kv = sendable(kv, hashes)
        layers = _layers_for(rid, kv, len(hashes), self.max_frame)
        st = self._state(rid)
        traceparent = _current_traceparent() if traceparent is None else traceparent
        base = {"kind": "blocks", "rid": rid, **_described(kv)}
        first = {"hashes": list(hashes), "tp": traceparent, **({"split": list(split)} if split else {})}
        ranges = layers.ranges(0, split[1] if split is not None else None)
        deadline = asyncio.get_running_loop().time() + timeout
        try:
            await _take(st.lock, deadline)
            try:
                base["seq"] = st.groups
                st.groups += 1
                sent = await self._send_group(st, base, first, layers, ranges, deadline)
            finally:
                st.lock.release()
            if st.error:  # the receiver failed rid while we were sending
                raise _error(st)
        except asyncio.CancelledError:
            self._rids.drop(rid, st)  # whoever cancelled tells the receiver (abort())
            raise
        except TimeoutError:
            why = f"send_blocks({rid}): timed out after {timeout}s"
            await self._forget(rid, st, notify=True, reason=why)
            raise KVTransferError(why) from None
        except Exception:
            await self._forget(rid, st, notify=True)
            raise
        return sent

    async def send_piece(
        self, rid: str, gid: int, kv: torch.Tensor | Encoded, lo: int, hi: int, *, timeout: float = 60.0
    ) -> int:
        """Layers [lo, hi) (lo >= 1) of a group that send_blocks(split=(gid, lo')) sends on
        another connection; kv is the whole group. Returns bytes sent. Raises KVConnectionLost
        when this connection drops (sending it again on another one is safe), KVTransferError
        on timeout. The receiver reports a bad piece on the request's connection, not here."""
        kv = sendable(kv, [0] * kv.shape[2])
        layers = _layers_for(rid, kv, 0, self.max_frame)
        base = {"kind": "piece", "rid": rid, "gid": gid, **_described(kv)}
        deadline = asyncio.get_running_loop().time() + timeout
        try:
            return await self._send_group(_Rid(), base, None, layers, layers.ranges(lo, hi), deadline)
        except TimeoutError:
            raise KVTransferError(f"send_piece({rid}): timed out after {timeout}s") from None

    async def finish(self, rid: str, *, payload: bytes = b"", timeout: float = 60.0) -> None:
        """Tell the receiver rid is complete and wait for its ack (sent after sink.on_done returned).
        `payload` reaches sink.on_done as is (the channel does not read it). A payload that is not
        bytes (TypeError) or too large for the receiver's header limit (KVTransferError) is refused
        before anything is sent: rid stays open. Raises KVTransferError if the receiver
        rejected/aborted rid, the peer vanished, or on timeout."""
        done = _done_frame(rid, payload, self.max_header)
        st = self._state(rid)
        st.ack = asyncio.get_running_loop().create_future()
        try:
            async with asyncio.timeout(timeout):
                async with st.lock:  # after any send_blocks of rid still in progress
                    await self._send_frame(st, done)
                await st.ack
        except TimeoutError:
            why = f"finish({rid}): no ack from {self.address} within {timeout}s"
            await self._forget(rid, st, notify=True, reason=why)
            raise KVTransferError(why) from None
        except BaseException:
            await self._forget(rid, st, notify=st.error is not None)
            raise
        self._rids.pop(rid, None)

    async def abort(self, rid: str, reason: str) -> None:
        """Stop sending rid (its pending/later send_blocks and finish raise); the receiver calls on_abort."""
        st = self._rids.pop(rid, None) or _Rid()
        if st.error is None:
            st.error = f"aborted: {reason}"
        self._rids.remember_failed(rid, st.error)
        if st.ack is not None and not st.ack.done():
            st.ack.set_exception(KVTransferError(st.error))
        if not self.closed:
            with contextlib.suppress(KVTransferError, TimeoutError):
                async with asyncio.timeout(CONTROL_TIMEOUT_S):
                    await self._send_frame(st, {"kind": "abort", "rid": rid, "reason": reason}, force=True)

    async def close(self) -> None:
        self._fail_all("closed by sender")  # shutdown: pending sends/receives error out at once
        self._reader.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self._reader
        # Close the socket only once no send is registered on it any more.
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(2), self._wlock:
                pass
        self._stream.close()

    # -- internals --

    def _closed_error(self) -> KVTransferError:
        return (KVConnectionLost if self._lost else KVTransferError)(
            f"kv channel to {self.address}: {self._close_reason}"
        )

    def _state(self, rid: str) -> _Rid:
        if self.closed:
            raise self._closed_error()
        return self._rids.state(rid)

    async def _send_group(
        self,
        st: _Rid,
        base: dict[str, Any],
        first: dict[str, Any] | None,
        layers: _Layers,
        ranges: list,
        deadline: float,
    ) -> int:
        """The sub-frames `ranges` of one group, `first` added to the lo == 0 one, all in the kernel
        by loop time `deadline`. Each slice is hashed right before it is sent, on this thread: the
        copy into the socket then reads it from cache (hashing in a worker thread read it from
        memory twice and cost a GIL hand-off per frame, more than it overlapped on a busy host)."""
        sent = 0
        for header, data in layers.frames(base, first, ranges, self.checksum):
            sent += await self._send_frame(st, header, data, deadline=deadline)
        return sent

    async def _forget(self, rid: str, st: _Rid, notify: bool, reason: str | None = None) -> None:
        """Drop a failed rid and tell the receiver to drop it too."""
        if self._rids.drop(rid, st, reason) and notify and not self.closed:
            with contextlib.suppress(KVTransferError, TimeoutError):
                async with asyncio.timeout(CONTROL_TIMEOUT_S):
                    await self._send_frame(
                        st, {"kind": "abort", "rid": rid, "reason": "sender gave up"}, force=True
                    )

    async def _send_frame(
        self,
        st: _Rid,
        header: dict,
        payload: memoryview | None = None,
        force: bool = False,
        deadline: float | None = None,
    ) -> int:
        """One whole frame under the write lock, in the kernel by loop time `deadline` (else
        TimeoutError). Interrupted mid-frame (timeout, cancel), the stream is unusable: the
        channel fails and every pending call raises."""
        hdr = pack(header)
        writing = False
        try:
            await _take(self._wlock, deadline)
            try:
                if self.closed:
                    raise self._closed_error()
                if st.error and not force:
                    raise _error(st)
                writing = True
                await self._stream.send(hdr, *([payload] if payload is not None else []), deadline=deadline)
                writing = False
            finally:
                self._wlock.release()
        except (asyncio.CancelledError, TimeoutError):  # TimeoutError before OSError: it is one
            if writing:
                self._fail_all(f"{header['kind']} frame interrupted")
            raise
        except (ConnectionError, OSError) as e:
            self._fail_all(f"connection lost: {e}", lost=True)
            raise KVConnectionLost(f"connection to {self.address} lost: {e}") from None
        n = len(hdr) + (len(payload) if payload is not None else 0)
        self.bytes_sent += n
        self.last_used = time.monotonic()
        return n

    async def _read_loop(self) -> None:
        try:
            while True:
                h = await read_header(self._stream, DEFAULT_MAX_HEADER)
                if h["kind"] == "ack":
                    self.last_used = time.monotonic()
                    self._rids.acked(h.get("rid"))
                elif h["kind"] == "error":
                    self._rids.refused(h.get("rid"), h.get("reason"))
                else:
                    raise FrameError(f"unexpected {h['kind']!r} frame from receiver")
        except asyncio.CancelledError:
            raise
        except FrameError as e:
            log.error("kv: receiver %s broke the protocol: %s", self.address, e)
            self._fail_all(f"protocol error: {e}")
        except (ConnectionError, OSError) as e:  # reset, EOF, TLS error
            self._fail_all(f"receiver gone: {e}", lost=True)

    def _fail_all(self, reason: str, lost: bool = False) -> None:
        if self.closed:
            return
        self.closed = True
        self._close_reason = reason
        self._lost = lost
        if reason != "closed by sender":
            log.warning("kv: channel to %s failed: %s", self.address, reason)
        self._stream.abort()  # wakes a send blocked on a dead or blackholed peer
        self._rids.fail_all(reason, lost)


async def open_kv_client(
    address: str,
    secret: str | None,
    *,
    timeout: float = 10.0,
    checksum: str | None = None,
    ssl: SSLContext | None = None,
    via: str | None = None,
    server_name: str | None = None,
    peer_roles: Collection[str] | None = None,
) -> KVClient:
    """Connect and authenticate. Raises KVTransferError when unauthenticated or refused by TLS,
    KVConnectionLost when the connection could not be made or dropped, or on timeout.
    `checksum`: "xxh3", "crc32" or "none"; by default none over TLS (its records are
    authenticated) and xxh3 (crc32 without xxhash) otherwise.
    `ssl`: TLS on tcp:// (a client context with this party's certificate); unix:// ignores it.
    `via`: a dial-on-demand WAN link's tcp:// address to reach tcp:// peers through.
    `server_name`: the host the peer's certificate must name (default: the address's host), when
    `ssl` checks host names. `peer_roles`: over TLS, the receiver's certificate must name one
    of these roles, checked before anything is sent; a receiver that goes by identity too then
    needs no `secret` (shared/kv/auth.py)."""
    stream: Stream | None = None
    try:
        async with asyncio.timeout(timeout):
            check = (lambda der: refusal(der, peer_roles)) if peer_roles else None
            stream = await transport_for(address).connect(
                address, ssl=ssl, via=via, server_name=server_name, peer_check=check
            )
            t0 = time.perf_counter()
            welcome = await auth.client_handshake(stream, secret.encode() if secret else None, peer_roles)
            rtt = time.perf_counter() - t0  # hello was already in flight: ~ one round trip
    except BaseException as e:
        if stream is not None:
            stream.close()
        if isinstance(e, TimeoutError):
            raise KVConnectionLost(f"{address}: no answer within {timeout}s") from None
        if isinstance(e, OSError) and not isinstance(e, SSLCertVerificationError):
            raise KVConnectionLost(f"{address}: {e}") from None  # refused, reset: worth another try
        if isinstance(e, OSError | FrameError):
            raise KVTransferError(f"{address}: {e}") from None
        raise
    return KVClient(stream, address, welcome, rtt, checksum)
