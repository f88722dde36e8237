"""An OpenAI-style request body, turned into what the router needs: prompt token ids and
sampling parameters. Every problem is an APIError with a 4xx status, never a 500."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError
from pydantic_core import from_json

from shared.engine import SamplingParams
from shared.engine.errors import InvalidRequestError
from shared.engine.grammar import check_spec
from shared.engine.logprobs import MAX_LOGPROBS
from shared.model.chat_template import ChatTemplateError

from ..core.errors import APIError
from .parallel import check_n
from .schemas import ChatCompletionRequest, ChatMessage, CompletionRequest
from .structured import structured_of
from .tool_request import ToolMode, template_tools, tool_mode_of, tool_schema

# Read from the raw body by structured.py (their shapes vary too much for the schema).
STRUCTURED_FIELDS = (
    "response_format",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
)

# OpenAI and vLLM fields this server does not implement, and the values that ask for nothing
# (the same as leaving the field out). Anything else is a 400 naming the field.
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "suffix": (None, ""),
    "functions": (None, []),
    "function_call": (None, "none", "auto"),
    "guided_decoding_backend": (None, "xgrammar", "auto"),
    "guided_whitespace_pattern": (None,),
    "use_beam_search": (None, False),
    "length_penalty": (None, 1, 1.0),
    "include_stop_str_in_output": (None, False),
    "skip_special_tokens": (None, True),
    "spaces_between_special_tokens": (None, True),
    "continue_final_message": (None, False),
    "chat_template": (None,),
    "documents": (None,),
    "allowed_token_ids": (None,),
    "bad_words": (None, []),
    "logits_processors": (None, []),
    "truncate_prompt_tokens": (None,),
    "return_tokens_as_token_ids": (None, False),
    "priority": (None, 0),
    "store": (None, False),
    "prediction": (None,),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "reasoning_effort": (None,),
}
# Fields that change nothing here whatever their value (who asks, how to bill, tracing tags).
ACCEPTED: frozenset[str] = frozenset(
    {"user", "metadata", "service_tier", "parallel_tool_calls", "request_id"}
)


@dataclass
class ParsedRequest:
    body: CompletionRequest | ChatCompletionRequest
    prompt_ids: list[int]
    params: SamplingParams
    structured_from: str | None = None  # the field the request's output constraint came from
    tools: ToolMode | None = None  # chat: the tools and the tool choice

    @property
    def n(self) -> int:
        return self.body.n


def chat_prompt(messages: list[dict] | list[ChatMessage], add_generation_prompt: bool = True) -> str:
    """A plain, model-agnostic chat layout, for a model without a chat template (the presets)."""
    lines = []
    for m in messages:
        m = m.model_dump(exclude_none=True) if isinstance(m, ChatMessage) else m
        text = m.get("content") or ""
        for call in m.get("tool_calls") or ():
            text += json.dumps({"name": call["function"]["name"], "arguments": call["function"]["arguments"]})
        lines.append(f"<|{m['role']}|>\n{text}\n")
    return "".join(lines) + ("<|assistant|>\n" if add_generation_prompt else "")


def template_messages(messages: list[ChatMessage]) -> list[dict]:
    """Messages as chat templates read them (as vLLM hands them over): `developer` is the system
    role, null content is empty text, and a tool call's arguments are an object, not JSON text."""
    out = []
    for m in messages:
        d = m.model_dump(exclude_none=True)
        d.setdefault("content", "")
        if d["role"] == "developer":
            d["role"] = "system"
        for call in d.get("tool_calls") or ():
            try:
                call["function"]["arguments"] = json.loads(call["function"]["arguments"])
            except ValueError:
                raise _bad("a tool call's arguments must be JSON text", param="messages") from None
        out.append(d)
    return out


def chat_prompt_ids(body, tokenizer, tools: list[dict] | None = None) -> list[int]:
    """The prompt of a chat (a chat completion, or /tokenize's messages): the checkpoint's
    template rendered with the messages, the tools (as the template gets them) and its kwargs."""
    template = tokenizer.chat_template
    messages = template_messages(body.messages)
    if template is None:
        return tokenizer.encode(chat_prompt(messages, body.add_generation_prompt))
    try:
        text = template.render(
            messages, body.add_generation_prompt, tools=tools, extra=body.chat_template_kwargs or {}
        )
    except ChatTemplateError as e:
        raise _bad(str(e), param="messages") from None
    # The template writes the BOS itself: no second one from the tokenizer (vLLM's default too).
    return tokenizer.encode(text, add_special_tokens=False)


def describe(errors) -> str:
    """One line from pydantic's validation errors."""
    parts = []
    for err in errors:
        loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
        parts.append(f"{loc}: {err.get('msg')}" if loc else str(err.get("msg")))
    return "invalid request: " + "; ".join(parts)


def _bad(message: str, param: str | None = None, status: int = 400, code: str | None = None) -> APIError:
    return APIError(message, status, "invalid_request_error", param=param, code=code)


def check_model(requested: str | None, model_id: str) -> None:
    """A request naming another model is a 404, as OpenAI answers it."""
    if requested is not None and requested != model_id:
        raise _bad(
            f"model '{requested}' does not exist; this server serves '{model_id}'",
            param="model",
            status=404,
            code="model_not_found",
        )


# Fields of the other endpoint (logprob options, tools), and their neutral values.
OTHER_ENDPOINT: dict[bool, dict[str, tuple[Any, ...]]] = {
    # completions: `logprobs` is the count; tools are chat's
    False: {"top_logprobs": (None, 0), "tools": (None, []), "tool_choice": (None, "none", "auto")},
    True: {"echo": (None, False)},  # chat
}


def _neutral(value: Any, neutral: tuple[Any, ...]) -> bool:
    """value is one of the neutral values; a boolean only equals a boolean (True == 1, yet n: true
    asks for something)."""
    return any(value == n and isinstance(value, bool) == isinstance(n, bool) for n in neutral)


def reject_unsupported(payload: dict, chat: bool = False) -> None:
    table = UNSUPPORTED | OTHER_ENDPOINT[chat]
    for name, neutral in table.items():
        if not _neutral(payload.get(name), neutral):
            raise _bad(f"'{name}' is not supported by this server", param=name, code="unsupported_parameter")
    known = (ChatCompletionRequest if chat else CompletionRequest).model_fields
    for name in payload:
        if name not in known and name not in table and name not in ACCEPTED and name not in STRUCTURED_FIELDS:
            raise _bad(f"unknown field '{name}'", param=name, code="unsupported_parameter")


def _logprob_count(payload: dict, name: str) -> None:
    n = payload.get(name)
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= MAX_LOGPROBS):
        raise _bad(f"'{name}' must be an integer from 0 to {MAX_LOGPROBS}, got {n!r}", param=name)


def check_logprob_options(payload: dict, chat: bool) -> None:
    """Logprob and stream options: a 400 naming the field for what is out of range."""
    if chat:
        if not isinstance(payload.get("logprobs"), bool | None):
            raise _bad(f"'logprobs' must be a boolean, got {payload['logprobs']!r}", param="logprobs")
        _logprob_count(payload, "top_logprobs")
        if payload.get("top_logprobs") and not payload.get("logprobs"):
            raise _bad("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    else:
        _logprob_count(payload, "logprobs")
    if payload.get("prompt_logprobs") is not None and payload.get("stream"):
        raise _bad("'prompt_logprobs' is not supported with 'stream': true", param="prompt_logprobs")
    if payload.get("stream_options") is not None and not payload.get("stream"):
        raise _bad("'stream_options' is only allowed with 'stream': true", param="stream_options")


def check_output_limit(payload: dict) -> None:
    """max_completion_tokens (OpenAI's current name) and max_tokens are one limit: both only if equal."""
    a, b = payload.get("max_tokens"), payload.get("max_completion_tokens")
    if a is not None and b is not None and a != b:
        raise _bad(
            f"'max_tokens' ({a!r}) and 'max_completion_tokens' ({b!r}) differ; give one of them",
            param="max_completion_tokens",
        )


def parse_body(raw: bytes, chat: bool) -> CompletionRequest | ChatCompletionRequest:
    return parse_payload(raw, chat)[0]


def parse_payload(raw: bytes, chat: bool) -> tuple[CompletionRequest | ChatCompletionRequest, dict]:
    """The checked body, and the raw JSON object it came from."""
    try:  # (unlike json.loads, this refuses lone surrogates, NaN and runaway nesting)
        payload = from_json(raw, allow_inf_nan=False)
    except ValueError as e:
        raise _bad(f"request body is not valid JSON: {e}") from None
    if not isinstance(payload, dict):
        raise _bad("request body must be a JSON object")
    reject_unsupported(payload, chat)
    check_logprob_options(payload, chat)
    check_output_limit(payload)
    check_n(payload)
    if chat:
        tool_mode_of(payload, "hermes")  # (checked here, a 400 naming the field; read in parse_request)
    try:
        return (ChatCompletionRequest if chat else CompletionRequest).model_validate(payload), payload
    except ValidationError as e:
        raise _bad(describe(e.errors())) from None


def prompt_ids_of(
    body: CompletionRequest | ChatCompletionRequest, tokenizer, tools: ToolMode | None = None
) -> list[int]:
    if isinstance(body, ChatCompletionRequest):
        ids = chat_prompt_ids(body, tokenizer, template_tools(tools))
    elif isinstance(body.prompt, str):
        ids = tokenizer.encode(body.prompt)
    else:
        ids = list(body.prompt)
        if any(t < 0 or t >= tokenizer.vocab_size for t in ids):
            raise _bad(f"prompt token ids must be in [0, {tokenizer.vocab_size})", param="prompt")
    if not ids:
        raise _bad("prompt is empty", param="prompt")
    return ids


def parse_request(
    raw: bytes,
    chat: bool,
    *,
    model_id: str,
    tokenizer,
    max_model_len: int,
    max_tokens_default: int | None,
    tool_parser: str = "hermes",
) -> ParsedRequest:
    """`tool_parser`: the format the model's tool calls take (the router's --tool-call-parser)."""
    body, payload = parse_payload(raw, chat)
    check_model(body.model, model_id)
    tools = tool_mode_of(payload, tool_parser) if chat else None
    structured, structured_from = structured_of(payload)
    if tools is not None and (schema := tool_schema(tools)) is not None:
        structured, structured_from = tool_constraint(schema, structured_from)
    prompt_ids = prompt_ids_of(body, tokenizer, tools)
    # Without max_tokens: the rest of the context, as vLLM (at least one token: a prompt that
    # fills the context is refused below).
    max_tokens = body.max_tokens or max_tokens_default or max(max_model_len - len(prompt_ids), 1)
    if len(prompt_ids) + max_tokens > max_model_len:
        raise _bad(
            f"prompt ({len(prompt_ids)} tokens) plus max_tokens ({max_tokens}) exceeds the context limit "
            f"of {max_model_len} tokens",
            param="prompt",
            code="context_length_exceeded",
        )
    if body.min_tokens > max_tokens:
        raise _bad(
            f"'min_tokens' ({body.min_tokens}) must not exceed max_tokens ({max_tokens})", param="min_tokens"
        )
    params = SamplingParams(
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        max_tokens=max_tokens,
        stop=body.stop,
        seed=body.seed,
        ignore_eos=body.ignore_eos,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        repetition_penalty=body.repetition_penalty,
        min_p=body.min_p,
        min_tokens=body.min_tokens,
        logit_bias=logit_bias(body.logit_bias, tokenizer.vocab_size),
        stop_token_ids=token_ids(body.stop_token_ids, tokenizer.vocab_size, "stop_token_ids"),
        structured=structured,
    )
    params.logprobs, params.prompt_logprobs = logprob_counts(body)
    return ParsedRequest(body, prompt_ids, params, structured_from, tools)


def tool_constraint(schema: dict, other: str | None) -> tuple[dict, str]:
    """A forced tool choice's constraint on the output; with another constraint, a 400 (vLLM:
    structured outputs or tools, not both). Compact JSON: vLLM lets the model put whitespace
    between any two tokens, where a weak model can fill max_tokens with it; a call's JSON is
    read by a program, which needs none."""
    if other is not None:
        raise _bad(f"give '{other}' or a forced 'tool_choice', not both", param="tool_choice")
    constraint = {"kind": "json", "spec": schema, "disable_any_whitespace": True}
    try:
        check_spec(constraint)
    except InvalidRequestError as e:
        raise _bad(f"'tools': the parameters' schema does not compile: {e}", param="tools") from None
    return constraint, "tool_choice"


def token_ids(ids: list[int] | None, vocab_size: int, name: str) -> list[int]:
    if ids and max(ids) >= vocab_size:
        raise _bad(f"'{name}': token id {max(ids)} is out of the vocabulary [0, {vocab_size})", param=name)
    return list(ids or [])


LOGIT_BIAS_LIMIT = 100.0  # vLLM clamps each bias to [-100, 100]


def logit_bias(bias: dict[str, float] | None, vocab_size: int) -> dict[int, float]:
    out = {}
    for key, value in (bias or {}).items():
        try:
            token = int(key)
        except ValueError:
            raise _bad(f"'logit_bias' keys must be token ids, got {key!r}", param="logit_bias") from None
        if not 0 <= token < vocab_size:
            raise _bad(
                f"'logit_bias': token id {token} is out of the vocabulary [0, {vocab_size})",
                param="logit_bias",
            )
        out[token] = max(-LOGIT_BIAS_LIMIT, min(LOGIT_BIAS_LIMIT, value))
    return out


def logprob_counts(body: CompletionRequest | ChatCompletionRequest) -> tuple[int | None, int | None]:
    """(top alternatives per generated token, per prompt token); None: not asked. A completion's
    echo with logprobs and `prompt_logprobs` share one count: the larger."""
    asked = body.prompt_logprobs
    if isinstance(body, ChatCompletionRequest):
        return (body.top_logprobs or 0) if body.logprobs else None, asked
    echo = body.logprobs if body.echo else None
    both = [n for n in (echo, asked) if n is not None]
    return body.logprobs, max(both) if both else None
