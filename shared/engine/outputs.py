"""What the engine reports: a StepOutput per request and step, EngineStats for the whole engine."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from shared.engine.logprobs import TokenLogprobs


class FinishReason(StrEnum):
    STOP = "stop"  # an EOS id or a stop string
    LENGTH = "length"  # max_tokens or max_model_len
    PREFILLED = "prefill"  # a PREFILL request sampled its first token
    ABORT = "abort"
    ERROR = "error"


@dataclass(frozen=True, kw_only=True)
class StepOutput:
    rid: str
    token_id: int | None = None  # newly sampled token, or None
    index: int | None = None  # absolute position - num_prompt_tokens (first generated token: 0)
    finished: bool = False
    finish_reason: FinishReason | None = None
    # A PREFILL request's first token (finish_reason PREFILLED): whether the request ends at it
    # (STOP / LENGTH), so that prefill need not ask the engine again before it streams the token.
    ends: FinishReason | None = None
    error: str | None = None
    computed: bool = False  # a HOLD sequence has KV for all its tokens
    logprobs: TokenLogprobs | None = None  # of token_id, when the request asked
    # Prompt tokens 1.. (the first has none), with output 0, when the request asked for them.
    prompt_logprobs: list[TokenLogprobs] | None = None


@dataclass(frozen=True)
class EngineStats:
    num_blocks: int
    free_blocks: int
    used_blocks: int
    cached_blocks: int
    running: int
    waiting: int
    held: int  # HOLD sequences waiting for extend() or release()
    prefilled: int  # PREFILL sequences keeping their blocks until release()
    pinned_blocks: int
    preemptions: int
    kv_bytes_per_token: int
    computed_tokens: int  # tokens run through the model since start
    prefix_hit_tokens: int  # tokens admitted from the prefix cache since start
    prefix_query_tokens: int  # tokens of the sequences admitted since start (what the cache was asked for)
    pending_tokens: int  # tokens of waiting and running sequences not yet run through the model


def group_by_request(outputs: list[StepOutput]) -> dict[str, list[StepOutput]]:
    """One step's outputs per request id, in order."""
    by_rid: dict[str, list[StepOutput]] = {}
    for out in outputs:
        by_rid.setdefault(out.rid, []).append(out)
    return by_rid
