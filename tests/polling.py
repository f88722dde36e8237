"""Waiting for a condition that another task or process makes true: no fixed sleeps in tests."""

from __future__ import annotations

import asyncio
from collections.abc import Callable


async def until(cond: Callable[[], object], timeout: float = 20.0) -> None:
    """Poll `cond` until it is truthy; TimeoutError after `timeout` seconds."""
    async with asyncio.timeout(timeout):
        while not cond():  # noqa: ASYNC110 (state of other tasks, processes or files: nothing to await)
            await asyncio.sleep(0.01)
