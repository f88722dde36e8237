"""`pdd bench e2e`'s ratios: every one carries its bootstrap interval in the JSON, requests pair
by planned step (agentic) or by round (single), and targets are judged on the interval. Rows
are made up here; no system is started."""

from __future__ import annotations

import json
import random

import pytest

from bench.e2e import parse_args
from bench.e2e_agentic_report import AGENTIC_RATIOS, agentic_ratios, agentic_targets
from bench.e2e_single import SINGLE_RATIO_KEYS, single_ratios, single_targets
from pdd.benchkit.report import print_targets

SLOWER = {"same-dc": 1.0, "naive": 2.0, "pdd": 1.5}  # each request's latency x this, by deployment


def agentic_rows(n_clients: int = 3, n_steps: int = 12) -> list[dict]:
    """The same planned steps on each deployment, each a fixed multiple of the step's base latency."""
    rng = random.Random(0)
    rows = []
    for client in range(n_clients):
        for step in range(n_steps):
            base = rng.lognormvariate(-1.0, 0.8)
            for d, k in SLOWER.items():
                rows.append(
                    {
                        "deployment": d,
                        "client": client,
                        "step": step,
                        "ok": True,
                        "ttft": base * k,
                        "tt2t": base * k * 1.2,
                        "max_gap": base * k * 0.1,
                        "tpot": 0.03 * k,
                        "e2e": base * k * 3,
                    }
                )
    return rows


def ratio_is_json(r: dict) -> None:
    assert set(r) == {"ratio", "lo", "hi", "n"}
    assert r["lo"] <= r["ratio"] <= r["hi"]


def test_agentic_ratios_carry_intervals_paired_by_step():
    args = parse_args([])
    rows = agentic_rows()
    busy = dict.fromkeys(SLOWER, 100.0)
    ratios = json.loads(json.dumps(agentic_ratios(args, rows, busy, list(SLOWER))))
    assert set(ratios) == {"naive/same-dc", "pdd/same-dc", "pdd/naive"}
    for name, rs in ratios.items():
        assert set(rs) == {*AGENTIC_RATIOS, "sla_goodput"}
        for r in rs.values():
            ratio_is_json(r)
            assert r["n"] == 36
        x, y = name.split("/")
        for k in AGENTIC_RATIOS:  # paired, every pair keeps its ratio: zero width
            assert rs[k]["lo"] == pytest.approx(SLOWER[x] / SLOWER[y])
            assert rs[k]["hi"] == pytest.approx(SLOWER[x] / SLOWER[y])
    targets = {t["what"]: t for t in agentic_targets(ratios)}
    t = targets["PDD vs naive cross-DC: p99 time to 2nd token at most naive's"]
    # The interval meets the goal, but 36 requests do not resolve a p99.
    assert (t["verdict"], t["met"], t["value"]) == ("likely", False, "×0.75 [0.75–0.75]")
    t = targets["PDD vs naive cross-DC: TTFT p50 at most naive's"]
    assert (t["verdict"], t["met"], t["value"]) == ("met", True, "×0.75 [0.75–0.75]")


def test_agentic_goodput_ratio_resamples_requests_and_scales_to_busy_time():
    args = parse_args(["--sla-ttft-s", "0.5"])
    rows = agentic_rows()
    busy = {"same-dc": 100.0, "naive": 100.0, "pdd": 50.0}
    r = agentic_ratios(args, rows, busy, ["naive", "pdd"])["pdd/naive"]["sla_goodput"]
    met = {d: sum(x["ttft"] <= 0.5 for x in rows if x["deployment"] == d) for d in ("naive", "pdd")}
    assert 0 < met["naive"] < met["pdd"] < 36
    assert r["ratio"] == pytest.approx((met["pdd"] / 50.0) / (met["naive"] / 100.0))  # as the table's
    assert r["lo"] < r["ratio"] < r["hi"]  # which requests meet the SLA varies with the resample
    r = agentic_ratios(parse_args(["--sla-ttft-s", "100"]), rows, busy, ["naive", "pdd"])["pdd/naive"]
    # Every request meets the SLA everywhere: what is left is the requests' time (x1.5 vs x2 of
    # the step's), which the resample moves alike on both sides, scaled to the measured x2.
    assert r["sla_goodput"]["ratio"] == pytest.approx(2.0)
    assert r["sla_goodput"]["lo"] == pytest.approx(2.0) and r["sla_goodput"]["hi"] == pytest.approx(2.0)


def test_a_failed_request_drops_its_pair():
    rows = agentic_rows()
    failed = next(r for r in rows if r["deployment"] == "pdd")
    failed["ok"] = False
    ratios = agentic_ratios(parse_args([]), rows, dict.fromkeys(SLOWER, 100.0), list(SLOWER))
    assert ratios["pdd/naive"]["tt2t_p99"]["n"] == 35
    assert ratios["pdd/naive"]["sla_goodput"]["n"] == 36  # a failed request counts: it misses the SLA
    assert ratios["naive/same-dc"]["tt2t_p99"]["n"] == 36


def test_agentic_targets_say_likely_when_the_interval_crosses_the_goal_or_n_is_short():
    noisy = {"ratio": 0.8, "lo": 0.6, "hi": 1.1, "n": 600}
    clear = {"ratio": 0.5, "lo": 0.4, "hi": 0.6, "n": 600}
    short = {"ratio": 0.5, "lo": 0.4, "hi": 0.6, "n": 36}  # a p99 of 36 requests: not resolved
    worse = {"ratio": 1.3, "lo": 1.1, "hi": 1.5, "n": 36}
    ratios = {
        "pdd/naive": {
            "tt2t_p99": noisy,
            "max_gap_p99": clear,
            "ttft_p50": worse,
            "ttft_p99": short,
            "sla_goodput": worse,
        }
    }
    verdicts = [(t["verdict"], t["met"]) for t in agentic_targets(ratios)]
    assert verdicts == [("likely", False), ("met", True), ("MISSED", False), ("likely", False), ("met", True)]


def single_rows(rounds: int = 3) -> list[dict]:
    scale = {"no-wan": 1.0, "p-md": 2.0, "p-rld-md": 1.1}
    rows = []
    for r in range(rounds):
        load = 1.0 + r  # the host's load moves every variant of a round alike
        for v, k in scale.items():
            rows.append(
                {
                    "variant": v,
                    "round": r,
                    "ok": True,
                    "ttft": load * k,
                    "tt2t": load * k * 2,
                    "max_gap": load * k * 0.5,
                    "tpot": 0.02 * load * k,
                }
            )
    return rows


def test_single_ratios_pair_variants_by_round():
    rows = single_rows()
    ratios = json.loads(json.dumps(single_ratios(rows, ["no-wan", "p-md", "p-rld-md"])))
    assert set(ratios) == {"p-md/no-wan", "p-rld-md/no-wan", "p-rld-md/p-md"}
    for rs in ratios.values():
        assert set(rs) == set(SINGLE_RATIO_KEYS)
        for r in rs.values():
            ratio_is_json(r)
            assert r["n"] == 3
    assert ratios["p-rld-md/p-md"]["max_gap"]["lo"] == pytest.approx(0.55)
    assert ratios["p-rld-md/p-md"]["max_gap"]["hi"] == pytest.approx(0.55)
    summary = {
        v: {"n_tokens": 1000, "rld_share": 0.09, "rld_tokens": 90, "tt2t": 3.0, "max_gap": 1.5}
        for v in ("no-wan", "p-md", "p-rld-md")
    }
    targets = {t["what"]: t for t in single_targets(summary, ratios, 2.7)}
    assert targets["p-rld-md TTFT within 1.5x of no-WAN"]["verdict"] == "likely"  # 3 rounds: a median of 3
    assert targets["P→MD TTFT (P streams the 1st token itself)"]["value"] == "×2.00 [2.00–2.00] of no-WAN"
    ratios = single_ratios(single_rows(rounds=10), ["no-wan", "p-md", "p-rld-md"])
    targets = {t["what"]: t for t in single_targets(summary, ratios, 2.7)}
    assert targets["p-rld-md TTFT within 1.5x of no-WAN"]["verdict"] == "met"


def test_targets_print_their_verdict(capsys):
    print_targets(
        [
            {"what": "a", "value": "×0.8 [0.6–1.1] n.s.", "met": False, "verdict": "likely"},
            {"what": "b", "value": "1", "met": False},
            {"what": "c", "value": "2", "met": None},
        ]
    )
    assert capsys.readouterr().out.splitlines()[-3:] == [
        "  [likely] a: ×0.8 [0.6–1.1] n.s.",
        "  [MISSED] b: 1",
        "  [info] c: 2",
    ]
