"""The router's log says where it serves once it does (the line an operator waits for)."""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace

import uvicorn
from fastapi import FastAPI

from services.router.main import DrainingServer
from tests.polling import until


async def test_the_router_logs_ready_with_its_url(caplog) -> None:
    app = FastAPI()
    app.state.core = SimpleNamespace(settings=SimpleNamespace(instance="r-0"))
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off")
    server = DrainingServer(config, app, drain_timeout_s=1.0)
    caplog.set_level(logging.INFO, logger="services.router.main")
    task = asyncio.create_task(server.serve())
    try:
        await until(lambda: server.started, timeout=10)
        port = server.servers[0].sockets[0].getsockname()[1]
        assert f"router r-0 ready on http://127.0.0.1:{port}" in caplog.text
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 10)
