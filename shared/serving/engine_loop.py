"""Runs an engine on one dedicated thread, driven from asyncio.

The engine is not thread-safe, so every call — steps and commands alike — goes through
one single-worker executor: commands queued by message handlers run between steps, in
order, and the event loop never blocks on a forward pass.

Every `call` has a deadline. When it passes, the caller gets TimeoutError and the call is
settled, not lost: one still waiting in the queue is skipped (it never runs), unless it is a
`must_run` call (a free: skipping it would leak blocks), which stays queued and runs later;
one already running finishes on the engine thread and its result is dropped. All are logged.

`stats` is the engine's figures as of the end of the last step or call, read without waiting
for the engine thread: a heartbeat must not wait behind a long prefill step; `on_stats` is
told each new figure on the engine thread (prefill publishes its backlog from it). A decoder
on a host shared with prefill waits before a step while `give_way` says so (host_share.py).
`min_step_s` (a test knob, 0 = off) makes each step take at least that long: the loop waits out
the rest after the step, so a test can hold a decoder mid-output whatever the host's speed.
Each step's time and, while busy, the time from one step's end to the next one's start (less
give-way waits) go to pdd_engine_step_seconds / pdd_engine_between_steps_seconds{service}.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

from shared.engine import Engine, EngineStats, StepOutput
from shared.serving.host_share import GiveWay
from shared.telemetry import metrics

log = logging.getLogger(__name__)
T = TypeVar("T")
CALL_TIMEOUT_S = 30.0  # default deadline of one call (services pass settings.engine_call_timeout_s)
GIVE_WAY_POLL_S = 0.002  # how often a decoder giving way to prefill looks again

# Called on the engine thread right after each step (e.g. to export freshly computed KV).
PostStep = Callable[[Engine], Any]
# Called on the event loop with the step's outputs and what PostStep returned.
OnOutputs = Callable[[list[StepOutput], Any], Awaitable[None]]


def _log_late_end(name: str, future: Future) -> None:
    error = None if future.cancelled() else future.exception()
    log.warning("late engine call %s ended%s", name, f" with {error!r}" if error else "")


class EngineLoop:
    def __init__(
        self,
        engine: Engine,
        on_outputs: OnOutputs,
        post_step: PostStep | None = None,
        call_timeout_s: float = CALL_TIMEOUT_S,
        on_stats: Callable[[EngineStats], None] | None = None,
        give_way: GiveWay | None = None,
        service: str = "engine",
    ):
        self.engine = engine
        self._on_stats = on_stats
        self._give_way = give_way
        self.call_timeout_s = call_timeout_s
        self._on_outputs = on_outputs
        self._post_step = post_step
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.stats: EngineStats = engine.stats()
        self.min_step_s = 0.0  # a floor on each step's time (a test knob; 0 = off)
        self._step_seconds = metrics.ENGINE_STEP_SECONDS.labels(service=service)
        self._between_steps = metrics.ENGINE_BETWEEN_STEPS_SECONDS.labels(service=service)
        self._last_step_end: float | None = None  # engine thread: None after the loop idled
        self._gave_way_s = 0.0  # give-way wait before the next step (set before it is submitted)

    async def call(
        self,
        fn: Callable[..., T],
        *args: Any,
        timeout_s: float | None = None,
        must_run: bool = False,
        **kwargs: Any,
    ) -> T:
        """Run fn(*args, **kwargs) on the engine thread between two steps. Raises TimeoutError
        after `timeout_s` (default: `call_timeout_s`); see the module docstring for what then
        becomes of the call."""
        limit = self.call_timeout_s if timeout_s is None else timeout_s
        future = self._executor.submit(self._then_snapshot, fn, *args, **kwargs)
        deadline = asyncio.timeout(limit)
        waited = asyncio.wrap_future(future)
        try:
            async with deadline:
                return await (asyncio.shield(waited) if must_run else waited)
        except TimeoutError:
            if not deadline.expired():
                raise  # fn's own
            raise TimeoutError(self._settle_late(fn, future, limit, must_run)) from None
        finally:
            self._wake.set()

    @staticmethod
    def _settle_late(fn: Callable, future: Future, limit: float, must_run: bool) -> str:
        """Skip a late call that has not started (unless must_run); log what became of it.
        The error message."""
        name = getattr(fn, "__qualname__", repr(fn))
        if not must_run and future.cancel():
            what = "skipped: it had not started"
        else:  # it runs (or ran) anyway; its end is logged too
            what = "it runs later" if must_run and not future.running() else "still running"
            what += "; its result is dropped"
            future.add_done_callback(lambda f: _log_late_end(name, f))
        log.warning("engine call %s missed its %g s deadline: %s", name, limit, what)
        return f"engine call {name} missed its {limit:g} s deadline ({what})"

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="engine-loop")

    async def ended(self) -> None:
        """Waits as long as the loop runs; raises once it has ended on its own (a crash), so a
        service whose engine is gone does not live on as a shell that still heartbeats."""
        assert self._task is not None, "start() first"
        await asyncio.shield(self._task)  # a cancelled watch leaves the loop running
        raise RuntimeError("the engine loop ended")

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            except Exception as e:  # it had crashed (what ended the service): stop the rest anyway
                log.info("the engine loop had ended with %r", e)
        self._executor.shutdown(wait=True, cancel_futures=True)

    async def _sleep(self, seconds: float) -> None:
        """Until woken or `seconds` pass. Not wait_for: on Python 3.11 it can swallow the
        cancellation that stop() sends when the timeout fires at the same moment."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):
                await self._wake.wait()

    def _snapshot(self) -> None:
        self.stats = self.engine.stats()
        if self._on_stats:
            self._on_stats(self.stats)

    def _then_snapshot(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        try:
            return fn(*args, **kwargs)
        finally:
            self._snapshot()

    def _tick(self) -> tuple[list[StepOutput], Any, bool]:
        began = time.monotonic()
        if self._last_step_end is not None:
            self._between_steps.observe(max(0.0, began - self._last_step_end - self._gave_way_s))
            self._last_step_end = None  # (a step that raises starts the count afresh)
        outputs = self.engine.step()
        extra = self._post_step(self.engine) if self._post_step else None
        self._snapshot()
        busy = self.engine.has_unfinished()
        ended = time.monotonic()
        self._step_seconds.observe(ended - began)
        self._last_step_end = ended if busy else None
        return outputs, extra, busy

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        busy = False
        while True:
            if not busy:  # idle: one thread hop to look, then sleep until woken
                busy = await loop.run_in_executor(self._executor, self.engine.has_unfinished)
            if not busy:
                self._wake.clear()
                await self._sleep(0.5)
                continue
            waiting = time.monotonic()
            while self._give_way and self._give_way.should_wait():  # noqa: ASYNC110 - another process writes it
                await asyncio.sleep(GIVE_WAY_POLL_S)
            began = time.monotonic()
            self._gave_way_s = began - waiting
            try:
                outputs, extra, busy = await loop.run_in_executor(self._executor, self._tick)
            except Exception:  # a failing step must not kill the service; it is logged and retried
                log.exception("engine step failed")
                busy = False
                await asyncio.sleep(0.05)
                continue
            if outputs or extra:
                try:
                    await self._on_outputs(outputs, extra)
                except Exception:
                    log.exception("output handler failed")
            else:
                # Nothing came out (e.g. only held sequences waiting for a handoff batch):
                # yield briefly instead of spinning on the engine thread.
                self._wake.clear()
                await self._sleep(0.002)
            if (rest := self.min_step_s - (time.monotonic() - began)) > 0:
                await asyncio.sleep(rest)  # commands still run on the engine thread meanwhile
