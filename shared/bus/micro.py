"""Register a service with `nats.micro`, so `$SRV.PING/INFO/STATS` discovery works."""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from typing import Any

from nats.aio.client import Client
from nats.micro import add_service
from nats.micro.request import Request
from nats.micro.service import EndpointConfig, Service

Handler = Callable[[Request], Awaitable[None]]


def endpoint_name(subject: str) -> str:
    """micro endpoint names allow only [A-Za-z0-9_-]; derive one from a subject."""
    return re.sub(r"[^A-Za-z0-9_-]", "_", subject)


async def register_service(
    nc: Client,
    name: str,
    version: str,
    description: str,
    endpoints: dict[str, Handler] | None = None,
    metadata: dict[str, Any] | None = None,
) -> Service:
    """Start a micro service. `endpoints` maps a *subject* to its handler (queue group "q", the
    micro default, so instances of one service share the load). Call `await service.stop()`."""
    svc = await add_service(
        nc,
        name=name,
        version=version,
        description=description,
        metadata={str(k): str(v) for k, v in (metadata or {}).items()},
    )
    try:
        for subject, handler in (endpoints or {}).items():
            await svc.add_endpoint(
                EndpointConfig(name=endpoint_name(subject), subject=subject, handler=handler)
            )
    except BaseException:
        await svc.stop()
        raise
    return svc
