"""What the bench reads of each engine service (pdd/benchkit/engine_figures.py): the step,
between-steps and KV-tail figures of a real registry, served over real HTTP, and their
difference over a timed stretch in a CPU account."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server

from pdd.benchkit import engine_figures
from pdd.benchkit.cpu import Account


def test_a_services_steps_gaps_and_kv_tails_are_read_from_its_metrics():
    reg = CollectorRegistry()
    step = Histogram("pdd_engine_step_seconds", "steps", ["service"], registry=reg)
    between = Histogram("pdd_engine_between_steps_seconds", "gaps", ["service"], registry=reg)
    tail = Histogram("pdd_kv_tail_seconds", "tails", ["path"], registry=reg)
    tail_bytes = Counter("pdd_kv_tail_bytes", "bytes", ["path"], registry=reg)
    for s in (0.01, 0.02, 0.03):
        step.labels(service="main_decode").observe(s)
    for g in (0.001, 0.003):
        between.labels(service="main_decode").observe(g)
    for path, seconds, nbytes in (("wan", 0.01, 4e6), ("wan", 0.02, 4e6), ("local", 0.005, 4e6)):
        tail.labels(path=path).observe(seconds)
        tail_bytes.labels(path=path).inc(nbytes)
    server, _ = start_http_server(0, addr="127.0.0.1", registry=reg)
    try:
        url = f"http://127.0.0.1:{server.server_port}/metrics"
        got = engine_figures.scrape({"main_decode": url, "gone": "http://127.0.0.1:9/metrics"})
    finally:
        server.shutdown()
    assert set(got) == {"main_decode"}  # a service that does not answer is left out
    assert got["main_decode"] == pytest.approx(
        {
            "steps": 3,
            "step_s": 0.06,
            "gaps": 2,
            "between_s": 0.004,
            "tails_wan": 2,
            "tail_s_wan": 0.03,
            "tail_bytes_wan": 8e6,
            "tails_local": 1,
            "tail_s_local": 0.005,
            "tail_bytes_local": 4e6,
        }
    )
    assert engine_figures.parse("") == {"steps": 0.0, "step_s": 0.0, "gaps": 0.0, "between_s": 0.0}


def test_an_account_adds_its_own_systems_loops_over_stretches():
    def snap(figures: dict) -> dict:
        return {"t": 0.0, "host_busy_s": 0.0, "bench_s": 0.0, "procs": {}, "figures": figures}

    a = {"steps": 10.0, "step_s": 0.1, "gaps": 9.0, "between_s": 0.009}
    b = {"steps": 30.0, "step_s": 0.4, "gaps": 28.0, "between_s": 0.037}
    acct = Account()
    acct.add(
        snap({"x": {"relay": a}, "y": {"relay": a}}), snap({"x": {"relay": b}, "y": {"relay": b}}), own="x"
    )
    acct.add(snap({"x": {"relay": a}}), snap({"x": {"relay": b, "prefill": b}}), own="x")  # new: not counted
    loops = acct.as_json()["engine_figures"]
    assert loops == {"relay": pytest.approx({"steps": 40, "step_s": 0.6, "gaps": 38, "between_s": 0.056})}
