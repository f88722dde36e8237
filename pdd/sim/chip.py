"""One instance's hardware as the simulator sees it: a hardware profile applied to a model."""

from __future__ import annotations

from dataclasses import dataclass

from pdd.sim.step_cost import StepCost


@dataclass(frozen=True)
class Chip:
    name: str  # the profile's name, e.g. "h200-roofline", "cpu-calibrated"
    step: StepCost  # seconds of one engine step of this model on this chip
    kv_capacity_bytes: int  # memory left for the KV pool after the weights
    price_per_hour: float  # USD per instance-hour
    chips: int = 1  # devices the instance spans (tensor parallel)
