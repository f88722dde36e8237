"""The shipped monitoring files without a running system: the Grafana dashboard's structure,
its queries parsed by Prometheus's own promtool, the Prometheus config and rules checked by
promtool and the alerts run on synthetic series (`promtool test rules`). Against a live
system: tests/e2e/test_e2e_telemetry.py."""

from __future__ import annotations

import json

import pytest
import yaml

from tests.prometheus_server import (
    CONFIG_DIR,
    DASHBOARD,
    MISSING,
    PROMTOOL,
    SHIPPED_CONFIG,
    as_promql,
    dashboard_exprs,
    promtool,
)

needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason=MISSING)


def test_every_panel_queries_the_provisioned_datasource() -> None:
    board = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    graphs = [p for p in board["panels"] if p["type"] != "row"]
    assert graphs and all(p.get("targets") for p in graphs)
    assert all(t["datasource"]["uid"] == "pdd-prometheus" for p in graphs for t in p["targets"])
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
        "Requests running and waiting",
        "KV cache usage",
        "Finished requests by reason",
    }
    assert wanted <= {p["title"] for p in graphs}


def test_grafana_variables_become_durations() -> None:
    expr = "rate(x[$__rate_interval]) + rate(y[${__interval}])"
    assert as_promql(expr, "5m") == "rate(x[5m]) + rate(y[5m])"


@needs_promtool
def test_every_dashboard_query_parses_as_promql(tmp_path) -> None:
    # promtool parses a rule file's expressions: one recording rule per query
    rules = [
        {"record": f"dashboard:query_{i}", "expr": as_promql(e)} for i, (_, e) in enumerate(dashboard_exprs())
    ]
    path = tmp_path / "dashboard_rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    out = promtool("check", "rules", path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"{len(rules)} rules found" in out.stdout
    # and a query that is not PromQL fails that check (the check can fail)
    path.write_text(
        yaml.safe_dump({"groups": [{"name": "bad", "rules": [{"record": "x:y", "expr": "sum(("}]}]})
    )
    assert promtool("check", "rules", path).returncode != 0


@needs_promtool
def test_shipped_config_and_rules_pass_promtool() -> None:
    out = promtool("check", "config", SHIPPED_CONFIG)  # its rule files too
    assert out.returncode == 0, out.stdout + out.stderr
    for name in yaml.safe_load(SHIPPED_CONFIG.read_text())["rule_files"]:
        out = promtool("check", "rules", CONFIG_DIR / name)
        assert out.returncode == 0, out.stdout + out.stderr
    out = promtool("test", "rules", CONFIG_DIR / "rules_test.yml")  # the alerts fire when they should
    assert out.returncode == 0, out.stdout + out.stderr
