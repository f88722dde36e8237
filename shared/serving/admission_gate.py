"""The way into an engine service: messages that create a job. Refuses them while the service
is leaving, for a request id it already holds, or for one aborted lately; counts admissions
under way, so a drain waits for those too; lets an abort that overtook its admission win."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from shared.bus.connection import respond, respond_error
from shared.bus.messages import Abort, Role
from shared.serving.runtime import Lifecycle

Admit = Callable[[Any, Any], Awaitable[None]]  # (message, raw NATS message): creates the job and replies
RecentAborts = Mapping[str, tuple[float, Abort, Role]]  # rid -> (when heard, the abort, its source)


class AdmissionGate:
    def __init__(
        self,
        life: Lifecycle,
        nc: Any,
        jobs: Mapping[str, Any],
        aborted: RecentAborts,
        late_abort: Callable[[Abort, Role], Awaitable[None]],
    ):
        self.life = life
        self.nc = nc
        self.jobs = jobs
        self.aborted = aborted
        self.late_abort = late_abort  # the service's handler for an abort of a job it holds
        self.in_flight = 0  # admissions under way (not jobs yet)
        self.closed: str | None = None  # why new work is refused (the service is leaving)

    def close(self, why: str) -> None:
        self.closed = why

    async def subscribe(
        self,
        subject: str,
        cls: type,
        reply_cls: type,
        admit: Admit,
        queue: str = "",
        if_aborted: Callable[[Any], Any] | None = None,
    ) -> None:
        """Admission waits for the engine thread (up to one step), so it runs off the
        subscription: requests arriving together are admitted together. A duplicate request id
        is refused with `reply_cls(ok=False, error=...)`; so is one already aborted, unless
        `if_aborted(msg)` gives the reply for that."""

        async def on_message(msg: Any, raw: Any) -> None:
            self.life.spawn(self.admit(msg, raw, reply_cls, admit, if_aborted))

        await self.life.endpoint(self.nc, subject, cls, on_message, queue=queue)

    async def admit(
        self,
        msg: Any,
        raw: Any,
        reply_cls: type,
        admit: Admit,
        if_aborted: Callable[[Any], Any] | None = None,
    ) -> None:
        if self.closed is not None:
            # A service error: the router's request raises and it takes the request elsewhere.
            await respond_error(raw, "503", self.closed)
            return
        self.in_flight += 1
        try:
            await self._admit_new(msg, raw, reply_cls, admit, if_aborted)
        finally:
            self.in_flight -= 1

    async def _admit_new(
        self,
        msg: Any,
        raw: Any,
        reply_cls: type,
        admit: Admit,
        if_aborted: Callable[[Any], Any] | None,
    ) -> None:
        if msg.rid in self.jobs:
            await respond(raw, reply_cls(ok=False, error=f"duplicate request id {msg.rid}"))
        elif msg.rid in self.aborted:
            refusal = reply_cls(ok=False, error=f"request {msg.rid} was aborted")
            await respond(raw, if_aborted(msg) if if_aborted else refusal)
        else:
            await admit(msg, raw)
            late = self.aborted.get(msg.rid)
            if late is not None and msg.rid in self.jobs:  # its abort overtook the admission
                await self.late_abort(*late[1:])
