"""Subscribe a service from its declared table (shared/bus/contract.py): each route's subject
for this instance, decoded as its message type, to the handler the route names on `owner`."""

from __future__ import annotations

from operator import attrgetter
from typing import Any

from shared.bus.contract import At, Delivery, Route
from shared.serving.job_admission import AdmissionGate
from shared.serving.runtime import Lifecycle


async def serve(
    owner: Any,
    routes: tuple[Route, ...],
    at: At,
    life: Lifecycle,
    nc: Any,
    admission: AdmissionGate | None = None,
) -> None:
    for route in routes:
        handler = attrgetter(route.handler)(owner)
        subject = route.subject_at(at)
        if route.delivery is Delivery.ADMIT:
            assert admission is not None and route.reply is not None
            if_aborted = attrgetter(route.if_aborted)(owner) if route.if_aborted else None
            await admission.subscribe(subject, route.message, route.reply, handler, route.queue, if_aborted)
        elif route.delivery is Delivery.ANSWER:
            await life.endpoint(nc, subject, route.message, handler, queue=route.queue)
        else:
            ack = route.delivery is Delivery.ACKED
            await life.subscribe(nc, subject, route.message, handler, queue=route.queue, ack=ack)
