"""Sealed records (shared/kv/sealed.py) without sockets: partial reads, records larger than the
reader's view, frames across record boundaries, a peer gone mid-record, and records that were
tampered with, reordered or mislabelled."""

from __future__ import annotations

import os
import random

import pytest

from shared.kv import sealed
from shared.kv.sealed import HEADER, RECORD, RecordReader, RecordWriter, SealError, batches, derive_keys

KEY = bytes(range(32))


def wire_of(*sends: bytes, key: bytes = KEY) -> bytes:
    """What a stream puts on the socket for these send() calls."""
    writer, out = RecordWriter(key), bytearray()
    for data in sends:
        for batch in batches([memoryview(data)]):
            out += writer.seal(batch)
    return bytes(out)


class Wire:
    """A socket stand-in: hands out `data` in pieces of at most `step` bytes (random when 0),
    and now and then has nothing yet (BlockingIOError), as a non-blocking socket does."""

    def __init__(self, data: bytes, step: int = 0, stalls: bool = False, seed: int = 0) -> None:
        self.data, self.pos, self.step, self.stalls = memoryview(data), 0, step, stalls
        self.rng = random.Random(seed)

    def recv(self, view: memoryview) -> int:
        if self.stalls and self.rng.random() < 0.3:
            raise BlockingIOError
        n = min(len(view), len(self.data) - self.pos, self.step or self.rng.randint(1, 70_000))
        view[:n] = self.data[self.pos : self.pos + n]
        self.pos += n
        return n


def read_exactly(reader: RecordReader, n: int, views: list[int]) -> bytes:
    """Fill n bytes through views of the given sizes in turn (as frame header then payload
    reads would), retrying on BlockingIOError."""
    out = bytearray(n)
    mv, got, i = memoryview(out), 0, 0
    while got < n:
        size = min(views[i % len(views)], n - got)
        try:
            k = reader.read_into(mv[got : got + size])
        except BlockingIOError:
            continue
        assert k > 0, "EOF before the data"
        got += k
        i += 1
    return bytes(out)


@pytest.mark.parametrize("step", [0, 1, 5, RECORD + 21, 1 << 22])
@pytest.mark.parametrize("views", [[7], [4, 200, 1 << 20], [RECORD // 3], [1 << 22]])
def test_bytes_come_back_exact_however_the_socket_and_reader_cut_them(step, views) -> None:
    header, payload = os.urandom(300), os.urandom(3 * RECORD + 12345)  # frames across records
    data = header + payload + header
    reader = RecordReader(KEY, Wire(wire_of(header + payload, header), step, stalls=True).recv)
    assert read_exactly(reader, len(data), views) == data
    while True:  # then a clean EOF between records
        try:
            assert reader.read_into(memoryview(bytearray(10))) == 0
            break
        except BlockingIOError:
            continue


def test_bytes_that_arrived_with_the_handshake_come_first() -> None:
    data = os.urandom(RECORD + 99)
    wire = wire_of(data)
    reader = RecordReader(KEY, Wire(wire[1000:]).recv, early=wire[:1000])
    assert read_exactly(reader, len(data), [65536]) == data


def test_large_sends_go_as_records_of_at_most_RECORD_bytes_one_buffer_per_batch() -> None:
    views = [memoryview(bytes(100)), memoryview(bytes(5 * RECORD))]
    cut = list(batches(views))
    assert [len(p) for b in cut for p in b] == [100, RECORD, RECORD, RECORD, RECORD, RECORD]
    assert all(sum(map(len, b)) < sealed.BATCH + RECORD for b in cut)
    # the header rides with the first MiB of the payload: one buffer, then the rest
    assert [len(b) for b in cut] == [1 + sealed.BATCH // RECORD, 5 - sealed.BATCH // RECORD]


def test_peer_closing_mid_record_is_an_error_not_a_short_read() -> None:
    wire = wire_of(os.urandom(5000))
    reader = RecordReader(KEY, Wire(wire[:-7]).recv)
    with pytest.raises(SealError, match="closed mid-record"):
        read_exactly(reader, 5000, [1 << 20])


@pytest.mark.parametrize("where", [HEADER, HEADER + 100, -1])  # ciphertext, last tag byte
def test_a_flipped_bit_fails_authentication(where) -> None:
    wire = bytearray(wire_of(os.urandom(5000)))
    wire[where] ^= 1
    with pytest.raises(SealError, match="failed authentication"):
        read_exactly(RecordReader(KEY, Wire(bytes(wire)).recv), 5000, [1 << 20])


def test_reordered_replayed_or_foreign_records_fail() -> None:
    one, two = wire_of(b"a" * 100), wire_of(b"a" * 100, b"b" * 100)[len(wire_of(b"a" * 100)) :]
    for wire in (two + one, one + one):  # swapped; the first replayed
        reader = RecordReader(KEY, Wire(wire).recv)
        with pytest.raises(SealError, match="failed authentication"):
            read_exactly(reader, 200, [1 << 20])
    with pytest.raises(SealError, match="failed authentication"):  # sealed under another key
        read_exactly(RecordReader(bytes(32), Wire(one).recv), 100, [100])


@pytest.mark.parametrize("length", [0, RECORD + 1, 0xFFFFFFFF])
def test_a_record_announcing_a_bad_length_is_refused_before_reading_it(length) -> None:
    wire = length.to_bytes(4, "big") + bytes(64)
    with pytest.raises(SealError, match="announces"):
        RecordReader(KEY, Wire(wire).recv).read_into(memoryview(bytearray(64)))


def test_keys_roll_forward_in_step_on_both_ends(monkeypatch) -> None:
    monkeypatch.setattr(sealed, "REKEY_RECORDS", 3)
    data = os.urandom(10 * RECORD)
    assert read_exactly(RecordReader(KEY, Wire(wire_of(data)).recv), len(data), [RECORD]) == data


def test_each_direction_has_its_own_key_from_both_shares() -> None:
    a, b = os.urandom(32), os.urandom(32)
    client_send, client_recv = derive_keys(a, b, server_side=False)
    server_send, server_recv = derive_keys(b, a, server_side=True)
    assert client_send == server_recv and server_send == client_recv and client_send != client_recv
    assert derive_keys(a, os.urandom(32), server_side=False)[0] != client_send
