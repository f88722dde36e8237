"""An OpenAI-style request body, turned into what the router needs: prompt token ids and
sampling parameters. Every problem is an APIError with a 4xx status, never a 500."""

from __future__ import annotations

import json
from dataclasses import dataclass

from pydantic import ValidationError

from shared.engine import SamplingParams

from .errors import APIError
from .schemas import ChatCompletionRequest, CompletionRequest

MAX_BODY_BYTES = 8 << 20


@dataclass
class ParsedRequest:
    body: CompletionRequest | ChatCompletionRequest
    prompt_ids: list[int]
    params: SamplingParams


def chat_prompt(messages) -> str:
    """A plain, model-agnostic chat layout (checkpoint chat templates are not applied)."""
    lines = [f"<|{m.role}|>\n{m.content}\n" for m in messages]
    return "".join(lines) + "<|assistant|>\n"


def describe(errors) -> str:
    """One line from pydantic's validation errors."""
    parts = []
    for err in errors:
        loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
        parts.append(f"{loc}: {err.get('msg')}" if loc else str(err.get("msg")))
    return "invalid request: " + "; ".join(parts)


def _bad(message: str, param: str | None = None, status: int = 400, code: str | None = None) -> APIError:
    return APIError(message, status, "invalid_request_error", param=param, code=code)


def parse_body(raw: bytes, chat: bool) -> CompletionRequest | ChatCompletionRequest:
    if len(raw) > MAX_BODY_BYTES:
        raise _bad(f"request body over {MAX_BODY_BYTES} bytes", status=413)
    try:
        payload = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise _bad(f"request body is not valid JSON: {e}") from None
    if not isinstance(payload, dict):
        raise _bad("request body must be a JSON object")
    try:
        return (ChatCompletionRequest if chat else CompletionRequest).model_validate(payload)
    except ValidationError as e:
        raise _bad(describe(e.errors())) from None


def prompt_ids_of(body: CompletionRequest | ChatCompletionRequest, tokenizer) -> list[int]:
    if isinstance(body, ChatCompletionRequest):
        ids = tokenizer.encode(chat_prompt(body.messages))
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
    if body.model is not None and body.model != model_id:
        raise _bad(f"model '{body.model}' does not exist; this server serves '{model_id}'",
                   param="model", status=404, code="model_not_found")  # fmt: skip
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
        temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, max_tokens=max_tokens,
        stop=body.stop, seed=body.seed, ignore_eos=body.ignore_eos,
    )  # fmt: skip
    return ParsedRequest(body, prompt_ids, params)
