"""`pdd sim validate`: a scenario rebuilt from the bench's recorded config, the side-by-side
comparison on hand-made numbers, and a tiny run of the command."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from types import SimpleNamespace

import pytest

from pdd.sim.fleet.deployment import LinkSpec
from pdd.sim.fleet.records import SimResult
from pdd.sim.hardware.profiles import chip, model_spec
from pdd.sim.hardware.step_cost import decode_load
from pdd.sim.studies import validate as v

AGENTIC = {  # what bench/e2e.py records (vars of its arguments), cut to a tiny workload
    "scenario": "agentic",
    "seed": 0,
    "prefill_chunk": 256,
    "delay_ms": 15.0,
    "jitter_ms": 2.0,
    "bandwidth_mbps": 100.0,
    "deployments": "same-dc,naive,pdd",
    "requests": 4,
    "clients": 2,
    "wave": 2,
    "shared_prefix": 64,
    "new_min": 64,
    "new_max": 128,
    "append_min": 8,
    "context_max": 256,
    "output_min": 4,
    "output_max": 8,
    "outlier_frac": 0.0,
    "think_s": 0.0,
    "md_kv_mb": 8.0,
}
SINGLE = {
    "scenario": "single",
    "seed": 0,
    "prefill_chunk": 0,
    "delay_ms": 15.0,
    "jitter_ms": 0.0,
    "bandwidth_mbps": 100.0,
    "prompt_tokens": 64,
    "output_tokens": 6,
    "rounds": 2,
    "variants": "no-wan,p-md,p-rld-md/one-shot",
}


@pytest.fixture(scope="module")
def base():
    return chip("cpu-calibrated", model_spec("small"))


def test_agentic_scenario_from_the_recorded_config(base):
    cases = v.agentic_cases(AGENTIC, base)
    assert {d: c.deployment.kind for d, c in cases.items()} == {
        "same-dc": "same-dc",
        "naive": "naive",
        "pdd": "pdd",
    }
    d = cases["pdd"].deployment
    assert d.wan == LinkSpec(12.5e6, 0.013, 0.004)  # 100 Mbit/s; 15 ms ±2 ms uniform
    assert (
        d.prefill.chip.kv_capacity_bytes,
        d.decode.chip.kv_capacity_bytes,
        d.relay.chip.kv_capacity_bytes,
    ) == (8 * 2**20, 8 * 2**20, 256 * 2**20)
    assert d.prefill.chip.step == base.step and d.prefill.count == d.decode.count == d.relay.count == 1
    s = cases["pdd"].settings
    assert (s.max_batched_tokens, s.prefill_chunk, s.max_num_seqs, s.router.wan_time_threshold_s) == (
        2048,
        256,
        64,
        0.5,
    )
    w = cases["naive"].workload
    warm, *reqs = w.requests
    assert (warm.kind, warm.input_tokens, warm.client, cases["naive"].warm) == ("warm", 128, -1, 1)
    assert len(reqs) == 4 and [r.client for r in reqs] == [0, 1, 0, 1] and w.closed_loop
    assert [r.arrival_s for r in reqs] == [v.WARM_S, v.WARM_S, 0.0, 0.0]  # the agents start after the warm-up
    # The warm-up holds the agents' shared system prompt (4 blocks): every new session starts with it.
    assert any(r.block_hashes[:4] == warm.block_hashes[:4] for r in reqs)


def test_the_agents_run_in_the_benchs_waves(base):
    for wave, expected in ((1, [0, 0, 1, 1]), (2, [0, 0, 0, 0])):  # 2 agents, 2 requests each
        _, *reqs = v.agentic_cases({**AGENTIC, "wave": wave}, base)["pdd"].workload.requests
        assert [r.wave for r in reqs] == expected  # each agent's k-th request in wave k // --wave


def test_single_scenario_from_the_recorded_config(base):
    cases = v.single_cases(SINGLE, base)
    assert {n: c.deployment.kind for n, c in cases.items()} == {
        "no-wan": "same-dc",
        "p-md": "naive",
        "p-rld-md/one-shot": "pdd",
    }
    one_shot = cases["p-rld-md/one-shot"]
    assert one_shot.settings.relay.catchup_threshold == 100_000
    assert one_shot.settings.router.wan_time_threshold_s == 0.0  # the relay is forced, as the bench forces it
    p_md = cases["p-md"].settings
    assert (p_md.relay.catchup_threshold, p_md.max_batched_tokens, p_md.prefill_chunk) == (64, 2048, 256)
    assert one_shot.deployment.wan == LinkSpec(12.5e6, 0.015, 0.0)
    assert one_shot.deployment.relay.chip.kv_capacity_bytes == 256 * 2**20
    reqs = one_shot.workload.requests
    assert [(r.input_tokens, r.output_tokens, len(r.block_hashes), r.arrival_s) for r in reqs] == [
        (64, 6, 4, 0.0),
        (64, 6, 4, 1.0),
    ]
    assert not set(reqs[0].block_hashes) & set(reqs[1].block_hashes)  # uncached, round after round


def test_each_role_is_charged_its_measured_time_between_steps(base):
    loop = {"steps": 0.0, "step_s": 0.0}
    account = {
        "engine_figures": {
            "prefill": {**loop, "gaps": 8.0, "between_s": 0.016},
            "main_decode-1": {**loop, "gaps": 100.0, "between_s": 0.05},  # two MDs: one mean
            "main_decode-2": {**loop, "gaps": 100.0, "between_s": 0.15},
            "relay": {**loop, "gaps": 0.0, "between_s": 0.0},  # never busy twice in a row: nothing known
        }
    }
    assert v.loop_gaps(account) == pytest.approx({"prefill": 0.002, "decode": 0.001})
    assert v.loop_gaps({"wall_s": 1.0}) == {}  # a run from before the bench recorded them
    d = v.agentic_cases(AGENTIC, base)["pdd"].deployment
    charged = v.with_gaps(d, {"decode": 0.001})
    load = decode_load(4, 1000)
    assert charged.decode.chip.step.step_s(load) == pytest.approx(d.decode.chip.step.step_s(load) + 0.001)
    assert (charged.prefill, charged.relay) == (d.prefill, d.relay)
    # Charged after the host's share, in full: the gap is wall time the run measured.
    case = v.single_cases(SINGLE, base)["no-wan"]
    one = v.run_case(case, model_spec("small"), 2.0, 2.0)[0].records[0].tpot_s
    gap = v.run_case(case, model_spec("small"), 2.0, 2.0, gaps={"decode": 0.005})[0].records[0].tpot_s
    assert gap == pytest.approx(one + 0.005, rel=0.02)


def test_the_hosts_unshaped_kv_paths_move_kv_at_their_measured_rates(base):
    figures = {"tails_wan": 2.0, "tail_s_wan": 0.02, "tail_bytes_wan": 8e6, "tails_local": 0.0}
    account = {"engine_figures": {"prefill": figures, "main_decode": {"steps": 1.0}}}
    rates = v.kv_path_rates(account)
    assert rates == pytest.approx({"wan": 4e8}) and v.kv_path_rates({}) == {}
    cases = v.agentic_cases(AGENTIC, base)
    same = v.on_kv_paths(cases["same-dc"].deployment, {"wan": 4e8, "local": 1e9})
    assert same.wan.bandwidth_Bps == 4e8  # the emulator, lifted: this host's path, not RDMA's
    pdd = v.on_kv_paths(cases["pdd"].deployment, {"wan": 4e8, "local": 1e9})
    assert pdd.wan == cases["pdd"].deployment.wan and pdd.local.bandwidth_Bps == 1e9  # a shaped WAN stays
    naive = cases["naive"].deployment
    assert v.on_kv_paths(naive, {"wan": 4e8}) == naive


def test_cpu_share_factor(base):
    assert v.share_factor(3.0, 2.0) == 1.5 and v.share_factor(1.4, 2.0) == 1.0
    load = decode_load(4, 1000)
    assert v.scaled(base.step, 1.5).step_s(load) == pytest.approx(1.5 * base.step.step_s(load))
    d = v.with_share(v.agentic_cases(AGENTIC, base)["pdd"].deployment, 2.0)
    assert d.relay.chip.step.step_s(load) == pytest.approx(2 * base.step.step_s(load))
    assert d.decode.chip.kv_capacity_bytes == 8 * 2**20
    # The engines' busy spells over the measured part: from the first request after the warm-up (60 s).
    first = SimpleNamespace(arrival_s=60.0, kind="low")
    run = SimResult(
        "pdd",
        "w",
        [SimpleNamespace(arrival_s=0.0, kind="warm"), first],
        100.0,
        0.0,
        [],
        busy_spells={"p0": [(0.0, 10.0), (55.0, 70.0)], "md0": [(61.0, 100.0)]},
    )
    assert v.measured_spells(run, warm=1) == ([[(60.0, 70.0)], [(61.0, 100.0)]], 40.0)
    assert v.measured_spells(run, warm=0)[1] == 100.0  # no warm-up: all of it


def test_cpu_share_from_the_hosts_recorded_load():
    report = {"wall_s": 800.0, "host": {"cores": 2, "loadavg_end": [8.0, 6.0, 5.0]}}
    assert v.host_share(report) == 2.5  # the 15-minute load: its window is nearest the 800 s run
    assert v.host_share({**report, "wall_s": 90.0}) == 4.0  # a short run: the 1-minute load
    assert v.host_share({**report, "host": {"cores": 16, "loadavg_end": [8.0, 6.0, 5.0]}}) == 1.0
    assert v.host_share({"wall_s": 800.0}) is None  # not recorded
    assert v.resolve_share("auto", report) == 2.5 and v.resolve_share("auto", {"wall_s": 1.0}) is None
    assert v.resolve_share("engines", report) is None and v.resolve_share("1.7", report) == 1.7
    assert v.resolve_share("measured", report) is None


def _stats(ttft, tt2t, gap, tpot):
    return {
        "ttft_p50": ttft,
        "ttft_p99": 9.0,
        "tt2t_p50": tt2t,
        "tt2t_p99": 9.0,
        "max_gap_p50": gap,
        "max_gap_p99": 9.0,
        "tpot_p50": tpot,
        "tpot_p99": 9.0,
    }


def test_comparison_marks_the_tolerance_and_the_ordering():
    measured = {
        "same-dc": _stats(1.0, 1.0, 1.0, 1.0),
        "naive": _stats(2.0, 2.0, 2.0, 2.0),
        "pdd": _stats(3.0, 3.0, 3.0, 3.0),
    }
    simulated = {
        "same-dc": _stats(1.25, 1.26, 1.0, 1.0),
        "naive": _stats(1.5, 2.0, 1.49, 2.0),
        "pdd": _stats(2.4, 3.0, 3.0, 1.9),
    }
    rows = v.compare("agentic", simulated, measured)
    within = {(r.deployment, r.metric): r.within for r in rows}
    assert within[("same-dc", "ttft_p50")] is True  # +25%: on the bound
    assert within[("same-dc", "tt2t_p50")] is False  # +26%
    assert within[("naive", "ttft_p50")] is True  # -25%
    assert within[("naive", "max_gap_p50")] is False  # -25.5%
    assert within[("pdd", "ttft_p50")] is True and within[("pdd", "ttft_p99")] is None  # a p99 is not judged
    assert next(
        r for r in rows if r.metric == "tt2t_p50" and r.deployment == "same-dc"
    ).error == pytest.approx(0.26)
    orders = v.orderings(rows)
    assert orders["ttft_p50"] == ("same-dc < naive < pdd", "same-dc < naive < pdd", True)
    assert orders["max_gap_p50"][2] is True  # 1.0 < 1.49 < 3.0
    assert orders["tpot_p50"] == ("same-dc < pdd < naive", "same-dc < naive < pdd", False)
    assert v.order({"a": 2.0, "b": 1.0, "c": 1.04}) == "b ≈ c < a"
    # Within 5% is a tie, which agrees with either order; beyond it, the order counts.
    assert v.same_order({"a": 1.0, "b": 1.04}, {"a": 2.0, "b": 1.0})
    assert not v.same_order({"a": 1.0, "b": 1.06}, {"a": 2.0, "b": 1.0})


def _rows(side: str, names: list[str]) -> list[dict]:
    return [
        {side: n, "ok": True, "ttft": 0.1 * (i + 1), "tt2t": 0.2, "max_gap": 0.05, "tpot": 0.03}
        for i, n in enumerate(names)
    ] + [{side: names[0], "ok": False, "ttft": 99.0, "tt2t": None, "max_gap": None, "tpot": None}]


def test_main_against_a_hand_made_measured_run(tmp_path, capsys):
    for cfg, names in ((AGENTIC, ["same-dc", "naive", "pdd"]), (SINGLE, SINGLE["variants"].split(","))):
        report = {"scenario": cfg["scenario"], "config": cfg, "rows": _rows(v.SIDE[cfg["scenario"]], names)}
        if cfg is AGENTIC:  # the host's load recorded: its share; else the simulation's own
            report.update(wall_s=60.0, host={"cores": 2, "loadavg_end": [3.0, 1.0, 1.0]})
        (tmp_path / f"e2e_{cfg['scenario']}.json").write_text(json.dumps(report))
    out = tmp_path / "validate.json"
    assert v.main(["--measured", str(tmp_path), "--out", str(out), "--cores", "2"]) == 0
    printed = capsys.readouterr().out
    assert "of 24 medians within ±25%" in printed and "p-rld-md/one-shot" in printed
    res = json.loads(out.read_text())["scenarios"]
    rows = {(r["deployment"], r["metric"]): r for s in res.values() for r in s["rows"]}
    assert len(rows) == 6 * 8
    assert rows[("same-dc", "ttft_p50")]["measured"] == pytest.approx(0.1)  # the failed row left out
    assert all(
        r["simulated"] > 0 and not math.isnan(r["simulated"])
        for k, r in rows.items()
        if k[1] != "max_gap_p99"
    )
    assert {h["factor"] for h in res["agentic"]["hostings"].values()} == {1.5}
    assert all(h["factor"] >= 1.0 for h in res["single"]["hostings"].values())


def test_main_says_when_a_measured_run_is_missing(tmp_path, capsys):
    assert (
        v.main(["--measured", str(tmp_path), "--scenario", "single", "--out", str(tmp_path / "x.json")]) == 2
    )
    assert "no measured run" in capsys.readouterr().out


def test_the_warm_up_is_not_measured(base):
    model = model_spec("small")
    case = v.agentic_cases(AGENTIC, base)["pdd"]
    result, hosting = v.run_case(case, model, None, 2.0)
    mean, seen = v.full_speed_engines(case, model)  # engines: the mean over the measured part
    assert (
        hosting.engines == mean
        and hosting.factor == max(1.0, mean / 2.0)
        and sorted(r.kind for r in result.records).count("warm") == 1
    )
    assert 1.0 <= seen <= 3.0 and mean < seen  # a step sees itself and some of the others
    records = [replace(r, ttft_s=1e6) if r.kind == "warm" else r for r in result.records]
    assert v.simulated_stats(records)["ttft_p99"] < 100.0  # the tiny prompts take well under a second
