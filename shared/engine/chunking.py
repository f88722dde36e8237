"""How many tokens of one sequence go into a forward (the engine's scheduler and the
simulator's prefill use the same rule)."""

from __future__ import annotations


def chunk_size(remaining: int, budget: int, chunk: int) -> int:
    """At most `chunk` of a sequence's `remaining` tokens within the step's `budget`; but a tail
    shorter than a quarter chunk goes with the chunk before it: a forward of its own, or a wait
    in a forward shared with other prompts, costs far more than its tokens (a 257-token prompt
    in 256-token chunks would get its first token a whole forward late)."""
    n = min(remaining, budget, chunk)
    if remaining - n < chunk // 4 and remaining <= budget:
        return remaining
    return n
