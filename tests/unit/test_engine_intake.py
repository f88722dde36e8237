"""Request intake: bad requests and extends are refused with InvalidRequestError, the engine serves on."""

from __future__ import annotations

import random

import pytest

from shared.engine import EngineError, InvalidRequestError, Mode, SamplingParams
from tests.engine_util import greedy, make_engine, random_prompt, run_all

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
