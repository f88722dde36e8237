"""Several WAN links in one process plus a small HTTP control API (FastAPI on uvicorn).

GET  /links          -> {name: settings + byte counters}
POST /links/{name}   <- {delay_ms?, jitter_ms?, bandwidth_mbps? (null = unlimited), cut?, cut_mode?}
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Iterator

import uvicorn
from fastapi import FastAPI, HTTPException
from pydantic import BaseModel, Field

from shared.wan.link import WanLink, split_hostport

log = logging.getLogger(__name__)


class LinkUpdate(BaseModel):
    delay_ms: float | None = Field(None, ge=0)
    jitter_ms: float | None = Field(None, ge=0)
    bandwidth_mbps: float | None = Field(None, gt=0)  # explicit null = unlimited
    cut: bool | None = None
    cut_mode: str = "drop"


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # Embedded in our own loop: the owner (CLI, `pdd up`, tests) handles signals.
        yield


class WanEmulator:
    def __init__(self, links: list[WanLink], control: str | None = "127.0.0.1:0"):
        self.links = {link.name: link for link in links}
        self.control = control
        self.control_url: str | None = None
        self._server: _Server | None = None
        self._task: asyncio.Task | None = None

    def app(self) -> FastAPI:
        app = FastAPI(title="pdd wan emulator")

        @app.get("/links")
        async def get_links() -> dict:
            return {name: link.state() for name, link in self.links.items()}

        @app.post("/links/{name}")
        async def set_link(name: str, body: LinkUpdate) -> dict:
            link = self.links.get(name)
            if link is None:
                raise HTTPException(404, f"no link {name!r}")
            try:
                await self.apply(link, body)
            except ValueError as e:
                raise HTTPException(422, str(e)) from None
            return link.state()

        @app.get("/health")
        async def health() -> dict:
            return {"ok": True}

        return app

    @staticmethod
    async def apply(link: WanLink, body: LinkUpdate) -> None:
        given = body.model_fields_set
        link.configure(
            delay_ms=body.delay_ms,
            jitter_ms=body.jitter_ms,
            bandwidth_mbps=body.bandwidth_mbps if "bandwidth_mbps" in given else -1.0,
        )
        if body.cut is True:
            await link.cut(body.cut_mode)
        elif body.cut is False:
            await link.restore()

    async def start(self) -> None:
        for link in self.links.values():
            await link.start()
        if self.control:
            host, port = split_hostport(self.control)
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
            sock.listen(64)
            sock.setblocking(False)
            self.control_url = f"http://{host}:{sock.getsockname()[1]}"
            config = uvicorn.Config(self.app(), log_level="warning", lifespan="off", access_log=False)
            self._server = _Server(config)
            self._task = asyncio.create_task(self._server.serve(sockets=[sock]))
            async with asyncio.timeout(10):
                while not self._server.started:
                    if self._task.done():
                        self._task.result()  # re-raise why it died
                    await asyncio.sleep(0.01)
        log.info(
            "wan emulator: %s; control %s",
            ", ".join(f"{n} {k.listen}>{k.target}" for n, k in self.links.items()),
            self.control_url,
        )

    async def stop(self) -> None:
        if self._server is not None and self._task is not None:
            self._server.should_exit = True
            with contextlib.suppress(TimeoutError, asyncio.CancelledError):
                async with asyncio.timeout(5):
                    await self._task
            if not self._task.done():
                self._task.cancel()
        for link in self.links.values():
            await link.stop()

    async def __aenter__(self) -> WanEmulator:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()
