"""The rule by which a decoder gives way to prefill's backlog on a host they share, pure (no
clock, no files), so `pdd up`'s decoders (host_share.py) and the fleet simulator's
(pdd/sim/fleet/give_way.py) keep one rule: from when the backlog goes above `above_tokens` (a
burst, not two prompts that came together) until it is gone, no step, for at most `max_s` in a
row; then steps until the backlog is gone."""

from __future__ import annotations


class BacklogWait:
    def __init__(self, max_s: float, above_tokens: int = 0):
        self.max_s = max_s
        self.above_tokens = above_tokens
        self.since: float | None = None  # when the backlog given way to began

    def wait_until(self, backlog: int, now: float) -> float | None:
        """Asked before a step: None to step now, else until when to wait (unless asked again)."""
        if backlog <= 0:
            self.since = None
            return None
        if self.since is None:
            if backlog <= self.above_tokens:
                return None
            self.since = now
        end = self.since + self.max_s
        return end if now < end else None

    def would_wait(self, backlog: int, now: float) -> bool:
        """Whether a decoder asking now would wait: a burst not given way to yet, or one whose
        max_s has not run out (a backlog gone ends the burst, as asking would)."""
        if backlog <= 0:
            self.since = None
            return False
        if self.since is None:
            return backlog > self.above_tokens
        return now < self.since + self.max_s
