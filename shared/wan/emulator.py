"""Several WAN links in one process plus a small HTTP control API (FastAPI on uvicorn).

GET  /links          -> {name: listen, target (a pattern on dial-on-demand links), settings, counters}
POST /links/{name}   <- {delay_ms?, jitter_ms?, bandwidth_mbps? (null = unlimited), cut?, cut_mode?}

A request that is not that (a wrong type, an unknown key, a value outside shaper.LIMITS such
as a negative, infinite or NaN delay) gets 400 with the reason and changes nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Iterator
from dataclasses import fields

import uvicorn
from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict

from shared.wan.link import CutMode, WanLink, split_hostport
from shared.wan.shaper import LinkSettings

log = logging.getLogger(__name__)


SETTINGS = frozenset(f.name for f in fields(LinkSettings))


class LinkUpdate(BaseModel):
    """Only the fields a request gives are applied; strict: JSON numbers and booleans only."""

    model_config = ConfigDict(strict=True, extra="forbid")

    delay_ms: float = 0.0
    jitter_ms: float = 0.0
    bandwidth_mbps: float | None = None  # explicit null = unlimited
    cut: bool | None = None
    cut_mode: CutMode = "drop"

    def settings(self) -> dict[str, float | None]:
        """The link settings this request changes (their ranges are LinkSettings.validate's)."""
        return self.model_dump(include=self.model_fields_set & SETTINGS)


def _where(loc: tuple) -> str:
    return ".".join(p for p in loc[1:] if isinstance(p, str)) or "body"  # loc[0] is "body"


async def _bad_request(_: Request, exc: RequestValidationError) -> JSONResponse:
    """400, not FastAPI's 422, naming each offending key ("body" when it is not a JSON object)."""
    reasons = "; ".join(f"{_where(e['loc'])}: {e['msg']}" for e in exc.errors())
    return JSONResponse({"detail": reasons}, status_code=400)


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
        app.add_exception_handler(RequestValidationError, _bad_request)

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
                raise HTTPException(400, str(e)) from None
            return link.state()

        @app.get("/health")
        async def health() -> dict:
            return {"ok": True}

        return app

    @staticmethod
    async def apply(link: WanLink, body: LinkUpdate) -> None:
        link.configure(**body.settings())  # validates them all before changing any
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
