"""KV admission policy: how many blocks a request may need, and whether it can be taken now.

A decode instance that takes a request commits to its whole lifetime: the prompt's KV (pinned
or imported) and every generated token's KV. Committing at most the pool, in total, means an
admitted request never fails, and never waits forever, for lack of blocks.
"""

from __future__ import annotations

from enum import Enum, auto

from shared.engine.block_pool import blocks_for


class Verdict(Enum):
    ADMIT = auto()  # reserve its blocks now
    WAIT = auto()  # not now: blocks are committed to other requests
    NEVER = auto()  # more than the whole pool: it can never run here


def request_blocks(num_prompt_tokens: int, max_tokens: int, max_model_len: int, block_size: int) -> int:
    """KV blocks a generating request holds at most: every token but the last sampled one."""
    return blocks_for(min(num_prompt_tokens + max_tokens, max_model_len) - 1, block_size)


def admission_verdict(need: int, committed: int, pool_blocks: int, take_now: int, free_now: int) -> Verdict:
    """`need` blocks for the request's life, `take_now` of them out of the free queue at once
    (blocks to import, cached ones to pin); `committed` blocks are promised to others."""
    if need > pool_blocks:
        return Verdict.NEVER
    if committed + need > pool_blocks or take_now > free_now:
        return Verdict.WAIT
    return Verdict.ADMIT
