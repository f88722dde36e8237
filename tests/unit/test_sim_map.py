"""`pdd sim map`: its axes and a tiny map that runs end to end."""

from __future__ import annotations

import json

import pytest

from pdd.sim.studies import map as sim_map
from pdd.sim.studies import paper_fleets
from pdd.sim.workloads.agentic import prefix_hits


def test_b_speed_moves_b_decode_per_dollar_and_kv_bytes_the_model():
    base = paper_fleets.REGIMES["published"]
    slow = paper_fleets.Scenario(regime=sim_map.regime(base, sim_map.Cell(1.0, 4390, 25.0, 0.8)))
    fast = paper_fleets.Scenario(regime=sim_map.regime(base, sim_map.Cell(3.0, 70000, 25.0, 0.5)))
    assert sim_map.decode_per_dollar(fast) > 2 * sim_map.decode_per_dollar(slow)
    assert paper_fleets.model_of(fast.r).kv_bytes_per_token == 70000
    assert fast.r.traffic.high_hit_frac == 0.5


def test_fixed_hit_and_output_scale_shape_the_traffic():
    base = paper_fleets.REGIMES["published"]
    cell = sim_map.Cell(1.0, 4390, 25.0, 0.0, fixed_hit=0.99, output_scale=4.0)
    sc = paper_fleets.Scenario(scale=0.05, regime=sim_map.regime(base, cell))
    t = sc.r.traffic
    assert (t.output_min, t.output_max) == (4 * base.traffic.output_min, 4 * base.traffic.output_max)
    assert t.outlier_output == base.traffic.outlier_output  # the outliers stay short
    assert sc.window.measure_s > paper_fleets.Scenario(regime=base).window.measure_s  # longer lives
    w = paper_fleets.make_workload(sc, 2.0)
    prompt, out = paper_fleets.fixed_shape(sc.r)
    assert {r.kind for r in w.requests} == {"fixed"}
    assert {(r.input_tokens, r.output_tokens) for r in w.requests} == {(prompt, out)}
    assert out == 4 * (base.traffic.output_min + base.traffic.output_max) // 2
    hits = prefix_hits(w)[64:]  # every prefix seen: each request hits 99% of its prompt
    assert hits and all(h == pytest.approx(0.99, abs=0.01) for h in hits)


def test_bad_axis_values_are_refused(tmp_path, capsys):
    with pytest.raises(SystemExit, match="fixed-hit"):
        sim_map.main(["--fixed-hit", "1.5", "--out", str(tmp_path / "m.json"), "--quiet"])
    with pytest.raises(SystemExit, match="output-scale"):
        sim_map.main(["--output-scale", "0", "--out", str(tmp_path / "m.json"), "--quiet"])


def test_a_tiny_map_has_a_cell_per_point_of_its_axes(tmp_path):
    out = tmp_path / "map.json"
    argv = [
        "--scenario",
        "7b-dense",
        "--scale",
        "0.03",
        "--lifetimes",
        "0.1",
        "--warmup",
        "0.2",
        "--rel-tol",
        "0.5",
        "--jobs",
        "1",
    ]
    argv += ["--b-speed", "2", "--kv-bytes", "57344", "--line-gbps", "400", "--fixed-hit", "0.95"]
    argv += ["--output-scale", "1", "2", "--out", str(out), "--quiet"]
    assert sim_map.main(argv) == 0
    result = json.loads(out.read_text())
    cells = result["cells"]
    assert [(c["fixed_hit"], c["output_scale"]) for c in cells] == [(0.95, 1), (0.95, 2)]
    assert cells[1]["output_tokens_mean"] == 2 * cells[0]["output_tokens_mean"]
    assert result["scenario"]["warmup"] == 0.2
    for c in result["cells"]:
        assert {
            "goodput_change",
            "bcr_change_20",
            "naive_goodput_change",
            "mean_hit",
            "b_decode_per_dollar",
        } <= set(c)
        assert c["goodput_rps"]["same-dc"] > 0
        assert sum(c["pdd_at_goodput"]["pipelines"].values()) == pytest.approx(1.0)
    assert (tmp_path / "map.png").exists()
