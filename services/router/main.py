"""Wires the router: NATS connection, tokenizer, RouterCore, HTTP app."""

from __future__ import annotations

from fastapi import FastAPI

from shared.bus.connection import connect
from shared.config import RouterSettings
from shared.model.describe import describe_model
from shared.security.credentials import nats_options
from shared.telemetry.tracing import setup_tracing, shutdown_tracing

from .api.app import create_app
from .api.http_settings import HttpSettings
from .service import RouterCore


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

        max_len = min(settings.engine.max_model_len, info.max_position_embeddings)
        return core, info.tokenizer, max_len, close

    return create_app(factory, http or HttpSettings.from_env())
