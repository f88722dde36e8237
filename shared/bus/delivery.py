"""Control messages that must arrive: sent as NATS requests that the receiver acks on arrival
(`subscribe(..., ack=True)`), and sent again until acked or a deadline passes.

NATS delivers at most once: a message in flight when a server restarts or a gateway blips is
gone, and a request that waits for it (an MD target, a handoff batch, its ack, kv_ready, the
relay's start) would otherwise wait until the router's stall rule moves it. Every receiver takes
a repeat as a no-op (by request id and, for batches, sequence number), so sending again is safe;
an ack that is lost only costs one more copy. A message never acked is counted and logged: the
stall rule remains the last resort.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time

from nats.aio.client import Client
from prometheus_client import Counter

from shared.bus.codec import Message, encode
from shared.bus.connection import trace_headers

log = logging.getLogger(__name__)

ACK_TIMEOUT_S = 0.5  # per copy: a WAN round trip and a busy receiver's event loop, with room
BACKOFF_S = 0.05  # before the second copy; doubles up to MAX_BACKOFF_S
MAX_BACKOFF_S = 0.4
DEADLINE_S = 6.0  # past this no new copy is sent (a NATS server restart takes a few seconds)

# Fault injection, for tests only: the first copy of each message of these kinds (class names,
# comma-separated) is dropped before it leaves, as NATS drops one in a server restart. A single
# lost message cannot be produced on cue otherwise.
DROP_FIRST = frozenset(filter(None, os.environ.get("PDD_FAULT_DROP_FIRST_COPY", "").split(",")))

RESENT = Counter("pdd_bus_control_resent", "Control messages sent again for want of an ack", ["kind"])
UNDELIVERED = Counter(
    "pdd_bus_control_undelivered", "Control messages never acked before the deadline", ["kind"]
)


async def deliver(
    nc: Client,
    subject: str,
    msg: Message,
    *,
    ack_timeout_s: float = ACK_TIMEOUT_S,
    deadline_s: float = DEADLINE_S,
) -> bool:
    """Send `msg` until its receiver acks it; False if none did within deadline_s."""
    data, headers, kind = encode(msg), trace_headers(None), type(msg).__name__
    start, delay, copies = time.monotonic(), BACKOFF_S, 0
    while True:
        copies += 1
        try:
            if copies == 1 and kind in DROP_FIRST:
                await asyncio.sleep(ack_timeout_s)  # the ack a lost copy never brings
                raise TimeoutError("first copy dropped (PDD_FAULT_DROP_FIRST_COPY)")
            await nc.request(subject, data, timeout=ack_timeout_s, headers=headers)
            return True
        except asyncio.CancelledError:
            raise
        except Exception as e:  # no ack in time, nobody listening yet, the connection down
            last = e
        if time.monotonic() - start + delay > deadline_s:
            UNDELIVERED.labels(kind=kind).inc()
            log.warning("%s on %s not acked after %d copies: %r", kind, subject, copies, last)
            return False
        await asyncio.sleep(delay)
        delay = min(delay * 2, MAX_BACKOFF_S)
        RESENT.labels(kind=kind).inc()
