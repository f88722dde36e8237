"""What a KV receiver (relay, main decode) implements."""

from __future__ import annotations

from typing import Protocol

import torch

CONNECTION_LOST = "connection lost"  # on_abort's reason when the sender vanished (see on_abort)


class KVSink(Protocol):
    async def on_blocks(self, rid: str, hashes: list[int], kv: torch.Tensor, traceparent: str | None) -> None:
        """One send_blocks() group. kv: [L, 2, n, block_size, kv_heads, head_dim], freshly allocated
        and owned by the sink. traceparent: the sender's (W3C), to parent the receiving span.
        Raise to reject the request: the receiver aborts it and the sender's finish() fails.
        After a dropped connection the sender sends every block of rid again: a block already
        held for rid must be a no-op. Calls for one connection are sequential: keep this quick
        (copy into the pool, return); past server.SINK_CALL_TIMEOUT_S the request is rejected."""

    async def on_done(self, rid: str, payload: bytes) -> None:
        """The sender called finish(rid, payload=...); every block of rid was delivered before this.
        payload: the sender's bytes, as is. The sender's finish() returns once this returns
        (raise to fail it). May come again for rid when the connection dropped before its ack."""

    async def on_abort(self, rid: str, reason: str) -> None:
        """Drop everything held for rid. May come for a rid with no blocks delivered yet;
        comes at most once per failure, and for every rid in flight when the sender vanishes:
        at once on a protocol error or shutdown; when its connection dropped, only if the sender
        does not continue rid on a new connection within the reconnect grace (reason
        "connection lost")."""
