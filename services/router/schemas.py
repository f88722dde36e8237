"""OpenAI-compatible request bodies and the error shape."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class PddOptions(BaseModel):
    """Per-request operator overrides (an extension field, like vLLM's extra params)."""

    model_config = ConfigDict(extra="forbid")

    pipeline: Literal["p-md", "p-rld-md"] | None = None  # a Pipeline value
    catchup_threshold: int | None = Field(default=None, ge=1)


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)
    stop: str | list[str] | None = Field(default=None, validate_default=True)
    seed: int | None = Field(default=None, ge=0, le=2**63 - 1)
    stream: bool = False
    n: int = Field(default=1, ge=1, le=1)
    ignore_eos: bool = False
    pdd: PddOptions | None = None

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, v: Any) -> list[str]:
        if v is None:
            return []
        stops = [v] if isinstance(v, str) else list(v)
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("stop must be up to 4 non-empty strings")
        return stops


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str]

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v: Any) -> str | list[int]:
        if isinstance(v, list) and v and all(isinstance(x, str) for x in v):
            if len(v) != 1:
                raise ValueError("only one prompt per request is supported")
            return v[0]
        return v


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant", "tool"]
    content: str


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
