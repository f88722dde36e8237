"""Render one trace as a per-datacenter, per-service text waterfall, or as JSON.

Spans are grouped by datacenter, then by service instance (in order of first activity);
inside a group they are listed depth-first, indented by how many of their ancestors
belong to the same group. A group's top span whose parent lives in another service is
marked `<- service/instance`, which is how a request is seen crossing NATS or the WAN.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from shared.telemetry.span_store import SpanRecord

BAR_WIDTH = 40
NAME_WIDTH = 44


def _ms(ns: int) -> float:
    return ns / 1e6


def _group(s: SpanRecord) -> tuple[str, str]:
    return s.datacenter or "?", f"{s.service}/{s.instance}" if s.instance else s.service


def _ordered(spans: Sequence[SpanRecord]) -> list[tuple[SpanRecord, int]]:
    """(span, depth within its group) in per-group depth-first order, groups by first start."""
    by_id = {s.span_id: s for s in spans}
    children: dict[str | None, list[SpanRecord]] = defaultdict(list)
    for s in spans:
        parent = s.parent_span_id if s.parent_span_id in by_id else None
        children[parent].append(s)
    out: list[tuple[SpanRecord, int]] = []

    def walk(s: SpanRecord, depth: int) -> None:
        out.append((s, depth))
        for c in sorted(children[s.span_id], key=lambda c: c.start_ns):
            walk(c, depth + 1 if _group(c) == _group(s) else 0)

    for root in sorted(children[None], key=lambda s: s.start_ns):
        walk(root, 0)
    # Stable sort keeps depth-first order inside each group.
    first: dict[tuple[str, str], int] = {}
    for s, _ in out:
        first[_group(s)] = min(first.get(_group(s), s.start_ns), s.start_ns)
    return sorted(out, key=lambda sd: (_group(sd[0])[0], first[_group(sd[0])], _group(sd[0])[1]))


def _bar(s: SpanRecord, t0: int, total: int) -> str:
    start = min(BAR_WIDTH - 1, int((s.start_ns - t0) / total * BAR_WIDTH))
    length = max(1, round(s.duration_ns / total * BAR_WIDTH))
    length = min(length, BAR_WIDTH - start)
    return "|" + " " * start + "█" * length + " " * (BAR_WIDTH - start - length) + "|"


def render_waterfall(spans: Sequence[SpanRecord]) -> str:
    """Text waterfall: start offset and duration in ms, bars scaled to the trace duration."""
    if not spans:
        return "(no spans)\n"
    t0 = min(s.start_ns for s in spans)
    total = max(1, max(s.end_ns for s in spans) - t0)
    by_id = {s.span_id: s for s in spans}
    dcs = sorted({_group(s)[0] for s in spans})
    lines = [
        f"trace {spans[0].trace_id}  {_ms(total):.1f} ms  {len(spans)} spans  {', '.join(dcs)}",
        f"{'':{NAME_WIDTH}} {'start':>9} {'dur':>9}  0 ms{'':{BAR_WIDTH - 12}}{_ms(total):>8.1f} ms",
    ]
    current: tuple[str, str] | None = None
    for s, depth in _ordered(spans):
        dc, svc = _group(s)
        if current is None or current[0] != dc:
            lines.append(dc)
        if current != (dc, svc):
            lines.append(f"  {svc}")
        current = (dc, svc)
        name = "    " + "  " * depth + s.name + (" !" if s.status == "ERROR" else "")
        parent = by_id.get(s.parent_span_id or "")
        if depth == 0 and parent is not None and _group(parent) != (dc, svc):
            name += f"  <- {_group(parent)[1]}"
        if len(name) > NAME_WIDTH:
            name = name[: NAME_WIDTH - 1] + "…"
        lines.append(
            f"{name:{NAME_WIDTH}} {_ms(s.start_ns - t0):9.1f} {_ms(s.duration_ns):9.1f}  {_bar(s, t0, total)}"
        )
    return "\n".join(lines) + "\n"


def trace_to_json(spans: Sequence[SpanRecord]) -> dict[str, Any]:
    """The trace as JSON for `GET /v1/traces/{id}`: spans with offsets/durations in ms."""
    if not spans:
        return {"trace_id": None, "duration_ms": 0.0, "datacenters": [], "services": [], "spans": []}
    t0 = min(s.start_ns for s in spans)
    ordered = [s for s, _ in _ordered(spans)]
    return {
        "trace_id": spans[0].trace_id,
        "start_ns": t0,
        "duration_ms": _ms(max(s.end_ns for s in spans) - t0),
        "datacenters": sorted({s.datacenter for s in spans}),
        "services": list(dict.fromkeys(_group(s)[1] for s in ordered)),
        "spans": [
            {**s.to_json(), "offset_ms": _ms(s.start_ns - t0), "duration_ms": _ms(s.duration_ns)}
            for s in ordered
        ],
    }
