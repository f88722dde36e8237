"""What an engine service's core asks its shell to send: plain data, performed by the shell
(services/<role>/service.py) in the order the core gives them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from opentelemetry import context as otel_context
from opentelemetry.context import Context

from shared.bus.delivery import deliver
from shared.bus.messages import AbortReason, TokenEvent
from shared.serving.runtime import Lifecycle


@dataclass(frozen=True)
class SendTokens:
    """A token event to the router that owns the request."""

    router: str
    event: TokenEvent


@dataclass(frozen=True)
class SendAbort:
    """Tell every other role to drop the request."""

    rid: str
    reason: AbortReason
    detail: str = ""


@dataclass(frozen=True)
class Deliver:
    """A control message to one instance's subject, acked and resent until it lands (under
    `ctx`, the request's trace context, when given)."""

    subject: str
    msg: Any
    ctx: Context | None = None


J = TypeVar("J")


@dataclass(frozen=True)
class Free(Generic[J]):
    """The request ends here: the shell has the core forget it, then frees what it held
    (blocks, pins, spans); once only, however many events asked for it."""

    job: J


@dataclass(frozen=True)
class Unknown:
    """A message for a request this instance does not hold (it ended, or never came)."""

    rid: str


Sent = SendTokens | SendAbort | Deliver | Unknown
SENT = (SendTokens, SendAbort, Deliver, Unknown)


class Sender(Protocol):
    """What performs a Sent: an engine service."""

    nc: Any
    life: Lifecycle

    async def send_tokens(self, router: str, event: TokenEvent) -> None: ...

    async def send_abort(self, rid: str, reason: AbortReason, detail: str = "") -> None: ...

    def count_unknown_request(self) -> None: ...


async def perform_sent(service: Sender, action: Sent) -> None:
    """Send what the core asked for: tokens and aborts now, a control message by a delivery
    task of its own (which inherits the request's trace context when the action names one)."""
    if isinstance(action, SendTokens):
        await service.send_tokens(action.router, action.event)
    elif isinstance(action, SendAbort):
        await service.send_abort(action.rid, action.reason, action.detail)
    elif isinstance(action, Deliver):
        token = otel_context.attach(action.ctx) if action.ctx is not None else None
        try:
            service.life.spawn(deliver(service.nc, action.subject, action.msg))
        finally:
            if token is not None:
                otel_context.detach(token)
    else:
        service.count_unknown_request()
