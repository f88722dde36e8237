"""The relay's request life as plain decisions: a message or a clock tick goes in, the jobs'
new states and the actions they call for come out. No NATS, no engine and no clock of its
own here; the service (service.py) feeds the events in and performs the actions, as the
router's adapter performs what its request life decides.

A request starts when both halves are in, in either order: the local KV's landing and
prefill's RelayStart (early.py keeps whichever came first). MD's kv_ready starts the handoff
(handoff.py); MD lost, silent or giving up sends the relay solo; a request that ended here is
remembered a while, so a late half (a resent landing, a repeated RelayStart) cannot start it
again."""

from __future__ import annotations

from collections.abc import Container
from dataclasses import dataclass

from shared.bus.messages import Abort, KVReady, MainDecodeLost, RelayStart, Role

from .early import EARLY_TTL_S, Early
from .job import HOLDS_REQUEST, RelayJob, RelayState
from .kept import Kept

ENDED_MAX = 4096  # requests that ended here, remembered against a late half


@dataclass(frozen=True)
class Begin:
    """Add the request to the engine (prompt plus prefill's first token) and start its MD
    deadline; then, with `handoff`, hand it over at once (MD's kv_ready came first)."""

    job: RelayJob
    start: RelayStart
    handoff: bool = False


@dataclass(frozen=True)
class Handoff:
    """MD is ready: hand the request over by token IDs (handoff.py)."""

    job: RelayJob


@dataclass(frozen=True)
class GoSolo:
    """MD is out of the picture: tell the other roles; the relay finishes the request."""

    job: RelayJob
    why: str


@dataclass(frozen=True)
class Unpin:
    """Let go of landed local KV that no request holds."""

    rid: str


@dataclass(frozen=True)
class Drop:
    """Another role ended the request: stop decoding it and free its blocks."""

    job: RelayJob


@dataclass(frozen=True)
class Fail:
    """Give the request up: an error to the router (which moves it), an abort to the others."""

    job: RelayJob
    error: str


Action = Begin | Handoff | GoSolo | Unpin | Drop | Fail


class RelayCore:
    def __init__(self, jobs: dict[str, RelayJob], aborted: Container[str], catchup_threshold: int) -> None:
        self.jobs = jobs  # rid -> job, shared with the service's admission and heartbeats
        self.aborted = aborted  # rids another role gave up on lately
        self.catchup_threshold = catchup_threshold  # the default; a RelayStart may ask another
        self.early = Early()
        self.ended: Kept[bool] = Kept(EARLY_TTL_S, ENDED_MAX)

    # ---- the two halves of a start --------------------------------------------------
    def kv_landed(self, rid: str) -> list[Action]:
        """All of the request's prompt blocks are here (again, after a dropped ack: no-op)."""
        if rid in self.aborted:
            raise ValueError(f"request {rid} was aborted")
        if rid in self.jobs or rid in self.ended:
            return []
        start = self.early.kv_landed(rid)
        return self._begin(start) if start is not None else []

    def relay_start(self, msg: RelayStart) -> list[Action]:
        """Prefill's first token and the request's parameters, once the local KV is acked."""
        if msg.rid in self.jobs or msg.rid in self.ended or msg.rid in self.aborted:
            return []
        return self._begin(msg) if self.early.start_came(msg) else []

    def _begin(self, start: RelayStart) -> list[Action]:
        asked = start.catchup_threshold or 0
        threshold = asked if asked > 0 else self.catchup_threshold
        job = self.jobs[start.rid] = RelayJob(start.rid, threshold, router=start.router)
        md = self.early.ready.pop(start.rid)
        if md is not None:
            job.md_instance = md
            job.state.to(RelayState.HANDING_OFF)
        return [Begin(job, start, handoff=md is not None)]

    # ---- MD's side ------------------------------------------------------------------
    def kv_ready(self, msg: KVReady) -> list[Action]:
        job = self.jobs.get(msg.rid)
        if job is None:
            if msg.rid not in self.ended:
                self.early.ready.put(msg.rid, msg.md_instance)
            return []
        if not job.state.is_in(RelayState.RELAYING):  # a duplicate cannot start a second handoff
            return []
        job.md_instance = msg.md_instance
        job.state.to(RelayState.HANDING_OFF)
        return [Handoff(job)]

    def md_lost(self, msg: MainDecodeLost) -> list[Action]:
        job = self.jobs.get(msg.rid)
        if job is None or not job.state.is_in(RelayState.RELAYING, RelayState.HANDING_OFF):
            return []
        return [self.solo(job, f"main decode {msg.md_instance} was lost")]

    def md_deadline(self, job: RelayJob) -> list[Action]:
        """MD's kv_ready did not come in time."""
        if self.jobs.get(job.rid) is not job or not job.state.is_in(RelayState.RELAYING):
            return []
        return [self.solo(job, "MD not ready in time")]

    def solo(self, job: RelayJob, why: str) -> GoSolo:
        job.state.to(RelayState.SOLO)
        return GoSolo(job, why)

    # ---- endings --------------------------------------------------------------------
    def abort(self, msg: Abort, source: Role) -> list[Action]:
        """Another role gave up on the request."""
        job = self.jobs.get(msg.rid)
        if job is None:  # before decoding began: only landed KV to let go of
            self.early.forget(msg.rid)
            return [Unpin(msg.rid)]
        if source is Role.MAIN_DECODE and job.state.is_in(RelayState.RELAYING, RelayState.HANDING_OFF):
            return [self.solo(job, f"MD gave up: {msg.reason.value} {msg.detail}")]
        return [Drop(job)] if self.forget(job) else []

    def stream_aborted(self, rid: str) -> list[Action]:
        """The local KV stream was aborted: if decoding had not begun, let its blocks go."""
        if rid in self.jobs:
            return []
        self.early.forget(rid)
        return [Unpin(rid)]

    def expire(self, now: float, timeout_s: float) -> list[Action]:
        """What waited in vain for its other half goes; no request outlives the timeout."""
        actions: list[Action] = [Unpin(rid) for rid in self.early.expire(now)]
        self.ended.expire(now)
        for job in list(self.jobs.values()):
            if now - job.created > timeout_s and job.state.is_in(*HOLDS_REQUEST):
                actions.append(Fail(job, "request timed out on the relay"))
        return actions

    def forget(self, job: RelayJob) -> bool:
        """The relay holds nothing more of the request; False if it had ended already."""
        if not job.state.finish(RelayState.DONE):
            return False
        self.jobs.pop(job.rid, None)
        self.ended.put(job.rid, True)
        return True
