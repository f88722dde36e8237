"""Small hand-computable pieces for the simulator's tests: a model of 16 KV bytes per token
and a chip whose every step takes exactly 10 ms."""

from __future__ import annotations

from pdd.sim.hardware.chip import Chip
from pdd.sim.hardware.model_spec import ModelSpec
from pdd.sim.hardware.step_cost import Linear, StepCost
from pdd.sim.workloads.workload import SimRequest, Workload

TINY = ModelSpec(
    "tiny", layers=1, hidden=8, heads=1, kv_heads=1, head_dim=4, intermediate=16, vocab=32
)  # 16 B/token
STEP_S = 0.01
FLAT = Chip(
    "flat", StepCost(STEP_S, Linear(), Linear()), kv_capacity_bytes=16 * 16 * 4096, price_per_hour=1.0
)
BLOCK = 16


def request(rid: int, arrival: float, blocks: int, output: int, first_hash: int | None = None) -> SimRequest:
    """A prompt of `blocks` full blocks whose hashes no other request shares (unless first_hash
    repeats); `output` tokens."""
    base = (first_hash if first_hash is not None else rid) * 1000
    return SimRequest(rid, arrival, blocks * BLOCK, output, tuple(base + i for i in range(blocks)))


def workload(*reqs: SimRequest) -> Workload:
    return Workload("test", BLOCK, tuple(reqs))
