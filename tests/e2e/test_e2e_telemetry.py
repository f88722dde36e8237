"""One P→RLD→MD request is one trace across both datacenters; metrics after traffic; the
Grafana dashboard's queries name what the system exports; `pdd top` against it."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import httpx
import pytest

from pdd.system import RunningSystem, start_system
from tests.prometheus_samples import Samples, moved, scrape
from tests.promql import Selector, dashboard_exprs, selectors


@pytest.fixture(scope="module")
def system(tmp_path_factory) -> RunningSystem:
    sysm = start_system(
        tmp_path_factory.mktemp("pdd-tel"),
        {"PDD_RELAY_CATCHUP_THRESHOLD": "1"},
        delay_ms=5,
        model_preset="small",
    )
    yield sysm
    sysm.stop()


def _trace(system: RunningSystem, rid: str, want: set[str], timeout: float = 15.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        r = httpx.get(f"{system.router_url}/v1/traces/{rid}", timeout=10)
        names = {s["name"] for s in r.json().get("spans", [])} if r.status_code == 200 else set()
        if want <= names or time.monotonic() > deadline:
            return r.json()
        time.sleep(0.3)


def test_relay_request_is_one_trace_across_both_datacenters(system):
    prompt = [(i * 11 + 5) % 250 for i in range(600)]
    # 600 tokens of KV (9.6 MB) cross in ~0.4 s; the relay's 400 tokens take longer, so MD takes over.
    with system.shaped("bulk", bandwidth_mbps=200.0):
        r = httpx.post(
            f"{system.router_url}/v1/completions",
            timeout=120,
            json={
                "prompt": prompt,
                "max_tokens": 400,
                "temperature": 0,
                "ignore_eos": True,
                "pdd": {"pipeline": "p-rld-md"},
            },
        )
    assert r.status_code == 200, r.text
    rid, body = r.headers["x-request-id"], r.json()
    assert body["pdd"]["pipeline"] == "p-rld-md"
    trace_id = body["pdd"]["trace_id"]
    assert re.fullmatch(r"[0-9a-f]{32}", trace_id)
    assert r.headers["traceparent"].split("-")[1] == trace_id

    want = {
        "router.request",
        "router.route",
        "prefill.compute",
        "kv.transfer",
        "relay.decode",
        "relay.handoff_batch",
        "md.kv_receive",
        "md.extend",
        "md.decode",
    }
    data = _trace(system, rid, want)
    spans = data["spans"]
    names = {s["name"] for s in spans}
    assert want <= names, names
    assert {s["trace_id"] for s in spans} == {trace_id}
    assert {s["datacenter"] for s in spans} == {"dc-a", "dc-b"}
    by_id = {s["span_id"]: s for s in spans}

    def parent(name: str, **attrs) -> str:
        span = next(
            s
            for s in spans
            if s["name"] == name and all(s["attributes"].get(k) == v for k, v in attrs.items())
        )
        return by_id[span["parent_span_id"]]["name"]

    root = next(s for s in spans if s["name"] == "router.request")
    route = next(s for s in spans if s["name"] == "router.route")["attributes"]
    instances = {k: route[f"pdd.instances.{k}"] for k in ("prefill", "relay", "main_decode")}
    assert instances == body["pdd"]["instances"] == {"prefill": "0", "relay": "0", "main_decode": "0"}
    assert root["parent_span_id"] is None
    assert parent("prefill.compute") == "router.request"  # across NATS (submit)
    assert parent("kv.transfer", path="wan") == "router.request"
    assert parent("md.kv_receive") == "kv.transfer"  # across the bulk channel, over the WAN
    assert parent("relay.decode") == "kv.transfer"  # across the local fast path
    assert parent("relay.handoff_batch") == "relay.decode"
    assert parent("md.extend") == "relay.handoff_batch"  # across the NATS gateway
    assert parent("md.decode") == "router.request"  # across the gateway (prepare)
    services = {s["service"] for s in spans}
    assert services == {"router", "prefill", "relay", "main_decode"}

    # `pdd trace` renders the same trace as a waterfall grouped by datacenter.
    out = subprocess.run(
        [sys.executable, "-m", "pdd.cli", "trace", rid, "--dir", str(system.workdir / "traces")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert "dc-a" in out.stdout and "dc-b" in out.stdout and "md.extend" in out.stdout


def _stream(system: RunningSystem, body: dict) -> tuple[list[list[int]], dict]:
    """The token chunks of a streamed completion, and its final pdd summary."""
    chunks, summary = [], {}
    with httpx.stream(
        "POST", f"{system.router_url}/v1/completions", json={**body, "stream": True}, timeout=60
    ) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                data = json.loads(line[6:])
                assert "error" not in data, data
                if data["choices"][0]["token_ids"]:
                    chunks.append(data["choices"][0]["token_ids"])
                summary = data.get("pdd", summary)
    return chunks, summary


def test_metrics_after_traffic(system):
    urls = system.metrics_urls()
    router, md = urls["router"], urls["main_decode"]
    before_router, before_md = scrape(router), scrape(md)
    chunks, summary = _stream(
        system,
        {
            "prompt": "metrics please",
            "max_tokens": 12,
            "temperature": 0,
            "ignore_eos": True,
            "pdd": {"pipeline": "p-md"},
        },
    )
    assert sum(len(c) for c in chunks) == 12 and summary["pipeline"] == "p-md"
    after_router, after_md = scrape(router), scrape(md)

    def router_moved(name: str, **labels: str) -> float:
        return moved(before_router, after_router, name, **labels)

    assert router_moved("pdd_requests_total", outcome="ok", pipeline="p-md") == 1
    assert router_moved("pdd_ttft_seconds_count", pipeline="p-md") == 1
    assert router_moved("pdd_prefix_hit_rate_count") == 1
    # one inter-token gap per token chunk after the first
    assert router_moved("pdd_itl_seconds_count", pipeline="p-md") == len(chunks) - 1
    # MD counts the tokens it produced (prefill sampled the first)
    assert (
        moved(before_md, after_md, "pdd_output_tokens_total", role="main_decode")
        == summary["md_tokens"]
        == 11
    )
    inst = httpx.get(f"{system.router_url}/v1/instances", timeout=10).json()
    assert set(inst) == {"prefill/0", "relay/0", "main_decode/0"}


TARGET_LABELS = frozenset({"job"})  # Prometheus adds them at scrape time: not in /metrics


def _unexported(scrapes: list[Samples], wanted: list[Selector]) -> list[Selector]:
    """The selectors no scraped sample matches (by name, and each label="value" matcher)."""
    have = {(name, frozenset(labels)) for samples in scrapes for name, labels in samples}

    def found(s: Selector) -> bool:
        equal = {(k, v) for k, v in s.equal.items() if k not in TARGET_LABELS}
        return any(name == s.name and equal <= labels for name, labels in have)

    return [s for s in wanted if not found(s)]


def test_dashboard_queries_name_what_the_system_exports(system):
    # Both pipelines with a handoff, and the anomalous-traffic filter (the relay ends the request
    # before MD has the KV: the WAN transfer is aborted), so the labelled series exist.
    _, summary = _stream(
        system,
        {
            "prompt": "dashboards for two datacenters",
            "max_tokens": 12,
            "temperature": 0,
            "ignore_eos": True,
            "pdd": {"pipeline": "p-md"},
        },
    )
    assert summary["pipeline"] == "p-md"
    prompt = [(i * 13 + 7) % 250 for i in range(300)]
    _, summary = _stream(
        system,
        {
            "prompt": prompt,
            "max_tokens": 48,
            "temperature": 0,
            "ignore_eos": True,
            "pdd": {"pipeline": "p-rld-md"},
        },
    )
    assert summary["pipeline"] == "p-rld-md" and summary["handoff_mode"], summary
    with system.shaped("bulk", bandwidth_mbps=1.0):
        _, summary = _stream(
            system,
            {
                "prompt": prompt[:200] + [1] * 400,
                "max_tokens": 3,
                "temperature": 0,
                "ignore_eos": True,
                "pdd": {"pipeline": "p-rld-md"},
            },
        )
    assert summary["pipeline"] == "rld-only", summary

    wanted = [s for _, expr in dashboard_exprs() for s in selectors(expr)]
    deadline = time.monotonic() + 20  # counters of other processes land a moment after the response
    while True:
        missing = _unexported([scrape(url) for url in system.metrics_urls().values()], wanted)
        if not missing or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert not missing, f"dashboard queries name series no service exports: {missing}"


def test_pdd_top_once_shows_every_instance_and_the_request_rate(system):
    out = subprocess.run(
        [sys.executable, "-m", "pdd.cli", "top", "--url", system.router_url, "--once", "--interval", "0.5"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "COLUMNS": "80"},
    )
    assert out.returncode == 0, out.stdout + out.stderr
    instances = system.instances()
    assert instances and all(key in out.stdout for key in instances), out.stdout
    assert re.search(
        r"^requests/s  p-md \d+\.\d\d  p-rld-md \d+\.\d\d .* total \d+\.\d\d$", out.stdout, re.M
    ), out.stdout
