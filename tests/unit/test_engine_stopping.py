"""When a request ends: the finish_reason rule on its own, then in the engine (step() and
finish_reason(rid), which a prefill calls after its first token)."""

from __future__ import annotations

import random

from shared.engine import FinishReason, Mode, SamplingParams
from shared.engine.stopping import finish_reason
from shared.model import ByteTokenizer
from tests.engine_util import dense_greedy, greedy, make_engine, random_prompt, run_all, tokens_of

EOS_IDS = (257, 10, 13)  # several ids end generation (Llama 3 has three)
PROMPT = list(b"the prompt ")


def _reason(output: bytes | list[int], params: SamplingParams, max_model_len: int = 100):
    ids = PROMPT + list(output)
    return finish_reason(
        ids,
        len(PROMPT),
        params,
        eos_token_ids=EOS_IDS,
        decode=ByteTokenizer().decode,
        max_model_len=max_model_len,
    )


def test_every_eos_id_stops_unless_ignored():
    params = SamplingParams(max_tokens=10)
    for eos in EOS_IDS:
        assert _reason(list(b"ab") + [eos], params) is FinishReason.STOP
        assert _reason(list(b"ab") + [eos], SamplingParams(max_tokens=10, ignore_eos=True)) is None
    assert _reason(b"abc", params) is None
    assert _reason(list(b"ab") + [256], params) is None  # BOS is no EOS
    assert _reason(b"", params) is None  # nothing generated yet: the prompt's last token is no EOS


def test_stop_string_spanning_two_tokens():
    params = SamplingParams(max_tokens=10, stop=["xy"])
    assert _reason(b"abx", params) is None
    assert _reason(b"abxy", params) is FinishReason.STOP
    accent = SamplingParams(max_tokens=10, stop=["é"])  # two byte tokens: 0xC3 0xA9
    assert _reason("aé".encode()[:-1], accent) is None
    assert _reason("aé".encode(), accent) is FinishReason.STOP
    # The prompt never counts: "x" in the prompt, "y" generated.
    ids = list(b"prompt x") + list(b"y")
    kw = dict(eos_token_ids=EOS_IDS, decode=ByteTokenizer().decode, max_model_len=100)
    assert finish_reason(ids, len(ids) - 1, params, **kw) is None


def test_length_limits_and_stop_before_length():
    assert _reason(b"abc", SamplingParams(max_tokens=3)) is FinishReason.LENGTH
    assert _reason(b"ab", SamplingParams(max_tokens=3)) is None
    n = len(PROMPT) + 2
    assert _reason(b"ab", SamplingParams(max_tokens=10), max_model_len=n) is FinishReason.LENGTH
    assert _reason(b"ab", SamplingParams(max_tokens=10), max_model_len=n + 1) is None
    # Both at once: the stop condition is the reason.
    assert _reason(b"a\n", SamplingParams(max_tokens=2)) is FinishReason.STOP
    assert _reason(b"xy", SamplingParams(max_tokens=2, stop=["xy"])) is FinishReason.STOP


def test_stop_string_eos_and_max_model_len_in_step():
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
    # EOS: make the 6th greedy token one of several EOS ids (config tweak, same model).
    engine.model_config.eos_token_ids = (257, ref[5])
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


def test_prefill_is_told_the_same_rule_for_its_first_token():
    engine = make_engine()
    prompt = random_prompt(random.Random(35), 24)
    token = dense_greedy(engine, prompt, 1)[0]
    cases = [  # (eos ids, max_tokens) -> how a generating request ends at its first token
        ((257,), 5, None),
        ((257, token), 5, FinishReason.STOP),  # an EOS id other than the tokenizer's
        ((257,), 1, FinishReason.LENGTH),
    ]
    for i, (eos_ids, max_tokens, expected) in enumerate(cases):
        engine.model_config.eos_token_ids = eos_ids
        params = SamplingParams(max_tokens=max_tokens)
        engine.add_request(f"p{i}", prompt, params, mode=Mode.PREFILL)
        engine.add_request(f"g{i}", prompt, params)
        outs = engine.step()
        gen = next(o for o in outs if o.rid == f"g{i}")
        pre = next(o for o in outs if o.rid == f"p{i}")
        assert gen.finish_reason == expected and gen.ends is None  # step() decided, for the generating twin
        assert pre.finish_reason is FinishReason.PREFILLED and pre.ends == expected  # and told the prefill
        engine.release(f"p{i}")
        engine.abort(f"g{i}")
