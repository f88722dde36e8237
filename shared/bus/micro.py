"""Register a service with `nats.micro`, so `$SRV.PING/INFO/STATS` discovery works and lists
the request/reply subjects it answers as endpoints."""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from typing import Any

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.micro import add_service
from nats.micro.request import Request
from nats.micro.service import EndpointConfig, Service

Handler = Callable[[Request], Awaitable[None]]
SERVICE_VERSION = "0.1.0"


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


async def add_endpoint(
    svc: Service, subject: str, on_msg: Callable[[Msg], Awaitable[None]], queue: str = ""
) -> None:
    """Answer `subject` as an endpoint of svc ($SRV.INFO lists it, $SRV.STATS counts its
    requests). on_msg gets the NATS message itself, so it replies as any responder does. Without
    a queue the endpoint takes micro's default group: one instance's own subject has one member."""

    async def handle(request: Request) -> None:
        await on_msg(request._msg)  # the message a micro Request wraps (nats-py keeps it private)

    config = EndpointConfig(
        name=endpoint_name(subject), subject=subject, queue_group=queue or None, handler=handle
    )
    await svc.add_endpoint(config)
