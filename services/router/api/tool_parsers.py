"""Tool calls read from a whole output, as vLLM's tool parsers read them:

- `hermes` (Hermes 2 Pro, Qwen2.5, Qwen3, SmolLM): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
  one or more times (the last one may be unclosed); the text before the first is the content;
- `llama3_json` (Llama 3.x): JSON objects `{"name": ..., "parameters"|"arguments": {...}}`,
  optionally after `<|python_tag|>`, separated by `;`; no content;
- a forced choice: `required` outputs a JSON array of `{"name", "parameters"}`, a named
  choice outputs the arguments object itself.

An output that does not parse is plain content (vLLM's fallback). Arguments are JSON text,
re-serialized from the parsed value (`ensure_ascii=False`), as vLLM returns them.
Pure functions: no I/O."""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

HERMES_START, HERMES_END = "<tool_call>", "</tool_call>"
HERMES_CALL = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)
PYTHON_TAG = "<|python_tag|>"


@dataclass(frozen=True)
class Call:
    name: str
    arguments: str  # JSON text


@dataclass(frozen=True)
class Parsed:
    content: str | None
    calls: list[Call]


def call_id() -> str:
    """A tool call's id, in vLLM's form."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def _arguments(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def _plain(text: str) -> Parsed:
    return Parsed(text, [])


def parse_hermes(text: str) -> Parsed:
    if HERMES_START not in text:
        return _plain(text)
    try:
        calls = []
        for closed, unclosed in HERMES_CALL.findall(text):
            obj = json.loads(closed or unclosed)
            calls.append(Call(obj["name"], _arguments(obj["arguments"])))
    except (ValueError, KeyError, TypeError):
        return _plain(text)
    content = text[: text.find(HERMES_START)]
    return Parsed(content or None, calls)


def parse_llama3_json(text: str) -> Parsed:
    if PYTHON_TAG not in text and "{" not in text:
        return _plain(text)
    decoder, calls, end = json.JSONDecoder(), [], -1
    for match in re.finditer(r"\{", text):
        start = match.start()
        if start <= end:
            continue  # inside an object already read
        try:
            obj, length = decoder.raw_decode(text[start:])
            end = start + length
            args = obj["arguments"] if "arguments" in obj else obj["parameters"]
            calls.append(Call(obj["name"], _arguments(args)))
        except (ValueError, KeyError, TypeError):
            return _plain(text)
    return Parsed(None, calls) if calls else _plain(text)


def parse_required(text: str) -> Parsed:
    """`tool_choice: "required"`: the grammar made it a JSON array of {name, parameters}."""
    try:
        calls = [Call(c["name"], _arguments(c["parameters"])) for c in json.loads(text)]
    except (ValueError, KeyError, TypeError):
        return _plain(text)
    return Parsed("", calls) if calls else _plain(text)


def parse_named(name: str, text: str) -> Parsed:
    """A named choice: the grammar made the output the arguments object (kept as it came, as
    vLLM returns it)."""
    return Parsed("", [Call(name, text)])


PARSERS = {"hermes": parse_hermes, "llama3_json": parse_llama3_json}


def parse_output(choice: str, parser: str, text: str, named: str | None = None) -> Parsed:
    """The content and calls of a whole output under a tool choice (none | auto | required | named)."""
    if choice == "named":
        assert named is not None
        return parse_named(named, text)
    if choice == "required":
        return parse_required(text)
    if choice == "auto":
        return PARSERS[parser](text)
    return _plain(text)


def finish_reason(choice: str, called: bool, reason: str, streamed: bool = False) -> str:
    """vLLM's (and OpenAI's): `tool_calls` when auto called a tool, or required ended its
    calls normally; a named call ends with the model's own reason (`stop`). A stream says
    `tool_calls` only for an output that ended normally (vLLM's stream generator)."""
    if streamed:
        return "tool_calls" if called and choice != "named" and reason == "stop" else reason
    if called and (choice == "auto" or (choice == "required" and reason == "stop")):
        return "tool_calls"
    return reason
