"""Receiver side of groups split over several connections of one sender.

The request's connection carries layers [0, upto) of a split group and says so on its first
sub-frame; the sender's other connections carry the rest as piece frames. Whichever frame
arrives first makes the group's tensor (reserved against the caps of its connection and of the
server); every frame lands straight in it and is checksummed on its own. The request's
connection waits until every layer is in, then delivers the group as one, so the sink sees
groups and done in order as before. Pieces never wait for anything, so connections that carry
pieces cannot stall one another.

A split group is known by (sender identity, gid): another peer cannot add to it. One with no
frame landed for SPLIT_WAIT_S is dropped (the waiting connection then fails its request); once dropped or delivered its gid is remembered
for a while and late pieces for it are discarded.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from shared.kv.buffers import RecvBuffers
from shared.kv.caps import InFlight
from shared.kv.codec import EXACT
from shared.kv.frame import BlocksHeader

SPLIT_WAIT_S = 10.0  # a split group with no frame landed for this long is dropped
GONE_MEMORY = 4096  # dropped or delivered split groups remembered, to discard their late pieces

Key = tuple[str, int]  # (sender identity, gid)


@dataclass
class SplitGroup:
    rid: str
    kv: torch.Tensor
    nbytes: int
    charged: list[InFlight]  # given back once the group is delivered or dropped
    have: bytearray  # per layer: landed and its checksum matched
    expiry: asyncio.TimerHandle
    error: str | None = None
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    codec: str = EXACT  # kv holds this codec's wire bytes

    def fail(self, reason: str) -> None:
        self.error = self.error or reason
        self.changed.set()


class SplitGroups:
    def __init__(self, buffers: RecvBuffers, inflight: InFlight, wait_s: float = SPLIT_WAIT_S) -> None:
        self.buffers, self.inflight, self.wait_s = buffers, inflight, wait_s
        self._groups: dict[Key, SplitGroup] = {}
        self._gone: collections.OrderedDict[Key, str] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._groups)

    def get(
        self, key: Key, b: BlocksHeader, conn: InFlight, refusal: Callable[[int], str | None]
    ) -> SplitGroup | str:
        """The split group `key`, made by this frame if it is the first; or why not (it was
        dropped, it does not fit the caps, or the frame does not match it)."""
        if key in self._gone:
            return self._gone[key]
        group = self._groups.get(key)
        if group is None:
            nbytes = b.held_nbytes
            why = refusal(nbytes)
            if why is not None:
                self.drop(key, why)
                return why
            kv = self.buffers.tensor(b.wire_shape, b.wire_dtype)
            for scope in (conn, self.inflight):
                scope.take(nbytes)
            charged = [conn, self.inflight]
            group = self._groups[key] = SplitGroup(
                b.rid, kv, nbytes, charged, bytearray(b.shape[0]), self._arm(key), codec=b.codec
            )
        if (
            group.rid != b.rid
            or list(group.kv.shape) != b.wire_shape
            or group.kv.dtype != b.wire_dtype
            or group.codec != b.codec
        ):
            return f"frame of {b.rid} {b.shape} does not match split group {key[1]}"
        return group

    def _arm(self, key: Key) -> asyncio.TimerHandle:
        why = f"split group: nothing landed for {self.wait_s}s"
        return asyncio.get_running_loop().call_later(self.wait_s, self.drop, key, why)

    def landed(self, key: Key, lo: int, hi: int) -> None:
        """Layers [lo, hi) of the group are in, checksum verified."""
        group = self._groups.get(key)
        if group is not None:
            group.have[lo:hi] = b"\x01" * (hi - lo)
            group.expiry.cancel()
            group.expiry = self._arm(key)
            group.changed.set()

    async def wait(self, group: SplitGroup, upto: int) -> str | None:
        """Until layers [upto, L) are in (None) or the group failed (why)."""
        while group.error is None and not all(group.have[upto:]):
            group.changed.clear()
            await group.changed.wait()  # the group's expiry fails it at the latest
        return group.error

    def drop_all(self, reason: str) -> None:
        for key in list(self._groups):
            self.drop(key, reason)

    def drop(self, key: Key, reason: str) -> None:
        """Forget the group (delivered, or failed: reason); late pieces of it are discarded."""
        group = self._groups.pop(key, None)
        self._gone[key] = reason
        while len(self._gone) > GONE_MEMORY:
            self._gone.popitem(last=False)
        if group is not None:
            group.expiry.cancel()
            for scope in group.charged:
                scope.give(group.nbytes)
            group.fail(reason)
