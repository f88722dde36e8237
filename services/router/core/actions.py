"""What the request life asks the router to do: plain values, performed by the adapter
(services/router/adapter/effects.py). The life itself never publishes, waits or counts."""

from __future__ import annotations

from dataclasses import dataclass

from shared.bus.messages import AbortReason, DecodeReport, RelayReport

from .request_stream import Delta, Failure, RequestStream


@dataclass(frozen=True)
class Publish:
    """Send `msg` on `subject` (fire and forget)."""

    subject: str
    msg: object


@dataclass(frozen=True)
class SendAbort:
    """Tell every instance to drop the attempt `attempt_rid` (traced under `stream`'s span)."""

    attempt_rid: str
    reason: AbortReason
    stream: RequestStream | None = None


@dataclass(frozen=True)
class Deliver:
    """Hand the client's consumer the next delta, or the failure that ends its request."""

    stream: RequestStream
    item: Delta | Failure
    ttft_s: float | None = None  # set on the delta that carries the request's first token
    gap_s: float | None = None  # on a later delta with tokens: the time since the previous one


@dataclass(frozen=True)
class Move:
    """The request's instance is lost (or failed it): continue it elsewhere by token IDs."""

    stream: RequestStream
    why: str
    cause: str  # lost | gap | stall | error | dispatch (the migrations metric's label)


@dataclass(frozen=True)
class Resume:
    """A move began: offer the new attempt to live instances (`lost`: the one to avoid)."""

    stream: RequestStream
    why: str
    cause: str


@dataclass(frozen=True)
class CountReports:
    """Reports that came with a request's last tokens, each counted once."""

    relay: RelayReport | None
    decode: DecodeReport | None


@dataclass(frozen=True)
class UnknownMessage:
    """A message for one of this router's request ids that no stream holds any more."""

    rid: str


@dataclass(frozen=True)
class Closed:
    """The stream ended and was freed: release what it counted in routing, end its trace."""

    stream: RequestStream


@dataclass(frozen=True)
class Forget:
    """The request was aborted: nothing will be delivered for `rid` any more."""

    rid: str


Action = Publish | SendAbort | Deliver | Move | Resume | CountReports | UnknownMessage | Closed | Forget
