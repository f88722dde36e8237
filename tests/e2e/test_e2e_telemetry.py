"""One P→RLD→MD request is one trace across both datacenters; metrics after traffic; a real
Prometheus scraping every service, with the shipped config and rules, answering every query of
the shipped Grafana dashboard; `pdd top` against it."""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys

import httpx
import pytest

from pdd.system import RunningSystem, start_system
from tests.polling import wait_until
from tests.prometheus_samples import moved, scrape
from tests.prometheus_server import (
    MISSING,
    PROMETHEUS,
    as_promql,
    dashboard_exprs,
    running_prometheus,
    scrape_config,
)

RELAY_STEP_S = 0.025  # each relay step at least this long: 48 relayed tokens take >= 1.2 s


@pytest.fixture(scope="module")
def system(tmp_path_factory) -> RunningSystem:
    sysm = start_system(
        tmp_path_factory.mktemp("pdd-tel"),
        # The relay paced (a test knob, docs/testing.md): MD takes over before it ends a request.
        {"PDD_RELAY_CATCHUP_THRESHOLD": "1", "PDD_RELAY_MIN_STEP_S": str(RELAY_STEP_S)},
        delay_ms=5,
        model_preset="small",
    )
    yield sysm
    sysm.stop()


def _trace(system: RunningSystem, rid: str, want: set[str], timeout: float = 15.0) -> dict:
    """The request's trace once it holds every span in `want` (as it is at the deadline)."""
    last: dict = {}

    def complete() -> bool:
        r = httpx.get(f"{system.router_url}/v1/traces/{rid}", timeout=10)
        last["body"] = r.json()
        return r.status_code == 200 and want <= {s["name"] for s in last["body"].get("spans", [])}

    with contextlib.suppress(TimeoutError):
        wait_until(complete, timeout, 0.3)
    return last["body"]


def test_relay_request_is_one_trace_across_both_datacenters(system):
    prompt = [(i * 11 + 5) % 250 for i in range(600)]
    # 600 tokens of KV (9.6 MB) cross in ~0.4 s; the relay's 120 paced tokens take >= 3 s, so MD takes over.
    with system.shaped("bulk", bandwidth_mbps=200.0):
        r = httpx.post(
            f"{system.router_url}/v1/completions",
            timeout=120,
            json={
                "prompt": prompt,
                "max_tokens": 120,
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
    # vLLM's names for the same request, on the router, labelled with the served model
    model = httpx.get(f"{system.router_url}/v1/models", timeout=10).json()["data"][0]["id"]
    vllm = {"model_name": model, "engine": "0"}
    assert router_moved("vllm:generation_tokens_total", **vllm) == 12
    assert router_moved("vllm:request_success_total", **vllm, finished_reason="length") == 1
    assert router_moved("vllm:request_success_total", **vllm, finished_reason="stop") == 0
    for name in ("time_to_first_token", "e2e_request_latency", "request_queue_time"):
        assert router_moved(f"vllm:{name}_seconds_count", **vllm) == 1, name
    # one gap per delivery after the first: every token chunk the stream sent after the first
    assert router_moved("vllm:inter_token_latency_seconds_count", **vllm) == len(chunks) - 1
    inst = httpx.get(f"{system.router_url}/v1/instances", timeout=10).json()
    assert set(inst) == {"prefill/0", "relay/0", "main_decode/0"}


ENGINE_JOBS = {"prefill", "relay", "main_decode"}
# The series the example Grafana dashboard vLLM ships queries (examples/online_serving/
# prometheus_grafana/grafana.json in vLLM's repository), by name.
VLLM_DASHBOARD_SERIES = (
    "vllm:e2e_request_latency_seconds_bucket",
    "vllm:e2e_request_latency_seconds_sum",
    "vllm:e2e_request_latency_seconds_count",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:time_per_output_token_seconds_bucket",
    "vllm:time_per_output_token_seconds_sum",
    "vllm:time_per_output_token_seconds_count",
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:time_to_first_token_seconds_bucket",
    "vllm:time_to_first_token_seconds_sum",
    "vllm:time_to_first_token_seconds_count",
    "vllm:gpu_cache_usage_perc",
    "vllm:request_prompt_tokens_bucket",
    "vllm:request_generation_tokens_bucket",
    "vllm:request_success_total",
    "vllm:request_queue_time_seconds_sum",
    "vllm:request_prefill_time_seconds_sum",
    "vllm:request_decode_time_seconds_sum",
    "vllm:request_max_num_generation_tokens_sum",
)


def _jobs(result: list[dict]) -> set[str]:
    return {series["metric"]["job"] for series in result}


@pytest.mark.skipif(PROMETHEUS is None, reason=MISSING)
def test_prometheus_scrapes_every_service_and_every_dashboard_query_has_data(system, tmp_path):
    api_key = system.opts.api_keys[0] if system.opts.api_keys else None
    config = scrape_config(system.metrics_urls(), api_key)
    with running_prometheus(config, tmp_path / "prometheus") as prom:
        # Both pipelines with a handoff, and the anomalous-traffic filter (the relay ends the
        # request before MD has the KV: the WAN transfer is aborted), so the labelled series exist.
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

        # Scraped: Prometheus holds the router's own count of generated tokens after the traffic.
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
        router = scrape(system.metrics_urls()["router"], headers)
        generated = sum(v for (name, _), v in router.items() if name == "vllm:generation_tokens_total")
        assert generated >= 12 + 48 + 3
        wait_until(
            lambda: prom.value("sum(vllm:generation_tokens_total)") == generated,
            30,
            0.5,
            what=lambda: (
                f"prometheus: {prom.value('sum(vllm:generation_tokens_total)')} tokens, router {generated}"
            ),
        )
        targets = prom.get("/api/v1/targets")["activeTargets"]
        assert {t["labels"]["job"] for t in targets} == ENGINE_JOBS | {"router"}
        # Every target up at its latest scrape: on a busy host one scrape can outlast its 1 s
        # timeout (the interval's), so the next ones are waited for, not one snapshot.
        wait_until(
            lambda: all(t["health"] == "up" for t in prom.get("/api/v1/targets")["activeTargets"]),
            30,
            0.5,
            what=lambda: [
                (t["labels"]["job"], t["health"], t.get("lastError"))
                for t in prom.get("/api/v1/targets")["activeTargets"]
            ],
        )

        # vLLM's names: scheduler and cache figures on every engine service, request figures
        # on the router, each with the served model's name.
        model = httpx.get(f"{system.router_url}/v1/models", headers=headers, timeout=10).json()["data"][0][
            "id"
        ]
        for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
            assert _jobs(prom.query(f'{name}{{model_name="{model}"}}')) == ENGINE_JOBS, name
        assert _jobs(prom.query("vllm:prefix_cache_queries_total")) == ENGINE_JOBS
        for name in ("vllm:time_to_first_token_seconds_count", "vllm:inter_token_latency_seconds_count"):
            assert _jobs(prom.query(f'{name}{{model_name="{model}"}}')) == {"router"}, name
        assert prom.value('sum(vllm:request_success_total{finished_reason="length"})') >= 3
        # vLLM's own example Grafana dashboard: its model_name variable lists the served model,
        # and every series it queries has data for it.
        named = prom.get("/api/v1/label/model_name/values", **{"match[]": '{__name__=~"vllm:.*"}'})
        assert named == [model]
        no_data = [n for n in VLLM_DASHBOARD_SERIES if not prom.query(f'{n}{{model_name="{model}"}}')]
        assert not no_data, f"series vLLM's dashboard queries, without data: {no_data}"

        # Every query of the shipped dashboard, as Grafana would send it, has data; and every
        # recording rule has evaluated to data without an error.
        empty: list = []

        def every_query_has_data() -> bool:
            empty[:] = [(t, e) for t, e in dashboard_exprs() if not prom.query(as_promql(e))]
            groups = prom.get("/api/v1/rules")["groups"]
            rules = [r for g in groups for r in g["rules"]]
            empty.extend(r["name"] for r in rules if r["health"] != "ok")
            empty.extend(r["name"] for r in rules if r["type"] == "recording" and not prom.query(r["name"]))
            return bool(rules) and not empty

        with contextlib.suppress(TimeoutError):
            wait_until(every_query_has_data, 30, 1.0)
        assert not empty, f"no data (or a failing rule) through Prometheus: {empty}"


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
