"""StepOutput: what one step says about one request."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StepOutput:
    rid: str
    token_id: int | None  # newly sampled token, or None
    index: int | None  # absolute position - num_prompt_tokens (first generated token: 0)
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "prefill" | "abort" | "error"
    error: str | None = None
    computed: bool = False  # a "hold" sequence has KV for all its tokens


def group_by_request(outputs: list[StepOutput]) -> dict[str, list[StepOutput]]:
    """One step's outputs per request id, in order."""
    by_rid: dict[str, list[StepOutput]] = {}
    for out in outputs:
        by_rid.setdefault(out.rid, []).append(out)
    return by_rid
