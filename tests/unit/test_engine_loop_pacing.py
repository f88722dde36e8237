"""EngineLoop.min_step_s, the test knob that paces a decoder: every step takes at least that
long, whatever the host's speed (the floor holds on a fast host and a busy one alike), and
commands still run between the paced steps. A real tiny engine."""

from __future__ import annotations

import asyncio
import time

from prometheus_client import REGISTRY

from shared.serving.engine_loop import EngineLoop
from tests.engine_util import greedy, make_engine

PACE_S = 0.05
TOKENS = 8


async def test_each_step_takes_at_least_min_step_s() -> None:
    steps: list[float] = []
    finished = asyncio.Event()

    async def on_outputs(outputs, extra) -> None:
        steps.append(time.monotonic())
        if any(o.finished for o in outputs):
            finished.set()

    loop = EngineLoop(make_engine(), on_outputs, call_timeout_s=30)
    assert loop.min_step_s == 0.0  # off unless asked
    loop.min_step_s = PACE_S
    loop.start()
    try:
        began = time.monotonic()
        await loop.call(loop.engine.add_request, "r", [1, 2, 3], greedy(TOKENS))
        # A command between paced steps runs on the engine thread, not after the pace.
        assert await loop.call(lambda: "r" in loop.engine.seqs, timeout_s=5) is True
        await asyncio.wait_for(finished.wait(), 30)
    finally:
        await loop.stop()
    assert len(steps) >= 2
    # The k-th step starts no sooner than k paces after the first: the last output comes at
    # least (steps - 1) paces after the request went in.
    assert steps[-1] - began >= (len(steps) - 1) * PACE_S


def _sample(name: str, service: str) -> float:
    return REGISTRY.get_sample_value(name, {"service": service}) or 0.0


async def test_the_loop_reports_its_steps_and_the_time_between_them() -> None:
    """pdd_engine_step_seconds and pdd_engine_between_steps_seconds: one busy spell of paced
    steps, so every step but the first follows a gap, and steps plus gaps span the spell."""
    service = "loop-metrics-test"
    finished = asyncio.Event()

    async def on_outputs(outputs, extra) -> None:
        if any(o.finished for o in outputs):
            finished.set()

    loop = EngineLoop(make_engine(), on_outputs, call_timeout_s=30, service=service)
    loop.min_step_s = PACE_S  # the pacing wait falls between steps
    loop.start()
    try:
        await loop.call(loop.engine.add_request, "r", [1, 2, 3], greedy(TOKENS))
        await asyncio.wait_for(finished.wait(), 30)
    finally:
        await loop.stop()
    steps = _sample("pdd_engine_step_seconds_count", service)
    gaps = _sample("pdd_engine_between_steps_seconds_count", service)
    stepped = _sample("pdd_engine_step_seconds_sum", service)
    between = _sample("pdd_engine_between_steps_seconds_sum", service)
    assert steps >= TOKENS - 1 and gaps == steps - 1
    # From the first step's start to the last one's: at least a pace per gap.
    assert stepped + between >= (steps - 1) * PACE_S - 0.01
