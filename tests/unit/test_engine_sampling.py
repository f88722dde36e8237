"""Sampling: seeded draws keyed by position follow the filtered distribution (temperature,
top-k, top-p); a row draws the same token whatever else is in its batch; every request has a
seed; SamplingParams on the wire."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from shared.engine import SamplingParams
from shared.engine.sampler import NUCLEUS_CANDIDATES, Sampler, filtered_logits
from tests.engine_util import make_engine, run_all, tokens_of

LOGITS = torch.tensor([1.0, 0.0, -0.5, 2.0, 0.5, -1.0])  # smallest p ~ 0.027: >= 53 expected per 2000
N = 2000
# Chi-square critical value for df = 6 - 1 = 5 at p = 0.001: a correct sampler fails 1 seed in 1000.
CHI2_DF5_P001 = 20.515


def _draws(seed: int, first_position: int = 100, params: SamplingParams | None = None) -> list[int]:
    """One seeded request whose logits are the same at N consecutive positions."""
    rows = [params or SamplingParams(temperature=1.0)] * N
    positions = list(range(first_position, first_position + N))
    return Sampler()(LOGITS.repeat(N, 1), rows, [seed] * N, positions)


def _chi_square(draws: list[int], probs: torch.Tensor | None = None) -> float:
    """Over the tokens `probs` gives a chance; a draw of any other token fails the test."""
    p = torch.softmax(LOGITS.double(), dim=0) if probs is None else probs.double()
    observed = torch.bincount(torch.tensor(draws), minlength=len(LOGITS)).double()
    assert observed[p == 0].sum() == 0, "a token the filters leave out was drawn"
    expected = p * len(draws)
    keep = p > 0
    return float(((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def test_draws_over_positions_follow_the_softmax():
    a, b = _draws(seed=7), _draws(seed=8)
    assert _chi_square(a) < CHI2_DF5_P001
    assert _chi_square(b) < CHI2_DF5_P001
    # Another seed draws otherwise: independent draws agree at ~35% of positions (sum of p^2).
    assert sum(x == y for x, y in zip(a, b, strict=True)) < N // 2
    assert _draws(seed=7) == a  # and the same seed draws the same


# Critical values at p = 0.001 for the degrees of freedom left after filtering.
CHI2_P001 = {1: 10.828, 2: 13.816, 3: 16.266}


@pytest.mark.parametrize(
    ("params", "kept"),
    [
        (SamplingParams(temperature=0.5, top_k=3), [3, 0, 4]),  # the three best logits: 2.0, 1.0, 0.5
        (SamplingParams(temperature=1.0, top_p=0.7), [3, 0]),  # p = .54 + .20 reach 0.7
        (SamplingParams(temperature=1.0, top_p=0.8), [3, 0, 4]),
        (SamplingParams(temperature=2.0, top_k=4, top_p=0.6), [3, 0]),
    ],
    ids=["top-k", "top-p-2", "top-p-3", "top-k-top-p"],
)
def test_filtered_draws_follow_the_renormalised_distribution(params: SamplingParams, kept: list[int]):
    scaled = LOGITS / params.temperature
    probs = torch.zeros(len(LOGITS))
    probs[kept] = torch.softmax(scaled[kept], dim=0)
    assert _chi_square(_draws(seed=11, params=params), probs) < CHI2_P001[len(kept) - 1]


def test_filters_keep_what_the_definitions_say():
    x = torch.tensor([[3.0, 1.0, 1.0, 0.0, -2.0]])
    kept = filtered_logits(x, [SamplingParams(temperature=1.0, top_k=2)]) > float("-inf")
    assert kept.tolist() == [[True, True, True, False, False]]  # ties with the k-th stay
    # top-p keeps the smallest prefix reaching it: p ~ (.75, .10, .10, .04, .005).
    kept = filtered_logits(x, [SamplingParams(temperature=1.0, top_p=0.85)]) > float("-inf")
    assert kept.sum() == 2 and kept[0, 0]
    # A nucleus wider than the candidates ranked first: the whole row is sorted, same rule.
    flat = torch.zeros(1, 3 * NUCLEUS_CANDIDATES)
    flat[0, 7] = 1.0
    kept = filtered_logits(flat, [SamplingParams(temperature=1.0, top_p=0.9)]) > float("-inf")
    mass = float(torch.softmax(flat, dim=-1)[kept].sum())
    assert kept[0, 7] and int(kept.sum()) > NUCLEUS_CANDIDATES
    assert mass >= 0.9 > mass - 1 / float(flat.exp().sum())  # the smallest prefix that reaches it


def test_a_row_draws_the_same_whatever_else_is_in_its_batch():
    gen = torch.Generator().manual_seed(0)
    vocab, n = 2000, 12
    logits = torch.randn(n, vocab, generator=gen) * 4
    kinds = [
        SamplingParams(temperature=0.8),
        SamplingParams(temperature=1.3, top_k=40),
        SamplingParams(temperature=1.0, top_p=0.9),
        SamplingParams(temperature=0.7, top_k=200, top_p=0.8),
        SamplingParams(temperature=0.0),
    ]
    params = [kinds[i % len(kinds)] for i in range(n)]
    seeds, positions = list(range(50, 50 + n)), list(range(7, 7 + n))
    batch = Sampler()(logits, params, seeds, positions)
    alone = [
        Sampler()(logits[i : i + 1], params[i : i + 1], seeds[i : i + 1], positions[i : i + 1])[0]
        for i in range(n)
    ]
    assert batch == alone
    order = list(reversed(range(n)))  # and in another order, next to other rows
    shuffled = Sampler()(
        logits[order], [params[i] for i in order], [seeds[i] for i in order], [positions[i] for i in order]
    )
    assert shuffled == [batch[i] for i in order]
    assert batch[4::5] == logits[4::5].argmax(dim=-1).tolist()  # greedy rows are the argmax


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
    assert SamplingParams.from_dict({"max_tokens": 3, "stop": None, "extra": 1}) == SamplingParams(
        max_tokens=3
    )


@pytest.mark.parametrize("top_p", [5e-324, 1e-45, 1e-12])
def test_a_tiny_nucleus_keeps_the_best_token(top_p: float):
    # 5e-324 passes validation (> 0) but is 0 in fp32: the best token must still stay.
    x = torch.tensor([[3.0, 1.0, 1.0, 0.0, -2.0], [0.0, 0.0, 5.0, 1.0, 1.0]])
    params = [SamplingParams(temperature=1.0, top_p=top_p)] * 2
    kept = filtered_logits(x, params) > float("-inf")
    assert kept.tolist() == [[True, False, False, False, False], [False, False, True, False, False]]
    assert Sampler()(x, params, seeds=[1, 2], positions=[0, 0]) == [0, 2]
