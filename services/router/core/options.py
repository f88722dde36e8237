"""The per-request operator options a client may send (`pdd` in the body): which pipeline, and
the relay's catch-up threshold. The HTTP schemas carry them; dispatch reads them."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

MAX_INT32 = 2**31 - 1  # bound for counts that travel on the wire (msgpack has no big ints)


class PddOptions(BaseModel):
    """Per-request operator overrides (an extension field, like vLLM's extra params)."""

    model_config = ConfigDict(extra="forbid")

    pipeline: Literal["p-md", "p-rld-md"] | None = None  # a Pipeline value
    catchup_threshold: int | None = Field(default=None, ge=1, le=MAX_INT32)
