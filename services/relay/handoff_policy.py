"""When and how the relay hands a request over to MD. Pure functions."""

from __future__ import annotations

from shared.bus.messages import HandoffMode


def choose_handoff_mode(pending: int, relay_running: int, threshold: int, busy_at: int) -> HandoffMode:
    """One-shot frees the relay soonest; catch-up trades relay time for smaller MD stalls.

    Catch-up only pays when many tokens are pending and the relay has room to keep
    generating; a loaded relay hands everything over at once.
    """
    if pending > threshold and relay_running < busy_at:
        return HandoffMode.CATCH_UP
    return HandoffMode.ONE_SHOT


def catchup_is_final(pending: int, rounds_done: int, threshold: int, max_rounds: int) -> bool:
    """Send the last batch once the remainder is small, or after max_rounds.

    The round cap guarantees termination when the relay generates faster than MD can
    take batches across the WAN.
    """
    return pending <= threshold or rounds_done >= max_rounds


def catchup_batch_size(produced: int, handed: int) -> int:
    """Tokens of the next catch-up batch: every new one but the newest, which the final batch
    keeps (MD samples the next token from the logits of its extend pass, so it must carry one)."""
    return max(produced - 1 - handed, 0)
