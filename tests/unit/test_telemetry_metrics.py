"""Prometheus metrics stay bounded and observable: map sizes are read at scrape time, abort
reasons outside AbortReason collapse into "other", and a forgotten peer's series goes away.
The real default registry, read back through the exposition text."""

from __future__ import annotations

from services.router.adapter.request_metrics import count_reports
from services.router.core.actions import CountReports
from services.router.core.request_life import RequestLife
from services.router.core.request_stream import RequestStream
from services.router.routing.policy import RouteDecision
from shared.bus.messages import (
    AbortReason,
    DecodeReport,
    HandoffMode,
    Pipeline,
    RelayReport,
    Role,
    TokenEvent,
)
from shared.config import RouterSettings
from shared.telemetry import metrics
from shared.telemetry.token_latency import TokenLatency, token_latency
from tests.prometheus_samples import parse_samples


def _sample(name: str, **labels: str) -> float | None:
    return parse_samples(metrics.metrics_text()[0].decode()).get((name, frozenset(labels.items())))


def test_a_tracked_map_is_read_at_every_scrape() -> None:
    entries: dict[str, int] = {}
    metrics.track("test-svc", "things", lambda: len(entries))
    assert _sample("pdd_open_entries", service="test-svc", map="things") == 0
    entries.update(a=1, b=2)
    assert _sample("pdd_open_entries", service="test-svc", map="things") == 2
    metrics.track("test-svc", "things", lambda: 7)  # a new instance replaces the old callback
    assert _sample("pdd_open_entries", service="test-svc", map="things") == 7


def test_a_failing_size_callback_costs_only_its_own_sample() -> None:
    metrics.track("test-svc", "broken", lambda: 1 // 0)
    metrics.track("test-svc", "fine", lambda: 3)
    try:
        assert _sample("pdd_open_entries", service="test-svc", map="broken") is None
        assert _sample("pdd_open_entries", service="test-svc", map="fine") == 3
    finally:  # later scrapes in this process stay quiet
        metrics.track("test-svc", "broken", lambda: 0)


def test_abort_reason_labels_are_bounded() -> None:
    assert all(metrics.abort_reason(r.value) == r.value for r in AbortReason)
    assert metrics.abort_reason("md_lost") == "md_lost"  # prefill's own reason for a WAN cancel
    assert metrics.abort_reason("anything a peer made up") == "other"


def test_a_forgotten_peer_loses_its_series() -> None:
    for peer in ("tcp://a:1", "tcp://b:1"):
        metrics.WAN_BANDWIDTH.labels(peer=peer).set(1e6)
    metrics.forget_peer("tcp://a:1")
    metrics.forget_peer("tcp://a:1")  # twice, or never labelled: nothing happens
    name = "pdd_wan_bandwidth_bytes_per_second"
    assert _sample(name, peer="tcp://a:1") is None and _sample(name, peer="tcp://b:1") == 1e6

    labelled = {"tcp://b:1", "tcp://c:1"}
    metrics.WAN_BANDWIDTH.labels(peer="tcp://c:1").set(2e6)
    metrics.forget_peers_except(labelled, known=["tcp://c:1"])
    assert labelled == {"tcp://c:1"}
    assert _sample(name, peer="tcp://b:1") is None and _sample(name, peer="tcp://c:1") == 2e6


def test_a_forgotten_md_loses_its_wan_bytes() -> None:
    metrics.ROUTER_WAN_BYTES.labels(md="md-x").inc(100)
    metrics.ROUTER_WAN_BYTES.labels(md="md-y").inc(5)
    metrics.forget_peer("md-x")
    assert _sample("pdd_router_wan_bytes_total", md="md-x") is None
    assert _sample("pdd_router_wan_bytes_total", md="md-y") == 5


def test_second_token_is_the_delivery_that_crosses_it() -> None:
    # arrival at 10 s; first token at 10.5 s (one token), then two at once at 11 s, then one
    assert token_latency(10.0, 10.5, 10.5, 0, 1, False) == TokenLatency()
    assert token_latency(10.0, 10.5, 11.0, 1, 3, False) == TokenLatency(second_token_s=1.0)
    assert token_latency(10.0, 10.5, 11.2, 3, 4, False) == TokenLatency()
    # a first delivery of several tokens is also the 2nd token's
    assert token_latency(10.0, 10.5, 10.5, 0, 4, False).second_token_s == 0.5


def test_tpot_is_per_token_after_the_first_when_the_request_ends() -> None:
    assert token_latency(0.0, 0.5, 2.5, 4, 5, True) == TokenLatency(tpot_s=(2.5 - 0.5) / 4)
    assert token_latency(0.0, 0.5, 0.5, 0, 1, True) == TokenLatency()  # one token: no TPOT
    assert token_latency(0.0, 0.5, 0.5, 0, 2, True) == TokenLatency(second_token_s=0.5, tpot_s=0.0)
    assert token_latency(0.0, None, 1.0, 0, 0, True) == TokenLatency()  # ended without a token


def test_the_router_counts_each_report_once() -> None:
    stream = RequestStream("r", [1, 2, 3], RouteDecision(Pipeline.P_RLD_MD, 0.0, 0, 0.0), "md-r")

    def values() -> tuple:
        return (
            _sample("pdd_router_wan_bytes_total", md="md-r") or 0,
            _sample("pdd_router_handoffs_total", mode="catch-up") or 0,
            _sample("pdd_router_output_tokens_total", role="relay") or 0,
            _sample("pdd_router_output_tokens_total", role="main_decode") or 0,
        )

    start = values()
    handed = TokenEvent("r", Role.RELAY, 9, [], relay=RelayReport(True, 8, HandoffMode.CATCH_UP, 3))
    last = TokenEvent("r", Role.MAIN_DECODE, 9, [5], decode=DecodeReport("md-r", 20, 4096))
    requests = RequestLife(RouterSettings(), "r")
    requests.opened(stream)
    for ev in (handed, handed, last, last):  # each delivered twice
        for action in requests.on_tokens(ev, 0.0):
            if isinstance(action, CountReports):
                count_reports(action)
    assert [b - a for a, b in zip(start, values(), strict=True)] == [4096, 1, 8, 20]
