"""When a request stops at its newest token: the single rule for STOP and LENGTH."""

from __future__ import annotations

from collections.abc import Callable, Collection

from shared.engine.outputs import FinishReason
from shared.engine.sampling_params import SamplingParams

STOP_WINDOW_SLACK = 8  # tokens decoded beyond the longest stop string (multi-byte tokens)


def finish_reason(
    token_ids: list[int],
    num_prompt_tokens: int,
    params: SamplingParams,
    *,
    eos_token_ids: Collection[int],
    decode: Callable[[list[int]], str],
    max_model_len: int,
) -> FinishReason | None:
    """Would the request end at its last token? None if it goes on (or generated nothing yet)."""
    num_generated = len(token_ids) - num_prompt_tokens
    if num_generated <= 0:
        return None
    if not params.ignore_eos and token_ids[-1] in eos_token_ids:
        return FinishReason.STOP
    if token_ids[-1] in params.stop_token_ids:
        return FinishReason.STOP
    if params.stop and num_generated > params.min_tokens:
        # Only the tail can hold a stop string that the last token completed; the prompt never
        # counts, nor (min_tokens) a stop string that ends in the text of the first min_tokens.
        window = max(len(s.encode()) for s in params.stop) + STOP_WINDOW_SLACK
        start = max(num_prompt_tokens, len(token_ids) - window)
        text = decode(token_ids[start:])
        floor = len(decode(token_ids[start : num_prompt_tokens + params.min_tokens]))
        if any(text.find(s, max(0, floor - len(s) + 1)) >= 0 for s in params.stop):
            return FinishReason.STOP
    if num_generated >= params.max_tokens or len(token_ids) >= max_model_len:
        return FinishReason.LENGTH
    return None
