"""The way into an engine service: messages that create a job. Refuses them while the service
is leaving, for a request id it already holds, or for one aborted lately; counts admissions
under way, so a drain waits for those too; lets an abort that overtook its admission win.

The asker sends a request again when no answer came soon (NATS delivers at most once: the
request or its answer may be lost while a server restarts). A repeat, the same message again,
gets the first one's answer: at once if it was given, else when it is (an admission may wait
for KV memory). So a request is admitted once however often it is sent.
"""

from __future__ import annotations

import dataclasses
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from shared.bus.connection import respond, respond_error
from shared.bus.messages import Abort, Role
from shared.serving.runtime import Lifecycle

Admit = Callable[[Any, Any], Awaitable[None]]  # (message, raw NATS message): creates the job and replies
RecentAborts = Mapping[str, tuple[float, Abort, Role]]  # rid -> (when heard, the abort, its source)
ANSWERS_KEPT_S = 60.0  # longer than any asker waits (its timeouts are at most 30 s)


@dataclasses.dataclass
class _Asked:
    """One admission: its message, the time it came, its answer once given (payload,
    headers) and the repeats waiting for that answer."""

    msg: Any
    at: float
    answer: tuple[bytes, Any] | None = None
    repeats: list[Any] = dataclasses.field(default_factory=list)


class _Recorder:
    """The NATS client as the admit handler sees it: what it publishes is sent and kept as the
    admission's answer."""

    def __init__(self, nc: Any, asked: _Asked) -> None:
        self._nc, self._asked = nc, asked

    async def publish(self, subject: str, payload: bytes = b"", headers: Any = None) -> None:
        await self._nc.publish(subject, payload, headers=headers)
        self._asked.answer = (payload, headers)


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
        self.asked: OrderedDict[str, _Asked] = OrderedDict()  # rid -> its admission, oldest first

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
        self.forget_old()
        asked = self.asked.get(msg.rid)
        if asked is not None and asked.msg == msg:  # a repeat: the first copy or its answer was lost
            if asked.answer is None:
                asked.repeats.append(raw)
            else:
                await self._answer(raw, asked.answer)
            return
        if self.closed is not None:
            # A service error: the router's request raises and it takes the request elsewhere.
            await respond_error(raw, "503", self.closed)
            return
        asked = _Asked(msg, time.monotonic())
        if msg.rid not in self.asked:  # (a different message under a known id is refused below)
            self.asked[msg.rid] = asked
        self.in_flight += 1
        try:
            recorded = dataclasses.replace(raw, _client=_Recorder(raw._client, asked))
            await self._admit_new(msg, recorded, reply_cls, admit, if_aborted)
        finally:
            self.in_flight -= 1
            if asked.answer is None and self.asked.get(msg.rid) is asked:
                del self.asked[msg.rid]  # the handler gave no answer: a repeat is admitted afresh
            for repeat in asked.repeats if asked.answer else ():
                await self._answer(repeat, asked.answer)

    @staticmethod
    async def _answer(raw: Any, answer: tuple[bytes, Any]) -> None:
        if raw.reply:
            await raw._client.publish(raw.reply, answer[0], headers=answer[1])

    def forget_old(self) -> None:
        cutoff = time.monotonic() - ANSWERS_KEPT_S
        while self.asked and next(iter(self.asked.values())).at < cutoff:
            self.asked.popitem(last=False)

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
