"""Lifecycle.close: every task a service started has ended when close returns, bounded."""

from __future__ import annotations

import asyncio
import time

from shared.serving.runtime import Lifecycle


async def test_close_waits_for_each_cancelled_task_to_end():
    life, cleaned = Lifecycle(), []

    async def worker(i: int) -> None:
        try:
            await asyncio.sleep(60)
        finally:
            await asyncio.sleep(0.05)  # cleanup that itself awaits
            cleaned.append(i)

    for i in range(3):
        life.spawn(worker(i), f"worker-{i}")
    life.every(0.01, lambda: asyncio.sleep(0))
    await asyncio.sleep(0.02)
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
