"""The Grafana dashboard's queries, read without Prometheus: the PromQL tokenizer the live check
(tests/e2e/test_e2e_telemetry.py) relies on, and the dashboard's own structure."""

from __future__ import annotations

import json

from tests.promql import DASHBOARD, Selector, dashboard_exprs, selectors


def test_tokenizer_finds_metrics_not_functions_labels_or_ranges() -> None:
    expr = "histogram_quantile(0.99, sum by (le, pipeline) (rate(pdd_ttft_seconds_bucket[$__rate_interval])))"
    assert selectors(expr) == [Selector("pdd_ttft_seconds_bucket")]
    expr = (
        'sum(rate(pdd_output_tokens_total{role="relay", path=~"a|b"}[5m])) / '
        "sum without (instance) (rate(pdd_output_tokens_total[1m] offset 5m)) * 1e3"
    )
    assert selectors(expr) == [
        Selector("pdd_output_tokens_total", {"role": "relay"}),
        Selector("pdd_output_tokens_total"),
    ]
    assert selectors('pdd_kv_blocks_used > on (instance) group_left (service) up{job="x"} and bool 0') == [
        Selector("pdd_kv_blocks_used"),
        Selector("up", {"job": "x"}),
    ]
    assert selectors('sum(increase(pdd_requests_total{outcome!="ok", le="2.0"}[$__rate_interval]))') == [
        Selector("pdd_requests_total", {"le": "2.0"})
    ]


def test_every_panel_queries_the_provisioned_datasource() -> None:
    board = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    graphs = [p for p in board["panels"] if p["type"] != "row"]
    assert graphs and all(p.get("targets") for p in graphs)
    for title, expr in dashboard_exprs():
        assert selectors(expr), f"{title}: no metric in {expr!r}"
        assert all(s.name.startswith("pdd_") for s in selectors(expr)), f"{title}: {expr!r}"
    wanted = {
        "TTFT",
        "Time to 2nd token",
        "TPOT",
        "Requests by pipeline",
        "WAN KV bytes",
        "Goodput",
        "RLD share of output tokens",
        "Handoff batches by mode",
        "Handoff latency",
        "KV blocks used per instance",
        "Aborts by reason",
    }
    assert wanted <= {p["title"] for p in graphs}
