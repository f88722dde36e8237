"""Aborts an engine service heard lately. One may overtake the message that creates its job
(they travel different paths, and admission awaits the engine) and must still win, so each is
kept for a while (ABORTS_KEPT_S) against a late admission. No clock of its own: `now` is given."""

from __future__ import annotations

from shared.bus.messages import Abort, Role

ABORTS_KEPT_S = 60.0  # how long an abort is remembered against a late admission


class RecentAborts(dict[str, tuple[float, Abort, Role]]):
    """rid -> (when heard, the abort, the role that sent it)."""

    def heard(self, msg: Abort, source: Role, now: float) -> None:
        self[msg.rid] = (now, msg, source)

    def forget_old(self, now: float, keep_s: float = ABORTS_KEPT_S) -> None:
        for rid in [r for r, (t, *_) in self.items() if now - t > keep_s]:
            del self[rid]
