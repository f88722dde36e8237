"""Decoders that give way to prefill's backlog on a host they share with it, as `pdd up` runs
engines on one machine (shared/serving/host_share.py, the rule it keeps):

Prefill publishes the prompt tokens it has not computed yet after each step and command (a
prompt just added counts whole until the step that takes it has ended: the engine looks up
its cached prefix only then). Before each step a decoder reads that backlog; from when it goes
above `above_tokens` until it is gone, the decoder takes no step, for at most `max_s` in a row
(then it steps until the backlog is gone), so prefill's helper takes the core it leaves.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from shared.config import CommonSettings

_DEFAULTS = CommonSettings.model_fields


@dataclass(frozen=True)
class GiveWayRule:
    above_tokens: int = _DEFAULTS["give_way_above_tokens"].default
    max_s: float = _DEFAULTS["give_way_max_s"].default


class Backlog(Protocol):
    def pending_tokens(self) -> int: ...


class GiveWay:
    """One decoder's side (shared/serving/host_share.py GiveWay): whether to wait before a step."""

    def __init__(self, rule: GiveWayRule, prefills: list[Backlog]):
        self.rule, self.prefills = rule, prefills
        self.since: float | None = None  # when the backlog given way to began

    def backlog(self) -> int:
        return sum(p.pending_tokens() for p in self.prefills)

    def wait_until(self, now: float) -> float | None:
        """None: step now; else the time the decoder may step anyway (unless asked again on a
        change of the backlog)."""
        backlog = self.backlog()
        if backlog <= 0:
            self.since = None
            return None
        if self.since is None:
            if backlog <= self.rule.above_tokens:
                return None
            self.since = now
        end = self.since + self.rule.max_s
        return end if now < end else None

    def may_wait(self, now: float) -> bool:
        """Whether a decoder stepping now should stop at its next step boundary to ask: a
        burst it has not given way to yet, or one whose max_s has not run out."""
        backlog = self.backlog()
        if backlog <= 0:
            self.since = None  # (it reads the backlog before each step: it sees it gone)
            return False
        if self.since is None:
            return backlog > self.rule.above_tokens
        return now < self.since + self.rule.max_s


def share_host(rule: GiveWayRule, prefills: list, decoders: list) -> None:
    """Every decoder gives way to every prefill: on a change of their backlog each decoder is
    told (DecodeInstance.backlog_changed)."""
    for d in decoders:
        d.give_way = GiveWay(rule, prefills)
    told: list[Callable[[], None]] = [d.backlog_changed for d in decoders]
    for p in prefills:
        p.on_backlog = lambda: [tell() for tell in told]
