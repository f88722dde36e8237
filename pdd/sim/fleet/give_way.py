"""Decoders that give way to prefill's backlog on a host they share with it, as `pdd up` runs
engines on one machine (shared/serving/host_share.py; the rule itself is theirs, shared/serving/backlog_wait.py):

Prefill publishes the prompt tokens it has not computed yet after each step and command (a
prompt just added counts whole until the step that takes it has ended: the engine looks up
its cached prefix only then). Before each step a decoder reads that backlog; from when it goes
above `above_tokens` until it is gone, the decoder takes no step, for at most `max_s` in a row
(then it steps until the backlog is gone), so prefill's helper takes the core it leaves.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from shared.config import CommonSettings
from shared.serving.backlog_wait import BacklogWait

_DEFAULTS = CommonSettings.model_fields


@dataclass(frozen=True)
class GiveWayRule:
    above_tokens: int = _DEFAULTS["give_way_above_tokens"].default
    max_s: float = _DEFAULTS["give_way_max_s"].default


class Backlog(Protocol):
    def pending_tokens(self) -> int: ...


class GiveWay:
    """One decoder's side: the rule `pdd up`'s decoders keep (shared/serving/backlog_wait.py)
    over the simulated prefills' backlog."""

    def __init__(self, rule: GiveWayRule, prefills: list[Backlog]):
        self.rule, self.prefills = BacklogWait(rule.max_s, rule.above_tokens), prefills

    def backlog(self) -> int:
        return sum(p.pending_tokens() for p in self.prefills)

    def wait_until(self, now: float) -> float | None:
        """None: step now; else the time the decoder may step anyway (unless asked again on a
        change of the backlog)."""
        return self.rule.wait_until(self.backlog(), now)

    def may_wait(self, now: float) -> bool:
        """Whether a decoder stepping now should stop at its next step boundary to ask."""
        return self.rule.would_wait(self.backlog(), now)


def share_host(rule: GiveWayRule, prefills: list, decoders: list) -> None:
    """Every decoder gives way to every prefill: on a change of their backlog each decoder is
    told (DecodeInstance.backlog_changed)."""
    for d in decoders:
        d.give_way = GiveWay(rule, prefills)

    def tell_decoders() -> None:
        for d in decoders:
            d.backlog_changed()

    for p in prefills:
        p.on_backlog = tell_decoders
