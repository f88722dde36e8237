from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from enum import StrEnum
from typing import ClassVar

import msgpack
import pytest

from shared.bus import Message, MessageError, decode, encode, messages, subjects
from shared.bus.subjects import Req
from shared.engine import SamplingParams


class Color(StrEnum):
    RED = "red"
    BLUE = "blue"


@dataclass
class Plain:  # a plain dataclass travels as a map without a version
    x: int
    names: list[str] = field(default_factory=list)


@dataclass
class Inner(Message):
    a: int
    b: str = "x"


@dataclass
class Outer(Message):
    V: ClassVar[int] = 3
    rid: str
    n: int
    score: float
    ok: bool
    raw: bytes
    ids: list[int]
    tags: dict[str, float]
    inner: Inner
    inners: list[Inner] = field(default_factory=list)
    maybe: int | None = None
    by_id: dict[int, str] = field(default_factory=dict)
    color: Color = Color.RED
    plain: Plain | None = None


def sample() -> Outer:
    return Outer(
        rid="r1",
        n=3,
        score=0.5,
        ok=True,
        raw=b"\x00\xff",
        ids=[1, 2],
        tags={"t": 1.5},
        inner=Inner(7),
        inners=[Inner(1, "y")],
        maybe=4,
        by_id={5: "five"},
        color=Color.BLUE,
        plain=Plain(2, ["a"]),
    )


def test_round_trip() -> None:
    msg = sample()
    assert decode(Outer, encode(msg)) == msg
    wire = msgpack.unpackb(encode(msg), strict_map_key=False)
    assert wire["v"] == 3 and wire["inner"]["v"] == Message.V
    assert wire["color"] == "blue" and wire["plain"] == {"x": 2, "names": ["a"]}  # enum by value, no "v"
    got = decode(Outer, encode(msg))
    assert got.color is Color.BLUE and isinstance(got.plain, Plain)


def test_defaults_may_be_omitted_and_int_is_accepted_for_float() -> None:
    wire = msgpack.unpackb(encode(sample()), strict_map_key=False)
    del wire["inners"], wire["maybe"]
    wire["score"] = 1
    got = decode(Outer, msgpack.packb(wire))
    assert got.inners == [] and got.maybe is None and got.score == 1.0 and isinstance(got.score, float)


def _mutated(**changes: object) -> bytes:
    wire = msgpack.unpackb(encode(sample()), strict_map_key=False)
    for k, v in changes.items():
        if v is KeyError:
            del wire[k]
        else:
            wire[k] = v
    return msgpack.packb(wire)


@pytest.mark.parametrize(
    "data, why",
    [
        (b"\xc1", "bad msgpack"),
        (msgpack.packb([1, 2]), "expected a map"),
        (encode(sample()) + b"\x00", "bad msgpack"),  # trailing bytes
        (_mutated(v=1), "schema version"),
        (_mutated(v=KeyError), "schema version"),
        (_mutated(rid=KeyError), "missing fields"),
        (_mutated(extra=1), "unknown fields"),
        (_mutated(n="3"), ".n"),
        (_mutated(n=True), ".n"),  # bool is not an int
        (_mutated(score="x"), ".score"),
        (_mutated(ids=[1, "2"]), ".ids[1]"),
        (_mutated(tags={"t": "x"}), ".tags"),
        (_mutated(raw="text"), ".raw"),
        (_mutated(inner={"a": 1}), "inner: schema version"),
        (_mutated(inner={"a": "1", "v": Message.V}), "inner.a"),
        (_mutated(maybe="x"), ".maybe"),
        (_mutated(color="green"), "color: 'green' is not one of"),
        (_mutated(color=1), ".color"),
        (_mutated(plain={"x": "2"}), "plain.x"),
        (_mutated(plain={"x": 2, "v": 1}), "plain: unknown fields"),
    ],
)
def test_malformed_is_rejected(data: bytes, why: str) -> None:
    with pytest.raises(MessageError, match=why.replace("[", r"\[").replace("]", r"\]")):
        decode(Outer, data)


def _sample_value(tp: object, name: str) -> object:
    """A non-default value for a field of a protocol message (exercises nested types)."""
    import typing

    if isinstance(tp, type) and issubclass(tp, StrEnum):
        return list(tp)[-1]
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return _sample_message(tp)
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is list:
        return [_sample_value(args[0], name)]
    if args:  # X | None
        return _sample_value(args[0], name)
    return {int: 7, float: 0.25, bool: True, str: f"{name}-1", bytes: b"\x01"}[tp]


def _sample_message(cls: type) -> object:
    import typing

    hints = typing.get_type_hints(cls)
    if cls is SamplingParams:
        return SamplingParams(temperature=0.5, max_tokens=9, stop=["x"], seed=3)
    return cls(**{f.name: _sample_value(hints[f.name], f.name) for f in dataclasses.fields(cls)})


PROTOCOL = [
    c for c in vars(messages).values() if isinstance(c, type) and issubclass(c, Message) and c is not Message
]


@pytest.mark.parametrize("cls", PROTOCOL, ids=lambda c: c.__name__)
def test_every_protocol_message_round_trips_typed(cls: type) -> None:
    msg = _sample_message(cls)
    got = decode(cls, encode(msg))
    assert got == msg
    for f in dataclasses.fields(cls):  # enums come back as enum members, not bare strings
        assert type(getattr(got, f.name)) is type(getattr(msg, f.name)), f.name


def test_protocol_has_no_untyped_fields() -> None:
    """Meaning travels in typed fields: no Any, no free dicts."""
    import typing

    for cls in PROTOCOL:
        for name, tp in typing.get_type_hints(cls).items():
            if name == "V":
                continue
            assert tp is not typing.Any and typing.get_origin(tp) is not dict, f"{cls.__name__}.{name}: {tp}"


def test_an_unknown_enum_value_is_refused_at_the_edge() -> None:
    wire = msgpack.unpackb(encode(messages.Abort("r", messages.AbortReason.FINISHED)))
    wire["reason"] = "md_lost"  # a reason that no longer exists
    with pytest.raises(MessageError, match="reason"):
        decode(messages.Abort, msgpack.packb(wire))


def _matches(pattern: str, subject: str) -> bool:
    """NATS matching for the wildcards we use (`*` = exactly one token)."""
    p, s = pattern.split("."), subject.split(".")
    return len(p) == len(s) and all(a in ("*", b) for a, b in zip(p, s, strict=True))


def test_each_request_subject_is_caught_by_its_own_wildcard_only() -> None:
    for kind in Req:
        subject = subjects.req("abc", kind)
        assert subject.startswith("pdd.req.abc.")
        for other in Req:
            assert _matches(subjects.all_req(other), subject) == (other is kind), (kind, other)
        assert not _matches(subjects.all_req(kind), subjects.req("abc", kind) + ".x")
    assert len({subjects.req("abc", k) for k in Req}) == len(Req)


def test_an_abort_names_its_sender_in_the_subject() -> None:
    for role in messages.Role:
        subject = subjects.abort("abc", role.value)
        assert _matches(subjects.all_aborts(), subject) and subjects.abort_source(subject) == role.value
        assert not any(_matches(subjects.all_req(kind), subject) for kind in Req)
    assert not _matches(subjects.all_aborts(), subjects.req("abc", Req.TOKENS))


def test_service_subjects_are_distinct_and_caught_by_their_wildcards() -> None:
    singles = [
        subjects.prefill_submit(),
        subjects.prefill_submit_to("0"),
        subjects.md_prepare("0"),
        subjects.kv_events("main_decode", "0"),
        subjects.kv_events("prefill", "0"),
        subjects.kv_snapshot("main_decode", "0"),
        subjects.kv_snapshot("prefill", "0"),
        subjects.load("relay", "0"),
        subjects.req("0", Req.TOKENS),
        subjects.router_tokens("0"),
    ]
    assert len(set(singles)) == len(singles) and all(s.startswith("pdd.") for s in singles)
    assert _matches(subjects.all_kv_events(), subjects.kv_events("main_decode", "md0"))
    assert _matches(subjects.all_kv_events("prefill"), subjects.kv_events("prefill", "p0"))
    assert not _matches(subjects.all_kv_events("prefill"), subjects.kv_events("main_decode", "p0"))
    assert subjects.kv_events_source(subjects.kv_events("prefill", "p0")) == ("prefill", "p0")
    assert not _matches(subjects.all_kv_events(), subjects.kv_snapshot("main_decode", "events"))
    assert _matches(subjects.all_load(), subjects.load("main_decode", "md0"))
    assert not _matches(subjects.all_load(), subjects.kv_events("main_decode", "md0"))
    assert subjects.prefill_submit_to("p1") != subjects.prefill_submit_to("p2")
    assert _matches(subjects.all_router_tokens(), subjects.router_tokens("router-0-ab12"))
    assert not any(_matches(subjects.all_req(kind), subjects.router_tokens("r")) for kind in Req)


@pytest.mark.parametrize("bad", ["a.b", "a b", "*", ">", "", "a\tb"])
def test_ids_that_would_change_the_subject_are_refused(bad: str) -> None:
    for make in (
        lambda: subjects.req(bad, Req.TOKENS),
        lambda: subjects.md_prepare(bad),
        lambda: subjects.kv_events("prefill", bad),
        lambda: subjects.kv_snapshot("prefill", bad),
        lambda: subjects.load("relay", bad),
        lambda: subjects.router_tokens(bad),
    ):
        with pytest.raises(ValueError):
            make()


def test_a_finished_request_is_released_not_aborted_in_its_trace() -> None:
    from shared.bus.messages import AbortReason

    released = {r for r in AbortReason if r.span_name == "release"}
    assert released == {AbortReason.FINISHED, AbortReason.FINISHED_AT_PREFILL, AbortReason.RELAY_FINISHED}
    assert AbortReason.CLIENT_GONE.span_name == AbortReason.MIGRATED.span_name == "abort"
