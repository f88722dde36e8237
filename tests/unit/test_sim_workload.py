"""The simulator's workloads: the agentic generator shared with `pdd bench e2e`, its closed- and
open-loop workloads, the fixed-hit workload of the bathtub sweep, and Mooncake traces. Pure
functions: no system is started."""

from __future__ import annotations

import hashlib
import json
import random

import pytest

from bench.client import random_tokens
from bench.e2e import parse_args
from bench.e2e_agentic import Session, build_prompt
from bench.e2e_common import BLOCK
from pdd.sim.workloads.agentic import (
    BENCH,
    PAPER,
    AgenticParams,
    Step,
    agentic_closed_loop,
    agentic_open_loop,
    fixed_hit_open_loop,
    hit_profile,
    make_plans,
    prefix_hits,
)
from pdd.sim.workloads.trace import TraceError, read_mooncake, write_mooncake
from pdd.sim.workloads.workload import SimRequest, Workload

# ---------------------------------------------------------------- the bench's plans, unchanged

# Computed with bench/e2e.py's own make_plans / build_prompt before they moved here.
OLD_FIRST_STEPS = [  # --requests 12 --seed 7: each client's first three steps
    [
        ("high", 0.981895789179, 50, 3527346212),
        ("high", 0.977001315436, 47, 3551302831),
        ("high", 0.970537813135, 170, 505913792),
    ],
    [
        ("high", 0.952841947314, 161, 922121676),
        ("low", 0.599094619945, 181, 4070378921),
        ("high", 0.983418132043, 58, 2497953681),
    ],
    [
        ("outlier", 0.0, 8, 1862494042),
        ("high", 0.952429876356, 88, 200071088),
        ("high", 0.954774098224, 48, 2423943363),
    ],
]
OLD_PLANS_SHA = "691df2c6c5bdec5a49884207bc4f86ed9635db8d1c08ad013c27e09582ae1a0e"  # --requests 300 --seed 1
OLD_PROMPTS_SHA = (
    "0569f92ea0b74a62d2a4a7b3334b7229e9cbd90e06747eba4e8beda170b60570"  # --requests 120 --seed 1
)
OLD_PROMPT_LENS = [
    (1218, True),
    (1362, False),
    (1498, False),
    (1650, False),
    (2002, True),
    (2185, False),
    (2358, False),
    (2460, False),
    (2697, False),
    (3238, False),
    (3407, False),
    (1607, True),
]


def bench_params(*argv: str) -> tuple:
    a = parse_args(["--scenario", "agentic", *argv])
    return a, AgenticParams.from_args(a)


def test_plans_are_the_old_benchs():
    _, p = bench_params("--requests", "12", "--seed", "7")
    first = [[(s.kind, round(s.hit, 12), s.out, s.seed) for s in plan[:3]] for plan in make_plans(p)]
    assert first == OLD_FIRST_STEPS
    _, p = bench_params("--requests", "300", "--seed", "1")
    plans = [[(s.kind, s.hit, s.out, s.seed) for s in plan] for plan in make_plans(p)]
    assert hashlib.sha256(repr(plans).encode()).hexdigest() == OLD_PLANS_SHA


def bench_turns(a) -> list[list[tuple[Step, Session, list[int], bool]]]:
    """Per client, each step with the session before it, its prompt as the bench builds it and
    whether it starts a session (the model's outputs: filler tokens)."""
    shared = random_tokens(random.Random(f"shared-{a.seed}"), a.shared_prefix)
    out = []
    for plan in make_plans(AgenticParams.from_args(a)):
        sess, turns = Session(), []
        for step in plan:
            prompt, new = build_prompt(a, step, sess, shared)
            turns.append((step, sess, prompt, new))
            if step.kind != "outlier":
                sess = Session(prompt + [1] * step.out)
        out.append(turns)
    return out


def test_bench_prompts_are_the_old_ones():
    a, _ = bench_params("--requests", "120", "--seed", "1")
    h, lens = hashlib.sha256(), []
    for turns in bench_turns(a):
        for _, _, prompt, new in turns:
            h.update(repr((prompt, new)).encode())
            lens.append((len(prompt), new))
    assert h.hexdigest() == OLD_PROMPTS_SHA
    assert lens[:12] == OLD_PROMPT_LENS


# ---------------------------------------------------------------- closed loop = the bench


def paired(w: Workload, turns: list[list[tuple]]) -> list[tuple[SimRequest, tuple]]:
    """The workload's requests (in listed order) with the bench's turn each one stands for."""
    done: dict[int, int] = {}
    out = []
    for r in w.requests:
        k = done[r.client] = done.get(r.client, -1) + 1
        out.append((r, turns[r.client][k]))
    assert len(out) == sum(map(len, turns))
    return out


def test_closed_loop_has_the_benchs_prompts_and_hits():
    """Same lengths as the bench's prompts, and each request's hashed hit (against all earlier
    requests and their outputs) is what the bench's MD holds: the session's full blocks for a
    continuation, the system prompt it keeps for a new session (as far as an earlier request
    brought it: the bench warms MD with all of it), nothing for an outlier."""
    a, p = bench_params("--requests", "600", "--seed", "1")
    shared = random_tokens(random.Random(f"shared-{a.seed}"), a.shared_prefix)
    w = agentic_closed_loop(p, BLOCK)
    shared_seen = 0
    for (r, (step, sess, prompt, new)), hit in zip(paired(w, bench_turns(a)), prefix_hits(w), strict=True):
        assert (r.kind, r.input_tokens, r.output_tokens) == (step.kind, len(prompt), step.out)
        if step.kind == "outlier":
            want = 0
        elif new:
            kept = (
                next((i for i, (x, y) in enumerate(zip(prompt, shared, strict=False)) if x != y), len(shared))
                // BLOCK
                * BLOCK
            )
            want, shared_seen = min(kept, shared_seen), max(kept, shared_seen)
        else:
            want = (len(sess.ctx) - 1) // BLOCK * BLOCK
        assert hit == want / len(prompt), (r, step)


def test_closed_loop_hits_meet_the_plans_targets():
    """A continuation hits its step's target (to a token) unless its new part was raised to the
    minimum append; most requests are such continuations."""
    a, p = bench_params("--requests", "600", "--seed", "1")
    w = agentic_closed_loop(p, BLOCK)
    checked = 0
    for (_, (step, sess, prompt, new)), hit in zip(paired(w, bench_turns(a)), prefix_hits(w), strict=True):
        if not new and step.kind != "outlier" and len(prompt) - len(sess.ctx) > a.append_min:
            assert hit == pytest.approx(step.hit, abs=0.002)
            checked += 1
    assert checked >= 0.5 * len(w.requests)


# ---------------------------------------------------------------- open loop


@pytest.mark.parametrize(
    "preset, block, mean_band, outlier_band",
    [
        # PAPER aims low-hit requests at 60-95%: the paper's ~90% mean. BENCH keeps the bench's
        # defaults (low-hit requests uniform down to 0%, 4% outliers): a mean near 0.8.
        (PAPER, 512, (0.86, 0.94), (0.03, 0.04)),
        (BENCH, 16, (0.75, 0.92), (0.03, 0.045)),
    ],
    ids=["paper", "bench"],
)
def test_open_loop_is_paper_like(preset, block, mean_band, outlier_band):
    rate, duration = 20.0, 1800.0
    w = agentic_open_loop(preset, rate, duration, block, seed=3)
    prof = hit_profile(w)
    assert mean_band[0] <= prof["mean"] <= mean_band[1]
    assert 0.70 <= prof["above_95"] <= 0.80
    assert outlier_band[0] <= prof["outlier_share"] <= outlier_band[1]
    assert prof["rate_rps"] == pytest.approx(rate, rel=0.03)
    assert sum(prof["buckets"].values()) == pytest.approx(1.0)
    assert all(r.input_tokens + r.output_tokens <= preset.context_max for r in w.requests)
    arrivals = [r.arrival_s for r in w.requests]
    assert arrivals == sorted(arrivals) and arrivals[-1] < duration
    # The session pool holds the rate: about rate x turn gap sessions, each spaced by its think time.
    sessions = {r.client for r in w.requests if r.client is not None}
    assert 0.5 * rate * preset.turn_gap_s <= len(sessions) <= 2 * rate * preset.turn_gap_s


def test_paper_contexts_are_paper_sized():
    prof = hit_profile(agentic_open_loop(PAPER, 10.0, 600.0, 512, seed=1))
    assert 20_000 <= prof["input_tokens_mean"] <= 60_000
    assert 300 <= prof["output_tokens_mean"] <= 1000


# ---------------------------------------------------------------- fixed hit


@pytest.mark.parametrize("hit", [0.0, 0.3, 0.9, 0.97, 1.0])
def test_fixed_hit_hits_exactly(hit):
    w = fixed_hit_open_loop(hit, 50.0, 20.0, 8000, 100, 64, seed=1, prefixes=4)
    want = round(hit * 8000 / 64) * 64 / 8000
    assert abs(want - hit) <= 64 / 2 / 8000 + 1e-12  # to a block
    hits = prefix_hits(w, outputs=False)
    cold = [i for i, h in enumerate(hits) if h != want]  # the first request of each prefix
    assert len(cold) <= 4 and all(hits[i] == 0.0 for i in cold)
    assert len(w.requests) > 900 and all(len(r.block_hashes) == 8000 // 64 for r in w.requests)


# ---------------------------------------------------------------- Mooncake traces


def relabelled(w: Workload) -> list[tuple]:
    """Requests with block hashes numbered in order of first use (what a trace can keep)."""
    ids: dict[int, int] = {}
    return [
        (
            round(r.arrival_s, 6),
            r.input_tokens,
            r.output_tokens,
            tuple(ids.setdefault(h, len(ids)) for h in r.block_hashes),
        )
        for r in w.requests
    ]


def test_mooncake_round_trip(tmp_path):
    w = agentic_open_loop(PAPER, 5.0, 60.0, 512, seed=2)
    path = tmp_path / "t.jsonl"
    write_mooncake(w, path)
    back = read_mooncake(path)
    assert relabelled(back) == relabelled(w) and len(w.requests) > 200
    assert prefix_hits(back, outputs=False) == prefix_hits(w, outputs=False)
    # the format's own rule: one id per 512-token block, the last one partial
    assert all(
        len(json.loads(line)["hash_ids"]) == -(-r.input_tokens // 512)
        for line, r in zip(path.read_text().splitlines(), w.requests, strict=True)
    )
    assert len(read_mooncake(path, limit=10).requests) == 10
    with pytest.raises(ValueError, match="closed-loop"):
        write_mooncake(agentic_closed_loop(BENCH, 16), path)


def test_mooncake_hand_written_trace(tmp_path):
    path = tmp_path / "hand.jsonl"
    path.write_text(
        '{"timestamp": 0, "input_length": 1100, "output_length": 10, "hash_ids": [7, 8, 9]}\n'
        "\n"
        '{"timestamp": 1500, "input_length": 1536, "output_length": 20, "hash_ids": [7, 8, 11]}\n'
        '{"timestamp": 2250.5, "input_length": 1100, "output_length": 30, "hash_ids": [12, 8, 13]}\n'
    )
    w = read_mooncake(path)
    a, b, c = w.requests
    assert (w.block_size, [r.arrival_s for r in w.requests]) == (512, [0.0, 1.5, 2.2505])
    assert [(r.input_tokens, r.output_tokens, len(r.block_hashes)) for r in w.requests] == [
        (1100, 10, 2),
        (1536, 20, 3),
        (1100, 30, 2),
    ]  # a trailing partial block is not hashed
    assert b.block_hashes[:2] == a.block_hashes and b.block_hashes[2] not in a.block_hashes
    assert not set(c.block_hashes) & set(a.block_hashes + b.block_hashes)  # id 8 after 12: another prefix
    assert prefix_hits(w, outputs=False) == [0.0, 1024 / 1536, 0.0]


@pytest.mark.parametrize(
    "line, message",
    [
        ('{"timestamp": 0, "input_length": 1100', "not JSON"),
        ("[1, 2]", "expected an object"),
        ('{"input_length": 1100, "output_length": 1, "hash_ids": [1, 2, 3]}', "'timestamp' missing"),
        (
            '{"timestamp": 0, "input_length": "1100", "output_length": 1, "hash_ids": [1, 2, 3]}',
            "'input_length'",
        ),
        (
            '{"timestamp": 0, "input_length": 1100, "output_length": 1, "hash_ids": [1, 2, 3, 4]}',
            "must be 3 integers",
        ),
        ('{"timestamp": 0, "input_length": 1100, "output_length": 1, "hash_ids": [1]}', "got 1"),
        ('{"timestamp": 0, "input_length": 1100, "output_length": 1, "hash_ids": [1, -2, 3]}', "integers"),
        (
            '{"timestamp": -5, "input_length": 1100, "output_length": 1, "hash_ids": [1, 2, 3]}',
            "timestamp >= 0",
        ),
    ],
)
def test_malformed_trace_lines_name_the_line(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(
        '{"timestamp": 0, "input_length": 512, "output_length": 1, "hash_ids": [1]}\n' + line + "\n"
    )
    with pytest.raises(TraceError, match=message) as e:
        read_mooncake(path)
    assert f"{path}:2:" in str(e.value)


def test_the_shipped_sample_trace_reads():
    w = read_mooncake("pdd/sim/workloads/traces/agentic-sample.jsonl")
    prof = hit_profile(w)
    assert len(w.requests) >= 200 and prof["outlier_share"] is None
    assert 0.75 <= prof["mean"] <= 0.95


def test_hit_profile_buckets():
    def req(rid: int, hashes: tuple[int, ...]) -> SimRequest:
        return SimRequest(
            rid, float(rid), 100 * len(hashes), 1, hashes, kind="outlier" if rid == 3 else "high"
        )

    w = Workload(
        "hand",
        100,
        (
            req(0, tuple(range(100))),
            req(1, tuple(range(100))),
            req(2, (*range(96), -1, -2, -3, -4)),
            req(3, (-5,)),
        ),
    )
    prof = hit_profile(w, outputs=False)
    assert prefix_hits(w, outputs=False) == [0.0, 1.0, 0.96, 0.0]
    assert prof["buckets"] == {
        "0-90%": 0.5,
        "90-95%": 0.0,
        "95-96%": 0.0,
        "96-97%": 0.25,
        "97-98%": 0.0,
        "98-99%": 0.0,
        "99-100%": 0.25,
    }
    assert (prof["mean"], prof["above_95"], prof["outlier_share"]) == (pytest.approx(0.49), 0.5, 0.25)
