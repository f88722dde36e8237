"""The token events an engine service sends its router, built from the engine's step outputs:
pure functions, shared by the services' cores and shells."""

from __future__ import annotations

from shared.bus.messages import Outcome, Role, TokenEvent
from shared.engine.outputs import FinishReason, StepOutput


def token_event(rid: str, source: Role, index: int, outs: list[StepOutput]) -> TokenEvent:
    """The tokens of one step's outputs for the router, with their logprobs when asked for."""
    sampled = [o for o in outs if o.token_id is not None]
    lps = [o.logprobs for o in sampled]
    prompt_lps = next((o.prompt_logprobs for o in sampled if o.prompt_logprobs is not None), None)
    return TokenEvent(
        rid,
        source,
        index,
        [o.token_id for o in sampled],  # type: ignore[misc]
        logprobs=lps if sampled and None not in lps else None,
        prompt_logprobs=prompt_lps,  # type: ignore[arg-type]
    )


def error_event(rid: str, source: Role, error: str, index: int = 0) -> TokenEvent:
    """The request failed here: the router moves it (or ends it with the error)."""
    return TokenEvent(rid, source, index, [], outcome=Outcome.ERROR, error=error)


def outcome_of(reason: FinishReason | None) -> Outcome:
    """The wire outcome of an engine's finish reason."""
    if reason is FinishReason.STOP:
        return Outcome.STOP
    if reason is FinishReason.LENGTH:
        return Outcome.LENGTH
    return Outcome.ERROR
