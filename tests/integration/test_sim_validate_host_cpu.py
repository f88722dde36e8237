"""The measured host-CPU model of `pdd sim validate`: the bench's CPU accounts (pdd/benchkit/cpu.py) on
hand-made snapshots and on real processes, and the step-time factor they give (pdd/sim/studies/host_cpu.py)
on hand-computable cases."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry, Histogram, start_http_server

from pdd.benchkit.cpu import Account, Meter, busy_ticks, is_engine, process_cpu_s
from pdd.sim.hardware.profiles import helped_step
from pdd.sim.hardware.step_cost import Linear, StepCost, chunk_load, decode_load
from pdd.sim.studies import validate as v
from pdd.sim.studies.host_cpu import HostCpu, engines_seen_busy, from_account
from tests.unit.test_sim_validate import AGENTIC, SINGLE, _rows

ONE = StepCost(0.002, Linear(per_token=0.001), Linear(per_kv_read=1e-6))
HELPED = StepCost(0.002, Linear(per_token=0.0005), Linear(per_kv_read=0.9e-6))  # chunks 2x, decodes ~1.1x
CHUNK, DECODE = chunk_load(512, 0), decode_load(1, 3000)


def test_engine_cores_are_what_the_background_leaves():
    host = HostCpu(cores=2.0, background_cores=0.5)
    assert host.engine_cores == 1.5
    assert host.step(ONE, 3.0).step_s(CHUNK) == pytest.approx(2 * ONE.step_s(CHUNK))  # 3 engines on 1.5 cores
    assert host.step(ONE, 1.2) == ONE  # fewer than the cores left: full speed
    assert HostCpu(2.0, 2.5).engine_cores == 0.05  # a guard, not a model: the engines always got some


def test_helpers_speed_an_engine_up_only_on_cores_nobody_else_wants():
    host = HostCpu(cores=2.0, background_cores=0.0, helped=HELPED)
    for load in (CHUNK, DECODE):  # alone on an idle host: the calibrated helped steps
        assert host.step(ONE, 1.0).step_s(load) == pytest.approx(HELPED.step_s(load))
        # a core each: one thread's speed; half a core each: as without helpers
        assert host.step(ONE, 2.0).step_s(load) == pytest.approx(ONE.step_s(load))
        assert host.step(ONE, 4.0).step_s(load) == pytest.approx(2 * ONE.step_s(load))
        # 1.5 cores each (or the background's share taken): the second core free half the
        # time, the step half way to the helped time
        half = (ONE.step_s(load) + HELPED.step_s(load)) / 2
        assert host.step(ONE, 2.0 / 1.5).step_s(load) == pytest.approx(half)
        assert HostCpu(2.0, 0.5, HELPED).step(ONE, 1.0).step_s(load) == pytest.approx(half)
        assert HostCpu(4.0, 0.0, HELPED).step(ONE, 1.0).step_s(load) == pytest.approx(HELPED.step_s(load))
    # What a helper buys depends on the step: a prefill chunk far more than a small decode.
    assert ONE.step_s(CHUNK) / host.step(ONE, 1.0).step_s(CHUNK) > 1.9
    assert ONE.step_s(DECODE) / host.step(ONE, 1.0).step_s(DECODE) < 1.2
    assert (host.helper_core(1.0), host.helper_core(2.0 / 1.5), host.helper_core(3.0)) == (1.0, 0.5, 0.0)
    assert HostCpu(2.0, 0.0).step(ONE, 1.0) == ONE and HostCpu(2.0, 0.0).helper_core(1.0) == 0.0  # no helpers
    assert from_account({"wall_s": 1.0, "host_busy_s": 1.0, "engines_s": 1.0}, 2, HELPED).helped == HELPED


def test_background_is_the_host_busy_time_less_the_engines():
    account = {"wall_s": 100.0, "host_busy_s": 170.0, "engines_s": 120.0}
    assert from_account(account, 2) == HostCpu(2, 0.5)
    assert (
        from_account({**account, "host_busy_s": 110.0}, 2).background_cores == 0.0
    )  # clock skew: not negative
    assert from_account({**account, "wall_s": 0.0}, 2).background_cores == 0.0


def test_engines_a_step_sees_busy():
    # P busy for 50 s, MD for all 100 s: P's 50 s see 2, MD's first 50 s 2 and its last 50 s 1;
    # weighted by busy time: (50 * 2 + 50 * 2 + 50 * 1) / 150.
    assert engines_seen_busy([[(0.0, 50.0)], [(0.0, 100.0)]]) == pytest.approx(250 / 150)
    # The same busy time, but P computes only while MD waits (one request P→MD): each alone.
    assert engines_seen_busy([[(0.0, 10.0), (60.0, 100.0)], [(10.0, 60.0), (100.0, 150.0)]]) == 1.0
    assert engines_seen_busy([[(0.0, 30.0)], []]) == 1.0  # alone: only itself
    assert engines_seen_busy([[], []]) == 0.0 and engines_seen_busy([[(5.0, 5.0)]]) == 0.0


def test_host_busy_ticks_leave_out_idle_and_iowait():
    # user nice system idle iowait irq softirq steal guest guest_nice
    assert busy_ticks("cpu  100 5 30 1000 40 2 3 7 50 0") == 100 + 5 + 30 + 2 + 3 + 7


def _snap(t, host, bench, procs):
    return {"t": t, "host_busy_s": host, "bench_s": bench, "procs": procs}


def test_an_account_splits_the_driven_system_from_the_idle_ones():
    before = _snap(
        10.0,
        100.0,
        1.0,
        {
            "a": {"prefill": (11, 5.0), "router": (12, 2.0), "nats-a": (13, 1.0)},
            "b": {"main_decode": (21, 3.0)},
        },
    )
    after = _snap(
        20.0,
        116.0,
        2.5,
        {
            "a": {"prefill": (11, 12.0), "router": (12, 4.0), "nats-a": (13, 1.5)},
            "b": {"main_decode": (21, 3.5)},
            "c": {"relay": (31, 9.0)},
        },
    )
    acct = Account()
    acct.add(before, after, own="a")
    acct.add(
        before, _snap(20.0, 100.0, 1.0, {"a": {"prefill": (99, 50.0)}}), own="a"
    )  # restarted: not counted
    j = acct.as_json()
    assert (j["wall_s"], j["host_busy_s"], j["bench_s"]) == (20.0, 16.0, 1.5)
    assert j["processes"] == {"nats-a": 0.5, "prefill": 7.0, "router": 2.0}
    assert j["other_systems_s"] == 0.5  # b's main_decode; c was not there before
    assert (j["engines_s"], j["non_engine_s"], j["other_tenants_s"]) == (7.0, 4.5, 16.0 - 11.5)
    assert [
        is_engine(n) for n in ("prefill", "relay-1", "main_decode-2", "router", "nats-a", "router-1")
    ] == [True, True, True, False, False, False]


def test_a_meter_reads_real_processes(tmp_path: Path):
    """A busy child named as an engine in a `pdd up`-like run directory, the bench's own loop,
    and the engine's loop figures from its metrics over HTTP (a registry served here)."""
    child = subprocess.Popen(
        [sys.executable, "-c", "import time\nt = time.time()\nwhile time.time() - t < 30: pass"]
    )
    idle = subprocess.Popen(["sleep", "30"])
    registry = CollectorRegistry()
    steps = Histogram("pdd_engine_step_seconds", "steps", ["service"], registry=registry)
    server, _ = start_http_server(0, addr="127.0.0.1", registry=registry)
    urls = {
        "prefill": f"http://127.0.0.1:{server.server_port}/metrics",
        "router": "http://127.0.0.1:9/metrics",
    }
    try:
        (tmp_path / "run").mkdir()
        (tmp_path / "run" / "prefill.pid").write_text(f"{child.pid}\n")
        system = SimpleNamespace(
            workdir=tmp_path, proc=SimpleNamespace(pid=idle.pid), metrics_urls=lambda: urls
        )
        meter = Meter({"x": system})
        steps.labels(service="prefill").observe(1.0)  # before the stretch: not counted
        with meter.measure("x", "x"):
            steps.labels(service="prefill").observe(0.25)
            deadline = time.monotonic() + 10
            while process_cpu_s(child.pid) < 0.3 and time.monotonic() < deadline:
                sum(range(10_000))
        j = meter.as_json()["accounts"]["x"]
        assert j["engine_figures"] == {
            "prefill": {"steps": 1.0, "step_s": 0.25, "gaps": 0.0, "between_s": 0.0}
        }
        assert j["processes"]["prefill"] > 0.2 and j["engines_s"] == j["processes"]["prefill"]
        assert j["processes"]["up"] < 0.05  # a sleeping supervisor
        assert j["bench_s"] > 0 and j["host_busy_s"] >= j["engines_s"] + j["bench_s"] - 0.05
    finally:
        server.shutdown()
        for p in (child, idle):
            p.kill()
            p.wait(timeout=10)
    assert process_cpu_s(child.pid) is None


def test_validate_takes_each_deployments_measured_host(tmp_path, capsys):
    """A hand-made run whose same-dc had a busy host: 1.5 background cores leave the engines 0.5,
    so its factor is (engines a step sees busy) / 0.5; naive's host was idle: full speed."""

    def account(host_busy, engines):
        return {
            "wall_s": 10.0,
            "host_busy_s": host_busy,
            "bench_s": 2.0,
            "processes": {"router": 3.0, "prefill": engines},
            "other_systems_s": 0.0,
            "engines_s": engines,
            "other_tenants_s": host_busy - engines - 5.0,
        }

    names = AGENTIC["deployments"].split(",")
    report = {
        "scenario": "agentic",
        "config": AGENTIC,
        "rows": _rows("deployment", names),
        "wall_s": 60.0,
        "host": {"cores": 2, "loadavg_end": [3.0, 1.0, 1.0]},
        "cpu": {
            "cores": 2,
            "accounts": {
                "same-dc": account(20.0, 5.0),
                "naive": account(5.0, 0.0),
                "pdd": account(12.0, 5.0),
            },
        },
    }
    (tmp_path / "e2e_agentic.json").write_text(json.dumps(report))
    out = tmp_path / "validate.json"
    assert v.main(["--measured", str(tmp_path), "--out", str(out), "--scenario", "agentic"]) == 0
    printed = capsys.readouterr().out
    assert "background 1.50 = 0.30 + 0.00 + 0.00 + 0.00 + 0.20 + 0.00 + 1.00" in printed
    host = json.loads(out.read_text())["scenarios"]["agentic"]["host_cpu"]
    same = host["same-dc"]
    assert (same["background"], same["engine_cores"], same["engines_measured"]) == (1.5, 0.5, 0.5)
    assert same["factor"] == pytest.approx(max(1.0, same["engines_seen_busy"] / 0.5)) and same["factor"] > 1.9
    naive = host["naive"]  # 0.5 background: more than a core each, the helpers have part of a second
    helped = helped_step("cpu-calibrated")
    assert naive["engine_cores"] == 1.5 and helped is not None
    cores_each = 1.5 / naive["engines_seen_busy"]
    assert naive["factor"] == 1.0 and naive["helper_core"] == pytest.approx(cores_each - 1.0)
    assert naive["helper_core"] > 0.0
    assert host["pdd"]["background"] == pytest.approx(0.7)
    # The load-average model is still there, and a run without CPU accounts falls back to it.
    assert (
        v.main(
            ["--measured", str(tmp_path), "--out", str(out), "--scenario", "agentic", "--cpu-share", "auto"]
        )
        == 0
    )
    assert {
        h["factor"] for h in json.loads(out.read_text())["scenarios"]["agentic"]["hostings"].values()
    } == {1.5}
    report.pop("cpu")
    (tmp_path / "e2e_agentic.json").write_text(json.dumps(report))
    assert v.main(["--measured", str(tmp_path), "--out", str(out), "--scenario", "agentic"]) == 0
    assert {
        h["factor"] for h in json.loads(out.read_text())["scenarios"]["agentic"]["hostings"].values()
    } == {1.5}


def test_single_accounts_are_per_variant():
    account = {"wall_s": 4.0, "host_busy_s": 6.0, "engines_s": 3.0}
    hosts = v.measured_hosts("measured", {"cpu": {"cores": 2, "accounts": {"p-md": account}}}, 8)
    assert hosts == {"p-md": HostCpu(2, 0.75)}
    assert v.measured_hosts("auto", {"cpu": {"accounts": {"p-md": account}}}, 2) == {}
    assert v.measured_hosts("measured", {"config": SINGLE}, 2) == {}
