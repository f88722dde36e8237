"""The response bodies of the completion endpoints, as declared in /openapi.json (the
handlers build plain dicts; tests check those against these models)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

from shared.bus.messages import HandoffMode, Pipeline

FinishReason = Literal["stop", "length"]
ChatFinishReason = Literal["stop", "length", "tool_calls"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Usage(_Strict):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class PddInstances(_Strict):
    """Per role, the last instance of it the request ran on (null: none); after a move by
    token IDs, the one that took it over."""

    prefill: str | None
    relay: str | None
    main_decode: str | None


class PddSummary(_Strict):
    """How the request was served (an extension field)."""

    pipeline: Pipeline
    prefix_hit_rate: float
    handoff_mode: HandoffMode | None
    handoff_batches: int
    rld_tokens: int
    md_tokens: int
    wan_bytes: int
    migrations: int  # times the request moved to another instance by its token IDs (a fault)
    trace_id: str | None
    instances: PddInstances
    choices: list[PddSummary] | None = None  # n > 1: each choice's (the fields above: the first's)


class CompletionLogprobs(_Strict):
    """The legacy completions format: one entry per token (with echo, the prompt's first)."""

    tokens: list[str]
    token_logprobs: list[float | None]  # None: the first prompt token (echo)
    top_logprobs: list[dict[str, float] | None]  # the top alternatives and the chosen token
    text_offset: list[int]


class PromptLogprob(_Strict):
    logprob: float
    rank: int  # 1 + how many tokens were more likely
    decoded_token: str


# vLLM's prompt_logprobs: per prompt token, null (the first) or {token id: its logprob}.
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionChoice(_Strict):
    index: int
    text: str
    token_ids: list[int]
    finish_reason: FinishReason
    logprobs: CompletionLogprobs | None
    prompt_logprobs: PromptLogprobs | None = None  # when the request asked for them


class CompletionResponse(_Strict):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    pdd: PddSummary


class FunctionCall(_Strict):
    name: str
    arguments: str  # JSON text


class ToolCall(_Strict):
    id: str
    type: Literal["function"]
    function: FunctionCall


class AssistantMessage(_Strict):
    role: Literal["assistant"]
    content: str | None  # null: only tool calls
    tool_calls: list[ToolCall] | None = None


class TopLogprob(_Strict):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(_Strict):
    content: list[ChatTokenLogprob]


class ChatChoice(_Strict):
    index: int
    message: AssistantMessage
    finish_reason: ChatFinishReason
    logprobs: ChatLogprobs | None


class ChatCompletionResponse(_Strict):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    pdd: PddSummary
    prompt_logprobs: PromptLogprobs | None = None  # when the request asked for them


class ErrorDetail(_Strict):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(_Strict):
    error: ErrorDetail
