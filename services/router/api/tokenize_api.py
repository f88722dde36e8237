"""POST /tokenize and /detokenize in vLLM's shapes, with the router's own tokenizer, so clients
written for vLLM (benchmarks, prompt-length checks) count tokens the way the server does.

    /tokenize    {model?, prompt | messages, add_special_tokens?} -> {count, max_model_len, tokens}
    /detokenize  {model?, tokens}                                 -> {prompt}
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic_core import from_json

from ..core.errors import APIError
from .body import read_body
from .openai_request import chat_prompt_ids, check_model, describe
from .schemas import ChatMessage
from .tool_request import ToolMode, check_tools, template_tools

tokenize_api = APIRouter()


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")  # (vLLM's other options, e.g. return_token_strs)

    model: str | None = None
    prompt: str | None = None
    # Messages count as chat completions would run them: the template decides special tokens.
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: bool = True  # for a prompt, as in vLLM (the byte tokenizer has none to add)
    # For messages, as chat completions take them (vLLM's /tokenize has both).
    add_generation_prompt: bool = True
    chat_template_kwargs: dict | None = None
    tools: list[dict] | None = None  # rendered by the template, as chat completions render them

    @model_validator(mode="after")
    def _prompt_or_messages(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of 'prompt' and 'messages'")
        return self


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[int]


def _bad(message: str, param: str | None = None) -> APIError:
    return APIError(message, 400, "invalid_request_error", param=param)


async def _parse(request: Request, schema: type[BaseModel]) -> BaseModel:
    http = request.app.state.http
    raw = await read_body(request, http.max_body_bytes, http.body_timeout_s)
    try:
        payload = from_json(raw, allow_inf_nan=False)
    except ValueError as e:
        raise _bad(f"request body is not valid JSON: {e}") from None
    if not isinstance(payload, dict):
        raise _bad("request body must be a JSON object")
    try:
        body = schema.model_validate(payload)
    except ValidationError as e:
        raise _bad(describe(e.errors())) from None
    check_model(body.model, request.app.state.core.served_model_name)
    return body


@tokenize_api.post("/tokenize")
async def tokenize(request: Request) -> dict:
    body = await _parse(request, TokenizeRequest)
    tokenizer = request.app.state.tokenizer
    if body.messages is not None:
        tools = check_tools(body.tools) if body.tools is not None else None
        ids = chat_prompt_ids(body, tokenizer, template_tools(ToolMode(tools, "none")) if tools else None)
    else:
        ids = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
    return {
        "count": len(ids),
        "max_model_len": request.app.state.max_model_len,
        "tokens": ids,
        "token_strs": None,
    }


@tokenize_api.post("/detokenize")
async def detokenize(request: Request) -> dict:
    body = await _parse(request, DetokenizeRequest)
    tokenizer = request.app.state.tokenizer
    bad = [t for t in body.tokens if not 0 <= t < tokenizer.vocab_size]
    if bad:
        raise _bad(f"token ids must be in [0, {tokenizer.vocab_size}), got {bad[0]}", param="tokens")
    return {"prompt": tokenizer.decode(body.tokens)}
