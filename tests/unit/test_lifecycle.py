"""Lifecycle.close: every task a service started has ended when close returns, bounded; and a
service's lifetime (live): until its signal, or until its engine loop dies."""

from __future__ import annotations

import asyncio
import signal
import time

import pytest

from shared.serving.engine_loop import EngineLoop
from shared.serving.runtime import Lifecycle, live


async def test_close_waits_for_each_cancelled_task_to_end():
    life, cleaned, started = Lifecycle(), [], asyncio.Semaphore(0)

    async def worker(i: int) -> None:
        started.release()
        try:
            await asyncio.sleep(60)
        finally:
            await asyncio.sleep(0.05)  # cleanup that itself awaits
            cleaned.append(i)

    for i in range(3):
        life.spawn(worker(i), f"worker-{i}")
    life.every(0.01, lambda: asyncio.sleep(0))
    async with asyncio.timeout(5):  # every worker is inside its try before the close
        for _ in range(3):
            await started.acquire()
    await life.close()
    assert sorted(cleaned) == [0, 1, 2]
    assert not life.tasks


async def test_a_task_closing_its_own_lifecycle_does_not_wait_for_itself():
    life = Lifecycle()
    other = life.spawn(asyncio.sleep(60), "other")
    closer = life.spawn(life.close(), "closer")
    await asyncio.wait_for(closer, 1)
    assert other.cancelled()


async def test_a_task_that_ignores_cancellation_is_waited_for_a_bounded_time():
    life, release = Lifecycle(), asyncio.Event()

    async def stubborn() -> None:
        while not release.is_set():
            try:
                await release.wait()
            except asyncio.CancelledError:
                continue

    task = life.spawn(stubborn(), "stubborn")
    await asyncio.sleep(0)
    started = time.monotonic()
    await life.close(timeout_s=0.2)
    assert 0.15 < time.monotonic() - started < 2 and not task.done()
    release.set()
    await task


class _Engine:
    """An engine whose idle check fails: the one way the loop itself ends (a fault injected
    here, because a real engine does not fail there)."""

    def __init__(self, fail: bool) -> None:
        self.fail = fail

    def stats(self) -> None:
        return None

    def has_unfinished(self) -> bool:
        if self.fail:
            raise RuntimeError("engine thread broke")
        return False


class _Service:
    def __init__(self, fail: bool) -> None:
        self.engine_loop = EngineLoop(_Engine(fail), on_outputs=None)  # type: ignore[arg-type]
        self.drained = False

    async def drain(self, timeout_s: float) -> None:
        self.drained = True


async def test_a_service_lives_until_its_signal_and_drains_on_sigterm():
    service = _Service(fail=False)
    service.engine_loop.start()
    shutdown = asyncio.get_running_loop().create_future()
    asyncio.get_running_loop().call_later(0.1, shutdown.set_result, signal.SIGTERM)
    await asyncio.wait_for(live(service, shutdown, drain_timeout_s=1), 5)
    assert service.drained and not service.engine_loop._task.done()  # the loop is stopped by stop()
    await service.engine_loop.stop()


async def test_a_service_whose_engine_loop_dies_ends_its_life_with_that_error():
    service = _Service(fail=True)
    service.engine_loop.start()
    shutdown = asyncio.get_running_loop().create_future()  # no signal ever comes
    with pytest.raises(ExceptionGroup) as failed:
        await asyncio.wait_for(live(service, shutdown, drain_timeout_s=1), 5)
    assert "engine thread broke" in repr(failed.value.exceptions)
    assert not service.drained
    await service.engine_loop.stop()


def test_startup_s_objects_leave_the_collector_s_full_passes() -> None:
    """A ready service freezes what startup allocated: a full collection then walks only what
    came after, instead of holding the GIL for every module and weight object each time."""
    import gc

    from shared.serving.runtime import freeze_startup_heap

    try:
        freeze_startup_heap()
        assert gc.get_freeze_count() > 1000
    finally:
        gc.unfreeze()
