"""Sealed records: how a TLS bulk stream carries its bytes once the TLS 1.3 handshake is through.

Python's `ssl` (OpenSSL 3.0 here) moves bulk data at ~0.6 CPU s/GB per side even on a plain
SSLSocket (16 KiB records, each copied into and out of OpenSSL's buffers; memory BIOs add two
more copies and a Python call per record): the channel ran at half of plaintext or less. So
TLS does what it is good at, the mutual-certificate handshake, and then carries one message
each way: a fresh random share. Both shares, known only to the two ends of that TLS session,
give one AES-256-GCM key per direction (HKDF-SHA256); from then on the stream's bytes go as
records of up to RECORD bytes sealed under them: one AES pass per byte, encrypted from the
caller's memory and decrypted straight into the receiver's.

A record is: 4-byte big-endian plaintext length || ciphertext || 16-byte tag, the length as
associated data. The nonce is the record's number in its direction, counted by both ends and
never sent, so a record dropped, replayed, reordered or reflected back fails its tag. Keys roll
forward (HKDF) every REKEY_RECORDS records (<= 16 GiB), far inside AES-GCM's per-key limits.
"""

from __future__ import annotations

import asyncio
import os
import socket
import ssl
import struct
from collections.abc import Callable, Iterable, Iterator

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF, HKDFExpand

RECORD = 256 << 10  # plaintext per record: one AES call, still in L2 when the socket copy reads it
HEADER = 4
TAG = 16
OVERHEAD = HEADER + TAG
REKEY_RECORDS = 1 << 16
# A receiver says nothing to a peer whose certificate's role it refuses: it just closes.
_WHY_CLOSED = " (refused our certificate's identity, or going away)"
SHARE_MAGIC = b"pdd-kv-sealed-1\n"  # a peer without sealed records fails here, by name
SHARE_BYTES = 32
_LEN = struct.Struct(">I")


class SealError(ConnectionError):
    """A record failed its check (tampered, corrupted, out of order) or is malformed: the stream
    is unusable, as after a TLS record error."""


def _nonce(n: int) -> bytes:
    return n.to_bytes(12, "big")


class _Direction:
    """One direction's key, record counter and key rolls (the same on both ends)."""

    def __init__(self, key: bytes) -> None:
        self._key, self._aead, self._n = key, AESGCM(key), 0

    def next(self) -> tuple[AESGCM, bytes]:
        if self._n == REKEY_RECORDS:
            self._key = HKDFExpand(hashes.SHA256(), 32, b"pdd kv rekey").derive(self._key)
            self._aead, self._n = AESGCM(self._key), 0
        self._n += 1
        return self._aead, _nonce(self._n - 1)


def derive_keys(own: bytes, peer: bytes, server_side: bool) -> tuple[bytes, bytes]:
    """(send key, receive key) from both ends' shares; each direction has its own key."""
    client, server = (peer, own) if server_side else (own, peer)
    keys = HKDF(hashes.SHA256(), 64, salt=None, info=b"pdd kv sealed records").derive(client + server)
    c2s, s2c = keys[:32], keys[32:]
    return (s2c, c2s) if server_side else (c2s, s2c)


BATCH = 1 << 20  # plaintext sealed per buffer, i.e. per sendmsg (a batch ends past it)
_BATCH_PIECES = 64


def batches(views: Iterable[memoryview]) -> Iterator[list[memoryview]]:
    """The bytes of one send as batches of record-sized pieces, each under BATCH + RECORD (one
    buffer). A batch closes once it reaches BATCH, so a frame's small header rides with the
    first MiB of its payload: one sendmsg for a 1 MiB frame, not two."""
    batch: list[memoryview] = []
    size = 0
    for view in views:
        for i in range(0, len(view), RECORD):
            piece = view[i : i + RECORD]
            batch.append(piece)
            size += len(piece)
            if size >= BATCH or len(batch) == _BATCH_PIECES:
                yield batch
                batch, size = [], 0
    if batch:
        yield batch


class RecordWriter:
    """Seals a batch into one reusable buffer (sent before the next batch is sealed)."""

    def __init__(self, key: bytes) -> None:
        self._dir = _Direction(key)
        self._out = memoryview(bytearray(BATCH + RECORD + _BATCH_PIECES * OVERHEAD))

    def seal(self, batch: list[memoryview]) -> memoryview:
        """The batch's records, valid until the next call."""
        out, used = self._out, 0
        for piece in batch:
            n = len(piece)
            head = _LEN.pack(n)
            out[used : used + HEADER] = head
            aead, nonce = self._dir.next()
            aead.encrypt_into(nonce, piece, head, out[used + HEADER : used + n + OVERHEAD])
            used += n + OVERHEAD
        return out[:used]


class RecordReader:
    """Opens records into the caller's views. `recv` reads raw bytes into a view (returns 0 at
    EOF, may raise BlockingIOError); what arrived before the stream existed (`early`) comes
    first. A record that fits the view is decrypted straight into it, one that does not (e.g. a
    frame header read in two parts) into a buffer it is served from afterwards."""

    def __init__(self, key: bytes, recv: Callable[[memoryview], int], early: bytes = b"") -> None:
        self._dir = _Direction(key)
        self._recv, self._early = recv, memoryview(early)
        self._mv = memoryview(bytearray(RECORD + OVERHEAD + HEADER))  # a record and the next header
        self._have, self._need = 0, HEADER
        self._plain = memoryview(bytearray(RECORD))
        self._carry = self._plain[:0]

    def read_into(self, view: memoryview) -> int:
        """Fill some of `view` (non-empty); 0 at a clean EOF between records."""
        if self._carry:
            k = min(len(view), len(self._carry))
            view[:k] = self._carry[:k]
            self._carry = self._carry[k:]
            return k
        while self._have < self._need:
            # Up to the end of this record and the next one's header: never more than one
            # record in the buffer, and no extra read for headers.
            k = self._fill(self._mv[self._have : self._need + HEADER])
            if k == 0:
                if self._have:
                    raise SealError(f"the peer closed mid-record ({self._have} of {self._need} bytes)")
                return 0
            self._have += k
            self._parse_length()
        n = self._need - OVERHEAD
        direct = n <= len(view)
        out = view[:n] if direct else self._plain[:n]
        aead, nonce = self._dir.next()
        try:
            aead.decrypt_into(nonce, self._mv[HEADER : self._need], self._mv[:HEADER], out)
        except InvalidTag:
            raise SealError(
                "a KV record failed authentication (tampered, corrupted or out of order)"
            ) from None
        rest = self._have - self._need
        self._mv[:rest] = self._mv[self._need : self._have]
        self._have, self._need = rest, HEADER
        self._parse_length()
        if direct:
            return n
        k = len(view)
        view[:] = out[:k]
        self._carry = out[k:]
        return k

    def _parse_length(self) -> None:
        if self._need != HEADER or self._have < HEADER:
            return
        (n,) = _LEN.unpack_from(self._mv)
        if not 0 < n <= RECORD:
            raise SealError(f"a KV record announces {n} bytes (at most {RECORD})")
        self._need = n + OVERHEAD

    def _fill(self, view: memoryview) -> int:
        if self._early:
            k = min(len(view), len(self._early))
            view[:k] = self._early[:k]
            self._early = self._early[k:]
            return k
        return self._recv(view)


async def exchange_shares(
    sock: socket.socket, peer: str, tls: ssl.SSLObject, incoming: ssl.MemoryBIO, outgoing: ssl.MemoryBIO
) -> tuple[bytes, bytes, bytes]:
    """Right after the handshake: send our share inside the TLS session, read the peer's.
    Returns (send key, receive key, raw bytes that came after the peer's share). A refusal of
    our certificate by the peer surfaces here as its TLS alert (ssl.SSLError)."""
    loop = asyncio.get_running_loop()
    own = os.urandom(SHARE_BYTES)
    tls.write(SHARE_MAGIC + own)
    await loop.sock_sendall(sock, outgoing.read())
    want = len(SHARE_MAGIC) + SHARE_BYTES
    got = bytearray()
    while len(got) < want:
        try:
            chunk = tls.read(want - len(got))
            if not chunk:
                raise ssl.SSLZeroReturnError
            got += chunk
            continue
        except ssl.SSLWantReadError:
            pass
        except ssl.SSLZeroReturnError:
            raise ConnectionResetError(
                f"{peer} closed the connection after the TLS handshake{_WHY_CLOSED}"
            ) from None
        data = await loop.sock_recv(sock, 1 << 16)
        if not data:
            raise ConnectionResetError(f"{peer} closed the connection after the TLS handshake{_WHY_CLOSED}")
        incoming.write(data)
    if not got.startswith(SHARE_MAGIC):
        raise ssl.SSLError(f"{peer} does not speak sealed KV records (an older pdd?)")
    # OpenSSL reads a memory BIO record by record (no read-ahead): what is left is the
    # peer's first sealed records.
    send, recv = derive_keys(own, bytes(got[len(SHARE_MAGIC) :]), tls.server_side)
    return send, recv, incoming.read()
