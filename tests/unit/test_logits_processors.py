"""Logits processing before sampling (vLLM's formulas, worked by hand here), each field's effect
on a real engine, and a request continued on a second engine from its token ids processing its
logits as the first would have (what a handoff or a move does)."""

from __future__ import annotations

import pytest
import torch

from shared.bus.codec import decode, encode
from shared.bus.messages import Pipeline, PrepareRequest
from shared.engine import InvalidRequestError, SamplingParams
from shared.engine.logits_processors import apply_min_p, process_row
from shared.engine.sampler import filtered_logits
from tests.engine_util import make_engine, run_all, tokens_of

ROW = [2.0, -1.0, 0.5, 3.0, -2.0, 1.0]


def processed(params: SamplingParams, history: list[int], num_prompt: int, eos=(5,)) -> list[float]:
    row = torch.tensor(ROW)
    process_row(row, params, history, num_prompt, eos)
    return row.tolist()


def test_repetition_penalty_divides_positive_and_multiplies_negative_over_prompt_and_output():
    # prompt [0, 1], output [2]: tokens 0, 1, 2 are penalized; 3, 4, 5 are not.
    got = processed(SamplingParams(repetition_penalty=2.0), [0, 1, 2], 2)
    assert got == pytest.approx([1.0, -2.0, 0.25, 3.0, -2.0, 1.0])


def test_frequency_and_presence_penalties_count_the_output_only():
    # prompt [3, 3] is not counted; output [0, 0, 2]: token 0 twice, token 2 once.
    got = processed(SamplingParams(frequency_penalty=0.5, presence_penalty=0.25), [3, 3, 0, 0, 2], 2)
    assert got == pytest.approx([2.0 - 1.0 - 0.25, -1.0, 0.5 - 0.5 - 0.25, 3.0, -2.0, 1.0])


def test_negative_penalties_reward_repeats():
    got = processed(SamplingParams(frequency_penalty=-1.0), [1, 4, 4], 1)
    assert got == pytest.approx([2.0, -1.0, 0.5, 3.0, 0.0, 1.0])


def test_logit_bias_is_added():
    got = processed(SamplingParams(logit_bias={1: 100.0, 3: -3.0}), [0], 1)
    assert got == pytest.approx([2.0, 99.0, 0.5, 0.0, -2.0, 1.0])


def test_min_tokens_suppresses_eos_and_stop_token_ids_until_reached():
    params = SamplingParams(min_tokens=2, stop_token_ids=[3], max_tokens=8)
    early = processed(params, [0, 1], 1)  # one output token so far
    assert early[3] == early[5] == float("-inf") and early[0] == 2.0
    assert processed(params, [0, 1, 2], 1) == ROW  # two: no longer
    # ignore_eos does not let the EOS through early either (vLLM suppresses every stop id).
    assert processed(SamplingParams(min_tokens=1, ignore_eos=True), [0], 1)[5] == float("-inf")


def test_min_p_keeps_tokens_within_a_fraction_of_the_best():
    x = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    kept = apply_min_p(x, [0.25]) > float("-inf")  # threshold 0.125: keeps 0.5, 0.3, 0.15
    assert kept.tolist() == [[True, True, True, False]]
    assert torch.equal(apply_min_p(x, [0.0]), x)
    # In the sampler, after temperature: at temperature 2 the probabilities flatten and 0.05 stays.
    flat = filtered_logits(x, [SamplingParams(temperature=2.0, min_p=0.25)])
    assert (flat > float("-inf")).all()


def test_processing_sees_only_its_own_row():
    """A row with no processing is untouched by another row's (the engine clones the batch)."""
    engine = make_engine()
    plain = SamplingParams(max_tokens=6, ignore_eos=True)
    penal = SamplingParams(max_tokens=6, ignore_eos=True, repetition_penalty=3.0, logit_bias={65: 5.0})
    engine.add_request("alone", [1, 2, 3, 4], plain)
    alone = tokens_of(run_all(engine)["alone"])
    engine.add_request("a", [1, 2, 3, 4], plain)
    engine.add_request("b", [1, 2, 3, 4], penal)
    outs = run_all(engine)
    assert tokens_of(outs["a"]) == alone


PROMPT = [72, 101, 108, 108, 111, 32, 119, 111, 114, 108, 100]


def generate(params: SamplingParams, prompt=PROMPT, engine=None) -> list[int]:
    engine = engine or make_engine()
    engine.add_request("r", prompt, params)
    return tokens_of(run_all(engine)["r"])


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, **kw)


@pytest.mark.parametrize(
    "fields",
    [
        {"repetition_penalty": 1.8},
        {"frequency_penalty": 1.5},
        {"presence_penalty": 2.0},
        {"logit_bias": {33: 40.0}},
    ],
    ids=["repetition", "frequency", "presence", "logit_bias"],
)
def test_each_field_changes_greedy_output_and_continues_exactly_from_token_ids(fields):
    plain = generate(greedy())
    out = generate(greedy(**fields))
    assert out != plain, "the field had no effect"
    if "logit_bias" in fields:
        assert out == [33] * 24
    if "presence_penalty" in fields or "repetition_penalty" in fields:
        assert len(set(out)) > len(set(plain))  # fewer repeats
    # A second engine given the prompt and the first k output tokens goes on as the first did.
    for k in (1, 9):
        engine = make_engine()
        engine.add_request("r", PROMPT + out[:k], greedy(**fields), num_prompt_tokens=len(PROMPT))
        rest = tokens_of(run_all(engine)["r"])
        assert out[:k] + rest == out


def test_min_tokens_and_stop_token_ids_on_the_engine():
    engine = make_engine()
    eos = engine.model_config.eos_token_id
    # With the EOS pushed to the top, the request ends at once unless min_tokens holds it off.
    biased = dict(temperature=0.0, max_tokens=12, logit_bias={eos: 200.0})
    assert generate(SamplingParams(**biased)) == [eos]
    out = generate(SamplingParams(**biased, min_tokens=5))
    assert len(out) == 6 and out[-1] == eos and eos not in out[:5]
    # stop_token_ids end the request with its token, reason stop.
    plain = generate(greedy())
    stop_at = plain[4]
    first = plain.index(stop_at)
    engine = make_engine()
    engine.add_request("r", PROMPT, greedy(stop_token_ids=[stop_at]))
    outs = run_all(engine)["r"]
    assert tokens_of(outs) == plain[: first + 1] and outs[-1].finish_reason.value == "stop"
    # min_tokens holds stop_token_ids off too.
    later = generate(greedy(stop_token_ids=[stop_at], min_tokens=first + 2))
    assert len(later) > first + 1 and stop_at not in later[first + 1 : first + 2]


def test_seeded_sampling_with_min_p_continues_exactly():
    params = SamplingParams(
        temperature=1.0, min_p=0.1, seed=11, max_tokens=20, ignore_eos=True, presence_penalty=0.5
    )
    out = generate(params)
    engine = make_engine()
    engine.add_request("r", PROMPT + out[:7], params, num_prompt_tokens=len(PROMPT))
    assert out[:7] + tokens_of(run_all(engine)["r"]) == out


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"presence_penalty": 3.0}, "presence_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"min_p": 1.5}, "min_p"),
        ({"min_tokens": 30}, "min_tokens"),
        ({"logit_bias": {1 << 20: 1.0}}, "logit_bias"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ],
)
def test_bad_values_are_refused_by_name(fields, message):
    with pytest.raises(InvalidRequestError, match=message):
        make_engine().add_request("r", PROMPT, SamplingParams(max_tokens=10, **fields))


def test_new_fields_travel_as_plain_data():
    p = SamplingParams(
        logit_bias={3: 1.5}, stop_token_ids=[9], min_tokens=2, structured={"kind": "regex", "spec": "a+"}
    )
    assert SamplingParams.from_dict(p.to_dict()) == p
    msg = PrepareRequest("r", [1, 2], p, [], Pipeline.P_MD)
    got = decode(PrepareRequest, encode(msg)).params
    assert got == p
    got.validate()


def test_stop_strings_wait_for_min_tokens():
    """A stop string counts only if it ends after the text of the first min_tokens tokens."""
    from shared.engine.stopping import finish_reason

    def reason(out: str, min_tokens: int):
        ids = [0] + list(out.encode())
        params = SamplingParams(stop=["ab"], min_tokens=min_tokens, max_tokens=50)
        decode = lambda t: bytes(t).decode()  # noqa: E731
        return finish_reason(ids, 1, params, eos_token_ids=(), decode=decode, max_model_len=100)

    assert reason("xab", 0) is not None
    assert reason("xab", 3) is None  # still within min_tokens
    assert reason("xabc", 3) is None  # "ab" ended within the first 3 tokens' text
    assert reason("xaab", 3) is not None  # ends with the 4th token
