"""The admission gate's refusals, the abort that overtakes an admission and repeats of a request,
without a server."""

import asyncio
from dataclasses import dataclass, field
from typing import Any

from nats.aio.msg import Msg

from shared.bus.codec import decode
from shared.bus.connection import respond
from shared.bus.messages import Abort, AbortReason, ResumeReply, Role
from shared.serving.job_admission import AdmissionGate
from shared.serving.runtime import Lifecycle


@dataclass
class _Msg:
    rid: str


@dataclass
class _Msg2:
    rid: str
    n: int


class _Client:
    def __init__(self) -> None:
        self.sent: list[tuple[bytes, dict | None]] = []

    async def publish(self, subject: str, data: bytes, headers: dict | None = None) -> None:
        self.sent.append((data, headers))


@dataclass
class _Raw(Msg):
    _client: Any = field(default_factory=_Client)
    subject: str = "ask"
    reply: str = "inbox"

    def reply_msg(self) -> ResumeReply:
        return decode(ResumeReply, self._client.sent[-1][0])


def _gate(jobs: dict, aborted: dict, late: list) -> AdmissionGate:
    async def late_abort(msg: Abort, source: Role) -> None:
        late.append((msg.rid, source))

    return AdmissionGate(Lifecycle(), None, jobs, aborted, late_abort)


async def test_a_held_or_aborted_request_id_is_refused_and_admit_is_not_called() -> None:
    abort = Abort("gone", AbortReason.FAILED)
    gate, calls = _gate({"held": object()}, {"gone": (0.0, abort, Role.ROUTER)}, []), []

    async def admit(msg, raw) -> None:
        calls.append(msg.rid)

    for rid, error in [("held", "duplicate request id held"), ("gone", "request gone was aborted")]:
        raw = _Raw()
        await gate.admit(_Msg(rid), raw, ResumeReply, admit)
        assert raw.reply_msg() == ResumeReply(ok=False, error=error)
    gate, raw = _gate({}, {"gone": (0.0, abort, Role.ROUTER)}, []), _Raw()  # (a fresh gate: not a repeat)
    await gate.admit(_Msg("gone"), raw, ResumeReply, admit, if_aborted=lambda m: ResumeReply(ok=True))
    assert raw.reply_msg().ok and calls == []


async def test_an_abort_heard_during_admission_wins_and_in_flight_counts_the_admission() -> None:
    jobs: dict = {}
    aborted: dict = {}
    late: list = []
    gate = _gate(jobs, aborted, late)

    async def admit(msg, raw) -> None:
        assert gate.in_flight == 1
        jobs[msg.rid] = object()
        aborted[msg.rid] = (0.0, Abort(msg.rid, AbortReason.ROUTER_LOST), Role.ROUTER)  # overtook it

    await gate.admit(_Msg("r"), _Raw(), ResumeReply, admit)
    assert late == [("r", Role.ROUTER)] and gate.in_flight == 0


async def test_a_closed_gate_answers_with_a_service_error() -> None:
    gate, raw = _gate({}, {}, []), _Raw()
    gate.close("relay 0 is leaving")

    async def admit(msg, raw) -> None:
        raise AssertionError("admitted while leaving")

    await gate.admit(_Msg("r"), raw, ResumeReply, admit)
    data, headers = raw._client.sent[-1]
    assert data == b"" and headers == {
        "Nats-Service-Error-Code": "503",
        "Nats-Service-Error": "relay 0 is leaving",
    }


async def test_a_repeat_of_a_request_gets_the_first_answer_and_is_admitted_once() -> None:
    jobs: dict = {}
    gate, calls, go = _gate(jobs, {}, []), [], asyncio.Event()

    async def admit(msg, raw) -> None:
        calls.append(msg.rid)
        await go.wait()  # (say it waits for KV memory)
        jobs[msg.rid] = object()
        await respond(raw, ResumeReply(ok=True, error=f"answer {len(calls)}"))

    first, during, after = _Raw(), _Raw(reply="inbox2"), _Raw(reply="inbox3")
    admitting = asyncio.ensure_future(gate.admit(_Msg("r"), first, ResumeReply, admit))
    await asyncio.sleep(0)
    await gate.admit(_Msg("r"), during, ResumeReply, admit)  # the same message while it is admitted
    assert not during._client.sent
    go.set()
    await admitting
    await gate.admit(_Msg("r"), after, ResumeReply, admit)  # and once it was answered
    assert calls == ["r"]
    assert (
        first.reply_msg() == during.reply_msg() == after.reply_msg() == ResumeReply(ok=True, error="answer 1")
    )
    other = _Raw()
    await gate.admit(_Msg2("r", 2), other, ResumeReply, admit)  # another message under that id
    assert other.reply_msg() == ResumeReply(ok=False, error="duplicate request id r") and calls == ["r"]
