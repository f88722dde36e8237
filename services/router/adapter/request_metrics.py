"""The router's own per-request metrics, from what the request life hands out: reports
counted once, time to first and second token and TPOT as the client sees them (after the
merge), requests whose stream is gone."""

from __future__ import annotations

import time

from shared.bus.messages import Role
from shared.telemetry import metrics
from shared.telemetry.token_latency import token_latency

from ..core.actions import CountReports
from ..core.request_stream import Delta, RequestStream


def count_reports(reports: CountReports) -> None:
    """The reports instances send with a request's last tokens (the life passes each once)."""
    if reports.decode is not None:
        metrics.ROUTER_WAN_BYTES.labels(md=reports.decode.md_instance).inc(reports.decode.wan_bytes)
        metrics.ROUTER_OUTPUT_TOKENS.labels(role=Role.MAIN_DECODE.value).inc(reports.decode.md_tokens)
    if reports.relay is not None:
        metrics.ROUTER_OUTPUT_TOKENS.labels(role=Role.RELAY.value).inc(reports.relay.rld_tokens)
        if reports.relay.handed_over and reports.relay.handoff_mode is not None:
            metrics.ROUTER_HANDOFFS.labels(mode=reports.relay.handoff_mode.value).inc()


def unknown_message() -> None:
    metrics.UNKNOWN_REQUEST_MESSAGES.labels(service="router").inc()


def delivered(stream: RequestStream, delta: Delta, ttft_s: float | None) -> None:
    """TTFT with the first token; then time to the 2nd token and TPOT."""
    pipeline = stream.decision.pipeline.value
    if ttft_s is not None:
        metrics.TTFT.labels(pipeline=pipeline).observe(ttft_s)
    after = stream.merger.next_index
    lat = token_latency(
        stream.created, stream.first_token_at, time.monotonic(), after - len(delta.tokens), after, stream.done
    )
    if lat.second_token_s is not None:
        metrics.SECOND_TOKEN.labels(pipeline=pipeline).observe(lat.second_token_s)
    if lat.tpot_s is not None:
        metrics.TPOT.labels(pipeline=pipeline).observe(lat.tpot_s)
