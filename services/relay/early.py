"""What reaches the relay ahead of what it needs to start a request: the local KV's landing
and prefill's RelayStart (either may come first), and MD's kv_ready before either."""

from __future__ import annotations

from shared.bus.messages import RelayStart

from .kept import Kept

EARLY_MAX = 1024
# These halves follow each other by well under this, or the request is gone.
EARLY_TTL_S = 5.0


class Early:
    def __init__(self) -> None:
        self.ready: Kept[str] = Kept(EARLY_TTL_S, EARLY_MAX)  # kv_ready before the job: its MD
        self.start: Kept[RelayStart] = Kept(EARLY_TTL_S, EARLY_MAX)  # before the local KV landed
        self.landed: Kept[bool] = Kept(EARLY_TTL_S)  # local KV in (pinned), no RelayStart yet

    def kv_landed(self, rid: str) -> RelayStart | None:
        """rid's local KV is in: its RelayStart if that came first (start now); otherwise None
        and the landing is kept (again after a dropped ack: kept already)."""
        if rid in self.landed:
            return None
        start = self.start.pop(rid)
        if start is None:
            self.landed.put(rid, True)
        return start

    def start_came(self, msg: RelayStart) -> bool:
        """True when the request's local KV is in (start now); otherwise the message is kept."""
        if self.landed.pop(msg.rid) is None:
            self.start.put(msg.rid, msg)
            return False
        return True

    def forget(self, rid: str) -> None:
        self.landed.pop(rid)
        self.start.pop(rid)

    def expire(self, now: float) -> list[str]:
        """Drop what waited in vain; the rids whose landed KV is to be unpinned."""
        self.ready.expire(now)
        self.start.expire(now)
        return self.landed.expire(now)
