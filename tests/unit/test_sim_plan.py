"""The capacity search of `pdd sim plan` (pdd/sim/studies/planner.py) and one small real run.

The search is tested with a hand-made evaluator (fleet counts → attainment) in place of the
simulator: its cheapest passing fleet is known by construction, and a simulation per probe
would make these tests slow without testing the search any better. The last test runs the
real command on a tiny workload."""

import json
import math

from pdd.sim.hardware.step_cost import Linear, StepCost
from pdd.sim.studies import plan, planner
from pdd.sim.studies.planner import Counts, Evaluations, Outcome, Search, Shape, cheapest

PRICES = {"fast": 3.0, "slow": 2.0, "b": 4.0}
SPEED = {"fast": 2.0, "slow": 1.0, "b": 1.0}  # work one instance does
NEED = {"prefill": 6.0, "relay": 1.0, "decode": 10.0}  # work each role must do to meet the SLA
PDD_SHAPE = Shape("slow", "b", "slow")


def cost(f: Counts) -> float:
    return sum(f.count(r) * PRICES[f.shape.profile(r)] for r in f.shape.roles)


def fake(f: Counts) -> Outcome:
    """The SLA (0.9) is met when every role's instances do its work; below that, attainment
    rises with each short role's instances, and each short role points at itself."""
    short = {r: max(0.0, NEED[r] - f.count(r) * SPEED[f.shape.profile(r)]) / NEED[r] for r in f.shape.roles}
    return Outcome(0.89 * (1 - sum(short.values()) / 3) if any(short.values()) else 1.0, short)


class Counted:
    def __init__(self):
        self.calls: list[Counts] = []

    def __call__(self, f: Counts) -> Outcome:
        self.calls.append(f)
        return fake(f)


def run(starts, max_instances=100, max_evals=200):
    counted = Counted()
    evals = Evaluations(counted, max_evals)
    return cheapest(starts, Search(evals, cost, 0.9, max_instances)), evals, counted


def test_finds_the_known_cheapest_fleet():
    found, _, _ = run([Counts(PDD_SHAPE, 1, 1, 1)])
    assert (found.prefill, found.relay, found.decode) == (6, 1, 10)
    # a start above the optimum shrinks down to it
    found, _, _ = run([Counts(PDD_SHAPE, 20, 30, 4)])
    assert (found.prefill, found.relay, found.decode) == (6, 1, 10)


def test_respects_max_instances():
    found, evals, counted = run([Counts(PDD_SHAPE, 1, 1, 1)], max_instances=16)
    assert found is None  # 17 instances are needed
    assert max(f.instances for f in counted.calls) <= 16
    assert evals.spent > 1  # it did try to grow
    found, _, _ = run([Counts(PDD_SHAPE, 1, 1, 1)], max_instances=17)
    assert found is not None and found.instances == 17


def test_prefers_the_cheaper_profile_when_both_meet():
    # fast P: 3 instances at $3 = $9 beat slow P: 6 at $2 = $12; for the relay (one instance
    # either way) slow is cheaper
    shapes = [Shape(p, "b", r) for p in ("fast", "slow") for r in ("fast", "slow")]
    found, _, _ = run([Counts(s, 1, 1, 1) for s in shapes])
    assert found.shape == Shape("fast", "b", "slow")
    assert (found.prefill, found.relay, found.decode) == (3, 1, 10)


def test_each_fleet_is_simulated_once_and_the_cap_holds():
    shapes = [Shape(p, "b", r) for p in ("fast", "slow") for r in ("fast", "slow")]
    _, evals, counted = run([Counts(s, 1, 1, 1) for s in shapes])
    assert len(counted.calls) == len(set(counted.calls)) == evals.spent
    # nothing simulated is implied by an earlier simulation: a fleet no bigger in any role
    # than one that missed (or no smaller than one that met) of its shape
    for i, f in enumerate(counted.calls):
        for g in counted.calls[:i]:
            diff = [f.count(r) - g.count(r) for r in f.shape.roles]
            met = fake(g).attainment >= 0.9
            assert g.shape != f.shape or not (met and min(diff) >= 0 or not met and max(diff) <= 0)
    _, evals, counted = run([Counts(s, 1, 1, 1) for s in shapes], max_evals=5)
    assert len(counted.calls) == evals.spent == 5


def test_floors_by_hand():
    # a chunk costs 0.1 ms per token of compute; a decode step of b sequences of 1000 context
    # 10 ms + max(0.1 ms·b, 20 ms + 1 µs·1000·b) = 30 ms + 1 ms·b
    step = StepCost(0.01, Linear(per_token=1e-4), Linear(const=0.02, per_kv_read=1e-6))
    assert planner.prefill_floor([(1000, 11000)] * 3, 3.0, step) == 1  # 3 × 1.0 s of work in 3 s
    assert planner.prefill_floor([(0, 11000)] * 3, 3.0, step) == 2  # uncached: 3 × 1.1 s
    assert planner.decode_batch(step, 1000, 100_000, 0.08, 256) == 50  # the TPOT target binds
    assert planner.decode_batch(step, 1000, 30_000, 0.08, 256) == 30  # the KV room binds
    assert planner.decode_floor(1000.0, step, 50, 1000) == 2  # 50 tokens per 80 ms: 625 tokens/s a chip


def test_plan_writes_both_fleets(tmp_path):
    out = tmp_path / "plan.json"
    rc = plan.main(
        [
            "--rate",
            "1",
            "--duration",
            "12",
            "--dc-a",
            "gpu-a,h100-sxm",
            "--dc-b",
            "gpu-b",
            "--max-evals",
            "4",
            "--drain",
            "20",
            "--sla-ttft",
            "10",
            "--out",
            str(out),
            "--quiet",
        ]
    )
    assert rc == 0
    r = json.loads(out.read_text())
    cross, same = r["pdd"]["fleet"], r["same_dc"]["fleet"]
    assert (cross["prefill"]["profile"], cross["relay"]["profile"], cross["decode"]["profile"]) == (
        "gpu-a",
        "gpu-a",
        "gpu-b",
    )
    assert same["dc"] in ("dc-a", "dc-b") and "relay" not in same
    for f in (cross, same):
        assert f["attainment"] >= 0.9 and f["requests"] > 0 and not math.isnan(f["ttft_p99_s"])
    assert (
        cross["cost_per_hour"]
        == cross["prefill"]["count"] * 3.0
        + cross["relay"]["count"] * 3.0
        + cross["decode"]["count"] * 3.75
        + 10.0
    )
    # h100-sxm is gpu-a under another name: searched once, as gpu-a
    assert r["twins"] == {"h100-sxm": "gpu-a"}
    assert "h100-sxm" not in json.dumps(r["pdd"]["evaluations"] + r["same_dc"]["evaluations"])
    assert {s["dc"] for s in r["same_dc"]["shapes"]} == {"dc-a", "dc-b"}  # both DCs' same-DC fleets weighed
    assert r["saving"]["usd_per_hour"] == same["cost_per_hour"] - cross["cost_per_hour"]
