"""EngineLoop.call has a deadline: a call stuck behind a busy engine thread raises
TimeoutError and is skipped (it never runs later); a call that already runs past it raises
too, finishes on the engine thread, and the loop serves the next call. A real tiny engine;
the engine thread is kept busy by a real blocking call the test releases."""

from __future__ import annotations

import asyncio
import threading

import pytest

from shared.engine import Mode
from shared.serving.engine_loop import EngineLoop
from tests.engine_util import greedy, make_engine

WAIT_S = 30  # bound on every wait of the test; none is expected to take long


async def _no_outputs(outputs, extra) -> None:
    pass


@pytest.fixture
async def loop():
    engine_loop = EngineLoop(make_engine(), _no_outputs, call_timeout_s=WAIT_S)
    engine_loop.start()
    yield engine_loop
    await engine_loop.stop()


async def _occupy(loop: EngineLoop, release: threading.Event) -> asyncio.Task:
    """A call that holds the engine thread until `release` is set; returns once it runs."""
    running = threading.Event()

    def hold() -> None:
        running.set()
        release.wait(WAIT_S)

    task = asyncio.create_task(loop.call(hold))
    assert await asyncio.to_thread(running.wait, WAIT_S)
    return task


async def test_a_queued_call_past_its_deadline_raises_and_never_runs(loop) -> None:
    release = threading.Event()
    holder = await _occupy(loop, release)
    with pytest.raises(TimeoutError, match="skipped"):
        await loop.call(loop.engine.add_request, "late", [1, 2, 3], greedy(4), timeout_s=0.2)
    release.set()
    await asyncio.wait_for(holder, WAIT_S)
    # The engine thread is free again: the next call runs, and the skipped one never did.
    assert await loop.call(lambda: "late" in loop.engine.seqs) is False


async def test_a_queued_must_run_call_past_its_deadline_raises_and_runs_later(loop) -> None:
    await loop.call(loop.engine.add_request, "r", [1, 2, 3], greedy(4), mode=Mode.HOLD)  # stays until freed
    release = threading.Event()
    holder = await _occupy(loop, release)
    with pytest.raises(TimeoutError, match="deadline"):
        await loop.call(loop.engine.abort, "r", timeout_s=0.2, must_run=True)
    release.set()
    await asyncio.wait_for(holder, WAIT_S)
    assert await loop.call(lambda: "r" in loop.engine.seqs) is False  # the abort ran after all


async def test_a_running_call_past_its_deadline_raises_and_still_finishes(loop) -> None:
    release, done = threading.Event(), threading.Event()

    def slow_admit() -> None:
        release.wait(WAIT_S)
        loop.engine.add_request("slow", [1, 2, 3], greedy(4))
        done.set()

    with pytest.raises(TimeoutError, match="still running"):
        await loop.call(slow_admit, timeout_s=1.0)  # long enough for the engine thread to pick it up
    release.set()
    assert await asyncio.to_thread(done.wait, WAIT_S)
    assert await loop.call(lambda: "slow" in loop.engine.seqs) is True


async def test_a_timeout_the_call_raises_itself_is_not_taken_for_the_deadline(loop) -> None:
    def gives_up() -> None:
        raise TimeoutError("the call's own")

    with pytest.raises(TimeoutError, match="the call's own"):
        await loop.call(gives_up)


async def test_the_deadline_defaults_to_the_loops_setting() -> None:
    engine_loop = EngineLoop(make_engine(), _no_outputs, call_timeout_s=0.2)
    engine_loop.start()
    release = threading.Event()
    try:
        holder = await _occupy(engine_loop, release)
        with pytest.raises(TimeoutError, match="deadline"):
            await asyncio.wait_for(engine_loop.call(engine_loop.engine.stats), WAIT_S)
        release.set()
        with pytest.raises(TimeoutError, match="still running"):  # the holder ran past 0.2 s too
            await asyncio.wait_for(holder, WAIT_S)
    finally:
        release.set()
        await engine_loop.stop()
