"""The router's own per-request metrics, from what the request life hands out: reports
counted once, time to first and second token, the gaps between tokens and TPOT as the client
sees them (after the merge), requests whose stream is gone; pdd's and vLLM's names."""

from __future__ import annotations

import time

from shared.bus.messages import Pipeline, Role
from shared.telemetry import metrics
from shared.telemetry.token_latency import token_latency
from shared.telemetry.vllm_metrics import FinishedRequest, RequestMetrics

from ..core.actions import CountReports
from ..core.request_stream import Delta, RequestStream


def start() -> None:
    """Every pdd_requests series the router counts exists from the start, at 0, so that a
    rate() or increase() over an outcome that has not happened yet is 0, not empty."""
    for pipeline in Pipeline:
        for outcome in ("ok", "error"):
            metrics.REQUESTS.labels(pipeline=pipeline.value, outcome=outcome)
    metrics.REQUESTS.labels(pipeline="none", outcome="rejected")


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


def delivered(
    stream: RequestStream, delta: Delta, ttft_s: float | None, gap_s: float | None, vllm: RequestMetrics
) -> None:
    """TTFT with the first token; then the gaps between deliveries, time to the 2nd token and
    TPOT. vLLM's TTFT counts from the request's arrival, its wait for admission included."""
    pipeline = stream.decision.pipeline.value
    if ttft_s is not None:
        metrics.TTFT.labels(pipeline=pipeline).observe(ttft_s)
        vllm.first_token(stream.queued_s + ttft_s)
    if gap_s is not None:
        vllm.next_tokens(gap_s)
    after = stream.merger.next_index
    lat = token_latency(
        stream.created, stream.first_token_at, time.monotonic(), after - len(delta.tokens), after, stream.done
    )
    if lat.second_token_s is not None:
        metrics.SECOND_TOKEN.labels(pipeline=pipeline).observe(lat.second_token_s)
    if lat.tpot_s is not None:
        metrics.TPOT.labels(pipeline=pipeline).observe(lat.tpot_s)
        vllm.time_per_output_token(lat.tpot_s)


def finished(stream: RequestStream, reason: str, now: float) -> FinishedRequest:
    """vLLM's figures of a request (a choice) that ended at `now` for `reason`."""
    first = stream.first_token_at
    return FinishedRequest(
        reason=reason,
        prompt_tokens=len(stream.prompt_ids),
        generation_tokens=stream.merger.next_index,
        max_tokens=stream.params.max_tokens if stream.params is not None else None,
        prefill_s=(first if first is not None else now) - stream.created,
        decode_s=now - first if first is not None else 0.0,
        e2e_s=stream.queued_s + now - stream.created,
    )
