"""The declared tables (shared/bus/contract.py) against what the services do: every route's
subject is within its role's NATS permissions and each sender's, every handler a route names
exists, and the services subscribe through the tables alone."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

from services.main_decode.rdma_receiver import RdmaReceiver
from services.main_decode.service import MainDecodeService
from services.prefill.service import PrefillService
from services.relay.service import RelayService
from services.router.adapter.bus_adapter import BusAdapter
from services.router.adapter.cache_sync import CacheSync
from shared.bus.contract import TABLES, At, Delivery, Route
from shared.bus.permissions import PERMISSIONS, allows
from shared.serving.cache_events import CacheEvents
from shared.serving.subscriptions import serve
from shared.telemetry.span_bus import TraceAnswers

ROOT = Path(__file__).resolve().parents[2]
AT = At("inst-0", "dc-a", "tcp://10.0.0.7:9100")
SERVES = {
    "prefill": PrefillService,
    "relay": RelayService,
    "main_decode": MainDecodeService,
    "router": BusAdapter,
}
PARTS = {"rdma": RdmaReceiver, "cache_events": CacheEvents, "traces": TraceAnswers, "cache_sync": CacheSync}
ROUTES = [(role, route) for role, table in TABLES.items() for route in table]


def _id(item: tuple[str, Route]) -> str:
    return f"{item[0]}:{item[1].handler}:{item[1].pattern}"


@pytest.mark.parametrize("item", ROUTES, ids=_id)
def test_a_route_is_within_its_roles_permissions_and_its_senders(item: tuple[str, Route]) -> None:
    role, route = item
    subject = route.subject_at(AT)
    assert allows([route.pattern], subject), "a route's own subject lies within its pattern"
    assert allows(PERMISSIONS[role].subscribe, subject), f"{role} may not subscribe to {subject}"
    for sender in route.senders:
        sent = route.published_by(sender)
        assert allows([route.pattern], sent), f"{sender} sends {sent}, which {role} does not hear"
        assert allows(PERMISSIONS[sender].publish, sent), f"{sender} may not publish {sent}"


@pytest.mark.parametrize("item", ROUTES, ids=_id)
def test_a_routes_handler_exists_and_takes_message_and_raw(item: tuple[str, Route]) -> None:
    role, route = item
    *parts, name = route.handler.split(".")
    owner = PARTS[parts[0]] if parts else SERVES[role]
    handler = getattr(owner, name, None)
    assert handler is not None and inspect.iscoroutinefunction(handler), f"{role} has no {route.handler}"
    assert len(inspect.signature(handler).parameters) == 3  # self, the message, the raw NATS message
    if route.if_aborted:
        assert callable(getattr(owner, route.if_aborted, None))
    assert (route.delivery is Delivery.ADMIT) == (route.reply is not None)


def test_a_subject_missing_from_the_permissions_fails_the_check() -> None:
    """The check above can fail: a route the permissions were not generated from is refused."""
    stray = Route("on_stray", object, "pdd.prefill.*.stray", lambda at: f"pdd.prefill.{at.instance}.stray")
    assert not allows(PERMISSIONS["prefill"].subscribe, stray.subject_at(AT))


class _Recorder:
    """A Lifecycle and admission gate that note what is subscribed, and to whom it goes."""

    def __init__(self) -> None:
        self.made: list[tuple[str, object, str]] = []

    async def subscribe(self, *args, **kw) -> None:
        nc, subject, cls, handler = args if len(args) == 4 else (None, *args[:3])
        self.made.append((subject, cls, "acked" if kw.get("ack") else "event"))

    async def endpoint(self, nc, subject, cls, handler, *, queue: str = "") -> None:
        self.made.append((subject, cls, "answer"))


class _Owner:
    def __getattr__(self, name: str):
        return self if name in PARTS else (lambda *a: None)


@pytest.mark.parametrize("role", sorted(TABLES))
async def test_serve_subscribes_each_route_of_the_table_once(role: str) -> None:
    life, gate = _Recorder(), _Recorder()
    await serve(_Owner(), TABLES[role], AT, life, None, gate)  # type: ignore[arg-type]
    made = life.made + [(s, c, "admit") for s, c, _ in gate.made]
    assert sorted(s for s, *_ in made) == sorted(r.subject_at(AT) for r in TABLES[role])
    assert all(allows(PERMISSIONS[role].subscribe, s) for s, *_ in made)


def test_the_services_subscribe_through_their_tables_alone() -> None:
    """A subscription made beside the table would not be in the permissions it generates."""
    calls = re.compile(r"\b(life|admission)\.(subscribe|endpoint)\(|await subscribe\(")
    allowed = {
        "shared/serving/subscriptions.py",
        "shared/serving/runtime.py",
        "shared/serving/job_admission.py",
    }
    allowed.add("shared/telemetry/span_bus.py")  # serve_traces: a store answered outside a service
    found = [
        str(p.relative_to(ROOT))
        for base in ("services", "shared/serving")
        for p in (ROOT / base).rglob("*.py")
        if calls.search(p.read_text()) and str(p.relative_to(ROOT)) not in allowed
    ]
    assert found == []
