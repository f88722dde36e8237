"""Every per-request map drains: after a request, and after a client that leaves before its
first byte (the router must still free the stream and abort it everywhere). Read from
pdd_open_entries and pdd_kv_blocks_used on every service's /metrics (`pdd up`)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import socket

import httpx
import pytest

from pdd.launch import ENV_PREFIX, UpOptions, service_specs, with_base_port
from pdd.system import RunningSystem, start_system
from services.router.api.http_settings import HttpSettings
from services.router.main import build_app
from shared.config import RouterSettings
from shared.security.credentials import require_credentials
from tests.polling import until, wait_until
from tests.prometheus_samples import PER_INSTANCE, moved, open_entries, scrape, wait_until_drained

DRAIN_S = 30
ENGINES = ("prefill", "relay", "main_decode")
TRACKED = (
    {("router", "streams"), *PER_INSTANCE, ("prefill", "export_plans")}
    | {("relay", name) for name in ("early_ready", "early_start", "landed")}
    | {(svc, name) for svc in ENGINES for name in ("jobs", "engine_requests", "pins", "kv_blocks_used")}
)
LONG = 3000  # output tokens of a request that must be cut short by an abort


@pytest.fixture(scope="module")
def system(tmp_path_factory) -> RunningSystem:
    sysm = start_system(tmp_path_factory.mktemp("pdd-entries"), {"PDD_ROUTER_TOKEN_TIMEOUT_S": "60"})
    yield sysm
    sysm.stop()


def test_every_map_is_tracked_and_drains_after_requests(system):
    for pipeline in ("p-md", "p-rld-md"):
        r = httpx.post(
            f"{system.router_url}/v1/completions",
            timeout=60,
            json={"prompt": "x" * 40, "max_tokens": 8, "pdd": {"pipeline": pipeline}},
        )
        assert r.status_code == 200, r.text
    entries = open_entries(system)
    assert TRACKED <= set(entries), TRACKED - set(entries)
    assert entries[("router", "registry_reports")] == len(ENGINES)
    assert wait_until_drained(system, DRAIN_S) == {}


def _send_and_leave(system: RunningSystem, path: str, body: dict) -> None:
    """POST the request and close the connection without reading a byte of the answer."""
    payload = json.dumps(body).encode()
    head = f"POST {path} HTTP/1.1\r\nhost: router\r\ncontent-type: application/json\r\n"
    head += f"content-length: {len(payload)}\r\nconnection: close\r\n\r\n"
    host, port = system.router_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(head.encode() + payload)


def _wait_routed(router: str, before: dict) -> None:
    """Until the router has opened the stream (it counts each routed request's hit rate)."""
    routed = lambda: moved(before, scrape(router), "pdd_prefix_hit_rate_count") >= 1  # noqa: E731
    wait_until(routed, DRAIN_S, 0.1, "the request reaching the router")


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stream": True}),
        ("/v1/completions", {"prompt": "hi", "stream": True}),
        ("/v1/completions", {"prompt": "hi", "stream": False}),
    ],
)
def test_a_request_left_before_its_first_byte_is_freed_and_aborted(system, path, body):
    urls = system.metrics_urls()
    assert wait_until_drained(system, DRAIN_S) == {}
    before_router, before_md = scrape(urls["router"]), scrape(urls["main_decode"])
    request = {**body, "max_tokens": LONG, "ignore_eos": True, "temperature": 0, "pdd": {"pipeline": "p-md"}}
    # MD's prepare crosses the WAN: the client has left before the router can answer.
    with system.shaped("gw-ab", delay_ms=500):
        _send_and_leave(system, path, request)
        _wait_routed(urls["router"], before_router)
        left = wait_until_drained(system, DRAIN_S)
    assert left == {}, f"still held: {left}"
    # MD stopped early: the router's abort reached it (the request would have run to LONG).
    produced = moved(before_md, scrape(urls["main_decode"]), "pdd_output_tokens_total", role="main_decode")
    assert produced < LONG - 1  # prefill sampled the first token, MD would have made the rest


def _router_env(system: RunningSystem) -> dict[str, str]:
    """What `pdd up` gives this system's router (NATS, credentials, ports), for a second one."""
    base = int(system.router_url.rsplit(":", 1)[1])
    opts = dataclasses.replace(with_base_port(UpOptions(), base), workdir=system.workdir)
    return next(s for s in service_specs(opts) if s.name == "router").env


def _http_scope(path: str, payload: bytes) -> dict:
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": headers,
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 80),
    }


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
        ("/v1/completions", {"prompt": "hi"}),
    ],
)
async def test_a_stream_whose_client_is_gone_when_the_response_starts_is_freed(
    system, monkeypatch, path, body
):
    """The client is gone by the time the response starts, and the server's send yields to the
    loop (as any server's does under backpressure): the response is cancelled before its body
    was ever asked for, so deltas() never ran. Such a server is the one fake part (uvicorn's
    h11 server here reads the close only later): the ASGI receive/send of a second, in-process
    router on this system's NATS."""
    for name, value in {**_router_env(system), "PDD_ROUTER_INSTANCE": "asgi-test"}.items():
        monkeypatch.setenv(name, value)
    settings = require_credentials(RouterSettings(), "router", ENV_PREFIX["router"], kv=False)
    app = build_app(settings, http=HttpSettings())
    payload = json.dumps(
        {**body, "stream": True, "max_tokens": LONG, "ignore_eos": True, "pdd": {"pipeline": "p-md"}}
    ).encode()
    md = system.metrics_urls()["main_decode"]
    before_md, sent, asked = scrape(md), [], []

    async def receive() -> dict:
        asked.append(1)
        return (
            {"type": "http.request", "body": payload, "more_body": False}
            if len(asked) == 1
            else {"type": "http.disconnect"}
        )

    async def send(message: dict) -> None:
        sent.append(message["type"])
        await asyncio.sleep(0.01)  # waits for the socket to drain

    async with app.router.lifespan_context(app):
        core = app.state.core
        await until(lambda: min(core.ready().values()), DRAIN_S, 0.1, "every instance's load report")
        await app(_http_scope(path, payload), receive, send)
        # Cancelled at its start: Starlette 1.x may send the first chunk before it hears the
        # disconnect, never the stream's end.
        assert sent[0] == "http.response.start" and len(sent) <= 2
        assert core.streams == {}
        assert await asyncio.to_thread(wait_until_drained, system, DRAIN_S) == {}  # the loop sends the abort
    after_md = scrape(md)

    def md_tokens(samples) -> float:  # MD's output tokens, whatever other labels they carry (none yet: 0)
        return sum(
            v
            for (n, ls), v in samples.items()
            if n == "pdd_output_tokens_total" and ("role", "main_decode") in ls
        )

    produced = md_tokens(after_md) - md_tokens(before_md)
    assert produced < LONG - 1  # MD was told to stop before its last token
