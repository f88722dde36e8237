"""Wires the router: NATS connection, tokenizer, RouterCore, HTTP app, and the HTTP server
that drains on SIGTERM."""

from __future__ import annotations

import asyncio
import logging
import signal

import uvicorn
from fastapi import FastAPI

from shared.bus.connection import connect
from shared.config import RouterSettings
from shared.model.config import context_limit
from shared.model.describe import describe_model
from shared.security.credentials import nats_options
from shared.serving.runtime import freeze_startup_heap
from shared.telemetry.tracing import setup_tracing, shutdown_tracing

from .api.app import create_app
from .api.http_settings import HttpSettings
from .service import RouterCore

log = logging.getLogger(__name__)

# After the drain: what uvicorn waits for the last responses to be written (they are ended by then).
CLOSE_CONNECTIONS_S = 5.0


def build_app(settings: RouterSettings, nc=None, http: HttpSettings | None = None) -> FastAPI:
    """An app whose lifespan connects to NATS (or uses `nc`) and starts the RouterCore.
    `http`: API keys and request limits; by default from the environment (see http_settings)."""

    async def factory():
        setup_tracing("router", settings.instance, settings.datacenter)
        conn = nc or await connect(
            settings.nats_url, name=f"router-{settings.instance}", **nats_options(settings)
        )
        info = describe_model(settings.model)
        core = RouterCore(
            settings,
            conn,
            model_id=info.model_id,
            block_size=settings.engine.block_size,
            kv_bytes_per_token=info.kv_bytes_per_token,
            served_model_name=info.served_name,
        )
        await core.start()

        async def close() -> None:
            await core.stop()
            if nc is None:
                try:
                    await conn.drain()
                except Exception:  # NATS already gone (stopped first): just close
                    await conn.close()
            shutdown_tracing()

        max_len = context_limit(info.config, settings.engine.max_model_len)
        return core, info.tokenizer, max_len, close

    return create_app(factory, http or HttpSettings.from_env())


class DrainingServer(uvicorn.Server):
    """uvicorn, except that SIGTERM drains first: /health answers 503 `draining`, new work gets
    503 with Retry-After, the requests in flight run to their end (up to drain_timeout_s;
    those left then end with an error in their stream), and only then does the server stop,
    and the process exits 0. SIGINT keeps uvicorn's behaviour."""

    def __init__(self, config: uvicorn.Config, app: FastAPI, drain_timeout_s: float) -> None:
        super().__init__(config)
        self.app, self.drain_timeout_s = app, drain_timeout_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._draining: asyncio.Task | None = None

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)  # the lifespan (NATS, RouterCore) ran first
        freeze_startup_heap()
        if self.started:  # uvicorn logs at warning only: this is the line an operator looks for
            host, port = self.servers[0].sockets[0].getsockname()[:2]
            where = f"[{host}]" if ":" in host else host
            log.info("router %s ready on http://%s:%d", self.app.state.core.settings.instance, where, port)

    def handle_exit(self, sig: int, frame) -> None:
        if sig == signal.SIGTERM and self._loop is not None and not self.should_exit:
            # Not recorded as captured: uvicorn would raise it again once stopped (exit -15).
            self._loop.call_soon_threadsafe(self._begin_drain)
            return
        super().handle_exit(sig, frame)

    def _begin_drain(self) -> None:
        if self._draining is None:
            self._draining = asyncio.get_running_loop().create_task(self.drain())

    async def drain(self) -> None:
        state = self.app.state
        drain = state.drain
        drain.begin()
        log.warning("router draining (SIGTERM): %d requests in flight", drain.in_flight)
        if not await drain.wait(self.drain_timeout_s):
            core = getattr(state, "core", None)
            why = f"the router shut down after its {self.drain_timeout_s:g} s drain"
            ended = core.end_streams(why) if core else 0
            log.warning("drain timeout (%g s): %d streams ended", self.drain_timeout_s, ended)
            await drain.wait(CLOSE_CONNECTIONS_S)
        log.info("router drained; stopping")
        self.should_exit = True


def serve(settings: RouterSettings) -> None:
    """Serve the router until SIGINT, or SIGTERM (drained first, then exit 0)."""
    app = build_app(settings)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level="warning",
        timeout_graceful_shutdown=CLOSE_CONNECTIONS_S,
    )
    DrainingServer(config, app, settings.drain_timeout_s).run()
