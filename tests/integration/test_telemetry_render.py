"""Waterfall text/JSON rendering, and the values a service's /metrics endpoint reports."""

from __future__ import annotations

import httpx
import pytest

from shared.ports import free_port
from shared.telemetry import metrics
from shared.telemetry.span_store import SpanRecord
from shared.telemetry.vllm_metrics import EngineMetrics
from shared.telemetry.waterfall import render_waterfall, trace_to_json
from tests.prometheus_samples import moved, scrape

MS = 1_000_000
TID = "4bf92f3577b34da6a3ce929d0e0e4736"


def _span(sid: str, parent: str | None, name: str, svc: str, dc: str, start: int, end: int) -> SpanRecord:
    return SpanRecord(TID, sid, parent, name, svc, "0", dc, start * MS, end * MS)


SPANS = [
    _span("a1", None, "router.request", "router", "dc-a", 0, 100),
    _span("a2", "a1", "router.route", "router", "dc-a", 1, 2),
    _span("p1", "a1", "prefill.request", "prefill", "dc-a", 2, 30),
    _span("p2", "p1", "prefill.forward", "prefill", "dc-a", 3, 20),
    _span("m1", "p1", "md.receive_kv", "main_decode", "dc-b", 10, 60),
    _span("m2", "m1", "md.extend", "main_decode", "dc-b", 60, 65),
]


def test_waterfall_groups_by_dc_and_service() -> None:
    text = render_waterfall(SPANS)
    lines = text.splitlines()
    assert TID in lines[0] and "100.0 ms" in lines[0]
    for needle in ("dc-a", "dc-b", "router/0", "prefill/0", "main_decode/0", "md.extend"):
        assert any(needle in line for line in lines), needle
    assert lines.index("dc-a") < lines.index("dc-b")
    # nesting by indentation, and the cross-service parent is named
    fwd = next(line for line in lines if "prefill.forward" in line)
    req = next(line for line in lines if "prefill.request" in line)
    assert len(fwd) - len(fwd.lstrip()) > len(req) - len(req.lstrip())
    assert "<- router/0" in req
    assert "<- prefill/0" in next(line for line in lines if "md.receive_kv" in line)
    # bar of the root spans the whole width
    root = next(line for line in lines if "router.request" in line)
    assert "|" + "█" * 40 + "|" in root
    assert render_waterfall([]) == "(no spans)\n"


def test_trace_to_json() -> None:
    data = trace_to_json(SPANS)
    assert data["trace_id"] == TID
    assert data["datacenters"] == ["dc-a", "dc-b"]
    assert data["duration_ms"] == 100.0
    assert {s["span_id"] for s in data["spans"]} == {s.span_id for s in SPANS}
    md = next(s for s in data["spans"] if s["span_id"] == "m1")
    assert (md["offset_ms"], md["duration_ms"], md["parent_span_id"]) == (10.0, 50.0, "p1")


def test_metrics_endpoint_serves_the_recorded_values() -> None:
    """What services record reaches their /metrics endpoint, each value in its bucket."""
    port = free_port()
    metrics.start_metrics_server(port, addr="127.0.0.1")
    url = f"http://127.0.0.1:{port}/metrics"
    before = scrape(url)
    metrics.REQUESTS.labels(pipeline="p-md", outcome="ok").inc()
    metrics.TTFT.labels(pipeline="p-md").observe(0.3)
    metrics.PREFIX_HIT_RATE.observe(0.96)
    metrics.KV_BYTES.labels(path="wan").inc(4096)
    after = scrape(url)
    assert moved(before, after, "pdd_requests_total", pipeline="p-md", outcome="ok") == 1
    assert moved(before, after, "pdd_ttft_seconds_count", pipeline="p-md") == 1
    assert moved(before, after, "pdd_ttft_seconds_sum", pipeline="p-md") == pytest.approx(0.3)
    assert moved(before, after, "pdd_ttft_seconds_bucket", pipeline="p-md", le="0.25") == 0
    assert moved(before, after, "pdd_ttft_seconds_bucket", pipeline="p-md", le="0.5") == 1
    # hit rates are bucketed finely at the top, where most agentic requests land
    assert moved(before, after, "pdd_prefix_hit_rate_bucket", le="0.95") == 0
    assert moved(before, after, "pdd_prefix_hit_rate_bucket", le="0.97") == 1
    assert moved(before, after, "pdd_kv_bytes_total", path="wan") == 4096


def test_metrics_endpoint_keeps_vllms_names_for_an_openmetrics_scraper() -> None:
    """Prometheus asks for OpenMetrics first; the answer is the text format, ':' kept."""
    port = free_port()
    metrics.start_metrics_server(port, addr="127.0.0.1")
    EngineMetrics("m-endpoint", "e0")  # its series exist from the start, at 0
    accept = (  # what Prometheus 2.42 sends
        "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,"
        "text/plain;version=0.0.4;q=0.5,*/*;q=0.1"
    )
    r = httpx.get(f"http://127.0.0.1:{port}/metrics", headers={"Accept": accept}, timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    lines = r.text.splitlines()
    assert 'vllm:num_requests_running{engine="e0",model_name="m-endpoint"} 0.0' in lines
    assert not any(line.startswith("vllm_") for line in lines)
