"""Structured-output fields, as OpenAI and vLLM clients send them, into the one constraint the
engines apply (SamplingParams.structured, see shared/engine/grammar.py):

- OpenAI's `response_format`: `{"type": "json_object"}` or `{"type": "json_schema",
  "json_schema": {"name": ..., "schema": {...}}}` (`text`: none);
- vLLM's `structured_outputs`: exactly one of `json`, `regex`, `choice`, `grammar`,
  `json_object`, with `disable_any_whitespace`;
- vLLM's older `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`.

At most one constraint per request; each problem is a 400 naming the field.
"""

from __future__ import annotations

from typing import Any

from shared.engine.errors import InvalidRequestError
from shared.engine.grammar import check_spec

from ..core.errors import APIError

GUIDED = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}
STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")
STRUCTURED_OPTIONS = {"disable_any_whitespace", "disable_fallback", "disable_additional_properties"}


def _bad(message: str, param: str, code: str | None = None) -> APIError:
    return APIError(message, 400, "invalid_request_error", param=param, code=code)


def _from_response_format(value: Any) -> dict[str, Any] | None:
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise _bad("'response_format' must be an object with a 'type'", "response_format")
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return {"kind": "json_object"}
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise _bad(
                "'response_format' json_schema needs {'json_schema': {'schema': ...}}", "response_format"
            )
        return {"kind": "json", "spec": spec["schema"]}
    raise _bad(
        f"'response_format' type {kind!r} is not supported (text, json_object, json_schema)",
        "response_format",
        "unsupported_parameter",
    )


def _from_structured_outputs(value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _bad("'structured_outputs' must be an object", "structured_outputs")
    unknown = set(value) - set(STRUCTURED_KINDS) - STRUCTURED_OPTIONS
    if unknown:
        raise _bad(f"'structured_outputs' does not support {sorted(unknown)}", "structured_outputs")
    kinds = [k for k in STRUCTURED_KINDS if value.get(k) not in (None, False)]
    if len(kinds) != 1:
        raise _bad(
            f"'structured_outputs' needs exactly one of {', '.join(STRUCTURED_KINDS)}, got {kinds or 'none'}",
            "structured_outputs",
        )
    (kind,) = kinds
    out: dict[str, Any] = {"kind": kind}
    if kind != "json_object":
        out["spec"] = value[kind]
    if value.get("disable_any_whitespace"):
        out["disable_any_whitespace"] = True
    return out


def structured_of(payload: dict) -> tuple[dict[str, Any] | None, str | None]:
    """(the request's constraint or None, the field it came from), checked."""
    found: list[tuple[dict[str, Any] | None, str]] = []
    if payload.get("response_format") is not None:
        found.append((_from_response_format(payload["response_format"]), "response_format"))
    if payload.get("structured_outputs") is not None:
        found.append((_from_structured_outputs(payload["structured_outputs"]), "structured_outputs"))
    for name, kind in GUIDED.items():
        if payload.get(name) is not None:
            found.append(({"kind": kind, "spec": payload[name]}, name))
    found = [(c, name) for c, name in found if c is not None]
    if len(found) > 1:
        names = ", ".join(f"'{n}'" for _, n in found)
        raise _bad(f"give one structured-output constraint, not {names}", found[1][1])
    if not found:
        return None, None
    constraint, name = found[0]
    try:
        check_spec(constraint)
    except InvalidRequestError as e:
        raise _bad(f"'{name}': {e}", name) from None
    return constraint, name
