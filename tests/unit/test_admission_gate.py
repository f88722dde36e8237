"""The admission gate's refusals and the abort that overtakes an admission, without a server."""

from dataclasses import dataclass

from shared.bus.codec import decode
from shared.bus.messages import Abort, AbortReason, ResumeReply, Role
from shared.serving.admission_gate import AdmissionGate
from shared.serving.runtime import Lifecycle


@dataclass
class _Msg:
    rid: str


class _Client:
    def __init__(self) -> None:
        self.sent: list[tuple[bytes, dict | None]] = []

    async def publish(self, subject: str, data: bytes, headers: dict | None = None) -> None:
        self.sent.append((data, headers))


class _Raw:
    subject, reply = "ask", "inbox"

    def __init__(self) -> None:
        self._client = _Client()

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
    raw = _Raw()
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
