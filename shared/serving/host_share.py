"""Engines that share one host's cores: decoders give way to a prefill backlog.

Where prefill and the decoders run on one machine (`pdd up` on one host), a burst of prompts
(a client's first wave) waits for prefill's one core while the decoders hold the other cores
with the burst's first requests, so the burst's last prompt gets its first token late. Here
prefill says how many prompt tokens it has not computed yet, the step it is running
included, in a small file of a directory the engines share; a decoder reads those files
before each step and, from when they show a burst (more than `above_tokens`) until it is
gone, takes no step (at most `max_s` in a row; then it steps until the backlog is gone), so
prefill's helper threads take the idle core until prefill's last step of the burst has ended.
One engine's prefill-first scheduling, across processes: the burst's first requests pause
once, its last one starts sooner. A few prompts that came together are not a burst: giving
way to them paused the decoders many times a run for little. Between hosts nothing is
shared, and this is off.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import struct
import time
from pathlib import Path

from shared.engine.outputs import EngineStats
from shared.serving.backlog_wait import BacklogWait

# When it was written (time.monotonic, one clock for the whole host on Linux) and the prompt
# tokens queued. A reader may see a record half written: one wrong read, for one poll, that
# the next write corrects.
RECORD = struct.Struct("<dq")
STALE_S = 2.0  # an older record is a prefill that stopped or died (a 2,048-token step: ~0.5-1 s)
RESCAN_S = 1.0  # how often a decoder looks for prefill instances started or gone
PATTERN = "prefill-*.backlog"


def _map(path: Path, writable: bool) -> mmap.mmap:
    fd = os.open(path, os.O_RDWR if writable else os.O_RDONLY)
    try:
        return mmap.mmap(fd, RECORD.size, access=mmap.ACCESS_WRITE if writable else mmap.ACCESS_READ)
    finally:
        os.close(fd)


class PrefillBacklog:
    """Prefill's side: its queued prompt tokens, published after each step and command."""

    def __init__(self, directory: str | Path, instance: str):
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory / PATTERN.replace("*", instance)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_bytes(RECORD.pack(time.monotonic(), 0))
        tmp.replace(self.path)  # whole, so a reader never maps a short file
        self._map = _map(self.path, writable=True)

    def publish(self, queued_tokens: int) -> None:
        RECORD.pack_into(self._map, 0, time.monotonic(), max(0, queued_tokens))

    def after_step(self, stats: EngineStats) -> None:
        """The prompt tokens not yet computed, the next step's included (engine thread)."""
        self.publish(stats.pending_tokens)

    def close(self) -> None:
        self._map.close()
        self.path.unlink(missing_ok=True)


class GiveWay:
    """A decoder's side: whether to wait before its next step (backlog_wait.py)."""

    def __init__(self, directory: str | Path, max_s: float, above_tokens: int = 0):
        self.directory = Path(directory)
        self.rule = BacklogWait(max_s, above_tokens)
        self._maps: dict[tuple[Path, int], mmap.mmap] = {}  # by path and inode (a restart replaces it)
        self._scanned = -RESCAN_S

    def backlog(self) -> int:
        """Prompt tokens queued by the prefills of this host whose records are fresh."""
        now = time.monotonic()
        if now - self._scanned >= RESCAN_S:
            self._rescan(now)
        total = 0
        for m in self._maps.values():
            written, queued = RECORD.unpack_from(m)
            if now - written < STALE_S:
                total += queued
        return total

    def should_wait(self) -> bool:
        """True from when the backlog goes above above_tokens until it is gone, for at most
        max_s in a row."""
        return self.rule.wait_until(self.backlog(), time.monotonic()) is not None

    def _rescan(self, now: float) -> None:
        self._scanned = now
        found = set()
        for path in self.directory.glob(PATTERN):
            with contextlib.suppress(OSError):  # gone again
                found.add((path, path.stat().st_ino))
        for key in set(self._maps) - found:
            self._maps.pop(key).close()
        for key in found - set(self._maps):
            with contextlib.suppress(OSError, ValueError):  # gone again
                self._maps[key] = _map(key[0], writable=False)

    def close(self) -> None:
        for m in self._maps.values():
            m.close()
        self._maps.clear()


def host_share(settings, publishes_backlog: bool) -> tuple[PrefillBacklog | None, GiveWay | None]:
    """What a service on a host shared by prefill and decoders (settings.host_share_dir) holds:
    prefill its published backlog, a decoder the rule by which it gives way; neither without."""
    if not settings.host_share_dir:
        return None, None
    if publishes_backlog:
        return PrefillBacklog(settings.host_share_dir, settings.instance), None
    return None, GiveWay(settings.host_share_dir, settings.give_way_max_s, settings.give_way_above_tokens)
