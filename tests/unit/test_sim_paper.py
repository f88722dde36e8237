"""`pdd sim paper`: the paper's fleets, the cost arithmetic, the bandwidth ratio, and a tiny run."""

from __future__ import annotations

import json

import pytest

from pdd.sim import paper
from pdd.sim.deployment import LinkSpec, RoleSpec, naive
from pdd.sim.simulator import simulate
from pdd.sim.workload import SimRequest
from tests.sim_util import BLOCK, FLAT, TINY, workload


@pytest.mark.parametrize("regime", sorted(paper.REGIMES))
def test_fleets_have_the_papers_counts_and_chips(regime):
    """In chips: 88 A, or 43 A and 32 B (an instance count of tp chips each, rounded down)."""
    sc = paper.Scenario(regime=regime)
    a, b = paper.chips(sc)
    tp = sc.r.tp
    assert a.chips == b.chips == tp
    fleets = paper.candidates(sc, a, b)
    kinds = {d.kind for d in fleets}
    assert kinds == {"same-dc", "naive", "pdd"}
    for d in fleets:
        if d.kind == "same-dc":
            assert d.prefill.count + d.decode.count == 88 // tp
            assert d.prefill.chip.name == d.decode.chip.name == "gpu-a"
        else:
            relays = d.relay.count if d.relay else 0
            assert d.prefill.count + relays == 43 // tp and d.decode.count == 32 // tp
            assert d.prefill.chip.name == "gpu-a" and d.decode.chip.name == "gpu-b"
            assert d.relay is None or d.relay.chip.name == "gpu-a"
            assert d.wan.bandwidth_Bps == 400e9 / 8 and d.wan.price_per_hour == 1.0
    # the relay count is searched (5% and 10% of the A instances: one count for a few)
    assert sum(d.kind == "pdd" for d in fleets) >= (2 if tp == 1 else 1)


def test_cost_change_for_the_two_premiums_by_hand():
    a, b = paper.chips(paper.Scenario(regime="7b-dense"))
    assert a.price_per_hour == 3.0 and b.price_per_hour == 3.75  # the profiles' prices
    # (43 x 3.00 + 32 x 3.60 + 1.00) / (88 x 3.00) - 1 = 245.2 / 264 - 1
    assert paper.cost_change(a, 1.0, 1.20) == pytest.approx(245.2 / 264 - 1)
    # (43 x 3.00 + 32 x 3.90 + 1.00) / 264 - 1 = 254.8 / 264 - 1
    assert paper.cost_change(a, 1.0, 1.30) == pytest.approx(254.8 / 264 - 1)
    sc = paper.Scenario(regime="7b-dense")
    fleet = paper.with_premium(paper.pdd_fleet(sc, a, b, 4), a, 1.20)
    assert fleet.cost_per_hour == pytest.approx(245.2)
    a4, _ = paper.chips(paper.Scenario(regime="64k-moe"))  # 4 chips an instance: the same per chip
    assert a4.price_per_hour == 12.0
    assert paper.cost_change(a4, 1.0, 1.20) == pytest.approx(245.2 / 264 - 1)


def test_bandwidth_ratio_is_full_prompt_over_sent_bytes():
    """Request 1 shares request 0's first 3 blocks: MD holds them, so only its 4th block
    crosses. Full prompts: 8 blocks; sent: 4 + 1 blocks."""
    r0 = SimRequest(0, 0.0, 4 * BLOCK, 2, (10, 11, 12, 13))
    r1 = SimRequest(1, 5.0, 4 * BLOCK, 2, (10, 11, 12, 99))
    d = naive(RoleSpec(1, FLAT), RoleSpec(1, FLAT), LinkSpec(1e6, 0.01))
    records = simulate(d, workload(r0, r1), TINY).records
    kvbpt = TINY.kv_bytes_per_token
    assert [r.wan_bytes for r in records] == [4 * BLOCK * kvbpt, 1 * BLOCK * kvbpt]
    assert paper.full_prompt_bytes(records, kvbpt) == 8 * BLOCK * kvbpt
    assert paper.bandwidth_ratio(records, kvbpt) == pytest.approx(8 / 5)


def test_a_tiny_run_writes_every_metric_beside_the_papers(tmp_path):
    out = tmp_path / "paper.json"
    argv = [
        "--scenario",
        "7b-dense",
        "--scale",
        "0.05",
        "--duration",
        "5",
        "--jobs",
        "1",
        "--out",
        str(out),
        "--quiet",
    ]
    assert paper.main(argv) == 0
    result = json.loads(out.read_text())
    assert result["paper"] == paper.PAPER_FIGURES
    metrics = result["metrics"]
    for key in (
        "ttft_p50_change",
        "ttft_p99_change",
        "goodput_change",
        "bcr_change_20",
        "bcr_change_30",
        "cost_change_20",
        "cost_change_30",
        "bandwidth_ratio",
        "wan_gbps_mean",
        "wan_gbps_p99",
        "rld_token_share",
        "pipelines",
        "filtered_share",
        "believed_bandwidth_ratio",
    ):
        assert key in metrics, key
    assert {r["metric"].split(",")[0] for r in result["rows"]} >= {
        "TTFT p50 change",
        "SLA goodput change",
        "BCR change",
        "cost change",
    }
    assert set(result["fleets"]) == {"same-dc", "naive", "pdd"}
    assert result["fleets"]["same-dc"]["goodput_rps"] > 0
    assert (tmp_path / "paper.png").exists()
