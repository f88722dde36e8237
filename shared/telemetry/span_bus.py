"""Each datacenter's span store answers over the bus, so the router's `GET /v1/traces/{id}`
shows every DC's spans when the DCs are separate hosts (no shared trace directory).

Every engine instance answers `pdd.traces.<its dc>.get` with the spans of one trace in its
host's span store. No queue group: the instances of one DC may sit on different hosts, each
with its own store; where several share one store, the router drops the duplicates by span id.
The router asks every DC it knows and waits until each DC, and each live instance it knows,
has answered, or a bounded time; a DC that did not answer makes the result partial.

This is the fallback of the embedded store. In production every service exports OTLP to one
collector (`OTEL_EXPORTER_OTLP_ENDPOINT`), which holds the whole trace by itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from shared.bus import subjects
from shared.bus.codec import MessageError, decode, encode
from shared.bus.connection import respond
from shared.bus.messages import Role, TraceQuery, TraceSpans
from shared.telemetry.span_store import (
    REQUEST_ID_ATTR,
    SpanRecord,
    default_trace_dir,
    find_trace_id,
    load_trace,
)

MAX_REPLY_BYTES = 512 * 1024  # one answer, under NATS's default max_payload (1 MiB)
GATHER_TIMEOUT_S = 2.0  # a DC's answers cross the WAN once each way, after a read of its store


def is_trace_id(value: str) -> bool:
    """32 hex digits, not all zero (W3C's invalid id: `pdd check` asks for it to read no store)."""
    return len(value) == 32 and all(c in "0123456789abcdef" for c in value.lower()) and value.strip("0") != ""


def bounded(spans: Sequence[SpanRecord], max_bytes: int) -> tuple[list[str], bool]:
    """The spans as JSON lines (in start order: a request's root and first hops first) that fit
    in max_bytes, and whether some were left out."""
    out: list[str] = []
    size = 0
    for s in spans:
        line = json.dumps(s.to_json(), default=str)
        size += len(line)
        if size > max_bytes:
            return out, True
        out.append(line)
    return out, False


def answer(
    directory: Path | str, query: TraceQuery, max_bytes: int = MAX_REPLY_BYTES
) -> tuple[list[str], bool]:
    """What one store holds of the trace asked for (by trace id, else by request id)."""
    tid = query.trace_id.lower() if is_trace_id(query.trace_id) else None
    if tid is None and query.request_id:
        tid = find_trace_id(directory, query.request_id)
    return bounded(load_trace(directory, tid), max_bytes) if tid else ([], False)


class TraceAnswers:
    """Answers `pdd.traces.<datacenter>.get` from this host's span store (read off the event loop)."""

    def __init__(self, role: Role, instance: str, datacenter: str, directory: Path | None = None) -> None:
        self.role, self.instance, self.datacenter = role, instance, datacenter
        self.store = directory or default_trace_dir()

    async def on_query(self, query: TraceQuery, raw) -> None:
        spans, truncated = await asyncio.to_thread(answer, self.store, query)
        reply = TraceSpans(self.datacenter, self.role, self.instance, spans, truncated, time.time_ns())
        await respond(raw, reply)


async def serve_traces(
    life, nc, role: Role, instance: str, datacenter: str, directory: Path | None = None
) -> None:
    """Answer a DC's trace queries outside an engine service (whose table routes them)."""
    answers = TraceAnswers(role, instance, datacenter, directory)
    await life.subscribe(nc, subjects.traces_get(datacenter), TraceQuery, answers.on_query)


async def ask(
    nc,
    datacenters: Iterable[str],
    query: TraceQuery,
    expected: Iterable[str] = (),
    timeout_s: float = GATHER_TIMEOUT_S,
) -> list[TraceSpans]:
    """Every answer to `query` from `datacenters` within timeout_s; returns early once each DC
    and each instance in `expected` ("<role>/<instance>") has answered."""
    dcs, want = set(datacenters), set(expected)
    replies: list[TraceSpans] = []
    done = asyncio.Event()

    async def on_reply(raw) -> None:
        with contextlib.suppress(MessageError):  # not an answer we can read: as if unanswered
            replies.append(decode(TraceSpans, raw.data))
        if dcs <= {r.datacenter for r in replies} and want <= {f"{r.service}/{r.instance}" for r in replies}:
            done.set()

    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox, cb=on_reply)
    try:
        for dc in sorted(dcs):
            await nc.publish(subjects.traces_get(dc), encode(query), reply=inbox)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(done.wait(), timeout_s)
    finally:
        with contextlib.suppress(Exception):  # the connection may be closing
            await sub.unsubscribe()
    return replies


@dataclass
class Gathered:
    """One trace from the local store and the DCs' answers."""

    spans: list[SpanRecord]
    answered: list[str] = field(default_factory=list)  # "<dc>/<role>/<instance>" of every answer
    missing: list[str] = field(default_factory=list)  # DCs asked that nobody answered for
    unanswered: list[str] = field(default_factory=list)  # live instances that did not answer
    truncated: list[str] = field(default_factory=list)  # answers cut to their size bound

    @property
    def partial(self) -> bool:
        return bool(self.missing or self.truncated)

    def summary(self) -> dict:
        return {
            "partial": self.partial,
            "missing_datacenters": self.missing,
            "answered": self.answered,
            "unanswered": self.unanswered,
            "truncated": self.truncated,
        }


def merge(
    local: Sequence[SpanRecord],
    replies: Sequence[TraceSpans],
    datacenters: Iterable[str],
    expected: Iterable[str] = (),
    request_id: str = "",
) -> Gathered:
    """Spans deduplicated by span id, ordered by start. Asked by request id (no trace id known
    here), the trace is that of the latest span carrying the request id, as find_trace_id does."""
    spans: dict[str, SpanRecord] = {s.span_id: s for s in local}
    for r in replies:
        for line in r.spans:
            with contextlib.suppress(ValueError, TypeError, KeyError):  # a span we cannot read: skipped
                s = SpanRecord.from_json(json.loads(line))
                spans.setdefault(s.span_id, s)
    ordered = sorted(spans.values(), key=lambda s: (s.start_ns, s.span_id))
    tagged = [s for s in ordered if s.attributes.get(REQUEST_ID_ATTR) == request_id] if request_id else []
    if tagged:
        tid = max(tagged, key=lambda s: s.start_ns).trace_id
        ordered = [s for s in ordered if s.trace_id == tid]
    heard = {f"{r.service}/{r.instance}" for r in replies}
    return Gathered(
        ordered,
        answered=sorted(f"{r.datacenter}/{r.service}/{r.instance}" for r in replies),
        missing=sorted(set(datacenters) - {r.datacenter for r in replies}),
        unanswered=sorted(set(expected) - heard),
        truncated=sorted(f"{r.datacenter}/{r.service}/{r.instance}" for r in replies if r.truncated),
    )
