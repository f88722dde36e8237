"""The span store over the bus: what one store answers (bounded), how the router merges the
answers (deduplicated, partial when a DC is silent), and who may ask."""

from __future__ import annotations

import json
from pathlib import Path

from shared.bus import subjects
from shared.bus.codec import decode, encode
from shared.bus.messages import Role, TraceQuery, TraceSpans
from shared.bus.permissions import PERMISSIONS
from shared.telemetry.span_bus import answer, bounded, merge
from shared.telemetry.span_store import SpanRecord

TID = "ab" * 16


def span(sid: str, dc: str, start: int, tid: str = TID, rid: str = "") -> SpanRecord:
    attrs = {"pdd.request_id": rid} if rid else {}
    return SpanRecord(tid, sid, None, f"op-{sid}", "svc", "0", dc, start, start + 10, attrs)


def reply(dc: str, role: Role, *spans: SpanRecord, truncated: bool = False) -> TraceSpans:
    return TraceSpans(dc, role, "0", [json.dumps(s.to_json()) for s in spans], truncated)


def test_bounded_keeps_the_earliest_spans_that_fit():
    spans = [span(f"{i:016x}", "dc-b", i) for i in range(10)]
    one = len(json.dumps(spans[0].to_json()))
    kept, cut = bounded(spans, 3 * one)
    assert [json.loads(line)["start_ns"] for line in kept] == [0, 1, 2] and cut
    assert bounded(spans, 10**6) == ([json.dumps(s.to_json()) for s in spans], False)


def test_a_store_answers_by_trace_id_or_request_id(tmp_path: Path):
    lines = [span("1" * 16, "dc-b", 5, rid="r1"), span("2" * 16, "dc-b", 6, tid="cd" * 16)]
    (tmp_path / "md-0-1.jsonl").write_text("".join(json.dumps(s.to_json()) + "\n" for s in lines))
    assert [json.loads(x)["span_id"] for x in answer(tmp_path, TraceQuery(trace_id=TID))[0]] == ["1" * 16]
    assert [json.loads(x)["span_id"] for x in answer(tmp_path, TraceQuery(request_id="r1"))[0]] == ["1" * 16]
    assert answer(tmp_path, TraceQuery(request_id="nobody")) == ([], False)


def test_answers_round_trip_the_codec():
    r = reply("dc-b", Role.MAIN_DECODE, span("1" * 16, "dc-b", 5, rid="r1"))
    assert decode(TraceSpans, encode(r)) == r


def test_merge_dedups_by_span_id_and_marks_a_silent_dc():
    shared = span("1" * 16, "dc-a", 1)
    got = merge(
        [shared],
        [reply("dc-a", Role.PREFILL, shared), reply("dc-a", Role.RELAY, shared)],
        ["dc-a", "dc-b"],
        expected=["prefill/0", "relay/0", "main_decode/0"],
    )
    assert [s.span_id for s in got.spans] == ["1" * 16]
    assert got.missing == ["dc-b"] and got.unanswered == ["main_decode/0"] and got.partial


def test_merge_orders_both_dcs_and_reports_truncation():
    a, b = span("1" * 16, "dc-a", 1), span("2" * 16, "dc-b", 2)
    got = merge([a], [reply("dc-b", Role.MAIN_DECODE, b, truncated=True)], ["dc-a", "dc-b"])
    assert [s.datacenter for s in got.spans] == ["dc-a", "dc-b"]
    assert got.missing == ["dc-a"]  # the local store is not an answer
    assert got.truncated == ["dc-b/main_decode/0"] and got.partial


def test_merge_by_request_id_keeps_the_latest_trace_of_it():
    old = span("1" * 16, "dc-b", 1, tid="cd" * 16, rid="r1")
    new = span("2" * 16, "dc-b", 9, rid="r1")
    got = merge(
        [],
        [reply("dc-b", Role.MAIN_DECODE, old), reply("dc-b", Role.PREFILL, new)],
        ["dc-b"],
        request_id="r1",
    )
    assert [s.span_id for s in got.spans] == ["2" * 16] and not got.partial


def test_only_the_router_may_ask_and_every_engine_answers():
    asking = {name for name, p in PERMISSIONS.items() if subjects.all_traces_get() in p.publish}
    answering = {name for name, p in PERMISSIONS.items() if subjects.all_traces_get() in p.subscribe}
    assert asking == {"router"}
    assert answering == {"prefill", "relay", "main_decode"}
    assert all(PERMISSIONS[n].responds for n in answering)
    assert subjects.traces_get("dc-b") == "pdd.traces.dc-b.get"
