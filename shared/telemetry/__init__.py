"""Telemetry: OpenTelemetry tracing (OTLP or the local span store), waterfalls, Prometheus metrics."""

from shared.telemetry.span_store import REQUEST_ID_ATTR
from shared.telemetry.tracing import (
    context_from_traceparent,
    extract,
    get_tracer,
    inject,
    setup_tracing,
    shutdown_tracing,
    traceparent,
)

__all__ = [
    "REQUEST_ID_ATTR",
    "context_from_traceparent",
    "extract",
    "get_tracer",
    "inject",
    "setup_tracing",
    "shutdown_tracing",
    "traceparent",
]
