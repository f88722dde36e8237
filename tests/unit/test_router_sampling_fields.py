"""vLLM's sampling and chat fields as the router reads them: what reaches SamplingParams, the
400s that name a field, and chat messages the template sees (developer role, assistant tool
calls with null content, chat_template_kwargs)."""

from __future__ import annotations

import json

import pytest

from services.router.api.detokenizer import Detokenizer
from services.router.api.openai_request import parse_request
from services.router.core.errors import APIError
from shared.model.tokenizer import ByteTokenizer, load_tokenizer
from tests.unit.test_chat_template import parse_chat, qwen, reference

TOK = ByteTokenizer()


def parse(body: dict, chat: bool = False):
    base = {"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"}
    raw = json.dumps({**base, **body}).encode()
    return parse_request(raw, chat, model_id="m", tokenizer=TOK, max_model_len=512, max_tokens_default=8)


def refused(body: dict, chat: bool = False) -> APIError:
    with pytest.raises(APIError) as e:
        parse(body, chat)
    assert e.value.status == 400
    return e.value


@pytest.mark.parametrize("chat", [False, True])
def test_fields_reach_the_sampling_params(chat):
    p = parse(
        {
            "presence_penalty": 0.5,
            "frequency_penalty": -0.25,
            "repetition_penalty": 1.2,
            "min_p": 0.1,
            "min_tokens": 3,
            "top_k": -1,
            "logit_bias": {"65": 5, "66": -300},
            "stop_token_ids": [10, 11],
            "prompt_logprobs": 2,
        },
        chat,
    ).params
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.5, -0.25, 1.2)
    assert (p.min_p, p.min_tokens, p.top_k, p.stop_token_ids) == (0.1, 3, -1, [10, 11])
    assert p.logit_bias == {65: 5.0, 66: -100.0}  # clamped to [-100, 100] as vLLM does
    assert p.prompt_logprobs == 2
    p.validate()


@pytest.mark.parametrize(
    "body, param",
    [
        ({"logit_bias": {"258": 1}}, "logit_bias"),  # out of the vocabulary
        ({"logit_bias": {"a": 1}}, "logit_bias"),
        ({"stop_token_ids": [300]}, "stop_token_ids"),
        ({"min_tokens": 9}, "min_tokens"),  # more than max_tokens (8)
        ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
        ({"no_such_field": 1}, "no_such_field"),
        ({"guided_json": {"type": "object", "required": 3}}, "guided_json"),
        ({"use_beam_search": True}, "use_beam_search"),
    ],
)
def test_a_refused_field_is_a_400_naming_it(body, param):
    err = refused(body)
    assert err.param == param and f"'{param}'" in str(err)


@pytest.mark.parametrize("body", [{"presence_penalty": 2.5}, {"min_p": -0.1}, {"repetition_penalty": 0}])
def test_out_of_range_values_are_a_400_naming_the_field(body):
    (name,) = body
    assert name in str(refused(body))


def test_accepted_bookkeeping_fields_change_nothing():
    assert parse({"user": "u", "metadata": {"k": "v"}}).params == parse({}).params


def test_chat_developer_role_tool_calls_and_template_kwargs(tmp_path):
    path = qwen(tmp_path)
    tokenizer = load_tokenizer(path, eos_token_id=0, with_chat_template=True)
    call = {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}
    body = {
        "messages": [
            {"role": "developer", "content": "Be brief."},
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "12 C"},
        ],
        "chat_template_kwargs": {"enable_thinking": False, "messages": "never replaces them"},
    }
    ids = parse_chat(tokenizer, body).prompt_ids
    # What transformers renders for the same conversation, the developer turn as the system one
    # and the call's arguments as an object (as vLLM hands them to templates).
    as_template = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{**call, "function": {"name": "weather", "arguments": {"city": "Oslo"}}}],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "12 C"},
    ]
    want = reference(path, as_template, add_generation_prompt=True, enable_thinking=False)
    assert ids == tokenizer.encode(want, add_special_tokens=False)
    assert want.endswith("<think>\n\n</think>\n\n")  # enable_thinking: false reached the template


def test_null_content_only_with_tool_calls():
    err = refused({"messages": [{"role": "user", "content": None}]}, chat=True)
    assert "content" in str(err)


def test_stop_strings_wait_for_min_tokens_in_the_router():
    detok = Detokenizer(TOK, ["ab"], min_tokens=3)
    assert detok.add(list(b"xab")) == "xab" and not detok.stopped  # ends within the first 3 tokens
    assert detok.add(list(b"c")) == "c" and not detok.stopped
    detok = Detokenizer(TOK, ["ab"], min_tokens=3)
    detok.add(list(b"xa"))
    detok.add(list(b"ab"))  # ends with the 4th token
    assert detok.stopped and detok.emitted == "xa"


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize(
    "body, want",
    [
        ({"response_format": {"type": "json_object"}}, {"kind": "json_object"}),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}},
            {"kind": "json", "spec": SCHEMA},
        ),
        ({"response_format": {"type": "text"}}, None),
        ({"structured_outputs": {"regex": "[a-z]+"}}, {"kind": "regex", "spec": "[a-z]+"}),
        (
            {"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}},
            {"kind": "json", "spec": SCHEMA, "disable_any_whitespace": True},
        ),
        ({"guided_choice": ["yes", "no"]}, {"kind": "choice", "spec": ["yes", "no"]}),
        ({"guided_grammar": 'root ::= "a"'}, {"kind": "grammar", "spec": 'root ::= "a"'}),
        ({"guided_json": SCHEMA, "guided_decoding_backend": "xgrammar"}, {"kind": "json", "spec": SCHEMA}),
    ],
)
def test_structured_output_fields_become_one_constraint(body, want):
    parsed = parse(body)
    assert parsed.params.structured == want


@pytest.mark.parametrize(
    "body, param",
    [
        ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}}},
            "response_format",
        ),
        ({"structured_outputs": {"regex": "(a"}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
        ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs"),
        ({"response_format": {"type": "structural_tag"}}, "response_format"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_decoding_backend": "outlines"}, "guided_decoding_backend"),
    ],
)
def test_bad_structured_output_is_a_400_naming_the_field(body, param):
    assert refused(body).param == param


def test_an_unsupported_response_format_type_says_so():
    assert refused({"response_format": {"type": "structural_tag"}}).code == "unsupported_parameter"
