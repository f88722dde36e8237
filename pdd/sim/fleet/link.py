"""One direction of a network path: KV transfers queue FIFO and serialise at the bandwidth,
then take the propagation delay (plus seeded jitter, never reordering deliveries); control
messages take the delay alone (they travel on their own connection).

A link may carry KV in a lossy codec (shared/kv/codec.py, PDD_PREFILL_WAN_KV_CODEC): a transfer
of n engine bytes puts n / ratio on the wire and lands later by its encode and decode time at
the codec's measured CPU throughput (charged whole, as if neither overlapped the wire)."""

from __future__ import annotations

import math
import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pdd.sim.fleet.events import EventLoop
from shared.kv.codec import CODEC_BYTES_PER_S, EXACT, bytes_ratio, check_codec


@dataclass(frozen=True)
class LinkSpec:
    bandwidth_Bps: float  # bytes/s; math.inf: uncapped
    one_way_s: float  # propagation delay
    jitter_s: float = 0.0  # each crossing adds uniform(0, jitter_s), seeded; KV deliveries stay FIFO
    price_per_hour: float = 0.0  # a leased cross-DC line's cost (0 for in-DC)
    codec: LinkCodec | None = None  # KV as the engine holds it (None: exact)


@dataclass(frozen=True)
class LinkCodec:
    name: str
    ratio: float  # engine bytes over wire bytes
    seconds_per_byte: float  # encode at the sender plus decode at the receiver, per engine byte

    def wire_bytes(self, nbytes: int) -> int:
        return math.ceil(nbytes / self.ratio)


def link_codec(
    name: str, dtype_bytes: int = 2, head_dim: int = 128, block_size: int = 16
) -> LinkCodec | None:
    """The codec `name` on KV of `dtype_bytes` per value (None for exact): its bytes ratio from
    the wire format, its time from the conservative throughput in shared/kv/codec.py."""
    if check_codec(name) == EXACT:
        return None
    dtype = {4: torch.float32, 2: torch.bfloat16}[dtype_bytes]
    ratio = bytes_ratio(name, (1, 2, 1, block_size, 1, head_dim), dtype)
    return LinkCodec(name, ratio, 1.0 / CODEC_BYTES_PER_S[name])


IN_DC = LinkSpec(50e9, 10e-6)  # RDMA-class in-DC path (400 Gb/s)


@dataclass(eq=False, slots=True)
class Transfer:
    nbytes: int
    on_landed: Callable[[], None]
    dest: str = ""  # the receiving instance (backlog per destination)
    sent: int = 0  # bytes serialised (all of them once it left the queue)
    started_at: float | None = None
    aborted: bool = False
    queued: bool = False  # in its link's queue (sent, not yet serialised, not aborted)
    codec_s: float = 0.0  # encode + decode time of the link's codec, added to its landing


class Link:
    def __init__(self, loop: EventLoop, spec: LinkSpec, rng: random.Random, bins: list[float] | None = None):
        self.loop, self.spec, self.rng = loop, spec, rng
        self.bins = bins  # bytes serialised per 1 s bin, if counted
        self.queue: deque[Transfer] = (
            deque()
        )  # the head is on the wire; aborted ones behind it wait to be skipped
        self._head_event: int | None = None
        self._last_landing = 0.0
        self._queued_to: dict[str, int] = {}  # bytes in the queue per destination (none: absent)

    def delay(self) -> float:
        """One crossing's propagation time."""
        jitter = self.spec.jitter_s
        return self.spec.one_way_s + (self.rng.uniform(0.0, jitter) if jitter > 0 else 0.0)

    def message(self, fn: Callable[[], None]) -> None:
        """A control message: delay only."""
        self.loop.after(self.delay(), fn)

    @property
    def backlog(self) -> int:
        """Bytes queued and not yet serialised."""
        head = self.queue[0] if self.queue else None
        unsent = sum(t.nbytes for t in self.queue if not t.aborted)
        if head is not None and head.started_at is not None:
            unsent -= self._sent_by(head, self.loop.now)
        return unsent

    def backlog_to(self, dest: str) -> int:
        """Bytes queued toward one destination and not yet serialised."""
        queued = self._queued_to.get(dest, 0)
        head = self.queue[0] if self.queue else None
        if head is not None and head.dest == dest and head.started_at is not None:
            queued -= self._sent_by(head, self.loop.now)
        return queued

    def backlogs(self) -> dict[str, int]:
        """backlog_to() of every destination with bytes queued and not yet serialised (absent: 0)."""
        if not self.queue:
            return {}  # (every count is 0 then)
        out = dict(self._queued_to)
        head = self.queue[0] if self.queue else None
        if head is not None and head.dest in out and head.started_at is not None:
            out[head.dest] -= self._sent_by(head, self.loop.now)
        return out

    def send(self, nbytes: int, on_landed: Callable[[], None], dest: str = "") -> Transfer:
        """nbytes of KV as the engine holds it; the transfer carries what the link's codec makes
        of them."""
        codec = self.spec.codec
        t = Transfer(nbytes if codec is None else codec.wire_bytes(nbytes), on_landed, dest, queued=True)
        if codec is not None:
            t.codec_s = nbytes * codec.seconds_per_byte
        nbytes = t.nbytes
        if nbytes:
            self._queued_to[dest] = self._queued_to.get(dest, 0) + nbytes
        self.queue.append(t)
        if len(self.queue) == 1:
            self._start_head()
        return t

    def abort(self, t: Transfer) -> None:
        """Drop a transfer: its unsent bytes leave the queue (what was sent stays sent)."""
        if not t.queued:
            return
        t.aborted, t.queued = True, False
        self._unqueue(t)
        if t is self.queue[0] and t.started_at is not None:
            t.sent = self._sent_by(t, self.loop.now)
            self._count(t.started_at, self.loop.now, t.sent)
            self.loop.cancel(self._head_event)
            self.queue.popleft()
            self._start_head()
        # (one behind the head stays in the queue, skipped when it comes to the head: a long
        # queue is not searched for it)

    def _unqueue(self, t: Transfer) -> None:
        """t's bytes leave the count of what is queued toward its destination."""
        if t.nbytes:
            left = self._queued_to[t.dest] - t.nbytes
            if left:
                self._queued_to[t.dest] = left
            else:
                del self._queued_to[t.dest]  # (the router reads them all per request: keep only those queued)

    def _sent_by(self, t: Transfer, now: float) -> int:
        if math.isinf(self.spec.bandwidth_Bps):  # an uncapped link sends at once
            return t.nbytes
        return min(t.nbytes, round((now - t.started_at) * self.spec.bandwidth_Bps))

    def _start_head(self) -> None:
        queue = self.queue
        while queue and queue[0].aborted:
            queue.popleft()
        if not queue:
            return
        head = queue[0]
        head.started_at = self.loop.now
        self._head_event = self.loop.after(head.nbytes / self.spec.bandwidth_Bps, self._head_sent)

    def _head_sent(self) -> None:
        t = self.queue.popleft()
        t.sent, t.queued = t.nbytes, False
        self._unqueue(t)
        self._count(t.started_at, self.loop.now, t.nbytes)
        landing = max(self.loop.now + self.delay() + t.codec_s, self._last_landing)
        self._last_landing = landing
        self.loop.at(landing, t.on_landed)
        self._start_head()

    def _count(self, start: float, end: float, nbytes: int) -> None:
        """Spread bytes serialised over [start, end] across the 1 s bins."""
        if self.bins is None or nbytes <= 0:
            return
        rate = nbytes / (end - start) if end > start else 0.0
        second = int(start)
        while True:
            if len(self.bins) <= second:
                self.bins.extend([0.0] * (second + 1 - len(self.bins)))
            if rate == 0.0:
                self.bins[second] += nbytes
                return
            upto = min(end, second + 1.0)
            self.bins[second] += rate * (upto - max(start, float(second)))
            if upto >= end:
                return
            second += 1
