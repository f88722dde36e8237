"""Tool calls read from outputs, whole and streamed (services/router/api/tool_parsers.py and
tool_stream.py): vLLM's hermes and llama3_json formats and the forced choices; a streamed
output split anywhere gives the calls and content of the whole one."""

from __future__ import annotations

import json

import pytest

from services.router.api.tool_parsers import Call, Parsed, finish_reason, parse_output
from services.router.api.tool_stream import ToolStream, json_end, tag_overlap

WEATHER = {"city": "Paris", "days": [1, 2], "note": 'say "hi" {not a brace}'}
HERMES = (
    "Let me check.\n<tool_call>\n"
    + json.dumps({"name": "get_weather", "arguments": WEATHER})
    + "\n</tool_call>\n<tool_call>\n"
    + json.dumps({"name": "get_time", "arguments": {"tz": "CET"}})
    + "\n</tool_call>"
)
LLAMA = (
    '<|python_tag|>{"name": "get_weather", "parameters": '
    + json.dumps(WEATHER)
    + '}; {"name": "get_time", "arguments": {"tz": "CET"}}'
)
REQUIRED = json.dumps(
    [{"name": "get_weather", "parameters": WEATHER}, {"name": "get_time", "parameters": {"tz": "CET"}}]
)
NAMED = json.dumps(WEATHER)
BOTH = [Call("get_weather", json.dumps(WEATHER, ensure_ascii=False)), Call("get_time", '{"tz": "CET"}')]


def test_hermes_calls_and_the_content_before_them():
    assert parse_output("auto", "hermes", HERMES) == Parsed("Let me check.\n", BOTH)


def test_hermes_unclosed_last_call_is_read_and_no_content_is_none():
    text = '<tool_call>{"name": "get_time", "arguments": {"tz": "CET"}}'
    assert parse_output("auto", "hermes", text) == Parsed(None, [BOTH[1]])


@pytest.mark.parametrize(
    "text",
    [
        "plain text, no call",
        '<tool_call>{"name": "f", "arguments": {"a": 1</tool_call>',  # bad JSON
        '<tool_call>{"name": "f"}</tool_call>',  # no arguments
        "<tool_call>[1, 2]</tool_call>",
    ],
)
def test_hermes_that_does_not_parse_is_plain_content(text):
    assert parse_output("auto", "hermes", text) == Parsed(text, [])


def test_llama3_json_calls_with_parameters_or_arguments():
    assert parse_output("auto", "llama3_json", LLAMA) == Parsed(None, BOTH)


@pytest.mark.parametrize("text", ["no json here", '{"name": "f"}', '{"a": 1}'])
def test_llama3_json_without_a_call_is_plain_content(text):
    assert parse_output("auto", "llama3_json", text) == Parsed(text, [])


def test_required_is_a_json_array_of_name_and_parameters():
    assert parse_output("required", "hermes", REQUIRED) == Parsed("", BOTH)
    cut = REQUIRED[:20]  # (max_tokens ended it): content, no calls
    assert parse_output("required", "hermes", cut) == Parsed(cut, [])


def test_named_output_is_the_arguments_themselves():
    assert parse_output("named", "hermes", NAMED, "get_weather") == Parsed("", [Call("get_weather", NAMED)])


def test_none_is_never_parsed():
    assert parse_output("none", "hermes", HERMES) == Parsed(HERMES, [])


@pytest.mark.parametrize(
    "choice, called, reason, want",
    [
        ("auto", True, "stop", "tool_calls"),
        ("auto", True, "length", "tool_calls"),
        ("auto", False, "stop", "stop"),
        ("required", True, "stop", "tool_calls"),
        ("required", True, "length", "length"),
        ("named", True, "stop", "stop"),  # OpenAI's: a named call ends with "stop"
        ("none", False, "length", "length"),
    ],
)
def test_finish_reason_follows_vllm(choice, called, reason, want):
    assert finish_reason(choice, called, reason) == want


@pytest.mark.parametrize(
    "choice, called, reason, want",
    [
        ("auto", True, "stop", "tool_calls"),
        ("auto", True, "length", "length"),  # vLLM's stream: only an output that ended normally
        ("required", True, "stop", "tool_calls"),
        ("named", True, "stop", "stop"),
        ("auto", False, "stop", "stop"),
    ],
)
def test_a_streams_finish_reason_follows_vllms_stream(choice, called, reason, want):
    assert finish_reason(choice, called, reason, streamed=True) == want


def test_json_end_skips_brackets_in_strings_and_escapes():
    text = '{"a": "}\\"]", "b": [1, {"c": 2}]} tail'
    assert text[: json_end(text, 0)] == '{"a": "}\\"]", "b": [1, {"c": 2}]}'
    assert json_end(text[:-10], 0) is None


def test_tag_overlap():
    assert tag_overlap("abc <tool_", "<tool_call>") == 6
    assert tag_overlap("abc", "<tool_call>") == 0


# ---- streaming: every split point gives the whole output's result ----------------------------
def stream(pieces: list[str], choice: str, parser: str = "hermes", named: str | None = None) -> Parsed:
    """Reassemble a stream's deltas as a client does: content joined, each call's name from
    its first delta and its arguments' fragments joined, by index."""
    s = ToolStream(choice, parser, named)
    content, calls, ids = "", {}, {}
    for k, piece in enumerate(pieces):
        delta = s.feed(piece, final=k == len(pieces) - 1)
        content += delta.get("content", "")
        for entry in delta.get("tool_calls", []):
            i = entry["index"]
            if i not in calls:
                assert entry["id"].startswith("chatcmpl-tool-") and entry["type"] == "function"
                assert entry["function"]["name"], "a call's first delta names it"
                calls[i], ids[i] = [entry["function"]["name"], ""], entry["id"]
            else:
                assert "id" not in entry and "name" not in entry["function"]
            calls[i][1] += entry["function"].get("arguments", "")
    assert sorted(calls) == list(range(len(calls)))
    return Parsed(content or None, [Call(n, a) for n, a in (calls[i] for i in sorted(calls))])


def same_calls(streamed: Parsed, whole: Parsed) -> None:
    assert [c.name for c in streamed.calls] == [c.name for c in whole.calls]
    assert [json.loads(c.arguments) for c in streamed.calls] == [json.loads(c.arguments) for c in whole.calls]


CASES = [
    ("auto", "hermes", None, HERMES),
    ("auto", "hermes", None, "Just words, <tool and no call at all <tool_"),
    ("auto", "llama3_json", None, LLAMA),
    ("auto", "llama3_json", None, '{"name": "get_time", "arguments": {"tz": "CET"}}'),
    ("auto", "llama3_json", None, "Words, not JSON."),
    ("required", "hermes", None, REQUIRED),
    ("named", "hermes", "get_weather", NAMED),
]


@pytest.mark.parametrize("choice, parser, named, text", CASES)
def test_every_split_in_two_streams_the_whole_outputs_calls(choice, parser, named, text):
    whole = parse_output(choice, parser, text, named)
    for cut in range(len(text) + 1):
        streamed = stream([text[:cut], text[cut:]], choice, parser, named)
        same_calls(streamed, whole)
        assert (streamed.content or None) == (whole.content or None), cut


@pytest.mark.parametrize("choice, parser, named, text", CASES)
def test_character_by_character(choice, parser, named, text):
    whole = parse_output(choice, parser, text, named)
    streamed = stream(list(text), choice, parser, named)
    same_calls(streamed, whole)
    assert (streamed.content or None) == (whole.content or None)


def test_a_call_name_is_sent_whole_and_arguments_in_fragments():
    s = ToolStream("auto", "hermes")
    assert s.feed('<tool_call>{"name": "get_') == {}
    first = s.feed('time", "arguments": {"tz"')
    (entry,) = first["tool_calls"]
    assert entry["function"] == {"name": "get_time", "arguments": '{"tz"'}
    assert s.feed(': "CET"}}')["tool_calls"] == [{"index": 0, "function": {"arguments": ': "CET"}'}}]
    assert s.called


def test_parallel_tool_calls_false_streams_only_the_first_call():
    s = ToolStream("required", parallel=False)
    delta = s.feed(REQUIRED, final=True)
    assert {e["index"] for e in delta["tool_calls"]} == {0}
