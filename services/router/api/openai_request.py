"""An OpenAI-style request body, turned into what the router needs: prompt token ids and
sampling parameters. Every problem is an APIError with a 4xx status, never a 500."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError
from pydantic_core import from_json

from shared.engine import SamplingParams
from shared.engine.logprobs import MAX_LOGPROBS
from shared.model.chat_template import ChatTemplateError

from .errors import APIError
from .schemas import ChatCompletionRequest, CompletionRequest

# OpenAI fields this server does not implement, and the values that ask for nothing
# (the same as leaving the field out). Anything else is a 400 naming the field.
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "best_of": (None, 1),
    "n": (None, 1),
    "logit_bias": (None, {}),
    "presence_penalty": (None, 0),
    "frequency_penalty": (None, 0),
    "suffix": (None, ""),
    "tools": (None, []),
    "tool_choice": (None, "none", "auto"),
    "functions": (None, []),
    "function_call": (None, "none", "auto"),
    "response_format": (None, {"type": "text"}),
}


@dataclass
class ParsedRequest:
    body: CompletionRequest | ChatCompletionRequest
    prompt_ids: list[int]
    params: SamplingParams


def chat_prompt(messages) -> str:
    """A plain, model-agnostic chat layout, for a model without a chat template (the presets)."""
    lines = [f"<|{m.role}|>\n{m.content}\n" for m in messages]
    return "".join(lines) + "<|assistant|>\n"


def chat_prompt_ids(messages, tokenizer) -> list[int]:
    template = tokenizer.chat_template
    if template is None:
        return tokenizer.encode(chat_prompt(messages))
    try:
        text = template.render([m.model_dump(exclude_none=True) for m in messages])
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


# Fields of the other endpoint's logprob options, and their neutral values.
OTHER_ENDPOINT: dict[bool, dict[str, tuple[Any, ...]]] = {
    False: {"top_logprobs": (None, 0)},  # completions: `logprobs` is the count
    True: {"echo": (None, False)},  # chat
}


def reject_unsupported(payload: dict, chat: bool = False) -> None:
    for name, neutral in (UNSUPPORTED | OTHER_ENDPOINT[chat]).items():
        value = payload.get(name)
        if value is True or value not in neutral:  # (True == 1, yet asks for something)
            raise _bad(f"'{name}' is not supported by this server", param=name, code="unsupported_parameter")


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
    try:  # (unlike json.loads, this refuses lone surrogates, NaN and runaway nesting)
        payload = from_json(raw, allow_inf_nan=False)
    except ValueError as e:
        raise _bad(f"request body is not valid JSON: {e}") from None
    if not isinstance(payload, dict):
        raise _bad("request body must be a JSON object")
    reject_unsupported(payload, chat)
    check_logprob_options(payload, chat)
    check_output_limit(payload)
    try:
        return (ChatCompletionRequest if chat else CompletionRequest).model_validate(payload)
    except ValidationError as e:
        raise _bad(describe(e.errors())) from None


def prompt_ids_of(body: CompletionRequest | ChatCompletionRequest, tokenizer) -> list[int]:
    if isinstance(body, ChatCompletionRequest):
        ids = chat_prompt_ids(body.messages, tokenizer)
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
    raw: bytes, chat: bool, *, model_id: str, tokenizer, max_model_len: int, max_tokens_default: int
) -> ParsedRequest:
    body = parse_body(raw, chat)
    check_model(body.model, model_id)
    prompt_ids = prompt_ids_of(body, tokenizer)
    max_tokens = body.max_tokens or max_tokens_default
    if len(prompt_ids) + max_tokens > max_model_len:
        raise _bad(
            f"prompt ({len(prompt_ids)} tokens) plus max_tokens ({max_tokens}) exceeds the context limit "
            f"of {max_model_len} tokens",
            param="prompt",
            code="context_length_exceeded",
        )
    params = SamplingParams(
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        max_tokens=max_tokens,
        stop=body.stop,
        seed=body.seed,
        ignore_eos=body.ignore_eos,
    )
    params.logprobs, params.prompt_logprobs = logprob_counts(body)
    return ParsedRequest(body, prompt_ids, params)


def logprob_counts(body: CompletionRequest | ChatCompletionRequest) -> tuple[int | None, int | None]:
    """(top alternatives per generated token, per prompt token); None: not asked."""
    if isinstance(body, ChatCompletionRequest):
        return (body.top_logprobs or 0) if body.logprobs else None, None
    return body.logprobs, body.logprobs if body.echo else None
