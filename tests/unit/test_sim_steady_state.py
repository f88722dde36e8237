"""Steady-state probes on a fleet whose capacity is known in closed form, and the fixed
assumptions of the fleet model: per-chip batch caps, the decoder's first token, per-session
prefixes."""

from __future__ import annotations

import pytest

from pdd.sim.fleet.deployment import LinkSpec, RoleSpec, pdd, same_dc
from pdd.sim.fleet.simulator import SimSettings, simulate
from pdd.sim.hardware.chip import Chip, batch_cap
from pdd.sim.hardware.step_cost import Linear, StepCost
from pdd.sim.studies.goodput import Window, probe, sla_goodput
from pdd.sim.studies.sla import Sla
from pdd.sim.workloads.agentic import PAPER_SESSIONS, agentic_open_loop, prefix_hits
from pdd.sim.workloads.workload import SimRequest, Workload
from tests.sim_util import BLOCK, FLAT, TINY, request, workload

STEP = 0.05  # every decode step: 50 ms whatever the batch (overhead only)
OUT = 20  # tokens per request: a request decodes for 19 steps, 0.95 s
SLOTS = 4  # the decoder's batch cap
CAPACITY = SLOTS / ((OUT - 1) * STEP)  # 4 / 0.95 s = 4.21 requests/s
FAST_P = Chip("p", StepCost(1e-4, Linear(), Linear()), 1 << 22, 1.0)  # prefill takes no time to speak of
D = Chip("d", StepCost(STEP, Linear(), Linear()), 1 << 22, 1.0, max_seqs=SLOTS)


def evenly(rate: float, duration: float) -> Workload:
    """Arrivals 1 / rate apart: below capacity no request ever waits for a slot."""
    n = int(duration * rate)
    return Workload(
        "even", BLOCK, tuple(SimRequest(i, (i + 0.5) / rate, BLOCK, OUT, (i + 1,)) for i in range(n))
    )


def test_a_decode_bound_fleet_saturates_where_littles_law_says():
    """One fast P and one decoder of 4 slots, requests evenly spaced: below capacity L = λW and
    no request waits; above it the queue grows by the overload, and once it holds more than the
    TTFT budget (1 s) of work the SLA fails: over a 60 s window, from 2% over capacity. The
    search finds the capacity Little's law gives, 4 slots / 0.95 s, to its 3%."""
    fleet = same_dc(RoleSpec(1, FAST_P), RoleSpec(1, D))
    sla = Sla(ttft_s=1.0, tpot_s=0.06, attainment=0.9)
    window = Window(warmup_s=5.0, measure_s=60.0, tail_s=2.0)
    g = sla_goodput(
        fleet,
        lambda rate: evenly(rate, window.arrivals_s),
        TINY,
        sla,
        start_rps=2.0,
        rel_tol=0.03,
        window=window,
        growth=1.5,
    )
    assert 0.97 * CAPACITY <= g.rate_rps <= 1.03 * CAPACITY
    assert g.resolution <= 0.03 + 1e-9
    law = g.at_goodput.little
    assert law.slots == SLOTS
    assert law.in_system == pytest.approx(law.lambda_w, rel=0.05)  # Little's law over the window
    assert law.in_system <= SLOTS + 0.5  # at capacity: the slots full, hardly a queue
    over = probe(fleet, evenly(1.2 * CAPACITY, window.arrivals_s), TINY, sla, 1.2 * CAPACITY, window=window)
    assert over.attainment < 0.9 and over.little.in_system > 2 * SLOTS  # requests wait beyond the slots


def test_a_probe_counts_only_its_window():
    reqs = workload(request(0, 0.5, 1, 3), request(1, 2.0, 1, 3), request(2, 5.5, 1, 3))
    p = probe(
        same_dc(RoleSpec(1, FLAT), RoleSpec(1, FLAT)), reqs, TINY, Sla(), 1.0, window=Window(1.0, 4.0, 2.0)
    )
    assert p.measured == 1 and p.attainment == 1.0  # request 1 alone arrived in [1, 5)


def test_batch_cap_from_memory_and_tpot():
    """A chip's cap: the sequences its KV holds at the context, fewer if a step would run past
    the TPOT target (steps: 2 ms + 1 us per KV token read)."""
    step = StepCost(0.002, Linear(), Linear(per_kv_read=1e-6))
    big = Chip("big", step, 100 * 1000 * 10, 1.0)  # room for 100 sequences of 1000 tokens x 10 B
    assert batch_cap(big, 1.0, 1000, 10) == 100  # memory binds
    assert batch_cap(big, 0.05, 1000, 10) == 48  # 2 ms + 48 x 1 ms <= 50 ms < 2 + 49
    small = Chip("small", step, 20 * 1000 * 10, 1.0)
    assert batch_cap(small, 0.05, 1000, 10) == 20


def test_a_decoder_runs_no_more_sequences_than_its_chip_allows():
    capped = Chip("d", FLAT.step, FLAT.kv_capacity_bytes, 1.0, max_seqs=2)
    reqs = workload(*(request(i, 0.0, 1, 20) for i in range(4)))
    records = simulate(same_dc(RoleSpec(1, FLAT), RoleSpec(1, capped)), reqs, TINY).records
    # two decode at once; the other two wait for their slots: their first token comes ~19 steps later
    firsts = sorted(r.ttft_s for r in records)
    assert firsts[2] - firsts[1] > 15 * 0.01


def test_the_relays_first_token_is_the_users():
    """P→RLD→MD: the relay streams P's token as soon as its local copy of the KV lands."""
    wan = LinkSpec(1000.0, 0.5)  # a slow line: the router sends the request through the relay
    fleet = pdd(RoleSpec(1, FLAT), RoleSpec(1, FLAT), RoleSpec(1, FLAT), wan)
    (r,) = simulate(fleet, workload(request(0, 0.0, 2, 5000)), TINY, SimSettings()).records
    assert r.pipeline == "p-rld-md"
    assert 0.01 < r.ttft_s < 0.02  # one prefill step, the local path: not the line's seconds
    (at_p,) = simulate(
        fleet, workload(request(0, 0.0, 2, 5)), TINY, SimSettings(first_token_at_prefill=True)
    ).records
    assert at_p.ttft_s == pytest.approx(0.01)


def test_sessions_hit_their_own_history_not_one_shared_prefix():
    """The published traffic: sessions share only the 16K system prompt; a turn's hit beyond it
    is its own session's earlier prompt and answer."""
    w = agentic_open_loop(PAPER_SESSIONS, 2.0, 600.0, 512, seed=1)
    shared = PAPER_SESSIONS.shared_prefix // 512
    firsts: dict[int, tuple[int, ...]] = {}
    for r in w.requests:
        if r.client is not None and r.client not in firsts:
            firsts[r.client] = r.block_hashes
    prompts = list(firsts.values())
    for a, b in zip(prompts, prompts[1:], strict=False):
        common = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
        assert common <= shared  # two sessions share no more than the system prompt
    hits = prefix_hits(w)
    late = [h for r, h in zip(w.requests, hits, strict=True) if r.arrival_s > 300]
    assert 0.8 < sum(late) / len(late) < 0.95  # ~89% mean hit once sessions run
    assert 0.65 < sum(h > 0.95 for h in late) / len(late) < 0.85
    mean_in = sum(r.input_tokens for r in w.requests if r.arrival_s > 300) / len(late)
    assert 50_000 < mean_in < 75_000
