"""One instance's hardware as the simulator sees it: a hardware profile applied to a model."""

from __future__ import annotations

from dataclasses import dataclass, replace

from pdd.sim.hardware.step_cost import StepCost


@dataclass(frozen=True)
class Chip:
    name: str  # the profile's name, e.g. "h200-roofline", "cpu-calibrated"
    step: StepCost  # seconds of one engine step of this model on this chip
    kv_capacity_bytes: int  # memory left for the KV pool after the weights
    price_per_hour: float  # USD per instance-hour
    chips: int = 1  # devices the instance spans (tensor parallel)
    max_seqs: int | None = None  # its decode batch cap (None: the simulation's max_num_seqs)


def batch_cap(
    chip: Chip, tpot_s: float, context_tokens: int, kv_bytes_per_token: int, limit: int = 1024
) -> int:
    """The largest decode batch (at most `limit`) whose sequences of `context_tokens` fit the
    chip's KV memory and whose step at that context takes at most `tpot_s`: what an operator
    sets as the engine's max_num_seqs for this chip, model and SLA (at least 1)."""
    by_memory = chip.kv_capacity_bytes // max(1, context_tokens * kv_bytes_per_token)
    lo, hi = 1, max(1, min(limit, by_memory))
    if chip.step.decode_step_s(hi, hi * context_tokens) <= tpot_s:
        return hi
    while lo < hi:  # a step's time grows with the batch
        mid = (lo + hi + 1) // 2
        if chip.step.decode_step_s(mid, mid * context_tokens) <= tpot_s:
            lo = mid
        else:
            hi = mid - 1
    return lo


def with_batch_cap(chip: Chip, tpot_s: float, context_tokens: int, kv_bytes_per_token: int) -> Chip:
    return replace(chip, max_seqs=batch_cap(chip, tpot_s, context_tokens, kv_bytes_per_token))
