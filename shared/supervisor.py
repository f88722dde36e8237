"""Run a set of ProcessSpecs as child processes: logs to files, health gate, clean stop.

Each child gets its own session (process group), so a stop reaches whatever the child
spawned: SIGTERM to the group, SIGKILL after a grace period. On Linux children also get
PR_SET_PDEATHSIG, so even a SIGKILLed `pdd up` leaves no orphans behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import httpx

from shared.launch import ProcessSpec

log = logging.getLogger(__name__)


class ProcessDied(RuntimeError):
    """A child exited while the system was starting or running."""


def _die_with_parent() -> None:  # runs in the child between fork and exec
    if sys.platform == "linux":
        with contextlib.suppress(Exception):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def tail(path: Path, n: int = 20) -> str:
    """Last n lines of a log file ('' if missing)."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


@dataclass
class Child:
    spec: ProcessSpec
    log_path: Path
    proc: subprocess.Popen[bytes]
    log_file: IO[bytes]

    def describe_exit(self) -> str:
        code = self.proc.returncode
        last = tail(self.log_path)
        return f"{self.spec.name} exited with code {code}; last lines of {self.log_path}:\n{last}"


class Supervisor:
    """Starts specs in order and stops them in reverse order."""

    def __init__(self, log_dir: Path, grace_s: float = 10.0) -> None:
        self.log_dir = Path(log_dir)
        self.grace_s = grace_s
        self.children: list[Child] = []

    def start(self, spec: ProcessSpec) -> Child:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_dir / f"{spec.name}.log"
        log_file = log_path.open("wb")
        proc = subprocess.Popen(
            spec.argv,
            env={**os.environ, **spec.env},
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )
        child = Child(spec, log_path, proc, log_file)
        self.children.append(child)
        log.info("started %s (pid %d), log %s", spec.name, proc.pid, log_path)
        return child

    def start_all(self, specs: Sequence[ProcessSpec]) -> None:
        for spec in specs:
            self.start(spec)

    def check(self) -> None:
        """Raise ProcessDied naming the first child that has exited."""
        for c in self.children:
            if c.proc.poll() is not None:
                raise ProcessDied(c.describe_exit())

    async def wait_http_ok(self, url: str, timeout_s: float) -> None:
        """Poll `url` until it answers 200; fail fast if a child dies meanwhile."""
        deadline = time.monotonic() + timeout_s
        async with httpx.AsyncClient(timeout=2.0) as client:
            while True:
                self.check()
                with contextlib.suppress(httpx.HTTPError):
                    if (await client.get(url)).status_code == 200:
                        return
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{url} did not answer 200 within {timeout_s:.0f}s")
                await asyncio.sleep(0.25)

    async def stop_all(self) -> None:
        """SIGTERM every process group (reverse start order), SIGKILL what is left after grace_s."""
        children = list(reversed(self.children))
        for c in children:
            _signal_group(c.proc, signal.SIGTERM)
        deadline = time.monotonic() + self.grace_s
        # Popen has no awaitable wait; polling a handful of children is cheap.
        while any(c.proc.poll() is None for c in children) and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.05)
        for c in children:
            _signal_group(c.proc, signal.SIGKILL)  # also reaps grandchildren of exited leaders
            if c.proc.poll() is None:
                log.warning("%s did not stop within %.0fs; killed", c.spec.name, self.grace_s)
            c.proc.wait()
            c.log_file.close()
        self.children.clear()


def _signal_group(proc: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)  # pid == pgid: start_new_session made each child a group leader
