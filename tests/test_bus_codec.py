from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import msgpack
import pytest

from shared.bus import Message, MessageError, decode, encode, subjects


@dataclass
class Inner(Message):
    a: int
    b: str = "x"


@dataclass
class Outer(Message):
    V: ClassVar[int] = 2
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


def sample() -> Outer:
    return Outer(
        rid="r1", n=3, score=0.5, ok=True, raw=b"\x00\xff", ids=[1, 2], tags={"t": 1.5},
        inner=Inner(7), inners=[Inner(1, "y")], maybe=4, by_id={5: "five"},
    )  # fmt: skip


def test_round_trip() -> None:
    msg = sample()
    assert decode(Outer, encode(msg)) == msg
    wire = msgpack.unpackb(encode(msg), strict_map_key=False)
    assert wire["v"] == 2 and wire["inner"]["v"] == 1


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
        (_mutated(inner={"a": "1", "v": 1}), "inner.a"),
        (_mutated(maybe="x"), ".maybe"),
    ],
)
def test_malformed_is_rejected(data: bytes, why: str) -> None:
    with pytest.raises(MessageError, match=why.replace("[", r"\[").replace("]", r"\]")):
        decode(Outer, data)


def test_subjects() -> None:
    assert subjects.prefill_submit() == "pdd.prefill.submit"
    assert subjects.prefill_submit_to("0") == "pdd.prefill.0.submit"
    assert subjects.md_prepare("1") == "pdd.md.1.prepare"
    assert subjects.req_tokens("abc") == "pdd.req.abc.tokens"
    assert subjects.req_kv_ready("abc") == "pdd.req.abc.kv_ready"
    assert subjects.req_handoff("abc") == "pdd.req.abc.handoff"
    assert subjects.req_handoff_ack("abc") == "pdd.req.abc.handoff_ack"
    assert subjects.req_abort("abc") == "pdd.req.abc.abort"
    assert subjects.kv_events("md0") == "pdd.kv.events.md0"
    assert subjects.load("relay", "0") == "pdd.load.relay.0"
    assert subjects.all_kv_events() == "pdd.kv.events.*"
    assert subjects.all_load() == "pdd.load.*.*"
    for bad in ("a.b", "a b", "*", ">", ""):
        with pytest.raises(ValueError):
            subjects.req_tokens(bad)
