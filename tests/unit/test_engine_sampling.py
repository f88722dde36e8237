"""Sampling: seeded draws keyed by position follow the filtered distribution; every request
has a seed; SamplingParams on the wire."""

from __future__ import annotations

import dataclasses

import torch

from shared.engine import SamplingParams
from shared.engine.sampler import Sampler
from tests.engine_util import make_engine, run_all, tokens_of

LOGITS = torch.tensor([1.0, 0.0, -0.5, 2.0, 0.5, -1.0])  # smallest p ~ 0.027: >= 53 expected per 2000
N = 2000
# Chi-square critical value for df = 6 - 1 = 5 at p = 0.001: a correct sampler fails 1 seed in 1000.
CHI2_DF5_P001 = 20.515


def _draws(seed: int, first_position: int = 100) -> list[int]:
    """One seeded request whose logits are the same at N consecutive positions."""
    params = [SamplingParams(temperature=1.0)] * N
    positions = list(range(first_position, first_position + N))
    return Sampler()(LOGITS.repeat(N, 1), params, [seed] * N, positions)


def _chi_square(draws: list[int]) -> float:
    observed = torch.bincount(torch.tensor(draws), minlength=len(LOGITS)).double()
    expected = torch.softmax(LOGITS.double(), dim=0) * len(draws)
    return float(((observed - expected) ** 2 / expected).sum())


def test_draws_over_positions_follow_the_softmax():
    a, b = _draws(seed=7), _draws(seed=8)
    assert _chi_square(a) < CHI2_DF5_P001
    assert _chi_square(b) < CHI2_DF5_P001
    # Another seed draws otherwise: independent draws agree at ~35% of positions (sum of p^2).
    assert sum(x == y for x, y in zip(a, b, strict=True)) < N // 2
    assert _draws(seed=7) == a  # and the same seed draws the same


def test_unseeded_requests_get_a_seed_that_replays_them():
    engine = make_engine()
    params = SamplingParams(temperature=2.0, max_tokens=20, ignore_eos=True)
    for i in range(2):
        engine.add_request(f"u{i}", [1, 2, 3, 4], params)
    seeds = [engine.seqs[f"u{i}"].seed for i in range(2)]
    assert all(isinstance(s, int) and 0 <= s < 2**63 for s in seeds) and seeds[0] != seeds[1]
    assert params.seed is None  # the caller's params are left as they were
    outs = run_all(engine)
    assert tokens_of(outs["u0"]) != tokens_of(outs["u1"])
    # The assigned seed is what drew the tokens: the same request seeded with it draws them again.
    for i, seed in enumerate(seeds):
        engine.add_request(f"s{i}", [1, 2, 3, 4], dataclasses.replace(params, seed=seed))
    replay = run_all(engine)
    for i in range(2):
        assert tokens_of(replay[f"s{i}"]) == tokens_of(outs[f"u{i}"])


def test_sampling_params_wire_roundtrip():
    p = SamplingParams(temperature=0.7, top_p=0.9, top_k=20, max_tokens=5, stop=["\n"], seed=3)
    assert SamplingParams.from_dict(p.to_dict()) == p
    assert SamplingParams.from_dict({"max_tokens": 3, "stop": None, "extra": 1}) == SamplingParams(max_tokens=3)
