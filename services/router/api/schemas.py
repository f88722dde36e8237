"""OpenAI-compatible request bodies and the error shape."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from shared.engine.logprobs import MAX_LOGPROBS

from ..core.options import MAX_INT32, PddOptions
from .parallel import MAX_N

MAX_STOPS = 4
MAX_STOP_CHARS = 256
MAX_PENALTY = 1e6
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False  # a last chunk with `choices: []` and the usage


class _Sampling(BaseModel):
    # The raw body is checked first (openai_request.reject_unsupported): an unknown field is a
    # 400 naming it, so the published schema allows no other properties.
    model_config = ConfigDict(extra="ignore", json_schema_extra={"additionalProperties": False})

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)  # OpenAI's newer name for max_tokens
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1, le=MAX_INT32)  # 0 or -1: off (vLLM's -1)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=MAX_PENALTY)
    min_tokens: int = Field(default=0, ge=0, le=MAX_INT32)
    # Token id (a JSON key, so a string) -> bias added to its logit, clamped to [-100, 100] as vLLM does.
    logit_bias: dict[str, float] | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0, le=MAX_INT32)]] | None = None
    # Logprobs of the prompt's tokens (vLLM's extension): top alternatives per token.
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOPS)] | None = Field(
        default=None, validate_default=True
    )
    seed: int | None = Field(default=None, ge=0, le=2**63 - 1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    # Choices per request (parallel sampling, services/router/api/parallel.py); best_of: n or null.
    n: int = Field(default=1, ge=1, le=MAX_N)
    best_of: int | None = Field(default=None, ge=1, le=MAX_N)
    ignore_eos: bool = False
    pdd: PddOptions | None = None

    @model_validator(mode="after")
    def _one_output_limit(self) -> _Sampling:
        """max_tokens and max_completion_tokens are one limit (parse_body refuses two that differ)."""
        a, b = self.max_tokens, self.max_completion_tokens
        self.max_tokens = self.max_completion_tokens = a if a is not None else b
        return self

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_list(cls, v: Any) -> Any:
        if v is None:
            return []
        stops = [v] if isinstance(v, str) else v
        if not isinstance(stops, list):
            return stops  # the type check says what is wrong
        if len(stops) > MAX_STOPS or any(
            not isinstance(s, str) or not 0 < len(s) <= MAX_STOP_CHARS for s in stops
        ):
            raise ValueError(
                f"stop must be up to {MAX_STOPS} non-empty strings of at most {MAX_STOP_CHARS} characters"
            )
        return stops


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str]
    # Top alternatives per token, with the chosen token's logprob.
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False  # the prompt before the output (with its logprobs, if asked)

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v: Any) -> str | list[int]:
        if isinstance(v, list) and v and all(isinstance(x, str) for x in v):
            if len(v) != 1:
                raise ValueError("only one prompt per request is supported")
            return v[0]
        return v


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    # developer: OpenAI's newer name for the system role (the template gets "system").
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None  # parts are joined into one string, as vLLM does
    name: str | None = None
    tool_call_id: str | None = None  # on a "tool" message: the call it answers
    tool_calls: list[ToolCall] | None = None  # on an assistant message: the calls it made

    @model_validator(mode="after")
    def _has_content(self) -> ChatMessage:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content may be null only on an assistant message with tool_calls")
        return self

    @field_validator("content", mode="before")
    @classmethod
    def _join_text_parts(cls, v: Any) -> Any:
        if not isinstance(v, list):
            return v
        texts = [p.get("text") for p in v if isinstance(p, dict) and p.get("type") == "text"]
        if len(texts) != len(v) or not all(isinstance(t, str) for t in texts):
            raise ValueError('content parts must be {"type": "text", "text": "..."} (only text is supported)')
        return "\n".join(texts)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    # Extra variables for the checkpoint's chat template (e.g. Qwen3's enable_thinking).
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    logprobs: bool = False
    top_logprobs: int | None = Field(
        default=None, ge=0, le=MAX_LOGPROBS
    )  # alternatives per token (needs logprobs: true)
    # Functions the model may call (checked by tool_request.py): [{"type": "function",
    # "function": {"name", "description", "parameters"}}]; tool_choice: none | auto | required
    # | {"type": "function", "function": {"name": ...}} (default: auto with tools).
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
