"""A chat request's `tools` and `tool_choice`, as vLLM's OpenAI server takes them: checked (a
400 naming the field), the tools as the chat template gets them, and the output constraint a
forced choice puts on the output (vLLM's get_json_schema_from_tools):

- `none`: no constraint, nothing parsed (the template still sees the tools, as in vLLM);
- `auto` (the default with tools): no constraint; the output is parsed for calls;
- `required`: a JSON array of at least one `{"name": <a tool's name>, "parameters": <its
  parameters' schema>}`;
- named (`{"type": "function", "function": {"name": ...}}`): the tool's parameters' schema.

Pure functions: no I/O."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from ..core.errors import APIError

EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolMode:
    """What a chat request asked of tools. `choice`: none | auto | required | named."""

    tools: list[dict[str, Any]]
    choice: str
    parser: str = "hermes"
    named: str | None = None  # the function a named choice forces
    parallel: bool = True  # parallel_tool_calls: false keeps only the first call

    @property
    def parses(self) -> bool:
        """Whether the output is read for tool calls."""
        return self.choice != "none"


def _bad(message: str, param: str) -> APIError:
    return APIError(message, 400, "invalid_request_error", param=param)


def check_tools(tools: Any) -> list[dict[str, Any]]:
    """The tools, each `{"type": "function", "function": {"name", "description"?, "parameters"?}}`."""
    if not isinstance(tools, list) or not tools:
        raise _bad("'tools' must be a non-empty array (leave it out for none)", "tools")
    names: set[str] = set()
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if (
            not isinstance(tool, dict)
            or tool.get("type", "function") != "function"
            or not isinstance(fn, dict)
        ):
            raise _bad(f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}", "tools")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise _bad(f"tools[{i}].function.name must be a non-empty string", "tools")
        if name in names:
            raise _bad(f"tools[{i}]: the function name {name!r} is given twice", "tools")
        names.add(name)
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise _bad(f"tools[{i}].function.parameters must be a JSON schema object", "tools")
        if not isinstance(fn.get("description", ""), str):
            raise _bad(f"tools[{i}].function.description must be a string", "tools")
    return tools


def _choice(value: Any, names: set[str]) -> tuple[str, str | None]:
    """(none | auto | required | named, the named function)."""
    if value in ("none", "auto", "required"):
        return value, None
    usage = 'give "none", "auto", "required" or {"type": "function", "function": {"name": ...}}'
    fn = value.get("function") if isinstance(value, dict) else None
    if not isinstance(fn, dict) or value.get("type", "function") != "function":
        raise _bad(f"'tool_choice' {value!r} is not valid: {usage}", "tool_choice")
    name = fn.get("name")
    if not isinstance(name, str) or not name:
        raise _bad(f"'tool_choice' needs the function's name: {usage}", "tool_choice")
    if name not in names:
        raise _bad(f"'tool_choice' names {name!r}, which is not one of the tools", "tool_choice")
    return "named", name


def tool_mode_of(payload: dict, parser: str) -> ToolMode | None:
    """The request's tool mode, or None when it has no tools (then only `tool_choice` "none"
    or none at all is allowed, as in vLLM)."""
    tools, choice = payload.get("tools"), payload.get("tool_choice")
    if tools is None:
        if choice not in (None, "none"):
            raise _bad("'tool_choice' needs 'tools'", "tool_choice")
        return None
    tools = check_tools(tools)
    names = {t["function"]["name"] for t in tools}
    kind, named = _choice("auto" if choice is None else choice, names)
    parallel = payload.get("parallel_tool_calls")
    return ToolMode(tools, kind, parser, named, parallel is not False)


def _parameters(tool: dict[str, Any]) -> dict[str, Any]:
    return tool["function"].get("parameters") or EMPTY_PARAMETERS


def tool_schema(mode: ToolMode) -> dict[str, Any] | None:
    """The JSON schema a forced choice constrains the output to; None for none and auto."""
    if mode.choice == "named":
        return next(_parameters(t) for t in mode.tools if t["function"]["name"] == mode.named)
    if mode.choice != "required":
        return None
    defs: dict[str, Any] = {}
    items = []
    for tool in mode.tools:
        params = copy.deepcopy(_parameters(tool))
        for name, schema in params.pop("$defs", {}).items():  # shared at the top, as vLLM does
            if defs.get(name, schema) != schema:
                raise _bad(f"tool definition {name!r} ($defs) has two different schemas", "tools")
            defs[name] = schema
        items.append(
            {
                "properties": {
                    "name": {"type": "string", "enum": [tool["function"]["name"]]},
                    "parameters": params,
                },
                "required": ["name", "parameters"],
            }
        )
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": items}}
    if defs:
        schema["$defs"] = defs
    return schema


def template_tools(mode: ToolMode | None) -> list[dict[str, Any]] | None:
    """The tools as the chat template gets them (vLLM hands them over for every choice)."""
    return None if mode is None else [{"type": "function", "function": t["function"]} for t in mode.tools]


def default_parser(template_source: str | None) -> str:
    """The tool-call format a chat template teaches: Llama 3's JSON when it speaks of
    `<|python_tag|>` / ipython, else Hermes' `<tool_call>` (Qwen2.5, Qwen3, Hermes, SmolLM)."""
    source = template_source or ""
    if "<tool_call>" not in source and ("<|python_tag|>" in source or "ipython" in source):
        return "llama3_json"
    return "hermes"
