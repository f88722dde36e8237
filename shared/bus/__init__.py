"""NATS control plane: connection, typed msgpack messages, subjects, micro services, test servers."""

from shared.bus import subjects
from shared.bus.codec import Message, MessageError, decode, encode
from shared.bus.connection import (
    MALFORMED,
    RequestError,
    connect,
    flushed,
    publish,
    request,
    respond,
    subscribe,
)
from shared.bus.micro import register_service
from shared.bus.nats_server import NatsServer

__all__ = [
    "MALFORMED",
    "Message",
    "MessageError",
    "NatsServer",
    "RequestError",
    "connect",
    "decode",
    "encode",
    "flushed",
    "publish",
    "register_service",
    "request",
    "respond",
    "subjects",
    "subscribe",
]
