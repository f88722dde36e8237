"""Parallel sampling (n > 1) as the router plans it (services/router/api/parallel.py): vLLM
v1's child seeds, the usage of n choices, the bounds on n and best_of."""

from __future__ import annotations

import pytest

from services.router.api.parallel import MAX_N, SEED_SPACE, check_n, child_params, merged_usage
from services.router.core.errors import APIError
from shared.engine import SamplingParams


def test_child_i_samples_with_seed_plus_i():
    params = SamplingParams(temperature=0.8, seed=41, max_tokens=5, stop=["x"])
    children = child_params(params, 3)
    assert [c.seed for c in children] == [41, 42, 43]
    assert all(c.temperature == 0.8 and c.stop == ["x"] and c.max_tokens == 5 for c in children)
    children[1].stop.append("y")
    assert params.stop == ["x"] and params.seed == 41  # copies: the request's own are untouched


def test_without_a_seed_each_child_draws_its_own():
    children = child_params(SamplingParams(temperature=1.0), 2)
    assert [c.seed for c in children] == [None, None] and children[0] is not children[1]


def test_seeds_wrap_within_int64():
    assert [c.seed for c in child_params(SamplingParams(seed=SEED_SPACE - 1), 2)] == [SEED_SPACE - 1, 0]


def test_usage_counts_the_prompt_once_and_sums_completions():
    assert merged_usage(7, [3, 5, 0]) == {"prompt_tokens": 7, "completion_tokens": 8, "total_tokens": 15}


@pytest.mark.parametrize(
    "payload", [{}, {"n": 1}, {"n": MAX_N}, {"n": 3, "best_of": 3}, {"best_of": 1}, {"n": None}]
)
def test_n_and_best_of_accepted(payload):
    assert check_n(payload) is None  # a refusal raises APIError


@pytest.mark.parametrize(
    "payload, param",
    [
        ({"n": 0}, "n"),
        ({"n": MAX_N + 1}, "n"),
        ({"n": True}, "n"),
        ({"n": 2.0}, "n"),
        ({"n": 2, "best_of": 3}, "best_of"),  # vLLM v1 ranks no samples
        ({"n": 3, "best_of": 2}, "best_of"),
        ({"best_of": 2}, "best_of"),
        ({"best_of": True}, "best_of"),
    ],
)
def test_n_and_best_of_refused_naming_the_field(payload, param):
    with pytest.raises(APIError) as e:
        check_n(payload)
    assert e.value.status == 400 and e.value.param == param
