"""Prometheus metrics of every pdd service, defined once here so services import them.

All live in prometheus-client's default registry. Non-router services expose it with
`start_metrics_server(port, addr)`; the router serves `metrics_text()` on its own `/metrics`;
both in the text format (vLLM's names, in shared/telemetry/vllm_metrics.py, keep their ':').
Label values: pipeline = p-md | p-rld-md | rld-only; path = wan | local;
mode = one-shot | catch-up; role = rld | md. Labels taken from messages stay bounded: an abort
reason is an AbortReason value (else "other"), and a forgotten peer's series is removed
(`forget_peer`). `track` registers a map's size for `pdd_open_entries{service, map}`.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    REGISTRY,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from shared.bus.messages import AbortReason
from shared.telemetry.open_entries import OpenEntries, SizeOf

# Latency buckets span the paper's range: same-DC TTFT is seconds, cross-DC P99 tens of seconds.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 15.0, 30.0, 60.0, 120.0)
# Decode steps are ms on GPUs, tens of ms on CPU; handoff stalls reach hundreds of ms.
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
# Hit rates cluster at the top (70-80% of agentic requests hit >95%), so the top is fine-grained.
HIT_RATE_BUCKETS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.97, 0.99, 1.0)

REQUESTS = Counter("pdd_requests", "Finished requests by pipeline and outcome", ["pipeline", "outcome"])
TTFT = Histogram("pdd_ttft_seconds", "Time to first token", ["pipeline"], buckets=TTFT_BUCKETS)
ITL = Histogram("pdd_itl_seconds", "Inter-token latency", ["pipeline"], buckets=ITL_BUCKETS)
# P→MD's wait for the KV shows in the 2nd token, not in TTFT (P samples the first token itself).
SECOND_TOKEN = Histogram(
    "pdd_second_token_seconds", "Time to the second output token", ["pipeline"], buckets=TTFT_BUCKETS
)
TPOT = Histogram(
    "pdd_tpot_seconds",
    "Time per output token after the first, per request",
    ["pipeline"],
    buckets=ITL_BUCKETS,
)
# An engine's steps, and a busy engine's time from one step's end to the next step's start
# (output handling, commands, thread hops; a decoder's give-way waits excluded): what the
# serving loop adds to every step (`pdd sim validate` charges it).
LOOP_BUCKETS = (0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)
ENGINE_STEP_SECONDS = Histogram(
    "pdd_engine_step_seconds",
    "Engine steps (the forward and its post-step work)",
    ["service"],
    buckets=ITL_BUCKETS,
)
ENGINE_BETWEEN_STEPS_SECONDS = Histogram(
    "pdd_engine_between_steps_seconds",
    "A busy engine's time between one step's end and the next step's start",
    ["service"],
    buckets=LOOP_BUCKETS,
)
# A prompt's KV tail: from its last blocks handed to the sender to the peer's ack, by path (what
# a decoder waits after prefill's last step; `pdd sim validate` reads this host's KV path from it).
KV_TAIL_SECONDS = Histogram(
    "pdd_kv_tail_seconds",
    "A prompt's last KV blocks: handed to the sender to acked",
    ["path"],
    buckets=ITL_BUCKETS,
)
KV_TAIL_BYTES = Counter("pdd_kv_tail_bytes", "KV bytes of the blocks pdd_kv_tail_seconds times", ["path"])
KV_BYTES = Counter("pdd_kv_bytes", "KV bytes sent, by path", ["path"])
HANDOFF_BATCHES = Counter("pdd_handoff_batches", "RLD->MD handoff batches by mode", ["mode"])
HANDOFF_SECONDS = Histogram(  # relay: from MD's kv_ready to the final batch sent
    "pdd_handoff_seconds", "RLD->MD handoff duration by mode", ["mode"], buckets=ITL_BUCKETS
)
PREFIX_HIT_RATE = Histogram(
    "pdd_prefix_hit_rate", "Fraction of prompt tokens MD already holds", buckets=HIT_RATE_BUCKETS
)
RELAY_RUNNING = Gauge("pdd_relay_running", "Requests running on the relay decoder")
WAN_BANDWIDTH = Gauge("pdd_wan_bandwidth_bytes_per_second", "Router's live WAN bandwidth estimate", ["peer"])
# The router's own count of what instances report with a request's last tokens, so that its
# /metrics alone (`pdd top`, compose publishes nothing else) shows the WAN per MD link, the RLD
# share and the handoffs. pdd_kv_bytes / pdd_output_tokens / pdd_handoff_batches are the
# instances' own, counted as they happen.
ROUTER_WAN_BYTES = Counter(
    "pdd_router_wan_bytes", "KV bytes each MD received over the WAN (reported)", ["md"]
)
ROUTER_OUTPUT_TOKENS = Counter(
    "pdd_router_output_tokens", "Output tokens by producing role (reported)", ["role"]
)
ROUTER_HANDOFFS = Counter("pdd_router_handoffs", "Completed RLD->MD handoffs by mode (reported)", ["mode"])
KV_BLOCKS_USED = Gauge("pdd_kv_blocks_used", "KV blocks in use", ["service", "instance"])
# The RLD/MD token split (paper: RLD 6.2%, MD 93.8%) and aborted WAN transfers.
OUTPUT_TOKENS = Counter("pdd_output_tokens", "Output tokens by producing role", ["role"])
UNKNOWN_REQUEST_MESSAGES = Counter(
    "pdd_unknown_request_messages",
    "Messages naming a request id this instance does not hold (dropped)",
    ["service"],
)
MIGRATIONS = (
    Counter(  # cause = lost | gap | stall | error | dispatch (see RequestStream.stall, RequestLife.move)
        "pdd_migrations", "Requests moved to another instance by their token IDs", ["cause"]
    )
)
KV_RDMA_BYTES = Counter(
    "pdd_kv_rdma_bytes", "KV bytes prefill wrote one-sided into main decode's pool (RDMA path)"
)
KV_RDMA_FALLBACKS = Counter(  # reason = unavailable | refused | write | corrupt | verdict
    "pdd_kv_rdma_fallbacks",
    "WAN KV transfers (or blocks of them) sent over TCP instead of the RDMA path",
    ["reason"],
)
KV_RDMA_CORRUPT_BLOCKS = Counter(
    "pdd_kv_rdma_corrupt_blocks", "Blocks written over RDMA that failed main decode's checksum"
)
KV_TRANSFER_ABORTS = Counter(
    "pdd_kv_transfer_aborts", "WAN KV transfers aborted", ["reason"]
)  # see abort_reason
# A prompt block already on its way to MD for another request is waited for, not sent again
# (outcome = landed); if its transfer ends without it, MD computes it (outcome = computed).
KV_BLOCKS_SHARED_IN_FLIGHT = Counter(
    "pdd_kv_blocks_shared_in_flight", "Prompt blocks MD took from another request's transfer", ["outcome"]
)
HANDOFF_BATCHES_DROPPED = Counter(  # reason = stale (seq already applied) | duplicate (seq already held)
    "pdd_handoff_batches_dropped", "Redelivered handoff batches MD dropped (first copy kept)", ["reason"]
)

OPEN_ENTRIES = OpenEntries()
REGISTRY.register(OPEN_ENTRIES)
# Reasons a service names itself (not an Abort's) that are not AbortReason values.
OWN_ABORT_REASONS = frozenset({"md_lost"})
_ABORT_REASONS = frozenset(r.value for r in AbortReason) | OWN_ABORT_REASONS

_servers: dict[int, object] = {}
_lock = threading.Lock()


class _TextExposition(BaseHTTPRequestHandler):
    """GET (any path): the registry in the text format, whatever the Accept header asks for.
    prometheus-client answers a scraper asking for OpenMetrics (Prometheus does) with every
    ':' of a sample's name made '_', which would turn vLLM's names (vllm:...) into others."""

    def do_GET(self) -> None:
        body, content_type = metrics_text()
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args) -> None:  # noqa: A002 (the base class's name)
        pass  # a scrape every few seconds is not worth a log line


def start_metrics_server(port: int, addr: str = "127.0.0.1") -> None:
    """Serve the default registry on http://addr:port/metrics from a daemon thread
    (idempotent per port)."""
    with _lock:
        if port in _servers:
            return
        family, *_ = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
        server_class = type("MetricsServer", (ThreadingHTTPServer,), {"address_family": family})
        server = server_class((addr, port), _TextExposition)
        threading.Thread(target=server.serve_forever, name=f"metrics-{port}", daemon=True).start()
        _servers[port] = server


def metrics_text() -> tuple[bytes, str]:
    """(body, content type) for a `/metrics` HTTP handler."""
    return generate_latest(REGISTRY), CONTENT_TYPE_LATEST


def track(service: str, name: str, size: SizeOf) -> None:
    """Publish `size()` as pdd_open_entries{service, map=name} at every scrape."""
    OPEN_ENTRIES.track(service, name, size)


def abort_reason(reason: str) -> str:
    """A `reason` label value: the reason if it is a known one, else "other"."""
    return reason if reason in _ABORT_REASONS else "other"


def forget_peer(peer: str) -> None:
    """Drop a peer's per-peer series (the link estimator no longer knows it, or the MD left)."""
    for family in (WAN_BANDWIDTH, ROUTER_WAN_BYTES):
        try:
            family.remove(peer)
        except KeyError:
            pass  # never labelled, or already forgotten


def forget_peers_except(labelled: set[str], known: Iterable[str]) -> None:
    """forget_peer every peer of `labelled` (the caller's own set) that is not in `known`."""
    for peer in labelled - set(known):
        forget_peer(peer)
        labelled.discard(peer)
