"""`pdd sim paper`: the paper's fleets in chips, their prices, the per-token WAN cut, and a tiny run."""

from __future__ import annotations

import json

import pytest

from pdd.sim.fleet.deployment import LinkSpec, RoleSpec, naive
from pdd.sim.fleet.records import RequestRecord
from pdd.sim.fleet.simulator import simulate
from pdd.sim.studies import paper, paper_fleets, paper_report
from pdd.sim.workloads.workload import SimRequest
from tests.sim_util import BLOCK, FLAT, TINY, workload


@pytest.mark.parametrize("regime", sorted(paper_fleets.REGIMES))
def test_fleets_have_the_papers_chips_and_price_only_those(regime):
    """88 A, or 43 A and 32 B, in instances of tp chips; a chip no instance uses is not bought."""
    sc = paper_fleets.Scenario(regime=regime)
    r, tp = sc.r, sc.r.tp
    fleets = paper_fleets.candidates(sc)
    assert {d.kind for d in fleets} == {"same-dc", "naive", "pdd"}
    a_price, b_price = paper_fleets.price(sc, 1.25)
    for d in fleets:
        roles = [d.prefill, d.decode] + ([d.relay] if d.relay else [])
        assert all(x.chip.chips == tp for x in roles)
        if d.kind == "same-dc":
            assert d.prefill.count + d.decode.count <= 88 // tp
            assert d.prefill.chip.name == d.decode.chip.name == r.a
        else:
            relays = d.relay.count if d.relay else 0
            assert d.prefill.count + relays == 43 // tp and d.decode.count == 32 // tp
            assert (d.prefill.chip.name, d.decode.chip.name) == (r.a, r.b)
        line = d.wan.price_per_hour if d.kind != "same-dc" else 0.0
        chips_a = sum(x.count * tp for x in roles if not (d.kind != "same-dc" and x is d.decode))
        chips_b = d.decode.count * tp if d.kind != "same-dc" else 0
        assert d.cost_per_hour == pytest.approx(chips_a * a_price + chips_b * b_price + line)
    if regime == "published":
        (p,) = [d for d in fleets if d.kind == "pdd"]
        assert (p.prefill.count, p.relay.count, p.decode.count) == (40, 3, 32)  # the relay on 3 H100


def test_cost_change_by_hand():
    sc = paper_fleets.Scenario()  # H100 at $3.00 a chip-hour, H200 at 1.2x / 1.3x of it, a $1/h line
    assert paper_fleets.cost_change(sc, 1.20) == pytest.approx((43 * 3.0 + 32 * 3.6 + 1.0) / (88 * 3.0) - 1)
    assert paper_fleets.cost_change(sc, 1.30) == pytest.approx((43 * 3.0 + 32 * 3.9 + 1.0) / (88 * 3.0) - 1)
    tp2 = paper_fleets.Scenario(regime="64k-hybrid")  # 2 chips an instance: 42 A and 32 B serve
    assert paper_fleets.cost_change(tp2, 1.20) == pytest.approx((42 * 3.0 + 32 * 3.6 + 1.0) / (88 * 3.0) - 1)


def test_the_published_chips_keep_the_kv_room_their_memory_leaves():
    """Expert parallel: each chip holds the replicated weights and its share of the experts; B's
    batch is bigger by its memory left after the weights, far more than its 1.76x memory."""
    sc = paper_fleets.Scenario()
    a, b = paper_fleets.chip(sc, "h100-sxm", 43, True), paper_fleets.chip(sc, "h200-sxm", 32, True)
    assert b.kv_capacity_bytes / a.kv_capacity_bytes > 2.0
    assert b.max_seqs / a.max_seqs > 2.0


def test_wan_cut_is_per_token():
    """Two requests: 1000 tokens at hit 0.9 and 100 tokens at hit 0: the per-request mean hit
    is 45% but the line carries (100 + 100) of 1100 tokens: 5.5x, 1 / (1 - the token-weighted hit)."""

    def rec(rid: int, tokens: int, hit: float) -> RequestRecord:
        sent = round(tokens * (1 - hit)) * 10
        return RequestRecord(
            rid,
            "",
            None,
            0.0,
            tokens,
            1,
            "p-md",
            hit,
            hit,
            0,
            0,
            0,
            0,
            0,
            sent,
            sent,
            0,
            0,
            0,
            0,
            None,
            False,
            "p",
            "md",
            None,
        )

    records = [rec(0, 1000, 0.9), rec(1, 100, 0.0)]
    assert paper_report.bandwidth_ratio(records, 10) == pytest.approx(5.5)
    assert paper_report.token_weighted_hit(records) == pytest.approx(900 / 1100)
    assert paper_report.bandwidth_ratio(records, 10) == pytest.approx(1 / (1 - 900 / 1100))


def test_bandwidth_ratio_is_full_prompt_over_sent_bytes():
    """Request 1 shares request 0's first 3 blocks: MD holds them, so only its 4th block
    crosses. Full prompts: 8 blocks; sent: 4 + 1 blocks."""
    r0 = SimRequest(0, 0.0, 4 * BLOCK, 2, (10, 11, 12, 13))
    r1 = SimRequest(1, 5.0, 4 * BLOCK, 2, (10, 11, 12, 99))
    d = naive(RoleSpec(1, FLAT), RoleSpec(1, FLAT), LinkSpec(1e6, 0.01))
    records = simulate(d, workload(r0, r1), TINY).records
    kvbpt = TINY.kv_bytes_per_token
    assert [r.wan_bytes for r in records] == [4 * BLOCK * kvbpt, 1 * BLOCK * kvbpt]
    assert paper_report.bandwidth_ratio(records, kvbpt) == pytest.approx(8 / 5)


def test_explain_names_a_source_for_each_assumption(capsys):
    assert paper.main(["--explain"]) == 0
    text = capsys.readouterr().out
    for needle in (
        "23 GB",
        "4,390",
        "20-30%",
        "10-100 Gbit/s",
        "3 relay",
        "datasheet",
        "plan_route",
        "Little",
    ):
        assert needle in text, needle


def test_a_tiny_run_writes_the_table_beside_the_papers(tmp_path):
    out = tmp_path / "paper.json"
    argv = ["--scenario", "7b-dense", "--scale", "0.03", "--lifetimes", "0.1", "--warmup", "0.1"]
    argv += ["--rel-tol", "0.5", "--jobs", "1", "--out", str(out), "--quiet"]
    assert paper.main(argv) == 0
    result = json.loads(out.read_text())
    assert result["paper"]["goodput_change"] == 0.278
    m = result["metrics"]
    for key in (
        "goodput_change",
        "bcr_change_20",
        "cost_change_30",
        "ttft",
        "bandwidth_ratio",
        "rld_token_share",
    ):
        assert key in m, key
    assert {r["metric"] for r in result["rows"]} >= {
        "SLA goodput, PDD vs same-DC",
        "TTFT P99, PDD vs naive cross-DC",
    }
    assert result["fleets"]["same-dc"]["goodput_rps"] > 0
    assert m["little"]["same-dc"]["slots"] > 0
    assert (tmp_path / "paper.png").exists()
