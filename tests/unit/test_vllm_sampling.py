"""pdd's SamplingParams as vLLM's keyword arguments (shared/vllm/sampling.py), without vLLM:
every field, a continued request's counts, the constraints, and what vLLM cannot take."""

from __future__ import annotations

import sys

import pytest

from shared.engine.errors import InvalidRequestError
from shared.engine.sampling_params import SamplingParams
from shared.vllm.sampling import (
    JSON_OBJECT_OR_ARRAY,
    STRUCTURED_KEY,
    structured_outputs,
    to_vllm_sampling_params,
    vllm_sampling_kwargs,
)

DEFAULTS = {
    "temperature": 0.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
    "max_tokens": 16,
    "min_tokens": 0,
    "stop": [],
    "stop_token_ids": [],
    "ignore_eos": False,
    "seed": None,
    "logprobs": None,
    "prompt_logprobs": None,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
    "logit_bias": None,
    STRUCTURED_KEY: None,
}


def every_field() -> SamplingParams:
    return SamplingParams(
        temperature=0.7,
        top_p=0.9,
        top_k=40,
        max_tokens=32,
        stop=["\n\n", "END"],
        seed=1234,
        ignore_eos=True,
        logprobs=5,
        prompt_logprobs=2,
        presence_penalty=0.5,
        frequency_penalty=-0.25,
        repetition_penalty=1.3,
        min_p=0.05,
        min_tokens=4,
        logit_bias={65: 5.0, 66: -100},
        stop_token_ids=[0, 10],
        structured={"kind": "choice", "spec": ["yes", "no"]},
    )


def test_the_defaults_are_vllms_for_a_greedy_request():
    assert vllm_sampling_kwargs(SamplingParams()) == DEFAULTS


def test_every_field_maps_to_vllms_of_the_same_meaning():
    assert vllm_sampling_kwargs(every_field()) == {
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 40,
        "min_p": 0.05,
        "max_tokens": 32,
        "min_tokens": 4,
        "stop": ["\n\n", "END"],
        "stop_token_ids": [0, 10],
        "ignore_eos": True,
        "seed": 1234,
        "logprobs": 5,
        "prompt_logprobs": 2,
        "presence_penalty": 0.5,
        "frequency_penalty": -0.25,
        "repetition_penalty": 1.3,
        "logit_bias": {65: 5.0, 66: -100.0},
        STRUCTURED_KEY: {"choice": ["yes", "no"]},
    }


def test_the_kwargs_are_copies_not_the_requests_own_lists():
    params = every_field()
    kwargs = vllm_sampling_kwargs(params)
    kwargs["stop"].append("x")
    kwargs["stop_token_ids"].append(99)
    kwargs["logit_bias"][1] = 1.0
    kwargs[STRUCTURED_KEY]["choice"].append("maybe")
    assert params == every_field()


def test_top_k_off_is_vllms_0():
    assert vllm_sampling_kwargs(SamplingParams(top_k=-1))["top_k"] == 0
    assert vllm_sampling_kwargs(SamplingParams(top_k=0))["top_k"] == 0


def test_tokens_generated_elsewhere_count_toward_max_and_min_tokens():
    params = SamplingParams(temperature=1.0, max_tokens=20, min_tokens=8)
    kwargs = vllm_sampling_kwargs(params, generated=5)
    assert (kwargs["max_tokens"], kwargs["min_tokens"]) == (15, 3)
    kwargs = vllm_sampling_kwargs(params, generated=12)
    assert (kwargs["max_tokens"], kwargs["min_tokens"]) == (8, 0)
    kwargs = vllm_sampling_kwargs(params, generated=25)  # nothing left: still one (vLLM's floor)
    assert (kwargs["max_tokens"], kwargs["min_tokens"]) == (1, 0)
    assert params.max_tokens == 20 and params.min_tokens == 8  # the request itself is unchanged


def test_a_continued_request_leaves_the_prompts_logprobs_to_its_first_part():
    params = SamplingParams(logprobs=3, prompt_logprobs=2, max_tokens=10)
    assert vllm_sampling_kwargs(params, generated=4)["prompt_logprobs"] is None
    assert vllm_sampling_kwargs(params, generated=4)["logprobs"] == 3


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("presence_penalty", 0.5, "presence_penalty cannot run on vLLM for a request continued"),
        ("frequency_penalty", -0.1, "frequency_penalty cannot run on vLLM for a request continued"),
        ("structured", {"kind": "regex", "spec": "a+"}, "structured output constraint cannot run on vLLM"),
    ],
)
def test_what_vllm_counts_over_its_own_output_only_cannot_continue_a_request(field, value, message):
    params = SamplingParams(max_tokens=10, **{field: value})
    assert vllm_sampling_kwargs(params, generated=0)  # a request's first part: fine
    with pytest.raises(InvalidRequestError, match=message):
        vllm_sampling_kwargs(params, generated=1)
    # what covers the prompt as well continues as it is
    assert (
        vllm_sampling_kwargs(SamplingParams(repetition_penalty=1.2), generated=1)["repetition_penalty"] == 1.2
    )


def test_a_negative_generated_count_is_a_caller_bug():
    with pytest.raises(ValueError, match="generated must be an integer >= 0"):
        vllm_sampling_kwargs(SamplingParams(), generated=-1)


def test_greedy_temperatures_are_vllms_greedy():
    assert vllm_sampling_kwargs(SamplingParams(temperature=1e-6))["temperature"] == 0.0
    assert vllm_sampling_kwargs(SamplingParams(temperature=0.01))["temperature"] == 0.01
    assert vllm_sampling_kwargs(SamplingParams(temperature=2))["temperature"] == 2.0


@pytest.mark.parametrize("t", [0.005, 2.5])
def test_temperatures_vllm_would_change_or_refuse_are_refused(t):
    with pytest.raises(InvalidRequestError, match=rf"temperature {t} cannot run on vLLM"):
        vllm_sampling_kwargs(SamplingParams(temperature=t))


def test_a_seed_is_taken_modulo_2_64_as_pdd_takes_it():
    assert vllm_sampling_kwargs(SamplingParams(seed=0))["seed"] == 0
    # -1 would be "no seed" to vLLM; pdd draws with it as 2**64 - 1
    assert vllm_sampling_kwargs(SamplingParams(seed=-1))["seed"] == 2**64 - 1
    assert vllm_sampling_kwargs(SamplingParams(seed=2**64 + 3))["seed"] == 3


def test_a_request_pdd_refuses_is_refused_with_pdds_message():
    with pytest.raises(InvalidRequestError, match=r"top_p must be in \(0, 1\]"):
        vllm_sampling_kwargs(SamplingParams(top_p=0))
    with pytest.raises(InvalidRequestError, match="min_tokens .* must not exceed max_tokens"):
        vllm_sampling_kwargs(SamplingParams(max_tokens=2, min_tokens=3))


@pytest.mark.parametrize(
    ("structured", "expected"),
    [
        ({"kind": "json", "spec": {"type": "object"}}, {"json": {"type": "object"}}),
        ({"kind": "json", "spec": '{"type": "integer"}'}, {"json": '{"type": "integer"}'}),
        ({"kind": "json", "spec": True}, {"json": "true"}),
        (
            {"kind": "json", "spec": {"type": "object"}, "disable_any_whitespace": True},
            {"json": {"type": "object"}, "disable_any_whitespace": True},
        ),
        ({"kind": "json_object"}, {"json": JSON_OBJECT_OR_ARRAY}),
        ({"kind": "json_object", "disable_any_whitespace": True}, {"json": JSON_OBJECT_OR_ARRAY}),
        ({"kind": "regex", "spec": "[0-9]{3}"}, {"regex": "[0-9]{3}"}),
        ({"kind": "choice", "spec": ["a", "b c"]}, {"choice": ["a", "b c"]}),
        ({"kind": "grammar", "spec": 'root ::= "x"'}, {"grammar": 'root ::= "x"'}),
        ({"kind": "regex", "spec": "a", "disable_any_whitespace": False}, {"regex": "a"}),
    ],
)
def test_each_constraint_maps_to_vllms_structured_outputs(structured, expected):
    assert structured_outputs(structured) == expected
    kwargs = vllm_sampling_kwargs(SamplingParams(structured=structured))
    assert kwargs[STRUCTURED_KEY] == expected


def test_the_schema_for_json_object_admits_what_pdds_json_grammar_admits():
    xgr = pytest.importorskip("xgrammar")
    from xgrammar.testing import _is_grammar_accept_string as accepts

    pdds = xgr.Grammar.builtin_json_grammar()
    vllms = xgr.Grammar.from_json_schema(JSON_OBJECT_OR_ARRAY, any_whitespace=True)
    texts = ['{"a": [1, {"b": null}]}', "[1, 2.5e3]", "{ }", '{\n"a":\t1\r}', "[]", "1", '"s"', "null"]
    assert [accepts(vllms, t) for t in texts] == [accepts(pdds, t) for t in texts]
    assert [accepts(pdds, t) for t in texts] == [True] * 5 + [False] * 3


@pytest.mark.parametrize(
    ("structured", "message"),
    [
        ({"kind": "yaml", "spec": "x"}, "structured output kind must be one of .* got 'yaml'"),
        ({"kind": "regex", "spec": ""}, "a regex constraint must be a non-empty string"),
        ({"kind": "grammar", "spec": 3}, "a grammar constraint must be a non-empty string"),
        ({"kind": "choice", "spec": []}, "a choice constraint must be a list of non-empty strings"),
        ({"kind": "choice", "spec": ["a", ""]}, "a choice constraint must be a list of non-empty strings"),
        ({"kind": "json", "spec": 3}, "a json constraint must be a JSON schema"),
        (
            {"kind": "json", "spec": {}, "disable_fallback": True},
            r"option\(s\) \['disable_fallback'\] cannot run on vLLM",
        ),
    ],
)
def test_constraints_vllm_cannot_take_are_refused_clearly(structured, message):
    with pytest.raises(InvalidRequestError, match=message):
        vllm_sampling_kwargs(SamplingParams(structured=structured))


def test_the_kwargs_need_no_vllm(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # any `import vllm` now fails
    assert vllm_sampling_kwargs(every_field())["max_tokens"] == 32
    with pytest.raises(ImportError):
        to_vllm_sampling_params(every_field())
