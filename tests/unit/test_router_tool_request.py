"""A chat request's tools as the router reads them (services/router/api/tool_request.py): the
checks (a 400 naming the field, as vLLM's), the output constraint of each tool choice (vLLM's
get_json_schema_from_tools), the parser a template implies, and the whole message a choice
gets back (whole_response.chat_message)."""

from __future__ import annotations

import json

import pytest

from services.router.api.openai_request import parse_request
from services.router.api.tool_request import ToolMode, default_parser, tool_mode_of, tool_schema
from services.router.api.whole_response import chat_message
from services.router.core.errors import APIError
from shared.model.tokenizer import ByteTokenizer

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"$ref": "#/$defs/unit"}},
            "required": ["city"],
            "$defs": {"unit": {"enum": ["c", "f"]}},
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}  # no parameters
TOOLS = [WEATHER, TIME]


def mode(choice, tools=TOOLS, **extra) -> ToolMode | None:
    return tool_mode_of({"tools": tools, "tool_choice": choice, **extra}, "hermes")


def test_tools_default_to_auto_and_none_parses_nothing():
    assert tool_mode_of({"tools": TOOLS}, "hermes").choice == "auto"
    assert not mode("none").parses and mode("auto").parses
    assert tool_mode_of({}, "hermes") is None and tool_mode_of({"tool_choice": "none"}, "hermes") is None


@pytest.mark.parametrize(
    "payload, param",
    [
        ({"tools": []}, "tools"),  # vLLM and OpenAI refuse an empty list
        ({"tools": {"type": "function"}}, "tools"),
        ({"tools": [{"type": "code", "function": {"name": "f"}}]}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]}, "tools"),
        ({"tools": [TIME, TIME]}, "tools"),
        ({"tool_choice": "auto"}, "tool_choice"),  # a choice without tools
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {}}}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ],
)
def test_bad_tools_are_a_400_naming_the_field(payload, param):
    with pytest.raises(APIError) as e:
        tool_mode_of(payload, "hermes")
    assert e.value.status == 400 and e.value.param == param


def test_auto_and_none_put_no_constraint():
    assert tool_schema(mode("auto")) is None and tool_schema(mode("none")) is None


def test_named_is_the_functions_parameters_and_an_empty_object_without_them():
    named = {"type": "function", "function": {"name": "get_weather"}}
    assert tool_schema(mode(named)) == WEATHER["function"]["parameters"]
    empty = {"type": "function", "function": {"name": "get_time"}}
    assert tool_schema(mode(empty)) == {"type": "object", "properties": {}}


def test_required_is_an_array_of_name_and_parameters_with_defs_at_the_top():
    schema = tool_schema(mode("required"))
    weather_params = {k: v for k, v in WEATHER["function"]["parameters"].items() if k != "$defs"}
    assert schema == {
        "type": "array",
        "minItems": 1,
        "items": {
            "type": "object",
            "anyOf": [
                {
                    "properties": {
                        "name": {"type": "string", "enum": ["get_weather"]},
                        "parameters": weather_params,
                    },
                    "required": ["name", "parameters"],
                },
                {
                    "properties": {
                        "name": {"type": "string", "enum": ["get_time"]},
                        "parameters": {"type": "object", "properties": {}},
                    },
                    "required": ["name", "parameters"],
                },
            ],
        },
        "$defs": {"unit": {"enum": ["c", "f"]}},
    }
    assert "$defs" in WEATHER["function"]["parameters"]  # the request's own tools are left as they were


def test_required_with_two_different_defs_of_one_name_is_a_400():
    other = json.loads(json.dumps(WEATHER).replace('"c", "f"', '"k"').replace("get_weather", "other"))
    with pytest.raises(APIError) as e:
        tool_schema(mode("required", tools=[WEATHER, other]))
    assert e.value.param == "tools"


def test_the_parser_a_template_teaches():
    assert default_parser(None) == "hermes"
    assert default_parser("... <tool_call>\n{{ tool_call | tojson }}\n</tool_call> ...") == "hermes"
    assert default_parser("{%- if message.role == 'ipython' %} <|python_tag|>") == "llama3_json"


# ---- through parse_request ------------------------------------------------------------------
def parse(body: dict):
    raw = json.dumps({"messages": [{"role": "user", "content": "hi"}], **body}).encode()
    return parse_request(
        raw, True, model_id="m", tokenizer=ByteTokenizer(), max_model_len=512, max_tokens_default=8
    )


def test_a_forced_choice_constrains_the_output_to_its_schema():
    parsed = parse({"tools": TOOLS, "tool_choice": "required"})
    want = {"kind": "json", "spec": tool_schema(parsed.tools), "disable_any_whitespace": True}
    assert parsed.params.structured == want
    assert parsed.structured_from == "tool_choice"
    assert parse({"tools": TOOLS}).params.structured is None


def test_a_forced_choice_and_another_constraint_is_a_400():
    with pytest.raises(APIError) as e:
        parse({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}})
    assert e.value.param == "tool_choice"


def test_parameters_that_do_not_compile_are_a_400_naming_tools():
    bad = {"type": "function", "function": {"name": "f", "parameters": {"type": "no-such-type"}}}
    with pytest.raises(APIError) as e:
        parse({"tools": [bad], "tool_choice": "required"})
    assert e.value.param == "tools"


def test_legacy_functions_are_refused_naming_them():
    for field, value in (("functions", [{"name": "f"}]), ("function_call", {"name": "f"})):
        with pytest.raises(APIError) as e:
            parse({field: value})
        assert e.value.param == field


# ---- the message a choice gets back ----------------------------------------------------------
CALL = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'


def test_auto_message_has_the_calls_and_no_content():
    message, reason = chat_message(mode("auto"), CALL, "stop")
    (call,) = message["tool_calls"]
    assert message["content"] is None and reason == "tool_calls"
    assert call["type"] == "function" and call["id"].startswith("chatcmpl-tool-")
    assert call["function"] == {"name": "get_time", "arguments": "{}"}


def test_auto_without_a_call_is_plain_text():
    assert chat_message(mode("auto"), "Hello.", "stop") == (
        {"role": "assistant", "content": "Hello."},
        "stop",
    )


def test_none_and_no_tools_leave_the_text_alone():
    assert chat_message(mode("none"), CALL, "stop")[0] == {"role": "assistant", "content": CALL}
    assert chat_message(None, CALL, "length")[1] == "length"


def test_named_and_required_messages():
    named = mode({"type": "function", "function": {"name": "get_weather"}})
    message, reason = chat_message(named, '{"city": "Oslo"}', "stop")
    assert message["content"] == "" and reason == "stop"
    assert message["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    text = '[{"name": "get_time", "parameters": {}}, {"name": "get_weather", "parameters": {"city": "Rome"}}]'
    message, reason = chat_message(mode("required"), text, "stop")
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_time", "get_weather"]
    assert reason == "tool_calls"


def test_parallel_tool_calls_false_keeps_the_first_call():
    text = '[{"name": "get_time", "parameters": {}}, {"name": "get_weather", "parameters": {"city": "Rome"}}]'
    message, _ = chat_message(mode("required", parallel_tool_calls=False), text, "stop")
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_time"]
