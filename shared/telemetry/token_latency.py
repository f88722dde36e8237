"""What one delivery of tokens to a client says about its request's latencies (pure).

The router merges each request's tokens in order; after every merge it knows how many tokens
the client had before and has now. From that alone: the time to the 2nd token (the delivery
that crosses it) and, when the request ends, its TPOT. The same definitions as bench/client.py.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TokenLatency:
    second_token_s: float | None = None  # since arrival, if this delivery brought the 2nd token
    tpot_s: float | None = None  # (end - first token) / (tokens - 1), if this delivery ended it


def token_latency(
    created: float, first_token_at: float | None, now: float, before: int, after: int, finished: bool
) -> TokenLatency:
    """`before`/`after`: tokens delivered before and after this delivery, at `now`."""
    second = now - created if before < 2 <= after else None
    tpot = None
    if finished and after >= 2 and first_token_at is not None:
        tpot = (now - first_token_at) / (after - 1)
    return TokenLatency(second, tpot)
