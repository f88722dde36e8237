"""Waiting for a condition that another task or process makes true: no fixed sleeps in tests.
`until` (and `until_async`, for a condition that awaits) in async tests, `wait_until` in
blocking ones; all give back the condition's truthy value, and raise TimeoutError naming what
they waited for once the deadline passes."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


What = str | Callable[[], str] | None  # what was waited for; a callable tells the last state seen


def _what(cond: Callable, what: What) -> str:
    if callable(what):
        return what()
    return what or getattr(cond, "__qualname__", repr(cond))


async def until(cond: Callable[[], T], timeout: float = 20.0, every: float = 0.01, what: What = None) -> T:
    """Poll `cond` every `every` seconds until it is truthy; TimeoutError after `timeout` seconds."""
    try:
        async with asyncio.timeout(timeout):
            while not (value := cond()):  # noqa: ASYNC110 (state of other tasks, processes or files: nothing to await)
                await asyncio.sleep(every)
            return value
    except TimeoutError:
        raise TimeoutError(f"not within {timeout:g} s: {_what(cond, what)}") from None


async def until_async(
    cond: Callable[[], Awaitable[T]], timeout: float = 20.0, every: float = 0.05, what: What = None
) -> T:
    """`until` for a condition that awaits (a request over the bus, a probe of a server)."""
    try:
        async with asyncio.timeout(timeout):
            while not (value := await cond()):  # noqa: ASYNC110 (another process's state)
                await asyncio.sleep(every)
            return value
    except TimeoutError:
        raise TimeoutError(f"not within {timeout:g} s: {_what(cond, what)}") from None


def wait_until(cond: Callable[[], T], timeout: float = 20.0, every: float = 0.05, what: What = None) -> T:
    """Blocking `until`: poll `cond` every `every` seconds until it is truthy."""
    deadline = time.monotonic() + timeout
    while not (value := cond()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"not within {timeout:g} s: {_what(cond, what)}")
        time.sleep(every)
    return value
