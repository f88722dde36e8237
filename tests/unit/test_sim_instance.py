"""Instances on hand-computable cases: every step of the FLAT chip takes 10 ms, the TINY
model's KV is 16 B per token, prompts are 2 blocks (32 tokens, 512 B of KV)."""

from dataclasses import replace

import pytest

from pdd.sim.fleet.decoder import DecodeInstance, Seq
from pdd.sim.fleet.deployment import IN_DC, LinkSpec, RoleSpec, naive, same_dc
from pdd.sim.fleet.events import EventLoop
from pdd.sim.fleet.simulator import SimSettings, simulate
from pdd.sim.hardware.chip import Chip
from pdd.sim.hardware.step_cost import Linear, StepCost, decode_load
from pdd.sim.workloads.workload import Workload
from tests.sim_util import FLAT, TINY, request, workload

EXACT = 1e-12
KV = 32 * 16  # the prompt's KV bytes
IN_DC_S = KV / IN_DC.bandwidth_Bps + IN_DC.one_way_s  # its crossing in one DC


def test_same_dc_single_request():
    result = simulate(same_dc(RoleSpec(1, FLAT), RoleSpec(1, FLAT)), workload(request(0, 0.0, 2, 5)), TINY)
    (r,) = result.records
    kv_ready = 0.01 + IN_DC_S  # one prefill step, then the KV crosses
    assert r.ttft_s == pytest.approx(kv_ready, abs=EXACT)  # D streams P's token once it holds the KV
    assert r.tt2t_s == pytest.approx(kv_ready + 0.01, abs=EXACT)
    assert r.e2e_s == pytest.approx(kv_ready + 4 * 0.01, abs=EXACT)  # tokens 2..5 from D
    assert r.tpot_s == pytest.approx(0.01, abs=EXACT)
    assert r.max_gap_s == pytest.approx(0.01, abs=EXACT)
    assert (r.pipeline, r.md_tokens, r.rld_tokens, r.wan_bytes) == ("p-md", 4, 0, KV)
    assert result.wan_bytes_per_s == []  # nothing crossed DCs


@pytest.mark.parametrize("at_prefill", [False, True])
def test_p_md_across_a_wan(at_prefill):
    wan = LinkSpec(1000.0, 0.05)
    fleet = naive(RoleSpec(1, FLAT), RoleSpec(1, FLAT), wan)
    settings = SimSettings(first_token_at_prefill=at_prefill)
    result = simulate(fleet, workload(request(0, 0.0, 2, 5)), TINY, settings)
    (r,) = result.records
    # MD's prepare reply is back at 0.10; the 512 B serialise until 0.612 and land at 0.662.
    # MD's tokens 2..5 at 0.672 .. 0.702 reach the router 0.05 later. The first token: P's at
    # 0.01 straight to the router (pdd's prefill service), or MD's stream of it from 0.662,
    # at the router at 0.712 (the user's TTFT in PD systems: it holds the WAN crossing).
    first = 0.01 if at_prefill else 0.712
    assert r.ttft_s == pytest.approx(first, abs=EXACT)
    assert r.tt2t_s == pytest.approx(0.722, abs=EXACT)
    assert r.e2e_s == pytest.approx(0.752, abs=EXACT)
    assert r.tpot_s == pytest.approx((0.752 - first) / 4, abs=EXACT)
    assert r.max_gap_s == pytest.approx(0.722 - first if at_prefill else 0.01, abs=EXACT)
    assert r.wan_bytes == KV and sum(result.wan_bytes_per_s) == pytest.approx(KV)


@pytest.mark.parametrize(
    ("budget", "chunk", "ttfts"),
    [(64, 0, [0.01, 0.01]), (64, 16, [0.02, 0.02]), (16, 16, [0.02, 0.04])],
)
def test_prefill_chunks_prompts_that_share_its_step_budget(budget, chunk, ttfts):
    reqs = workload(request(0, 0.0, 2, 2), request(1, 0.0, 2, 2))  # 32 tokens each, together
    settings = SimSettings(max_batched_tokens=budget, prefill_chunk=chunk, first_token_at_prefill=True)
    result = simulate(same_dc(RoleSpec(1, FLAT), RoleSpec(1, FLAT)), reqs, TINY, settings)
    assert [r.ttft_s for r in result.records] == pytest.approx(ttfts, abs=EXACT)


def test_a_joiner_waits_for_the_step_boundary():
    reqs = workload(request(0, 0.0, 2, 5), request(1, 0.015, 2, 5))
    a, b = simulate(same_dc(RoleSpec(1, FLAT), RoleSpec(1, FLAT)), reqs, TINY).records
    # b's KV is in at 0.025 + IN_DC_S, in the middle of a's step that ends at 0.03 + IN_DC_S:
    # imported then, added when the next step ends (0.04 + IN_DC_S), its first token a step later.
    assert b.tt2t_s == pytest.approx(0.04 + IN_DC_S + 0.01 - 0.015, abs=EXACT)
    assert a.e2e_s == pytest.approx(0.01 + IN_DC_S + 0.04, abs=EXACT)  # a's steps kept their pace


def test_a_decode_run_fast_forwarded_equals_its_steps():
    step = StepCost(0.002, Linear(per_token=1e-4, per_attn=1e-7), Linear(const=1e-3, per_kv_read=2e-6))
    chip = Chip("lin", step, 1 << 30, 1.0)
    loop = EventLoop()
    d = DecodeInstance("d0", chip, loop, 1000, 16, max_num_seqs=8, max_batched_tokens=64)
    runs = []
    d.join(Seq(100, 300, lambda *run: runs.append(run), lambda: None))
    loop.run()
    ((first, last, n, gap),) = runs
    steps = [step.step_s(decode_load(1, 100 + i)) for i in range(300)]
    assert n == 300
    assert first == pytest.approx(steps[0], rel=1e-12)
    assert last == pytest.approx(sum(steps), rel=1e-12)
    assert gap == pytest.approx(max(steps[1:]), rel=1e-12)
    assert d.busy_s == pytest.approx(sum(steps), rel=1e-12)


def test_the_steps_within_a_budget_are_the_most_whose_run_fits():
    """decode_steps_within against decode_run_s counted one step count at a time, over both
    regimes (compute-bound early, memory-bound later) and budgets on and next to a run's end."""
    step = StepCost(0.002, Linear(per_token=1e-4, per_attn=1e-7), Linear(const=1e-3, per_kv_read=2e-6))
    for seqs, context in ((1, 100), (8, 4000), (64, 0)):  # (64 from 0: compute-bound for its first ~45 steps)
        ends = [step.decode_run_s(seqs, context, k) for k in range(400)]
        for k in (1, 2, 7, 50, 200, 398):
            for budget in (ends[k], ends[k] * (1 - 1e-12), (ends[k] + ends[k + 1]) / 2):
                assert step.decode_steps_within(seqs, context, budget) == max(
                    i for i, e in enumerate(ends) if e <= budget
                )


def test_a_run_cut_by_a_joiner_goes_on_from_the_context_it_reached():
    step = StepCost(0.002, Linear(per_token=1e-4, per_attn=1e-7), Linear(const=1e-3, per_kv_read=2e-6))
    loop = EventLoop()
    d = DecodeInstance(
        "d0", Chip("lin", step, 1 << 30, 1.0), loop, 1000, 16, max_num_seqs=8, max_batched_tokens=64
    )
    runs = {"a": [], "b": []}
    d.join(Seq(100, 300, lambda *run: runs["a"].append(run), lambda: None))
    loop.at(0.1, lambda: d.join(Seq(50, 10, lambda *run: runs["b"].append(run), lambda: None)))
    loop.run()
    # Step by step: b joins at the first step end at or after 0.1.
    t, contexts, a_last, b_first = 0.0, {"a": 100}, 0.0, None
    while contexts["a"] < 400:
        if t >= 0.1 and b_first is None and "b" not in contexts:
            contexts["b"] = 50
        t += step.step_s(decode_load(len(contexts), sum(contexts.values())))
        for k in list(contexts):
            contexts[k] += 1
            if k == "b" and b_first is None:
                b_first = t
            if k == "b" and contexts[k] == 60:
                del contexts[k]
        a_last = t
    assert runs["a"][-1][1] == pytest.approx(a_last, rel=1e-12)
    assert runs["b"][0][0] == pytest.approx(b_first, rel=1e-12)
    assert sum(n for _, _, n, _ in runs["a"]) == 300 and len(runs["a"]) == 3  # cut when b joins and leaves


def test_prefix_hits_on_p_and_md():
    second = request(1, 1.0, 3, 5, first_hash=0)  # its first 2 blocks are the first request's
    a, b = simulate(
        same_dc(RoleSpec(1, FLAT), RoleSpec(1, FLAT)), workload(request(0, 0.0, 2, 5), second), TINY
    ).records
    assert (a.prefill_hit, a.hit_rate, a.wan_bytes) == (0.0, 0.0, KV)
    assert b.prefill_hit == pytest.approx(32 / 48) and b.hit_rate == pytest.approx(32 / 48)
    assert b.wan_bytes == 16 * 16  # only the block D lacks


def test_closed_loop_the_next_request_follows_the_last_token_after_the_think_time():
    first, then = request(0, 0.2, 2, 5), request(1, 0.5, 2, 5)
    reqs = Workload("closed", 16, (replace(first, client=7), replace(then, client=7)), closed_loop=True)
    wan = LinkSpec(1000.0, 0.05)  # MD's last token reaches the router after MD is done with it
    a, b = simulate(naive(RoleSpec(1, FLAT), RoleSpec(1, FLAT), wan), reqs, TINY).records
    assert a.arrival_s == 0.2
    assert b.arrival_s == pytest.approx(0.2 + a.e2e_s + 0.5, abs=EXACT)


def test_the_simulated_pool_behaves_as_the_engine_pool():
    """The simulator's pool (per-block state in flat lists, a request's blocks in passes over
    them) makes the same allocations, hits, shares, releases and evictions as the engine's
    own pool, and keeps the same LRU order."""
    import random

    from pdd.sim.fleet.block_pool import SimBlockPool
    from shared.engine.block_pool import BlockPool

    n, rng = 1200, random.Random(3)
    sim, engine = SimBlockPool(n), BlockPool(n)
    held: list[list[int]] = []
    for _ in range(600):
        hashes = [
            rng.randrange(60) * 1000 + i for i in range(rng.randrange(1, 6))
        ]  # chains of a few prefixes
        r = rng.random()
        if held and (r < 0.4 or sim.num_free < 400):
            bids = held.pop(rng.randrange(len(held)))
            sim.release_many(bids)
            engine.release_many(bids)
        elif r < 0.6:
            hits = sim.lookup(hashes)
            assert hits == engine.lookup(hashes) and sim.cost_of(hits) == engine.cost_of(hits)
            for pool in (sim, engine):
                pool.touch_many(hits)
            fresh = sim.allocate_many(len(hashes) - len(hits) + rng.randrange(3))
            assert fresh == engine.allocate_many(len(fresh))
            bids = sim.register_or_share_many(hits + fresh[: len(hashes) - len(hits)], hashes)
            assert bids == engine.register_or_share_many(hits + fresh[: len(hashes) - len(hits)], hashes)
            held.append(bids + fresh[len(hashes) - len(hits) :])
        elif r < 0.8:  # computed without a lookup: blocks whose twin is cached are shared
            fresh = sim.allocate_many(len(hashes))
            assert fresh == engine.allocate_many(len(fresh))
            bids = sim.register_or_share_many(fresh, hashes)
            assert bids == engine.register_or_share_many(fresh, hashes)
            held.append(bids)
        else:
            big = sim.allocate_many(rng.randrange(50, 400))  # evicts cached blocks
            assert big == engine.allocate_many(len(big))
            held.append(big)
        events = engine.drain_events()
        split = [h for kind, h in events if kind == "stored"], [h for kind, h in events if kind == "evicted"]
        assert sim.drain_events() == split and list(sim.free) == list(engine.free)
    assert sim.num_free == engine.num_free  # (the same cache: every stored and evicted hash compared above)
