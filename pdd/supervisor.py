"""Run the system's processes as supervised children: logs, pid files, restarts, clean stop.

A service child gets its own session (process group), so a stop reaches whatever it spawned:
SIGTERM to the group, SIGKILL after a grace period. Every child (NATS servers too) gets
PR_SET_PDEATHSIG, so even a SIGKILLed `pdd up` leaves no orphans behind.

Once the system serves, a child that exits with status 0 stopped cleanly (the services exit 0
only after SIGTERM / SIGINT, once drained: an operator scaling in) and stays stopped, unless it
was asked to restart (`request_restart`, `pdd restart NAME`: a rolling restart, drained first),
which starts it again at once. Any other
exit is restarted after a backoff that doubles from
`backoff_initial_s` to `backoff_max_s` and starts over once the child stayed up `stable_after_s`;
`crash_loop_crashes` exits of one child within `crash_loop_window_s` are a crash loop, which
stops the system. While a child runs, `<workdir>/run/<name>.pid` holds its pid (fault injection
reads it with `read_pid`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from pdd.launch import ProcessSpec
from shared.parent_death import die_with_parent

log = logging.getLogger(__name__)

RUN_DIR = "run"  # under the workdir: one <name>.pid per running child
LOG_DIR = "logs"


class ProcessDied(RuntimeError):
    """A child exited while the system was starting."""


class CrashLoop(ProcessDied):
    """A child kept crashing: restarting it again would not help."""


@dataclass(frozen=True)
class RestartPolicy:
    backoff_initial_s: float = 0.5
    backoff_max_s: float = 10.0
    stable_after_s: float = 30.0  # up at least this long: its next crash starts the backoff over
    crash_loop_crashes: int = 5
    crash_loop_window_s: float = 60.0


class Backoff:
    """Restart delays of one child. Times come in as arguments, so the policy is testable without clocks."""

    def __init__(self, policy: RestartPolicy) -> None:
        self.policy = policy
        self.next_delay_s = policy.backoff_initial_s
        self.crashes: deque[float] = deque()

    def on_crash(self, started_at: float, now: float) -> float | None:
        """Seconds to wait before restarting a child started at `started_at` that exited at `now`;
        None when this crash completes a crash loop."""
        p = self.policy
        if now - started_at >= p.stable_after_s:
            self.next_delay_s = p.backoff_initial_s
        self.crashes.append(now)
        while self.crashes[0] <= now - p.crash_loop_window_s:
            self.crashes.popleft()
        if len(self.crashes) >= p.crash_loop_crashes:
            return None
        delay, self.next_delay_s = self.next_delay_s, min(2 * self.next_delay_s, p.backoff_max_s)
        return delay


def pid_path(workdir: Path, name: str) -> Path:
    return Path(workdir) / RUN_DIR / f"{name}.pid"


def restart_path(workdir: Path, name: str) -> Path:
    return Path(workdir) / RUN_DIR / f"{name}.restart"


def request_restart(workdir: Path, name: str) -> int:
    """A rolling restart of the child `name` of the `pdd up` running in `workdir`: SIGTERM (a
    service drains, then exits 0), and the supervisor starts it again once it exited. Its pid."""
    pid = read_pid(workdir, name)
    if pid is None:
        raise LookupError(f"{name} is not running under the `pdd up` of {workdir}")
    restart_path(workdir, name).touch()
    os.kill(pid, signal.SIGTERM)
    return pid


def read_pid(workdir: Path, name: str) -> int | None:
    """The pid of the child `name` of the `pdd up` running in `workdir`; None while it is not running."""
    try:
        return int(pid_path(workdir, name).read_text())
    except (OSError, ValueError):
        return None


def _take(path: Path) -> bool:
    """Remove a marker file; whether it was there."""
    try:
        path.unlink()
        return True
    except FileNotFoundError:
        return False


def tail(path: Path, n: int = 20) -> str:
    """Last n lines of a log file ('' if missing)."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def exit_reason(returncode: int | None) -> str:
    if returncode is None:
        return "is not running"
    if returncode < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by {signal.Signals(-returncode).name}"
    return f"exited with code {returncode}"


class Supervised(Protocol):
    """What the supervisor (re)starts: a ServiceProcess or a NATS server (shared/bus/nats_server.py)."""

    name: str

    @property
    def log_path(self) -> Path: ...
    @property
    def running(self) -> bool: ...
    @property
    def pid(self) -> int | None: ...
    @property
    def returncode(self) -> int | None: ...
    async def start(self) -> None: ...
    async def stop(self) -> None: ...


class ServiceProcess:
    """One ProcessSpec as a child process in its own session; output to <log_dir>/<name>.log."""

    def __init__(self, spec: ProcessSpec, log_dir: Path, grace_s: float) -> None:
        self.spec, self.name, self.grace_s = spec, spec.name, grace_s
        self.log_path = Path(log_dir) / f"{spec.name}.log"
        self.proc: asyncio.subprocess.Process | None = None

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode if self.proc is not None else None

    async def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab" if self.proc else "wb") as out:  # a restart keeps the crash's log
            self.proc = await asyncio.create_subprocess_exec(
                *self.spec.argv,
                env={**os.environ, **self.spec.env},
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=die_with_parent,
            )

    async def stop(self) -> None:
        """SIGTERM the process group; SIGKILL it after grace_s (also what an exited leader left)."""
        if self.proc is None:
            return
        _signal_group(self.proc.pid, signal.SIGTERM)
        try:
            async with asyncio.timeout(self.grace_s):
                await self.proc.wait()
        except TimeoutError:
            log.warning("%s did not stop within %.0fs; killing it", self.name, self.grace_s)
        _signal_group(self.proc.pid, signal.SIGKILL)
        async with asyncio.timeout(10):
            await self.proc.wait()


def _signal_group(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)  # pid == pgid: start_new_session made each child a group leader


class Supervisor:
    """Starts children in batches, restarts those that exit, stops batches in reverse order."""

    def __init__(self, workdir: Path, grace_s: float = 10.0, policy: RestartPolicy = RestartPolicy()) -> None:
        self.workdir = Path(workdir)
        self.grace_s = grace_s
        self.policy = policy
        self.batches: list[list[Supervised]] = []
        self._started_at: dict[str, float] = {}
        self._backoff: dict[str, Backoff] = {}
        self._restarts: dict[str, asyncio.Task[None]] = {}

    @property
    def children(self) -> list[Supervised]:
        return [c for batch in self.batches for c in batch]

    async def start(self, *children: Supervised, policy: RestartPolicy | None = None) -> None:
        """Start children in order, as one batch: they will stop together. `policy`: their
        restarts' (the supervisor's by default)."""
        batch: list[Supervised] = []
        self.batches.append(batch)
        for child in children:
            self._backoff[child.name] = Backoff(policy or self.policy)
            await self._start(child)
            batch.append(child)  # only now: a child that failed to start cleaned up after itself

    async def start_all(self, specs: Sequence[ProcessSpec]) -> list[ServiceProcess]:
        children = [ServiceProcess(spec, self.workdir / LOG_DIR, self.grace_s) for spec in specs]
        await self.start(*children)
        return children

    async def _start(self, child: Supervised) -> None:
        self._started_at[child.name] = time.monotonic()
        await child.start()
        path = pid_path(self.workdir, child.name)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"{child.pid}\n")
        log.info("started %s (pid %s), log %s", child.name, child.pid, child.log_path)

    def describe(self, child: Supervised) -> str:
        return f"{child.name} {exit_reason(child.returncode)}; last lines of {child.log_path}:\n{tail(child.log_path)}"

    def check(self) -> None:
        """Raise ProcessDied naming the first child that is not running."""
        for c in self.children:
            if not c.running:
                raise ProcessDied(self.describe(c))

    async def until_exit(self, poll_s: float = 0.25) -> None:
        """Raise ProcessDied once any child exits: while the system starts, nothing restarts."""
        while True:
            self.check()
            await asyncio.sleep(poll_s)

    async def supervise(self, poll_s: float = 0.2) -> None:
        """Restart children that exit, each after its backoff; raise CrashLoop when one keeps
        crashing. A child that stopped cleanly is let go."""
        try:
            while True:
                for c in self.children:
                    if c.running or c.name in self._restarts:
                        continue
                    if c.returncode == 0:
                        if _take(restart_path(self.workdir, c.name)):  # a rolling restart: at once
                            self._restarts[c.name] = asyncio.create_task(self._restart(c, 0.0))
                        else:
                            await self._let_go(c)
                        continue
                    delay = self._restart_delay(c)
                    self._restarts[c.name] = asyncio.create_task(self._restart(c, delay))
                await asyncio.sleep(poll_s)
        finally:
            await self._cancel_restarts()

    async def _let_go(self, child: Supervised) -> None:
        """Stop supervising a child that exited 0: it was told to stop and drained (scale in)."""
        for batch in self.batches:
            if child in batch:
                batch.remove(child)
        pid_path(self.workdir, child.name).unlink(missing_ok=True)
        await child.stop()  # reap it and whatever it left behind
        log.warning("%s stopped cleanly; not restarted", child.name)

    def _restart_delay(self, child: Supervised) -> float:
        pid_path(self.workdir, child.name).unlink(missing_ok=True)  # down: no pid to signal
        why = self.describe(child)
        backoff = self._backoff[child.name]
        delay = backoff.on_crash(self._started_at[child.name], time.monotonic())
        if delay is None:
            p = backoff.policy
            raise CrashLoop(
                f"crash loop ({p.crash_loop_crashes} exits within {p.crash_loop_window_s:.0f}s): {why}"
            )
        log.warning("%s\nrestarting %s in %gs", why, child.name, delay)
        return delay

    async def _restart(self, child: Supervised, delay_s: float) -> None:
        try:
            await asyncio.sleep(delay_s)
            await child.stop()  # reap it and whatever it left behind
            await self._start(child)
        except Exception as e:  # still down: the next poll counts it as another crash
            log.warning("restarting %s failed: %s", child.name, e)
        finally:
            self._restarts.pop(child.name, None)

    async def _cancel_restarts(self) -> None:
        tasks = list(self._restarts.values())
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def stop_all(self) -> None:
        """Stop the batches in reverse start order, the children of a batch together; remove pid files."""
        await self._cancel_restarts()
        for batch in reversed(self.batches):
            results = await asyncio.gather(*(c.stop() for c in batch), return_exceptions=True)
            for child, result in zip(batch, results, strict=True):
                pid_path(self.workdir, child.name).unlink(missing_ok=True)
                if isinstance(result, BaseException):
                    log.warning("stopping %s failed: %s", child.name, result)
        self.batches.clear()
