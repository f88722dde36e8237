"""Lifecycle helpers shared by every service: logging, signals, periodic tasks."""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
from collections.abc import Awaitable, Callable

log = logging.getLogger(__name__)


def setup_logging(service: str) -> None:
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s {service} %(levelname)s %(name)s: %(message)s",
    )


def freeze_startup_heap() -> None:
    """Move what startup allocated (modules, the model, settings: ~340k objects in an engine
    service) to the collector's permanent generation. A full collection otherwise walks them
    all while holding the GIL (~160 ms here) whenever it runs under load: the engine thread
    waits for it mid-step, and a step's tokens with it."""
    gc.collect()
    gc.freeze()


def shutdown_signal() -> asyncio.Future[signal.Signals]:
    """Resolves to the first SIGINT or SIGTERM received (later ones are ignored). Installed
    before the service starts: a signal that arrives while it starts must not kill the
    process with the default action (no drain, exit -15)."""
    loop = asyncio.get_running_loop()
    got: asyncio.Future[signal.Signals] = loop.create_future()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, lambda s=sig: got.done() or got.set_result(s))
    return got


async def every(interval_s: float, fn: Callable[[], Awaitable[None]]) -> None:
    """Run fn every interval_s until cancelled; a failing round is logged, not fatal."""
    while True:
        try:
            await fn()
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("periodic task %s failed", getattr(fn, "__name__", fn))
        await asyncio.sleep(interval_s)


def spawn(coro: Awaitable, tasks: set[asyncio.Task], name: str | None = None) -> asyncio.Task:
    """create_task that keeps a strong reference and logs an unexpected failure."""
    task = asyncio.ensure_future(coro)
    if name:
        task.set_name(name)
    tasks.add(task)

    def _done(t: asyncio.Task) -> None:
        tasks.discard(t)
        if not t.cancelled() and t.exception() is not None:
            log.error("task %s failed: %r", t.get_name(), t.exception())

    task.add_done_callback(_done)
    return task


CLOSE_TASKS_S = 2.0  # a cancelled task that takes longer is stuck in a blocking call
LEAVE_NATS_S = 3.0  # each NATS step of leaving; the supervisor kills a child after 10 s


class Lifecycle:
    """The subscriptions, request/reply endpoints and background tasks one service owns,
    stopped together. `name` and `metadata`: how nats.micro discovery shows the service."""

    def __init__(self, name: str = "", metadata: dict[str, str] | None = None) -> None:
        self.name, self.metadata = name, metadata or {}
        self.subs: list = []
        self.tasks: set[asyncio.Task] = set()
        self.micro = None  # the nats.micro service, once announced
        self._nc = None

    async def announce(self, nc) -> None:
        """Register with nats.micro ($SRV.PING / INFO / STATS), once."""
        from shared.bus.micro import SERVICE_VERSION, register_service

        if self.micro is None:
            desc = f"pdd {self.name}"
            self.micro = await register_service(nc, self.name, SERVICE_VERSION, desc, metadata=self.metadata)
            self._nc = nc

    async def endpoint(self, nc, subject: str, cls, handler, *, queue: str = "") -> None:
        """A request/reply subject this service answers: a nats.micro endpoint, decoded as
        `cls`, handler(message, raw) replying on raw."""
        from shared.bus.connection import decoding
        from shared.bus.micro import add_endpoint

        await self.announce(nc)
        await add_endpoint(self.micro, subject, decoding(subject, cls, handler), queue)

    async def subscribe(self, nc, subject: str, cls, handler, *, queue: str = "", ack: bool = False) -> None:
        """ack: the subject's messages are sent with shared/bus/delivery.py and acked on arrival."""
        from shared.bus.connection import subscribe

        self.subs.append(await subscribe(nc, subject, cls, handler, queue=queue, ack=ack))

    def spawn(self, coro: Awaitable, name: str | None = None) -> asyncio.Task:
        return spawn(coro, self.tasks, name)

    def every(self, interval_s: float, fn: Callable[[], Awaitable[None]]) -> asyncio.Task:
        return spawn(every(interval_s, fn), self.tasks, getattr(fn, "__name__", None))

    async def close(self, timeout_s: float = CLOSE_TASKS_S) -> None:
        """Unsubscribe, cancel every task and wait (bounded) until each has ended, so nothing
        this service started still runs once it says it stopped."""
        if self.micro is not None and self._nc.is_connected:
            try:  # leaves discovery and unsubscribes the endpoints
                async with asyncio.timeout(LEAVE_NATS_S):
                    await self.micro.stop()
            except Exception as e:
                log.warning("leaving the service registry failed: %r", e)
        self.micro = None
        for sub in self.subs:
            try:
                await sub.unsubscribe()
            except Exception as e:  # the connection may already be closed
                log.debug("unsubscribe failed: %s", e)
        pending = [t for t in self.tasks if t is not asyncio.current_task()]
        for t in pending:
            t.cancel()
        if pending:
            _, stuck = await asyncio.wait(pending, timeout=timeout_s)
            for t in stuck:
                log.warning("task %s did not end within %.1f s of its cancellation", t.get_name(), timeout_s)


async def serve_service(name: str, settings, factory) -> None:
    """Connect to NATS with this service's credentials (exit 2 without them), start
    `factory(settings, nc)`, run until SIGINT/SIGTERM or its engine loop dies (see live), then stop it
    and drain the connection. On SIGTERM (scale-in) a service that can drain finishes the
    requests it holds first (up to settings.drain_timeout_s), so the process exits 0 having
    failed none."""
    from shared.bus.connection import connect
    from shared.config import ENV_PREFIX
    from shared.security.credentials import nats_options, require_credentials
    from shared.telemetry.metrics import start_metrics_server
    from shared.telemetry.tracing import setup_tracing, shutdown_tracing

    await factory.preflight(settings)  # addresses that cannot work: exit 2 before anything starts
    require_credentials(settings, name, ENV_PREFIX[name])
    shutdown = shutdown_signal()
    setup_tracing(name, settings.instance, settings.datacenter)
    if settings.torch_threads > 0:
        import torch

        torch.set_num_threads(settings.torch_threads)
    if getattr(settings, "metrics_port", None):
        start_metrics_server(settings.metrics_port, settings.metrics_host)
    nc = await connect(settings.nats_url, name=f"{name}-{settings.instance}", **nats_options(settings))
    service = factory(settings, nc)
    # Before the first heartbeat: the collection holds the GIL for a while, and a router that
    # heard the heartbeat would take the silence that follows for a lost instance.
    freeze_startup_heap()
    await service.start()  # announces it to nats.micro discovery with its endpoints
    log.info("%s %s ready (%s)", name, settings.instance, settings.datacenter)
    try:
        await live(service, shutdown, settings.drain_timeout_s)
    finally:
        await _leave(nc, service)
        shutdown_tracing()


async def live(service, shutdown: asyncio.Future[signal.Signals], drain_timeout_s: float) -> None:
    """The service's lifetime, one TaskGroup: until SIGINT or SIGTERM (which drains first), or
    until its engine loop ends on its own, which ends the process with that error (its
    supervisor restarts it) instead of leaving a service that heartbeats with no engine."""
    async with asyncio.TaskGroup() as lifetime:
        engine = lifetime.create_task(service.engine_loop.ended(), name="engine-loop-watch")
        if await shutdown == signal.SIGTERM and hasattr(service, "drain"):
            await service.drain(drain_timeout_s)
        engine.cancel()


async def _leave(nc, service) -> None:
    """Stop the service (it leaves discovery), drain the connection. With NATS unreachable
    (stopped first, or down) the NATS steps are skipped, and bounded otherwise, instead of each
    waiting out a flush timeout, so the service stops (and exits 0) within the supervisor's
    grace either way."""
    await service.stop()
    if nc.is_connected:
        try:
            async with asyncio.timeout(LEAVE_NATS_S):
                await nc.drain()
            return
        except Exception as e:
            log.warning("draining the NATS connection failed: %r", e)
    try:
        async with asyncio.timeout(LEAVE_NATS_S):
            await nc.close()
    except Exception as e:  # nats-py's close can trip over a TLS transport that is already gone
        log.info("closing the NATS connection: %r", e)
