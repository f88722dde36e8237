"""`pdd sim map`: the axes' arithmetic, and a tiny map that runs end to end."""

from __future__ import annotations

import json

import pytest

from pdd.sim import map as sim_map
from pdd.sim import paper


def test_high_share_for_gives_the_mean_hit_aimed_at():
    for mean in (0.5, 0.7, 0.9):
        q = sim_map.high_share_for(mean)
        high, low = (0.95 + 0.999) / 2, 0.95 / 2
        assert (1 - sim_map.OUTLIERS) * (q * high + (1 - q) * low) == pytest.approx(mean)
    assert sim_map.high_share_for(0.99) == 1.0 and sim_map.high_share_for(0.1) == 0.0


def test_kv_layers_for_rounds_to_whole_full_attention_layers():
    base = paper.REGIMES["64k-hybrid"]  # 12 of 48 layers on full attention, 2 KiB each
    assert sim_map.kv_layers_for(24_576, base) == 12
    assert sim_map.kv_layers_for(6_000, base) == 3
    assert sim_map.kv_layers_for(10**9, base) == 48
    r = sim_map.regime(base, sim_map.Cell(3, 100.0, 0.5))
    assert paper.model_of(r).kv_bytes_per_token == 3 * 2048
    assert r.traffic.high_hit_frac == 0.5 and r.traffic.low_hit_min == 0.0


def test_a_tiny_map_has_a_cell_per_point_of_its_axes(tmp_path):
    out = tmp_path / "map.json"
    argv = ["--scenario", "7b-dense", "--scale", "0.05", "--duration", "3", "--jobs", "1"]
    argv += [
        "--kv-bytes",
        "28000",
        "57000",
        "--line-gbps",
        "400",
        "--mean-hit",
        "0.9",
        "--out",
        str(out),
        "--quiet",
    ]
    assert sim_map.main(argv) == 0
    result = json.loads(out.read_text())
    assert result["axes"] == {"kv_bytes_per_token": [28000, 57000], "line_gbps": [400.0], "mean_hit": [0.9]}
    assert [c["kv_bytes_per_token"] for c in result["cells"]] == [14 * 2048, 28 * 2048]
    for c in result["cells"]:
        assert {"goodput_change", "bcr_change_20", "naive_goodput_change", "mean_hit"} <= set(c)
        assert c["goodput_rps"]["same-dc"] > 0
    assert result["paper_point"] == sim_map.PAPER_POINT
    assert (tmp_path / "map.png").exists()
