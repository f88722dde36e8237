"""`pdd sim run`: its flags into the simulator's objects, its JSON and PNG outputs, the real
policy settings reached through --set, the bathtub, and its errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdd.sim.hardware.profiles import model_spec
from pdd.sim.studies import run
from pdd.sim.studies.specs import (
    deployments_from_args,
    settings_from_args,
    sla_from_args,
    workload_from_args,
)
from pdd.sim.workloads.trace import MOONCAKE_BLOCK

SAMPLE_TRACE = Path(__file__).resolve().parents[2] / "pdd/sim/workloads/traces/agentic-sample.jsonl"
# One instance per role under a few seconds of 4096-token prompts that hit half their prefix:
# a P serves ~10 of them a second, so a goodput search stops after a few short probes.
TINY = [
    "--prefill",
    "1",
    "--relay",
    "1",
    "--decode",
    "1",
    "--workload",
    "fixed-hit:0.5",
    "--input-tokens",
    "4096",
    "--output-tokens",
    "32",
    "--rate",
    "4",
    "--duration",
    "5",
    "--drain",
    "30",
    "--quiet",
]


def _args(*argv: str):
    return run.build_parser().parse_args(list(argv))


def test_qwen_7b_shape_from_its_config():
    spec = model_spec("qwen2.5-7b")
    assert spec.kv_bytes_per_token == 57344  # 2 (K, V) x 28 layers x 4 KV heads x 128 dims x 2 bytes
    assert (
        round(spec.params / 1e9, 2) == 7.62
    )  # the 7.61 B of the model card, plus the untied lm_head's share


def test_deployment_flags_give_counts_profiles_and_the_wan():
    args = _args(
        "--deployment",
        "same-dc,pdd:relay=2,decode=3,decode-profile=gpu-b",
        "--deployment",
        "pdd",
        "--prefill",
        "5",
        "--decode",
        "6",
        "--prefill-profile",
        "h100-sxm",
        "--wan-gbps",
        "40",
        "--wan-ms",
        "7",
        "--wan-jitter-ms",
        "2",
        "--wan-price",
        "9",
    )
    same, pdd_b, pdd_a = deployments_from_args(args, model_spec("qwen2.5-7b"))
    assert (same.kind, same.prefill.count, same.decode.count, same.relay) == ("same-dc", 5, 6, None)
    assert (same.prefill.chip.name, same.decode.chip.name) == ("h100-sxm", "gpu-a")
    assert (pdd_b.name, pdd_b.relay.count, pdd_b.decode.count, pdd_b.decode.chip.name) == (
        "pdd",
        2,
        3,
        "gpu-b",
    )
    assert (pdd_a.name, pdd_a.relay.count, pdd_a.decode.count, pdd_a.decode.chip.name) == (
        "pdd-2",
        1,
        6,
        "gpu-a",
    )
    assert pdd_b.wan.bandwidth_Bps == 5e9  # 40 Gbit/s
    assert (pdd_b.wan.one_way_s, pdd_b.wan.jitter_s, pdd_b.wan.price_per_hour) == (0.007, 0.002, 9.0)
    assert same.cost_per_hour == 5 * 3.0 + 6 * 3.0  # gpu-a's and h100-sxm's $3.00/h, no line in one DC


def test_set_reaches_the_real_settings_and_sla_flags_the_sla():
    args = _args(
        "--set",
        "router.wan_time_threshold_s=1.5",
        "--set",
        "relay.catchup_threshold=32",
        "--set",
        "sim.max_batched_tokens=4096",
        "--seed",
        "7",
        "--sla-ttft",
        "3",
        "--sla-tpot",
        "0.05",
        "--sla-gap",
        "1",
        "--sla-attainment",
        "0.95",
    )
    s = settings_from_args(args)
    assert (s.router.wan_time_threshold_s, s.relay.catchup_threshold, s.max_batched_tokens, s.seed) == (
        1.5,
        32,
        4096,
        7,
    )
    sla = sla_from_args(args)
    assert (sla.ttft_s, sla.tpot_s, sla.max_gap_s, sla.attainment) == (3.0, 0.05, 1.0, 0.95)


def test_workload_flags():
    fixed = workload_from_args(
        _args(
            "--workload",
            "fixed-hit:0.9",
            "--rate",
            "4",
            "--duration",
            "10",
            "--input-tokens",
            "2048",
            "--output-tokens",
            "16",
        )
    )
    w = fixed.at()
    assert (fixed.hit, w.block_size) == (0.9, 512)
    assert {(r.input_tokens, r.output_tokens, len(r.block_hashes)) for r in w.requests} == {(2048, 16, 4)}
    assert 20 <= len(w.requests) <= 60  # Poisson at 4 rps for 10 s
    native = workload_from_args(_args("--workload", f"trace:{SAMPLE_TRACE}"))  # at the trace's own rate
    w = native.at()
    assert (native.block_size, w.block_size, w.duration_s) == (
        MOONCAKE_BLOCK,
        MOONCAKE_BLOCK,
        native.trace.duration_s,
    )
    assert w.requests == native.trace.requests
    faster = workload_from_args(_args("--workload", f"trace:{SAMPLE_TRACE}", "--rate", "4")).at()
    assert len(faster.requests) == len(w.requests)
    assert faster.duration_s == pytest.approx(len(w.requests) / 4)  # the sample's ~2 rps, twice as fast


def _main(tmp_path: Path, *argv: str) -> dict:
    out = tmp_path / "r.json"
    assert run.main([*TINY, *argv, "--out", str(out)]) == 0
    return json.loads(out.read_text())


ROW_KEYS = {
    "name",
    "kind",
    "roles",
    "cost_per_hour",
    "requests",
    "unfinished",
    "sla_attainment",
    "pipelines",
    "rld_token_share",
    "filtered",
    "wan_gbps_mean",
    "wan_gbps_p99",
    "cdf",
    "wan_gbps_series",
    "goodput_rps",
    "bcr",
    "probes",
    "vs_first",
    *(f"{k}_{q}_s" for k in ("ttft", "tt2t", "tpot", "max_gap") for q in ("p50", "p99")),
}


def test_a_run_writes_every_output_and_its_plots(tmp_path, capsys):
    result = _main(tmp_path, "--sweep", "--sweep-tol", "0.5")
    assert set(result["settings"]) >= {"flags", "model", "sla", "workload", "router", "relay"}
    rows = result["deployments"]
    assert [r["name"] for r in rows] == ["same-dc", "naive", "pdd"]
    for r in rows:
        assert ROW_KEYS <= set(r), ROW_KEYS - set(r)
        assert r["requests"] == r["offered"] > 0 and r["goodput_rps"] > 0 and r["probes"]
        assert r["bcr"] == pytest.approx(r["goodput_rps"] * 3600 / r["cost_per_hour"])
    assert rows[2]["vs_first"]["cost_per_hour"] == pytest.approx(3 / 2)  # one relay more than 1 P + 1 D
    for name in ("latency", "wan", "goodput"):
        assert (tmp_path / f"r_{name}.png").stat().st_size > 1000
    printed = capsys.readouterr().out
    assert "SLA goodput" in printed and "BCR" in printed


def _pipelines(tmp_path: Path, threshold: str) -> dict:
    result = _main(tmp_path, "--deployment", "pdd", "--set", f"router.wan_time_threshold_s={threshold}")
    return result["deployments"][0]["pipelines"]


def test_the_wan_time_threshold_moves_the_pipeline_shares(tmp_path):
    assert _pipelines(tmp_path, "1000")["p-md"] == 1.0  # no transfer is that slow: never the relay
    always = _pipelines(tmp_path, "0")
    assert always["p-md"] == 0.0 and always["p-rld-md"] + always["rld-only"] == 1.0


def test_bathtub_gives_one_benefit_per_hit(tmp_path, capsys):
    # PDD with two P: without prefix hits prefill bounds both, so PDD serves about twice the rate.
    result = _main(
        tmp_path,
        "--deployment",
        "same-dc,pdd:prefill=2",
        "--bathtub",
        "--bathtub-grid",
        "0,0.9",
        "--bathtub-duration",
        "4",
    )
    points = result["bathtub"]["points"]
    assert [p["hit"] for p in points] == [0.0, 0.9]
    for p in points:
        assert (
            p["pdd_rps"] > 0
            and p["base_rps"] > 0
            and p["benefit"] == pytest.approx(p["pdd_rps"] / p["base_rps"])
        )
    assert points[0]["benefit"] > 1.5
    assert (tmp_path / "r_bathtub.png").exists()
    assert "hit   90%" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--decode-profile", "gpu-z"], "unknown hardware profile 'gpu-z'"),
        (["--deployment", "same-dc,cross-dc"], "unknown deployment 'cross-dc'"),
        (["--deployment", "pdd:relays=2"], "'relays=2' is not KEY=VALUE"),
        (["--set", "router.no_such_field=1"], "router.no_such_field=1"),
        (["--set", "relay.catchup_threshold=many"], "catchup_threshold"),
        (["--deployment", "same-dc", "--bathtub"], "add pdd to --deployment"),
    ],
)
def test_bad_flags_exit_2_with_a_message(tmp_path, capsys, argv, message):
    assert run.main([*TINY, *argv, "--out", str(tmp_path / "r.json")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pdd sim run: ") and message in err
    assert not (tmp_path / "r.json").exists()
