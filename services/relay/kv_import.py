"""The relay's import of local KV into a pool that may be full for a moment."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import torch

from shared.engine import Engine
from shared.engine.errors import KVShortageError
from shared.serving.engine_loop import EngineLoop


async def import_when_room(
    loop: EngineLoop,
    engine: Engine,
    freed: Callable[[], Awaitable[None]],
    wait_s: float,
    rid: str,
    hashes: list[int],
    kv: torch.Tensor,
) -> int:
    """Import, waiting (bounded) while the pool is full: decoding requests finish and prompts
    already here start decoding (and drop their pins), so blocks free up. Meanwhile the
    sender's connection is held back."""
    try:
        async with asyncio.timeout(wait_s):
            while True:
                try:
                    return await loop.call(engine.import_blocks, hashes, kv, pin=rid)
                except KVShortageError:
                    await freed()
    except TimeoutError:
        raise KVShortageError(f"no room for {len(hashes)} KV blocks within {wait_s:g} s") from None
