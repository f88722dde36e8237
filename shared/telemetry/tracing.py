"""OpenTelemetry setup and W3C context propagation.

One TracerProvider per service identity (service, instance, datacenter) rather than the
global one: tests run several services in one process, and each span must carry its own
service's resource. Exporters, chosen from the environment when a provider is created:

- `OTEL_EXPORTER_OTLP_ENDPOINT` set -> OTLP/HTTP through a BatchSpanProcessor (Jaeger in compose).
- otherwise, or when `PDD_TRACE_DIR` is set explicitly -> the local span store through a
  SimpleSpanProcessor: a span is on disk as soon as it ends, so `pdd trace` sees a request
  right after it finishes and a SIGKILLed process loses nothing.

Call `get_tracer` when a service starts, not at import: the provider is keyed on the
environment at that moment too, so a test that points `PDD_TRACE_DIR` elsewhere gets a
provider writing there.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping

from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
from opentelemetry.trace import Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from shared.telemetry.span_store import DATACENTER_ATTR, TRACE_DIR_ENV, JsonlSpanExporter, default_trace_dir

OTLP_ENDPOINT_ENV = "OTEL_EXPORTER_OTLP_ENDPOINT"
TRACEPARENT = "traceparent"

_lock = threading.Lock()
_providers: dict[tuple[str, ...], TracerProvider] = {}
_w3c = TraceContextTextMapPropagator()


def setup_tracing(service_name: str, instance: str, datacenter: str) -> TracerProvider:
    """The provider of this service identity, created on first use (idempotent)."""
    otlp = os.environ.get(OTLP_ENDPOINT_ENV, "")
    local = str(default_trace_dir()) if (not otlp or os.environ.get(TRACE_DIR_ENV)) else ""
    key = (service_name, instance, datacenter, otlp, local)
    with _lock:
        provider = _providers.get(key)
        if provider is not None:
            return provider
        resource = Resource.create(
            {"service.name": service_name, "service.instance.id": instance, DATACENTER_ATTR: datacenter}
        )
        provider = TracerProvider(resource=resource)
        if otlp:
            # Imported lazily: the exporter pulls in requests/protobuf, unused in the embedded mode.
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        if local:
            provider.add_span_processor(SimpleSpanProcessor(JsonlSpanExporter(local, service_name, instance)))
        if not _providers:
            # The first service of the process also becomes the global provider, for library
            # code that calls trace.get_tracer(); pdd code uses get_tracer() below.
            trace.set_tracer_provider(provider)
        _providers[key] = provider
        return provider


def get_tracer(service_name: str, instance: str, datacenter: str) -> Tracer:
    """Tracer whose spans carry this service's resource attributes."""
    return setup_tracing(service_name, instance, datacenter).get_tracer("pdd")


def shutdown_tracing(timeout_ms: int = 5000) -> None:
    """Flush every provider's pending spans (OTLP batches), e.g. when a service stops.

    Providers stay usable: other services may share this process (tests), and each
    provider's own atexit hook shuts it down when the process ends.
    """
    with _lock:
        providers = list(_providers.values())
    for p in providers:
        p.force_flush(timeout_ms)


def traceparent() -> str | None:
    """The current span context as a W3C `traceparent` string, or None outside a span."""
    carrier: dict[str, str] = {}
    _w3c.inject(carrier)
    return carrier.get(TRACEPARENT)


def context_from_traceparent(tp: str | None) -> Context:
    """A context whose parent is the span named by `tp` (an empty context for None/garbage)."""
    return _w3c.extract({TRACEPARENT: tp} if tp else {})


def inject(carrier: dict[str, str] | None = None, context: Context | None = None) -> dict[str, str]:
    """Write the current (or given) trace context into a dict carrier, e.g. NATS headers."""
    carrier = {} if carrier is None else carrier
    propagate.inject(carrier, context=context)
    return carrier


def extract(carrier: Mapping[str, str] | None) -> Context:
    """The trace context carried by a dict carrier (NATS headers may be None)."""
    return propagate.extract(dict(carrier or {}))
