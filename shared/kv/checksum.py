"""Payload checksums. xxh3-64 (~14 GB/s, releases the GIL) when `xxhash` is installed, else
zlib crc32 (~2 GB/s here, which alone would halve loopback goodput). The frame names its algorithm."""

from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import Protocol

try:
    import xxhash
except ImportError:  # pragma: no cover - xxhash is a declared dependency
    xxhash = None

ALGOS = ("xxh3", "crc32", "none") if xxhash is not None else ("crc32", "none")
DEFAULT_ALGO = ALGOS[0]  # "none" only where corruption cannot happen (a Unix socket is a memcpy)


def frame_algo(requested: str | None, sealed: bool) -> str:
    """The checksum a sender puts on its frames: `requested`, else none on a sealed stream (every
    record's AES-GCM tag already proves its bytes arrived as sent; a second pass over them would
    cost ~8% of the channel's rate) and DEFAULT_ALGO on a plain one."""
    algo = requested or ("none" if sealed else DEFAULT_ALGO)
    if algo not in ALGOS:
        raise ValueError(f"checksum must be one of {ALGOS}")
    return algo


class Hasher(Protocol):
    def update(self, data: memoryview | bytes) -> None: ...
    def value(self) -> int: ...


class _Crc32:
    def __init__(self) -> None:
        self._v = 0

    def update(self, data: memoryview | bytes) -> None:
        self._v = zlib.crc32(data, self._v)

    def value(self) -> int:
        return self._v


class _Nothing:
    def update(self, data: memoryview | bytes) -> None:
        pass

    def value(self) -> int:
        return 0


class _Xxh3:
    def __init__(self) -> None:
        self._h = xxhash.xxh3_64()

    def update(self, data: memoryview | bytes) -> None:
        self._h.update(data)

    def value(self) -> int:
        return self._h.intdigest()


_HASHERS: dict[str, Callable[[], Hasher]] = {"crc32": _Crc32, "none": _Nothing}
_ONE_SHOT: dict[str, Callable[[memoryview | bytes], int]] = {"crc32": zlib.crc32, "none": lambda data: 0}
if xxhash is not None:
    _HASHERS["xxh3"], _ONE_SHOT["xxh3"] = _Xxh3, xxhash.xxh3_64_intdigest


def new_hasher(algo: str) -> Hasher:
    return _of(_HASHERS, algo)()


def checksum(algo: str, data: memoryview | bytes) -> int:
    """One-shot checksum of `data` (same value as a hasher fed the same bytes)."""
    return _of(_ONE_SHOT, algo)(data)


def _of(table: dict, algo: str):
    try:
        return table[algo]
    except KeyError:
        raise ValueError(f"unsupported checksum {algo!r}") from None
