"""NATS as `pdd up` runs it, against a real nats-server: who may connect, who may say what,
and that the gateway between the datacenters carries no plaintext."""

from __future__ import annotations

import asyncio
import json
import os
import ssl
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from nats.aio.msg import Msg

from pdd.launch import SERVICES
from shared.bus import NatsServer, connect, flushed, publish, subjects, subscribe
from shared.bus.messages import Role, TokenBatch, TokenEvent
from shared.bus.subjects import Req
from shared.ports import free_port
from shared.security import client_context
from tests.fixtures_nats import NatsSecurity

RID = "r1"
PROBE = "_INBOX.probe"  # an inbox nobody asked for: no service may write into it


def _publishers() -> dict[str, set[str]]:
    """Every concrete subject the services use -> who may publish on it. Written out here, apart
    from shared/bus/permissions.py, so a wrong row there fails this test."""
    data = {"prefill", "relay", "main_decode"}
    table = {
        subjects.req(RID, Req.TOKENS): data,
        subjects.router_tokens("router-0-ab12"): data,
        subjects.to_instance("relay", "0", Req.KV_READY): {"main_decode"},
        subjects.to_instance("relay", "0", Req.RELAY_START): {"prefill"},
        subjects.to_instance("main_decode", "0", Req.HANDOFF): {"prefill", "relay"},
        subjects.to_instance("relay", "0", Req.HANDOFF_ACK): {"main_decode"},
        subjects.to_instance("prefill", "0", Req.MD_TARGET): {"router"},
        subjects.to_instance("prefill", "0", Req.MD_LOST): {"router"},
        subjects.to_instance("relay", "0", Req.MD_LOST): {"router"},
        subjects.req(RID, Req.HANDOFF): set(),  # per-request messages go to an instance, not here
        subjects.prefill_submit(): {"router"},
        subjects.prefill_submit_to("0"): {"router"},
        subjects.md_prepare("0"): {"router"},
        subjects.resume("main_decode", "0"): {"router"},
        subjects.resume("relay", "0"): {"router"},
        subjects.kv_events("main_decode", "0"): {"main_decode"},
        subjects.kv_events("prefill", "0"): {"prefill"},
        subjects.kv_snapshot("main_decode", "0"): {"router"},
        subjects.kv_snapshot("prefill", "0"): {"router"},
        PROBE: set(),
    }
    table.update({subjects.load(s, "0"): {s} for s in SERVICES})  # the router's is its heartbeat
    # An abort carries its sender's role in the subject: each role may sign only its own.
    table.update({subjects.abort(RID, s): {s} for s in SERVICES})
    return table


async def _refused(sec: NatsSecurity, server: NatsServer, **kw) -> str:
    """Connect with `kw`, which must fail; every error the client saw, as text."""
    errors: list[Exception] = []

    async def on_error(e: Exception) -> None:
        errors.append(e)

    with pytest.raises(Exception) as caught:  # noqa: B017 - TLS and auth failures differ in type
        nc = await connect(server.url, "intruder", allow_reconnect=False, timeout=10, error_cb=on_error, **kw)
        await nc.close()
    return " | ".join(repr(e) for e in [*errors, caught.value])


async def test_a_certificate_no_user_is_named_for_is_refused(
    nats_server: NatsServer, nats_security: NatsSecurity
) -> None:
    pki = nats_security.creds.pki
    pki.ensure(["stranger"], [])  # signed by the CA, but of no role: no user maps to it
    cert = client_context(pki.identity("stranger"))
    assert "Authorization Violation" in await _refused(nats_security, nats_server, tls=cert)
    # a user name and password claim nothing: the certificate alone says who connects
    claim = await _refused(nats_security, nats_server, tls=cert, user="main_decode", password="guess")
    assert "Authorization Violation" in claim


async def test_a_relay_certificate_cannot_act_as_main_decode(
    nats_server: NatsServer, nats_security: NatsSecurity
) -> None:
    """The relay's certificate is the relay on the bus, whatever it claims: with main_decode's
    user and a password it is refused; without, it may not hear MD's prepares nor send MD's
    kv_ready (the first link a forged MD touches)."""
    relay_cert = client_context(nats_security.creds.identity("relay"))
    claim = await _refused(nats_security, nats_server, tls=relay_cert, user="main_decode", password="x")
    assert "Authorization Violation" in claim
    errors: list[Exception] = []

    async def on_error(e: Exception) -> None:
        errors.append(e)

    router = await nats_security.connect(nats_server, "router", user="router")
    forged = await connect(nats_server.url, "md-forged", tls=relay_cert, error_cb=on_error)
    heard: list[str] = []

    async def seen(msg: Msg) -> None:
        heard.append(msg.subject)

    try:
        await forged.subscribe(subjects.md_prepare("md-forged"), cb=seen)
        await forged.publish(subjects.to_instance("relay", "0", Req.KV_READY), b"x")
        await flushed(forged)
        await router.publish(subjects.md_prepare("md-forged"), b"x")
        await flushed(router)
        await asyncio.sleep(0.3)
        assert heard == []
        violations = [str(e).lower() for e in errors if "permissions violation" in str(e).lower()]
        assert any("subscription" in v and "prepare" in v for v in violations), errors
        assert any("publish" in v and "kv_ready" in v for v in violations), errors
    finally:
        await forged.close()
        await router.close()


async def test_client_without_a_certificate_is_refused(
    nats_server: NatsServer, nats_security: NatsSecurity
) -> None:
    trusts_ca_only = ssl.create_default_context(cafile=str(nats_security.creds.pki.ca_cert))
    err = await _refused(nats_security, nats_server, tls=trusts_ca_only)
    # The server's alert, or (when it hangs up before the client reads the alert) a broken pipe.
    assert any(why in err for why in ("CERTIFICATE_REQUIRED", "Broken pipe", "Connection reset")), err


async def test_plaintext_client_is_refused(nats_server: NatsServer, nats_security: NatsSecurity) -> None:
    # The server's INFO line is plain (NATS upgrades after it); a client that then speaks
    # plaintext (so without a certificate, whatever user it names) gets no PONG and loses the
    # connection.
    reader, writer = await asyncio.open_connection(nats_server.host, nats_server.port)
    try:
        info = json.loads((await reader.readline()).removeprefix(b"INFO "))
        assert info["tls_required"] and info["auth_required"]
        hello = {"user": "CN=test,O=pdd", "verbose": False, "pedantic": False}
        writer.write(f"CONNECT {json.dumps(hello)}\r\nPING\r\n".encode())
        await writer.drain()
        rest = await asyncio.wait_for(reader.read(), 30)  # until the server closes
    finally:
        writer.close()
    assert b"PONG" not in rest


@pytest.mark.parametrize("service", SERVICES)
async def test_each_service_publishes_only_its_own_subjects(
    nats_server: NatsServer, nats_security: NatsSecurity, service: str
) -> None:
    listener = await nats_security.connect(nats_server, "listener")
    got: list[str] = []
    done = asyncio.Event()

    async def seen(msg: Msg) -> None:
        got.append(msg.subject)
        if msg.subject == subjects.abort("end", service):
            done.set()

    errors: list[Exception] = []

    async def on_error(e: Exception) -> None:
        errors.append(e)

    for pattern in ("pdd.>", PROBE):
        await listener.subscribe(pattern, cb=seen)
    await flushed(listener)
    nc = await nats_security.connect(nats_server, service, user=service, error_cb=on_error)
    try:
        table = _publishers()
        for subject in table:
            await nc.publish(subject, b"x")
        # Everyone may abort in its own name; one connection's messages arrive in order, so once
        # this one is here every message published before it that was let through is here too.
        await nc.publish(subjects.abort("end", service), b"x")
        await asyncio.wait_for(done.wait(), 10)
        await flushed(nc)  # the server's -ERR replies precede its PONG, and nats-py reports them inline
        assert set(got) - {subjects.abort("end", service)} == {
            s for s, who in table.items() if service in who
        }
        assert sum("permissions violation" in str(e).lower() for e in errors) == sum(
            service not in who for who in table.values()
        )
    finally:
        await nc.close()
        await listener.close()


async def test_a_token_event_from_the_router_never_reaches_the_router(
    nats_server: NatsServer, nats_security: NatsSecurity
) -> None:
    router = await nats_security.connect(nats_server, "router", user="router")
    relay = await nats_security.connect(nats_server, "relay", user="relay")
    got: asyncio.Queue = asyncio.Queue()

    async def on(msg, raw: Msg) -> None:
        await got.put(msg)

    try:
        subject = subjects.router_tokens("router-0-ab12")
        await subscribe(router, subject, TokenBatch, on)
        await flushed(router)
        forged = TokenBatch([TokenEvent(RID, Role.MAIN_DECODE, 0, [666])])
        await publish(router, subject, forged)  # the router may not
        # Had the server let it through, it would have sent it to this very connection before
        # answering these PINGs: so it would be queued ahead of the real one below.
        await flushed(router)
        real = TokenBatch([TokenEvent(RID, Role.RELAY, 0, [1])])
        await publish(relay, subject, real)  # the relay may
        assert await asyncio.wait_for(got.get(), 10) == real
    finally:
        await router.close()
        await relay.close()


async def test_a_service_cannot_listen_outside_its_row(
    nats_server: NatsServer, nats_security: NatsSecurity
) -> None:
    # The relay may not read token streams (only the router consumes them).
    relay = await nats_security.connect(nats_server, "relay", user="relay")
    prefill = await nats_security.connect(nats_server, "prefill", user="prefill")
    got: list[str] = []
    arrived = asyncio.Event()

    async def seen(msg: Msg) -> None:
        got.append(msg.subject)
        arrived.set()

    try:
        await relay.subscribe(subjects.all_req(Req.TOKENS), cb=seen)
        await relay.subscribe(subjects.all_aborts(), cb=seen)
        await flushed(relay)
        await prefill.publish(subjects.req(RID, Req.TOKENS), b"x")
        await prefill.publish(subjects.abort(RID, "prefill"), b"x")
        await flushed(prefill)
        await asyncio.wait_for(arrived.wait(), 10)  # in order: tokens first, had they been let through
        assert got == [subjects.abort(RID, "prefill")]
    finally:
        await relay.close()
        await prefill.close()


# ---- the gateway ---------------------------------------------------------------------------------


class Tap:
    """A TCP forwarder that keeps every byte it carries (one direction of a gateway)."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.seen = bytearray()
        self.server: asyncio.Server | None = None

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._pipe, "127.0.0.1", 0)
        return self.server.sockets[0].getsockname()[1]

    async def _pipe(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        ur, uw = await asyncio.open_connection("127.0.0.1", self.target_port)

        async def copy(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            while data := await src.read(65536):
                self.seen += data
                dst.write(data)
                await dst.drain()
            dst.close()

        await asyncio.gather(copy(r, uw), copy(ur, w), return_exceptions=True)

    def close(self) -> None:
        if self.server:
            self.server.close()


@pytest.fixture
async def tapped_pair(nats_security: NatsSecurity) -> AsyncIterator[tuple[NatsServer, NatsServer, Tap]]:
    """dc-a dials dc-b's gateway through a Tap; dc-b dials dc-a directly."""
    gw_b = free_port()
    tap = Tap(gw_b)
    tap_port = await tap.start()
    b = nats_security.server("dc-b", "nats-b", gateway_port=gw_b)
    a = nats_security.server(
        "dc-a", gateway_port=free_port(), gateways={"dc-b": f"nats://127.0.0.1:{tap_port}"}
    )
    await b.start()
    try:
        await a.start()
        await a.wait_gateways(15)
        await b.wait_gateways(15, names=["dc-a"])
        yield a, b, tap
    finally:
        await a.stop()
        await b.stop()
        tap.close()


async def test_the_gateway_runs_tls_and_carries_no_plaintext(
    tapped_pair, nats_security: NatsSecurity
) -> None:
    a, b, tap = tapped_pair
    assert "tls {" in a.config_text().split("gateway {")[1]  # both ends require certificates
    marker = b"plaintext-marker-" + os.urandom(8).hex().encode()
    md = await nats_security.connect(b, "md", user="main_decode")
    router = await nats_security.connect(a, "router", user="router")
    got: asyncio.Queue = asyncio.Queue()

    async def answer(msg: Msg) -> None:
        await msg.respond(marker)  # md's one reply to a request it received (allow_responses)

    try:
        await md.subscribe(subjects.md_prepare("0"), cb=answer)
        await flushed(md)
        async with asyncio.timeout(15):
            while got.empty():  # interest crosses the gateway asynchronously
                try:
                    await got.put(await router.request(subjects.md_prepare("0"), marker, timeout=0.5))
                except Exception:
                    await asyncio.sleep(0.05)
        assert (await got.get()).data == marker  # crossed both ways
        assert len(tap.seen) > 1000  # the tap did carry the gateway
        assert marker not in tap.seen and b"RMSG" not in tap.seen and b"CONNECT" not in tap.seen
    finally:
        await md.close()
        await router.close()


# ---- servers: routes and the gateway take only NATS servers' certificates -------------------------


async def test_a_relay_certificate_cannot_join_as_a_gateway_or_a_route(nats_security: NatsSecurity) -> None:
    """A nats-server run with DC A's relay certificate dials nats-a's gateway (as dc-b) and its
    route port (as a node of its cluster): both refused, while nats-b's own certificate joins."""
    gw_a, route_a = free_port(), free_port()
    a = nats_security.server("nats-a-0", cluster="nats-a", cluster_port=route_a, gateway_port=gw_a)
    relay = nats_security.creds.identity("relay")
    rogue_gw = NatsServer(
        "dc-b",
        tls=relay,
        users=nats_security.users(),
        gateway_port=free_port(),
        gateways={"nats-a": f"nats://127.0.0.1:{gw_a}"},
    )
    rogue_node = NatsServer(
        "nats-a-9",
        tls=relay,
        users=nats_security.users(),
        cluster="nats-a",
        routes=[f"nats-route://127.0.0.1:{route_a}"],
    )
    good = nats_security.server(
        "dc-b", "nats-b", gateway_port=free_port(), gateways={"nats-a": f"nats://127.0.0.1:{gw_a}"}
    )
    await a.start()
    try:
        for s in (rogue_gw, rogue_node):
            await s.start()
        await asyncio.sleep(2)  # several tries each
        for s in (rogue_gw, rogue_node):
            assert "Authorization Violation" in s.log_path.read_text(), s.name
        await rogue_gw.stop()
        await good.start()
        await good.wait_gateways(15)  # the same dial with nats-b's certificate is let in
        async with httpx.AsyncClient() as http:
            routez = (await http.get(f"{a.monitor_url}/routez")).json()
            gatewayz = (await http.get(f"{a.monitor_url}/gatewayz")).json()
        assert not routez.get("routes")
        assert set(gatewayz.get("inbound_gateways") or {}) == {"dc-b"}  # the good one's only
    finally:
        for s in (good, rogue_gw, rogue_node, a):
            await s.stop()


# ---- a service without credentials ---------------------------------------------------------------


@pytest.mark.e2e  # starts each service in its own interpreter (torch and all): too slow for the inner loop
@pytest.mark.parametrize(("service", "prefix"), [("prefill", "PDD_PREFILL_"), ("router", "PDD_ROUTER_")])
def test_a_service_without_credentials_exits_at_once(service: str, prefix: str, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDD_")}
    env[f"{prefix}NATS_URL"] = "tls://127.0.0.1:4222"
    proc = subprocess.run(
        [sys.executable, "-m", f"services.{service}"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith(f"{service}: missing setting {prefix}TLS_CA, {prefix}TLS_CERT"), line
    assert "NATS" not in line and (f"{prefix}SECRET" in line) == (service != "router")
