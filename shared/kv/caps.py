"""What senders can make a KV receiver hold, and the accounting that enforces it.

A group's buffer is reserved on its first sub-frame and held until the sink takes it (or the
group fails). Reservations are counted at the group's announced size, per connection and for
the whole server, so a ~100-byte header cannot make the receiver hold more than the caps.
(The buffers themselves are anonymous mmaps: pages are committed only as bytes arrive.)
"""

from __future__ import annotations

from dataclasses import dataclass

GiB = 1 << 30


@dataclass(frozen=True)
class ReceiveCaps:
    connections: int = 256  # open sender connections; a new one beyond is closed at once
    inflight_bytes: int = 8 * GiB  # group buffers reserved and not yet delivered, all connections
    conn_inflight_bytes: int = 2 * GiB  # the same, one connection
    groups: int = 4096  # groups being received, all connections
    conn_groups: int = 256  # the same, one connection


class InFlight:
    """Bytes and groups reserved under one pair of caps."""

    def __init__(self, max_bytes: int, max_groups: int, scope: str) -> None:
        self.max_bytes, self.max_groups, self.scope = max_bytes, max_groups, scope
        self.bytes = 0
        self.groups = 0

    def refusal(self, nbytes: int) -> str | None:
        """Why one more group of nbytes does not fit (None: it fits)."""
        if self.groups + 1 > self.max_groups:
            return f"{self.scope} already receives {self.groups} groups, its cap"
        if self.bytes + nbytes > self.max_bytes:
            held = f"{self.bytes} + {nbytes} bytes in flight"
            return f"{held} on {self.scope} would pass its cap of {self.max_bytes}"
        return None

    def take(self, nbytes: int) -> None:
        self.bytes += nbytes
        self.groups += 1

    def give(self, nbytes: int) -> None:
        self.bytes -= nbytes
        self.groups -= 1
