"""Parallel sampling (`n` > 1) as vLLM v1 does it (vllm/v1/engine/parallel_sampling.py): n
child requests of the same prompt, each sampling on its own. With a seed, child i samples
with seed + i (so child 0 is the request with n = 1 and that seed); without one, each child
draws its own. Choices are indexed by child; usage counts the prompt once and sums the
children's completion tokens.

The first child is routed and dispatched before the others: the router's view of MD's cache
then holds the prompt's blocks (dispatch counts them as MD's at once), so the others route
to that MD as a prefix hit (P→MD), and MD takes the blocks already on their way for the
first child instead of asking for them again (shared/engine/in_flight.py): the prompt's KV
crosses the WAN once."""

from __future__ import annotations

import asyncio
import copy

from opentelemetry.context import Context

from shared.engine import SamplingParams

from ..core.errors import APIError
from ..core.options import PddOptions
from ..core.request_stream import RequestStream

MAX_N = 16  # choices per request (vLLM has no bound; each child is a whole request here)
SEED_SPACE = 2**63  # seeds are int64 on the wire: seed + i wraps within it


def child_params(params: SamplingParams, n: int) -> list[SamplingParams]:
    """Each child's sampling parameters (copies: dispatch fills in a missing seed)."""
    children = []
    for i in range(n):
        child = copy.deepcopy(params)
        if params.seed is not None:
            child.seed = (params.seed + i) % SEED_SPACE
        children.append(child)
    return children


def merged_usage(prompt_tokens: int, completion_tokens: list[int]) -> dict:
    """One prompt, n completions."""
    completion = sum(completion_tokens)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
    }


def check_n(payload: dict) -> None:
    """`n` from 1 to MAX_N; `best_of` null or n (vLLM v1 samples n and returns n, ranking none)."""
    n, best_of = payload.get("n", 1), payload.get("best_of")
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_N):
        raise APIError(
            f"'n' must be an integer from 1 to {MAX_N}, got {n!r}", 400, "invalid_request_error", param="n"
        )
    if best_of is not None and (isinstance(best_of, bool) or best_of != (n or 1)):
        raise APIError(
            f"'best_of' ({best_of!r}) must equal 'n' ({n or 1}): this server, as vLLM's v1 engine, "
            "returns every sample and ranks none",
            400,
            "invalid_request_error",
            param="best_of",
            code="unsupported_parameter",
        )


async def open_children(
    core,
    prompt_ids: list[int],
    params: list[SamplingParams],
    options: PddOptions | None,
    trace_context: Context | None,
) -> list[RequestStream]:
    """Open the children (the first alone, then the rest at once); if one cannot be opened,
    those opened are released and its error is raised. Each open has its own timeouts."""
    first = await core.open(prompt_ids, params[0], options, trace_context)
    try:
        rest = await asyncio.gather(
            *(core.open(prompt_ids, p, options, trace_context) for p in params[1:]), return_exceptions=True
        )
    except BaseException:  # cancelled (the client left): the first is freed too
        core.release(first)
        raise
    failed = [r for r in rest if isinstance(r, BaseException)]
    if failed:
        for stream in [first, *(r for r in rest if isinstance(r, RequestStream))]:
            core.release(stream)
        raise failed[0]
    return [first, *rest]  # type: ignore[list-item]
