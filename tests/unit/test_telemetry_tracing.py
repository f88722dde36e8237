"""Tracing: per-service resources, the local span store, and dict-carrier propagation."""

from __future__ import annotations

from pathlib import Path

import pytest
from opentelemetry import trace

from shared.telemetry import tracing
from shared.telemetry.span_store import JsonlSpanExporter, find_trace_id, load_trace


@pytest.fixture
def trace_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("PDD_TRACE_DIR", str(tmp_path))
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    return tmp_path


def test_resource_attributes_and_idempotent(trace_dir: Path) -> None:
    p = tracing.setup_tracing("prefill", "0", "dc-a")
    assert tracing.setup_tracing("prefill", "0", "dc-a") is p
    attrs = p.resource.attributes
    assert attrs["service.name"] == "prefill"
    assert attrs["service.instance.id"] == "0"
    assert attrs["pdd.datacenter"] == "dc-a"
    assert tracing.setup_tracing("main_decode", "0", "dc-b") is not p


def test_two_services_one_process_share_a_trace(trace_dir: Path) -> None:
    router = tracing.get_tracer("router", "0", "dc-a")
    md = tracing.get_tracer("main_decode", "0", "dc-b")
    with router.start_as_current_span("router.request", attributes={"pdd.request_id": "req-1"}) as root:
        headers = tracing.inject({})  # as NATS headers would carry it
    with md.start_as_current_span("md.prepare", context=tracing.extract(headers)) as child:
        assert child.get_span_context().trace_id == root.get_span_context().trace_id

    tid = find_trace_id(trace_dir, "req-1")
    assert tid == trace.format_trace_id(root.get_span_context().trace_id)
    spans = load_trace(trace_dir, tid)
    assert [s.name for s in spans] == ["router.request", "md.prepare"]
    r, m = spans
    assert (r.service, r.datacenter, r.parent_span_id) == ("router", "dc-a", None)
    assert (m.service, m.datacenter, m.parent_span_id) == ("main_decode", "dc-b", r.span_id)
    assert {p.name.split("-")[0] for p in trace_dir.glob("*.jsonl")} == {"router", "main_decode"}


def test_traceparent_roundtrip(trace_dir: Path) -> None:
    tracer = tracing.get_tracer("relay", "0", "dc-a")
    assert tracing.traceparent() is None
    with tracer.start_as_current_span("relay.decode") as span:
        tp = tracing.traceparent()
    assert tp is not None and tp.startswith("00-")
    parent = trace.get_current_span(tracing.context_from_traceparent(tp)).get_span_context()
    assert parent.trace_id == span.get_span_context().trace_id
    assert parent.span_id == span.get_span_context().span_id
    assert not trace.get_current_span(tracing.context_from_traceparent("garbage")).get_span_context().is_valid
    assert not trace.get_current_span(tracing.extract(None)).get_span_context().is_valid


def test_span_store_rotates(tmp_path: Path) -> None:
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    from shared.telemetry.span_store import JsonlSpanExporter

    exporter = JsonlSpanExporter(tmp_path, "prefill", "0", max_bytes=2000)
    provider = TracerProvider(resource=Resource.create({"service.name": "prefill"}))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("t")
    for i in range(50):
        with tracer.start_as_current_span(f"s{i}"):
            pass
    files = sorted(tmp_path.iterdir())
    assert len(files) == 2 and all(f.stat().st_size < 4000 for f in files)


def test_flush_keeps_other_services_tracing(trace_dir: Path) -> None:
    a = tracing.get_tracer("prefill", "1", "dc-a")
    b = tracing.get_tracer("relay", "1", "dc-a")
    tracing.shutdown_tracing()  # one service stopping must not silence the others
    with a.start_as_current_span("after-a", attributes={"pdd.request_id": "r-a"}):
        pass
    with b.start_as_current_span("after-b", attributes={"pdd.request_id": "r-b"}):
        pass
    assert find_trace_id(trace_dir, "r-a") and find_trace_id(trace_dir, "r-b")


def test_otlp_when_endpoint_set(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    def exporters(provider) -> list[type]:
        procs = provider._active_span_processor._span_processors  # no public accessor
        return [type(p.span_exporter) for p in procs]

    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9")  # no span is ever ended here
    monkeypatch.delenv("PDD_TRACE_DIR", raising=False)
    only_otlp = tracing.setup_tracing("router", "otlp", "dc-a")
    monkeypatch.setenv("PDD_TRACE_DIR", str(tmp_path))  # explicit local store as well
    both = tracing.setup_tracing("router", "otlp", "dc-a")
    try:
        assert exporters(only_otlp) == [OTLPSpanExporter]
        assert exporters(both) == [OTLPSpanExporter, JsonlSpanExporter]
    finally:
        only_otlp.shutdown()  # nothing may try to reach the fake collector later
        both.shutdown()
