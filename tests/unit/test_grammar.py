"""Constrained decoding on a real engine: JSON schemas, any JSON object, regexes, choices and
EBNF grammars give output that parses and validates; the matcher state is rebuilt from the
token IDs a continued request comes with (a handoff, a move), so the output is the single
engine's; output the grammar cannot take is refused."""

from __future__ import annotations

import json
import re

import jsonschema_rs
import pytest

from shared.engine import InvalidRequestError, SamplingParams
from shared.engine.grammar import check_spec, choice_grammar
from tests.engine_util import make_engine, run_all, tokens_of

PROMPT = list(b"Give me JSON: ")
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z]{1,6}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
COMPACT = {"kind": "json", "spec": SCHEMA, "disable_any_whitespace": True}


def run(params: SamplingParams, prompt=PROMPT, engine=None, num_prompt_tokens=None) -> list[int]:
    engine = engine or make_engine()
    engine.add_request("r", prompt, params, num_prompt_tokens=num_prompt_tokens)
    return tokens_of(run_all(engine)["r"])


def text(tokens: list[int]) -> str:
    return bytes(t for t in tokens if t < 256).decode("utf-8", errors="strict")


def params(structured: dict, **kw) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.0, "max_tokens": 120, "structured": structured, **kw})


@pytest.mark.parametrize("sampled", [False, True])
def test_json_schema_output_validates(sampled):
    kw = {"temperature": 0.9, "seed": 5} if sampled else {}
    out = run(params(COMPACT, **kw))
    assert out[-1] == 257  # ended by the EOS the grammar allowed once the object closed
    value = json.loads(text(out))
    jsonschema_rs.validate(SCHEMA, value)


def test_unconstrained_output_is_not_json():
    """The preset model writes no JSON by itself: the constraint is what makes it."""
    out = run(SamplingParams(temperature=0.0, max_tokens=40))
    with pytest.raises(ValueError):
        json.loads(bytes(t for t in out if t < 256).decode(errors="replace"))


def test_json_object_regex_choice_grammar():
    assert re.fullmatch(
        r"[a-z]{3}-[0-9]{2}", text(run(params({"kind": "regex", "spec": "[a-z]{3}-[0-9]{2}"}))[:-1])
    )
    assert text(run(params({"kind": "choice", "spec": ["yes", "no", "maybe"]}))[:-1]) in (
        "yes",
        "no",
        "maybe",
    )
    ebnf = 'root ::= "(" digit digit? digit? ")" ("," " "? word)?\ndigit ::= [0-9]\nword ::= [a-z] [a-z]?'
    got = text(run(params({"kind": "grammar", "spec": ebnf}, max_tokens=30))[:-1])
    assert re.fullmatch(r"\(\d{1,3}\)(, ?[a-z]{1,2})?", got)
    # json_object: the random preset writes strings forever; a bias toward quotes and braces
    # lets it close them (the grammar alone decides what is valid).
    bias = {ord(c): 12.0 for c in '"}'} | {t: -100.0 for t in b" \t\n\r"}
    out = run(params({"kind": "json_object"}, max_tokens=60, logit_bias=bias))
    assert out[-1] == 257 and isinstance(json.loads(text(out)), dict)


@pytest.mark.parametrize("k", [1, 7, 20])
def test_continuing_from_token_ids_gives_the_same_output(k):
    """What a relay or MD does after a handoff, and an instance after a move."""
    for kw in ({}, {"temperature": 0.9, "seed": 8, "repetition_penalty": 1.2}):
        whole = run(params(COMPACT, **kw))
        assert k < len(whole)
        rest = run(params(COMPACT, **kw), PROMPT + whole[:k], num_prompt_tokens=len(PROMPT))
        assert whole[:k] + rest == whole


def test_a_held_request_extended_by_token_ids_takes_them_into_the_grammar():
    """MD's way: the prompt held, then the relay's tokens appended by extend()."""
    from shared.engine import Mode

    whole = run(params(COMPACT))
    engine = make_engine()
    engine.add_request("r", PROMPT, params(COMPACT), mode=Mode.HOLD)
    run_all(engine)
    engine.extend("r", whole[:5], final=False)
    run_all(engine)
    engine.extend("r", whole[5:9], final=True)
    assert whole[:9] + tokens_of(run_all(engine)["r"]) == whole


def test_output_the_grammar_does_not_allow_is_refused():
    with pytest.raises(InvalidRequestError, match="grammar"):
        run(params({"kind": "choice", "spec": ["yes"]}), PROMPT + list(b"no"), num_prompt_tokens=len(PROMPT))


@pytest.mark.parametrize(
    "structured",
    [
        {"kind": "json", "spec": {"type": "nope"}},
        {"kind": "regex", "spec": "(unclosed"},
        {"kind": "grammar", "spec": "root ::= missing_rule"},
        {"kind": "choice", "spec": []},
        {"kind": "xml"},
    ],
)
def test_bad_specs_are_refused(structured):
    with pytest.raises(InvalidRequestError):
        check_spec(structured)


def test_choice_grammar_escapes_quotes():
    assert choice_grammar(['say "hi"', "a\\b"]) == 'root ::= "say \\"hi\\"" | "a\\\\b"'


def test_a_checkpoint_tokenizer_gets_its_own_vocabulary(tmp_path):
    """A byte-level BPE checkpoint: valid JSON, as its tokenizer encodes it, fits the grammar."""
    from shared.engine.grammar import Grammars
    from shared.model.tokenizer import load_tokenizer
    from tests.unit.test_chat_template import qwen

    tokenizer = load_tokenizer(qwen(tmp_path), eos_token_id=0)
    eos = tokenizer.backend.token_to_id("<|im_end|>")
    grammars = Grammars(tokenizer, tokenizer.vocab_size, [eos])
    state = grammars.matcher(
        {"kind": "json", "spec": {"type": "object", "properties": {"a": {"type": "integer"}}}}
    )
    state.catch_up(tokenizer.encode('{"a": 12}', add_special_tokens=False) + [eos])
    assert state.matcher.is_terminated()
    bad = grammars.matcher({"kind": "regex", "spec": "[0-9]+"})
    with pytest.raises(InvalidRequestError):
        bad.catch_up(tokenizer.encode("x1", add_special_tokens=False))
