"""`pdd up`: the whole two-DC system on one machine, from the specs in pdd/launch.py.

Order: the credentials (created on first start, reused after), WAN emulator, the NATS servers
of both DCs (every node; routed within a DC, gatewayed across the WAN), then every instance of
prefill, relay, main_decode, router; ready once every router's /health answers 200. A child that exits before then stops `pdd up` (a setup error
that restarting would not fix); once up, pdd/supervisor.py restarts whatever exits, with
backoff. Ctrl-C / SIGTERM or a crash loop stops everything in reverse order.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import replace
from typing import Any

import httpx

from pdd.launch import SERVICES, NatsSpec, UpOptions, nats_specs, router_urls, secrets_dir, service_specs
from pdd.supervisor import ProcessDied, RestartPolicy, Supervisor
from shared.security.credentials import Credentials


async def _first(*aws: Awaitable[Any]) -> None:
    """Run until the first awaitable finishes; cancel the rest; re-raise its error."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    for t in done:
        t.result()


def ensure_credentials(opts: UpOptions, *, renew: bool = False) -> Credentials:
    """The secrets directory of this workdir, with a certificate naming `opts.host` too."""
    return Credentials(secrets_dir(opts)).ensure(SERVICES, [opts.host], renew=renew)


def _nats_server(spec: NatsSpec, opts: UpOptions, creds: Credentials) -> Any:
    from shared.bus.nats_config import nats_users
    from shared.bus.nats_server import NatsServer  # lazy: owned by the transport layer

    workdir = opts.workdir.resolve() / "nats" / spec.name
    workdir.mkdir(parents=True, exist_ok=True)
    return NatsServer(
        spec.name,
        host=opts.host,
        port=spec.port,
        gateway_port=spec.gateway_port,
        gateways=spec.gateways,
        workdir=workdir,
        gateway_advertise=spec.advertise,
        tls=creds.identity(spec.identity),
        users=nats_users(SERVICES),
        # a lone server gets today's arguments only: no cluster block at all
        **(
            dict(cluster=spec.cluster, cluster_port=spec.cluster_port, routes=spec.routes)
            if spec.cluster
            else {}
        ),
    )


async def _wait_http_ok(url: str, timeout_s: float) -> None:
    """Poll `url` until it answers 200."""
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(timeout=2.0) as client:
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if (await client.get(url)).status_code == 200:
                    return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{url} did not answer 200 within {timeout_s:.0f}s")
            await asyncio.sleep(0.25)


async def smoke_request(base_url: str, out: Callable[[str], None] = print) -> bool:
    """One non-streaming completion; prints the pipeline header and the body."""
    async with httpx.AsyncClient(base_url=base_url, timeout=120.0) as client:
        models = (await client.get("/v1/models")).json().get("data") or [{"id": "pdd"}]
        r = await client.post(
            "/v1/completions",
            json={"model": models[0]["id"], "prompt": "Hello from pdd", "max_tokens": 16, "temperature": 0},
        )
    out(f"POST /v1/completions -> {r.status_code}  x-pdd-pipeline={r.headers.get('x-pdd-pipeline')}")
    with contextlib.suppress(ValueError):
        out(json.dumps(r.json(), indent=2))
    return r.status_code == 200


# Every service waits on its NATS node: one that exits is started again at once the first time
# (an engine waits the policy's 0.5 s, leaving the cores to the survivors taking its streams).
BUS_FIRST_RESTART_S = 0.1


async def _start_nats(opts: UpOptions, sup: Supervisor, start_timeout_s: float) -> None:
    """Every node of both DCs; returns once each is routed to the rest of its cluster and
    gatewayed to the other DC."""
    creds = ensure_credentials(opts)
    specs = nats_specs(opts)
    servers = [_nats_server(spec, opts, creds) for spec in specs]
    bus = replace(sup.policy, backoff_initial_s=min(sup.policy.backoff_initial_s, BUS_FIRST_RESTART_S))
    for server in servers:
        await sup.start(server, policy=bus)
    clustered = [(server, spec) for server, spec in zip(servers, specs, strict=True) if spec.cluster]
    await asyncio.gather(*(s.wait_routes(len(spec.routes) - 1, start_timeout_s) for s, spec in clustered))
    await asyncio.gather(*(s.wait_gateways(start_timeout_s) for s in servers))


async def _start_system(opts: UpOptions, sup: Supervisor, urls: list[str], start_timeout_s: float) -> None:
    """WAN emulator, NATS servers, then the services; returns once every router's /health is 200."""
    wan, *services = service_specs(opts)
    await sup.start_all([wan])
    await _start_nats(opts, sup, start_timeout_s)
    await sup.start_all(services)
    await asyncio.gather(*(_wait_http_ok(f"{url}/health", start_timeout_s) for url in urls))


@contextlib.contextmanager
def _signals_set(event: asyncio.Event) -> Iterator[None]:
    """Ctrl-C / SIGTERM set `event` (instead of raising) while inside."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, event.set)
    try:
        yield
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)


async def run_up(
    opts: UpOptions,
    *,
    smoke: bool = False,
    start_timeout_s: float = 180.0,
    restart: RestartPolicy = RestartPolicy(),
    out: Callable[[str], None] = print,
) -> int:
    """Bring the system up; serve until a signal or a crash loop (with smoke: one request). Exit code."""
    workdir = opts.workdir.resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    sup = Supervisor(workdir, policy=restart)
    stop = asyncio.Event()
    urls = router_urls(opts)
    ok = True

    async def serve() -> None:
        nonlocal ok
        await _first(_start_system(opts, sup, urls, start_timeout_s), sup.until_exit())
        out(f"pdd is up: {' '.join(urls)}")
        out(f"  logs: {workdir / 'logs'}   traces: pdd trace <x-request-id> --dir {workdir / 'traces'}")
        if smoke:  # one request through every router
            ok = all([await smoke_request(url, out) for url in urls])
            return
        await sup.supervise()  # serve until stopped

    try:
        with _signals_set(stop):
            await _first(serve(), stop.wait())
    except ProcessDied as e:
        print(f"pdd up: {e}", file=sys.stderr)
        ok = False
    except (TimeoutError, RuntimeError, OSError) as e:  # NATS failing to start, ports in use, ...
        print(f"pdd up: {e}; logs in {workdir / 'logs'}", file=sys.stderr)
        ok = False
    finally:
        out("pdd up: stopping")
        await sup.stop_all()  # services first, then the NATS servers, the WAN emulator last
    return 0 if ok else 1
