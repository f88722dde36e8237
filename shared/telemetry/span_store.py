"""Local span store: the embedded default when no OTLP collector is configured.

Every process appends finished spans as JSON lines to its own file
`<dir>/<service>-<instance>-<pid>.jsonl`, so the processes that `pdd up` starts share one
directory without interleaving writes. `pdd trace` and the router's `GET /v1/traces/{id}`
read the directory back. Each file is capped: past `max_bytes` it is renamed to `.jsonl.1`
(replacing the previous one), so a process never holds more than 2 x `max_bytes` on disk.
"""

from __future__ import annotations

import json
import os
import re
import threading
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.trace import format_span_id, format_trace_id

TRACE_DIR_ENV = "PDD_TRACE_DIR"
MAX_BYTES_ENV = "PDD_TRACE_MAX_BYTES"
DEFAULT_MAX_BYTES = 16 * 1024 * 1024
REQUEST_ID_ATTR = "pdd.request_id"
DATACENTER_ATTR = "pdd.datacenter"


def default_trace_dir() -> Path:
    """`$PDD_TRACE_DIR`, else `.pdd/traces` under the current directory."""
    return Path(os.environ.get(TRACE_DIR_ENV) or Path.cwd() / ".pdd" / "traces")


@dataclass
class SpanRecord:
    """One finished span as stored on disk (ids are lowercase hex, times in ns since epoch)."""

    trace_id: str
    span_id: str
    parent_span_id: str | None
    name: str
    service: str
    instance: str
    datacenter: str
    start_ns: int
    end_ns: int
    attributes: dict[str, Any] = field(default_factory=dict)
    status: str = "UNSET"  # UNSET | OK | ERROR
    events: list[dict[str, Any]] = field(default_factory=list)

    @property
    def duration_ns(self) -> int:
        return max(0, self.end_ns - self.start_ns)

    @classmethod
    def from_span(cls, span: ReadableSpan) -> SpanRecord:
        res = span.resource.attributes
        ctx = span.get_span_context()
        return cls(
            trace_id=format_trace_id(ctx.trace_id),
            span_id=format_span_id(ctx.span_id),
            parent_span_id=format_span_id(span.parent.span_id) if span.parent else None,
            name=span.name,
            service=str(res.get("service.name", "unknown")),
            instance=str(res.get("service.instance.id", "")),
            datacenter=str(res.get(DATACENTER_ATTR, "")),
            start_ns=span.start_time or 0,
            end_ns=span.end_time or span.start_time or 0,
            attributes=_plain(span.attributes),
            status=span.status.status_code.name,
            events=[
                {"name": e.name, "time_ns": e.timestamp, "attributes": _plain(e.attributes)}
                for e in span.events
            ],
        )

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> SpanRecord:
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _plain(attrs: Any) -> dict[str, Any]:
    # OTel attribute values are scalars or tuples of scalars; tuples become JSON lists.
    return {k: list(v) if isinstance(v, tuple) else v for k, v in (attrs or {}).items()}


def _safe(part: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", part) or "_"


class JsonlSpanExporter(SpanExporter):
    """Appends spans as JSON lines to this process's file in the trace directory."""

    def __init__(self, directory: Path, service: str, instance: str, max_bytes: int | None = None) -> None:
        self.directory = Path(directory)
        self.path = self.directory / f"{_safe(service)}-{_safe(instance)}-{os.getpid()}.jsonl"
        self.max_bytes = max_bytes or int(os.environ.get(MAX_BYTES_ENV) or DEFAULT_MAX_BYTES)
        self._lock = threading.Lock()  # SimpleSpanProcessor exports on whichever thread ends a span

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        lines = "".join(json.dumps(SpanRecord.from_span(s).to_json(), default=str) + "\n" for s in spans)
        try:
            with self._lock:
                self.directory.mkdir(parents=True, exist_ok=True)
                if self.path.exists() and self.path.stat().st_size > self.max_bytes:
                    self.path.replace(self.path.with_suffix(".jsonl.1"))
                with self.path.open("a", encoding="utf-8") as f:
                    f.write(lines)
        except OSError:
            return SpanExportResult.FAILURE
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:  # nothing held open between exports
        pass

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


def iter_spans(directory: Path | str, needle: str | None = None) -> Iterator[SpanRecord]:
    """Every span in the store; `needle` skips lines not containing it before parsing them."""
    directory = Path(directory)
    if not directory.is_dir():
        return
    for path in sorted(directory.glob("*.jsonl*")):
        try:
            with path.open(encoding="utf-8") as f:
                for line in f:
                    if needle and needle not in line:
                        continue
                    try:
                        yield SpanRecord.from_json(json.loads(line))
                    except (ValueError, TypeError):
                        continue  # a torn last line of a killed process
        except OSError:
            continue


def load_trace(directory: Path | str, trace_id: str) -> list[SpanRecord]:
    """All spans of one trace, ordered by start time."""
    trace_id = trace_id.lower()
    spans = {s.span_id: s for s in iter_spans(directory, trace_id) if s.trace_id == trace_id}
    return sorted(spans.values(), key=lambda s: (s.start_ns, s.span_id))


def find_trace_id(directory: Path | str, request_id: str) -> str | None:
    """Trace id of the request whose spans carry `pdd.request_id == request_id` (latest wins)."""
    best: SpanRecord | None = None
    for s in iter_spans(directory, request_id):
        if s.attributes.get(REQUEST_ID_ATTR) == request_id and (best is None or s.start_ns > best.start_ns):
            best = s
    return best.trace_id if best else None
