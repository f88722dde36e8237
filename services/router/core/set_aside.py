"""Instances set aside because a peer refused their identity on the KV channel (prefill
refusing an MD whose certificate names another role, an MD refusing a sender that is no
prefill). A pure decision, no NATS: a fault goes in, the instance is no longer chosen for new
work and its requests move elsewhere; it returns only as another process (a new epoch in its
load report: restarted, e.g. with the right certificate), which the next KV connection checks
again."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from shared.bus.messages import IdentityFault, Role

from .actions import Move
from .request_stream import RequestStream, StreamState

CAUSE = "identity"  # the migrations metric's cause


@dataclass(frozen=True)
class Aside:
    reason: str
    reporter: str
    epoch: str  # the process that failed: another one under the same name returns
    since: float


class SetAside:
    def __init__(self) -> None:
        self.instances: dict[tuple[Role, str], Aside] = {}

    def fault(self, f: IdentityFault, reporter_role: str, epoch: str, now: float) -> Aside | None:
        """Set the faulty instance aside; the new entry, or None when there is nothing (more) to
        set aside: it is one already, or the reporter could not tell which instance it was."""
        key = (f.role, f.instance)
        if not f.instance or key in self.instances:
            return None
        who = f"{reporter_role} {f.reporter}".strip()
        self.instances[key] = aside = Aside(f.reason, who, epoch, now)
        return aside

    def reported(self, role: Role, instance: str, epoch: str) -> Aside | None:
        """A load report: an instance set aside that is another process now returns (the entry
        it leaves, else None)."""
        aside = self.instances.get((role, instance))
        if aside is None or not epoch or epoch == aside.epoch:
            return None
        del self.instances[(role, instance)]
        return aside

    def __contains__(self, key: tuple[Role, str]) -> bool:
        return key in self.instances

    def of(self, role: Role) -> set[str]:
        return {instance for r, instance in self.instances if r is role}

    def moves(self, streams: Iterable[RequestStream]) -> list[Move]:
        """The requests that must leave an instance set aside: those it produces, and those
        whose main decoder it is before it produced anything (still waiting for KV)."""
        out = []
        for stream in streams:
            if not stream.state.is_in(StreamState.DISPATCHING, StreamState.WITH_MD, StreamState.RESUMED):
                continue  # (relayed: the relay finishes it when its MD counts as lost)
            at = {stream.producer}
            if stream.md_instance and stream.state.is_in(StreamState.DISPATCHING, StreamState.WITH_MD):
                at.add((Role.MAIN_DECODE, stream.md_instance))
            if hit := next((a for a in at if a in self.instances), None):
                role, instance = hit
                why = f"{role.value} {instance} was set aside: {self.instances[hit].reason}"
                out.append(Move(stream, why, CAUSE))
        return out
