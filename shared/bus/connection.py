"""NATS connection plus typed publish / subscribe / request helpers.

Every message is a `codec.Message`; trace context rides in the NATS headers (`traceparent`) so one
request is one trace across both datacenters. A subscriber never crashes on bad input: malformed
messages are logged, counted and dropped, and handler exceptions are logged and swallowed.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import random
from collections import Counter as _Tally
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from opentelemetry import context as otel_context
from opentelemetry import propagate
from prometheus_client import Counter

from shared.bus.codec import Message, MessageError, decode, encode

log = logging.getLogger(__name__)

M = TypeVar("M", bound=Message)
R = TypeVar("R", bound=Message)

# Malformed / unknown messages dropped, keyed by the *subscribed* subject (so wildcards keep the
# label set bounded). The dict is for tests and quick looks; the Counter is for /metrics.
MALFORMED: _Tally[str] = _Tally()
MALFORMED_TOTAL = Counter("pdd_bus_malformed_total", "Bus messages dropped as malformed", ["subject"])

RECONNECT_BASE_S = 0.1
RECONNECT_GROWTH = 1.5  # (not 2: a server restarted by its supervisor is back within about a second)
RECONNECT_MAX_S = 5.0


class RequestError(Exception):
    """The responder answered with a `nats.micro` service error (headers Nats-Service-Error*)."""

    def __init__(self, code: str, description: str):
        super().__init__(f"{code}: {description}")
        self.code, self.description = code, description


def _backoff(servers: list, _info: dict) -> tuple[Any, float]:
    # Exponential backoff with full jitter, per server; nats-py alone only has a fixed wait.
    srv = min(servers, key=lambda s: s.reconnects)
    delay = min(RECONNECT_MAX_S, RECONNECT_BASE_S * RECONNECT_GROWTH ** min(srv.reconnects, 16))
    return srv, random.uniform(delay / 2, delay)


async def connect(url: str | list[str], name: str, *, timeout: float | None = 30.0, **kw: Any) -> Client:
    """Connect and keep reconnecting forever (exponential backoff). Callers `await nc.drain()` on shutdown.

    `timeout` bounds only the *first* connection (None = wait forever); `kw` goes to `nats.connect`.
    """
    # A settings string may list a cluster's nodes, comma-separated: nats-py fails over among them.
    servers = [u.strip() for u in url.split(",") if u.strip()] if isinstance(url, str) else list(url)

    async def on_disconnect() -> None:
        level = logging.INFO if nc.is_closed or nc.is_draining else logging.WARNING
        log.log(level, "nats %s: disconnected", name)

    async def on_reconnect() -> None:
        log.warning("nats %s: reconnected to %s", name, nc.connected_url.netloc if nc.connected_url else "?")

    async def on_error(e: Exception) -> None:
        log.warning("nats %s: %s: %s", name, type(e).__name__, e)

    async def on_closed() -> None:
        log.info("nats %s: closed", name)

    opts: dict[str, Any] = dict(
        servers=servers,
        name=name,
        allow_reconnect=True,
        max_reconnect_attempts=-1,
        connect_timeout=2,
        disconnected_cb=on_disconnect,
        reconnected_cb=on_reconnect,
        error_cb=on_error,
        closed_cb=on_closed,
    )
    if "reconnect_to_server_handler" in inspect.signature(Client.connect).parameters:  # newer nats-py only
        opts["reconnect_to_server_handler"] = _backoff
    opts.update(kw)
    nc = Client()
    try:
        async with asyncio.timeout(timeout):
            await nc.connect(**opts)
    except BaseException:
        await nc.close()
        raise
    return nc


async def flushed(nc: Client, timeout: float = 10) -> None:
    """Return once the server has processed every SUB and PUB sent on `nc` so far.

    nats-py writes its PING straight to the socket, ahead of commands still queued for its
    flusher task, so one `nc.flush()` may return before an earlier SUB reaches the server (a
    publish from another connection then finds no subscriber). The flusher runs before the
    first PONG can be read, so a second PING leaves after everything queued before the call."""
    await nc.flush(timeout)
    await nc.flush(timeout)


def trace_headers(headers: dict | None) -> dict[str, str] | None:
    out = dict(headers or {})
    propagate.inject(out)  # adds `traceparent` (and baggage) when a span is current
    return out or None


async def publish(nc: Client, subject: str, msg: Message, *, headers: dict | None = None) -> None:
    await nc.publish(subject, encode(msg), headers=trace_headers(headers))


async def subscribe(
    nc: Client,
    subject: str,
    cls: type[M],
    handler: Callable[[M, Msg], Awaitable[None]],
    *,
    queue: str = "",
    ack: bool = False,
) -> Subscription:
    """Subscribe with decoding. nats-py calls the callback of one subscription sequentially:
    a slow handler delays the next message of the same subscription (spawn a task if needed).
    With ack, a message sent by shared/bus/delivery.py is acked on arrival."""
    return await nc.subscribe(subject, queue=queue, cb=decoding(subject, cls, handler, ack=ack))


def decoding(
    subject: str, cls: type[M], handler: Callable[[M, Msg], Awaitable[None]], *, ack: bool = False
) -> Callable[[Msg], Awaitable[None]]:
    """The callback that decodes a message as `cls` (a malformed one is counted and dropped),
    joins the sender's trace and calls handler(message, raw NATS message); with ack, a
    message that asks for one (it has a reply subject) is acked first, once decoded."""

    async def on_msg(raw: Msg) -> None:
        try:
            msg = decode(cls, raw.data)
        except MessageError as e:
            MALFORMED[subject] += 1
            MALFORMED_TOTAL.labels(subject=subject).inc()
            log.warning("dropped malformed %s on %s: %s", cls.__name__, raw.subject, e)
            return
        if ack and raw.reply:
            try:
                await raw._client.publish(raw.reply, b"")
            except Exception as e:  # the sender sends it again
                log.debug("could not ack %s on %s: %r", cls.__name__, raw.subject, e)
        token = otel_context.attach(propagate.extract(raw.headers or {}))
        try:
            await handler(msg, raw)
        except Exception:
            log.exception("handler for %s on %s failed", cls.__name__, raw.subject)
        finally:
            otel_context.detach(token)

    return on_msg


async def request(nc: Client, subject: str, msg: Message, reply_cls: type[R], *, timeout: float) -> R:
    """Request/reply. Raises nats.errors.TimeoutError (an asyncio.TimeoutError), NoRespondersError,
    RequestError for a micro service error reply, MessageError for an undecodable reply."""
    reply = await nc.request(subject, encode(msg), timeout=timeout, headers=trace_headers(None))
    hdrs = reply.headers or {}
    if "Nats-Service-Error-Code" in hdrs:
        raise RequestError(hdrs["Nats-Service-Error-Code"], hdrs.get("Nats-Service-Error", ""))
    return decode(reply_cls, reply.data)


async def respond(msg: Msg, reply: Message) -> None:
    if not msg.reply:
        raise ValueError(f"message on {msg.subject} has no reply subject")
    # Msg.respond would echo the request's headers; publish our own trace context instead.
    await msg._client.publish(msg.reply, encode(reply), headers=trace_headers(None))


async def respond_error(msg: Msg, code: str, description: str) -> None:
    """Answer with a `nats.micro` service error: the asker's `request` raises RequestError."""
    if not msg.reply:
        raise ValueError(f"message on {msg.subject} has no reply subject")
    headers = {"Nats-Service-Error-Code": code, "Nats-Service-Error": description}
    await msg._client.publish(msg.reply, b"", headers=headers)
