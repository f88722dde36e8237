"""Bad input is refused with InvalidRequestError; stop conditions; abort/release in any state."""

from __future__ import annotations

import random

import pytest

from shared.engine import EngineError, FinishReason, InvalidRequestError, Mode, SamplingParams
from tests.engine_util import dense_greedy, greedy, make_engine, random_prompt, run_all, tokens_of

BAD_REQUESTS = [
    ([], SamplingParams(), {}, "empty"),
    ([1] * 4096, SamplingParams(), {}, "max_model_len"),
    ([1, 2], SamplingParams(max_tokens=0), {}, "max_tokens"),
    ([1, 2], SamplingParams(max_tokens=-3), {}, "max_tokens"),
    ([1, 258], SamplingParams(), {}, "out of the vocabulary"),
    ([1, -1], SamplingParams(), {}, "out of the vocabulary"),
    ([1, 2.0], SamplingParams(), {}, "integers"),
    ("abc", SamplingParams(), {}, "list of integers"),
    ([1, 2], SamplingParams(temperature=-0.5), {}, "temperature"),
    ([1, 2], SamplingParams(temperature=float("nan")), {}, "temperature"),
    ([1, 2], SamplingParams(top_p=0.0), {}, "top_p"),
    ([1, 2], SamplingParams(top_p=1.5), {}, "top_p"),
    ([1, 2], SamplingParams(top_k=-2), {}, "top_k"),
    ([1, 2], SamplingParams(stop=[""]), {}, "stop"),
    ([1, 2], SamplingParams(max_tokens=4000), {}, "KV blocks"),  # more KV than the pool
    ([1, 2], SamplingParams(), {"mode": "bogus"}, "mode"),
    ([1, 2], SamplingParams(), {"num_prompt_tokens": 0}, "num_prompt_tokens"),
    ([1, 2, 3], SamplingParams(max_tokens=2), {"num_prompt_tokens": 1}, "max_tokens"),
]


def test_bad_requests_are_refused_and_the_engine_keeps_serving():
    engine = make_engine(kv_memory_mb=0.5)  # 64 blocks = 1024 tokens
    good = random_prompt(random.Random(30), 25)
    engine.add_request("good", good, greedy(20))
    engine.step()
    for i, (ids, params, kw, msg) in enumerate(BAD_REQUESTS):
        with pytest.raises(InvalidRequestError, match=msg):
            engine.add_request(f"bad{i}", ids, params, **kw)
        assert issubclass(InvalidRequestError, EngineError)
        engine.step()
    with pytest.raises(InvalidRequestError, match="already exists"):
        engine.add_request("good", [1], greedy(1))
    outs = run_all(engine)
    assert set(outs) == {"good"} and outs["good"][-1].finished
    assert engine.stats().used_blocks == 0 and not engine.seqs


def test_bad_extend_calls():
    engine = make_engine()
    engine.add_request("g", [1, 2, 3], greedy(5))
    engine.add_request("h", [1, 2, 3], greedy(5), mode=Mode.HOLD)
    run_all(engine)
    with pytest.raises(InvalidRequestError, match="unknown"):
        engine.extend("nope", [1], final=True)
    engine.add_request("g2", [1, 2, 3], greedy(5))
    with pytest.raises(InvalidRequestError, match="not held"):
        engine.extend("g2", [1], final=True)
    with pytest.raises(InvalidRequestError, match="vocabulary"):
        engine.extend("h", [300], final=False)
    with pytest.raises(InvalidRequestError, match="nothing to generate"):
        engine.extend("h", [1, 2, 3, 4, 5], final=True)
    engine.extend("h", [7], final=True)  # still usable after refusals
    assert len(run_all(engine)["h"]) == 4


def test_abort_and_release_in_every_state():
    engine = make_engine()
    rng = random.Random(31)
    for rid, mode in (("w", Mode.GENERATE), ("r", Mode.GENERATE), ("h", Mode.HOLD), ("p", Mode.PREFILL)):
        engine.add_request(rid, random_prompt(rng, 40), greedy(30), mode=mode)
    engine.step()
    engine.step()
    assert engine.stats().held == 1 and engine.stats().prefilled == 1
    assert engine.abort("r") and engine.abort("h") and engine.abort("p")
    assert not engine.abort("r") and not engine.abort("unknown")
    engine.release("unknown")
    engine.release("w")  # release does not stop a generating request
    assert "w" in engine.seqs
    engine.add_request("w2", random_prompt(rng, 10), greedy(3))
    engine.abort("w2")  # still waiting
    outs = run_all(engine)
    assert set(outs) == {"w"} and [o.index for o in outs["w"]] == list(range(2, 30))
    assert engine.stats().used_blocks == 0


def test_stop_string_eos_and_max_model_len():
    engine = make_engine()
    prompt = random_prompt(random.Random(32), 20)
    ref = dense_greedy(engine, prompt, 30)
    decode = engine.tokenizer.decode
    text = decode(ref)
    start = next(i for i in range(8, len(text) - 2) if "\ufffd" not in text[i : i + 2])
    stop = text[start : start + 2]
    expect = next(k for k in range(1, 31) if stop in decode(ref[:k]))  # the token completing it
    engine.add_request("s", prompt, greedy(30, stop=[stop]))
    outs = run_all(engine)["s"]
    assert outs[-1].finish_reason is FinishReason.STOP and tokens_of(outs) == ref[:expect]
    # EOS: make the 6th greedy token the EOS id (config tweak, same model).
    engine.model_config.eos_token_ids = (ref[5],)
    first = ref.index(ref[5])
    engine.add_request("e", prompt, SamplingParams(max_tokens=30))
    outs = run_all(engine)["e"]
    assert outs[-1].finish_reason is FinishReason.STOP and len(outs) == first + 1
    engine.add_request("i", prompt, SamplingParams(max_tokens=30, ignore_eos=True))
    assert len(run_all(engine)["i"]) == 30
    # max_model_len bounds prompt + output.
    short = make_engine(max_model_len=32)
    short.add_request("m", prompt, greedy(100))
    outs = run_all(short)["m"]
    assert outs[-1].finish_reason is FinishReason.LENGTH and len(prompt) + len(outs) == 32


def test_sampling_params_wire_roundtrip():
    p = SamplingParams(temperature=0.7, top_p=0.9, top_k=20, max_tokens=5, stop=["\n"], seed=3)
    assert SamplingParams.from_dict(p.to_dict()) == p
    assert SamplingParams.from_dict({"max_tokens": 3, "stop": None, "extra": 1}) == SamplingParams(max_tokens=3)


def test_unseeded_requests_get_a_seed_and_sample():
    engine = make_engine()
    params = SamplingParams(temperature=2.0, max_tokens=20, ignore_eos=True)
    for i in range(2):
        engine.add_request(f"u{i}", [1, 2, 3, 4], params)
    outs = run_all(engine)
    assert tokens_of(outs["u0"]) != tokens_of(outs["u1"])
