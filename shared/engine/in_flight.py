"""Prompt KV blocks on their way into one decoder, so that a prefix crosses the WAN once.

Each block in flight has one carrier: the request whose transfer brings it. A later request
that needs a block still in flight does not ask for it again: it waits for the carrier's copy
(`claim` says which blocks it carries itself and which it waits for). When a block lands it is
cached for everyone (`landed`); when a carrier's transfer ends without them (its client left,
the filter stopped it, prefill died), the blocks it still owed are lost to their waiters
(`dropped`), who must get them another way: main decode computes them in its extend pass.

Pure bookkeeping by block hash and request id: main decode (services/main_decode) and the
fleet simulator (pdd/sim) both keep their decoder's blocks in flight with it.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class BlocksInFlight:
    carrier: dict[int, str] = field(default_factory=dict)  # block hash -> request bringing it
    carries: dict[str, set[int]] = field(default_factory=dict)  # request -> its blocks not landed yet
    awaits: dict[str, set[int]] = field(default_factory=dict)  # request -> others' blocks it waits for

    def claim(self, rid: str, hashes: list[int]) -> tuple[list[int], list[int]]:
        """`rid` needs `hashes` (blocks the decoder has not cached): (those it carries, those
        it waits for because another request's transfer brings them already), in order."""
        if rid in self.carries or rid in self.awaits:
            raise ValueError(f"request {rid!r} already claimed its blocks")
        carry, wait = [], []
        for h in dict.fromkeys(hashes):
            (wait if self.carrier.get(h, rid) != rid else carry).append(h)
        for h in carry:
            self.carrier[h] = rid
        if carry:
            self.carries[rid] = set(carry)
        if wait:
            self.awaits[rid] = set(wait)
        return carry, wait

    def waiting(self, rid: str) -> set[int]:
        """The blocks `rid` still waits for (another request carries them)."""
        return self.awaits.get(rid, set())

    def landed(self, rid: str, hashes: list[int]) -> dict[str, list[int]]:
        """`rid`'s transfer brought `hashes` (cached now): per waiting request, those of them
        it was waiting for."""
        mine = self.carries.get(rid)
        if not mine:
            return {}
        came = mine.intersection(hashes)
        if not came:
            return {}
        mine.difference_update(came)
        if not mine:
            del self.carries[rid]
        for h in came:
            del self.carrier[h]
        return self._resolve(came)

    def dropped(self, rid: str) -> dict[str, list[int]]:
        """`rid` is gone (done, failed or aborted): it waits for nothing more, and the blocks it
        still owed will not come. Per waiting request, the blocks it lost that way."""
        self.awaits.pop(rid, None)
        owed = self.carries.pop(rid, set())
        for h in owed:
            del self.carrier[h]
        return self._resolve(owed)

    def stop_waiting(self, rid: str) -> list[int]:
        """`rid` gives up the blocks it still waits for (its wait ran out): they stay in flight
        for their carrier, and `rid` gets them another way."""
        return sorted(self.awaits.pop(rid, ()))

    def _resolve(self, hashes: set[int]) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {}
        if not hashes:
            return out
        for waiter, wanted in list(self.awaits.items()):
            hit = wanted.intersection(hashes)
            if hit:
                wanted.difference_update(hit)
                out[waiter] = sorted(hit)
                if not wanted:
                    del self.awaits[waiter]
        return out

    def __len__(self) -> int:
        return len(self.carrier)
