"""The benchmarks' pure parts: the agentic workload's hit-rate mix, the bandwidth bench's hit
mixes and the client-side latency metrics. No system is started here."""

from __future__ import annotations

import random
import statistics

import pytest

from bench.bandwidth import hit_mix
from bench.client import Timed
from bench.e2e import parse_args
from bench.e2e_agentic import Session, build_prompt
from bench.e2e_common import BLOCK
from pdd.sim.workloads.agentic import AgenticParams, make_plans


def simulated_hits(argv: list[str]) -> tuple[list[float], dict[str, int]]:
    """Hit rates the plan would see if MD cached every finished turn (outputs: filler tokens)."""
    a = parse_args(argv)
    shared = list(range(3, 3 + a.shared_prefix))
    hits, kinds = [], {}
    for plan in make_plans(AgenticParams.from_args(a)):
        sess = Session()
        for step in plan:
            prompt, new = build_prompt(a, step, sess, shared)
            assert len(prompt) + step.out <= a.context_max
            if new or step.kind == "outlier":
                k = 0
                while (
                    k + BLOCK <= min(len(prompt), len(shared))
                    and prompt[k : k + BLOCK] == shared[k : k + BLOCK]
                ):
                    k += BLOCK
            else:
                k = (len(sess.ctx) - 1) // BLOCK * BLOCK
            hits.append(k / len(prompt))
            kinds[step.kind] = kinds.get(step.kind, 0) + 1
            if step.kind != "outlier":
                sess.ctx = prompt + [1] * step.out
    return hits, kinds


def test_agentic_mix_is_skewed_like_the_paper():
    hits, kinds = simulated_hits(["--requests", "600", "--seed", "1"])
    above = sum(h > 0.95 for h in hits) / len(hits)
    assert 0.65 <= above <= 0.85  # about 75% of requests above 95% hit
    assert min(hits) < 0.05  # ... and the rest spread down to 0%
    assert 0.02 <= kinds["outlier"] / len(hits) <= 0.07
    assert 0.75 <= statistics.fmean(hits) <= 0.92


def test_plans_are_deterministic():
    a = parse_args(["--requests", "30"])
    assert make_plans(AgenticParams.from_args(a)) == make_plans(AgenticParams.from_args(a))


@pytest.mark.parametrize("mean", [0.0, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99])
def test_hit_mix_keeps_the_mean(mean):
    hits = hit_mix(random.Random(0), mean, 8, 0.25)
    assert len(hits) == 8 and all(0.0 <= h <= 0.99 for h in hits)
    assert statistics.fmean(hits) == pytest.approx(mean, abs=0.02)


def test_timed_metrics():
    t = Timed(status=200, chunks=[(0.5, 1), (0.6, 1), (2.6, 2), (2.7, 1)], token_ids=[1, 2, 3, 4, 5])
    assert t.ok and t.ttft == 0.5 and t.time_to_token(2) == 0.6 and t.time_to_token(4) == 2.6
    assert t.max_gap == pytest.approx(2.0)
    assert t.tpot == pytest.approx((2.7 - 0.5) / 4)
