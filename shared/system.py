"""Starts the whole two-DC system (`pdd up`) as real processes, for end-to-end tests and benchmarks."""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from shared.launch import UpOptions, service_specs, with_base_port
from shared.security.credentials import Credentials

_handed_out: set[int] = set()
_port_lock = threading.Lock()


def free_port_block(n: int) -> int:
    """A base port with n consecutive free ports, below the kernel's ephemeral range (so
    outgoing connections cannot take them meanwhile) and never one this process handed out."""
    with _port_lock:
        for _ in range(500):
            base = random.randrange(20000, 32000 - n, 20)
            if base in _handed_out:
                continue
            socks = []
            try:
                for i in range(n):
                    sock = socket.socket()
                    sock.bind(("127.0.0.1", base + i))
                    socks.append(sock)
            except OSError:
                continue
            finally:
                for sock in socks:
                    sock.close()
            _handed_out.add(base)
            return base
    raise RuntimeError("no free port block")


@dataclass
class RunningSystem:
    proc: subprocess.Popen
    router_url: str
    wan_url: str
    workdir: Path

    def wan(self, link: str, **settings) -> None:
        r = httpx.post(f"{self.wan_url}/links/{link}", json=settings, timeout=10)
        r.raise_for_status()

    @contextmanager
    def shaped(self, link: str, **settings) -> Iterator[None]:
        """Apply WAN settings to a link for the duration of a block, then put back what was there."""
        before = httpx.get(f"{self.wan_url}/links", timeout=10).json()[link]
        self.wan(link, **settings)
        try:
            yield
        finally:
            self.wan(link, **{k: before[k] for k in settings})

    @property
    def credentials(self) -> Credentials:
        """What `pdd up` made for this system: CA, certificates, NATS passwords (always on)."""
        return Credentials(self.workdir / "secrets")

    def instances(self) -> dict:
        return httpx.get(f"{self.router_url}/v1/instances", timeout=10).json()

    def metrics_urls(self) -> dict[str, str]:
        """Where each service serves Prometheus metrics: the router on its HTTP port, the
        others on the ports `pdd up` gave them."""
        base = int(self.router_url.rsplit(":", 1)[1])
        urls = {"router": f"{self.router_url}/metrics"}
        for spec in service_specs(with_base_port(UpOptions(), base)):
            port = next((v for k, v in spec.env.items() if k.endswith("_METRICS_PORT")), None)
            if port is not None:
                urls[spec.name] = f"http://127.0.0.1:{port}/metrics"
        return urls

    def log(self, name: str) -> str:
        path = self.workdir / "logs" / f"{name}.log"
        return path.read_text() if path.exists() else ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def start_system(workdir: Path, env: dict[str, str] | None = None, *, delay_ms: float = 10, jitter_ms: float = 0,
                 bandwidth_mbps: float = 1000, model_preset: str = "tiny", timeout_s: float = 180) -> RunningSystem:
    base = free_port_block(20)
    args = [
        sys.executable, "-m", "shared.cli", "up", "--workdir", str(workdir), "--base-port", str(base),
        "--model-preset", model_preset, "--delay-ms", str(delay_ms), "--jitter-ms", str(jitter_ms), "--bandwidth-mbps", str(bandwidth_mbps),
    ]
    out = open(workdir / "pdd-up.log", "wb")
    proc = subprocess.Popen(args, env={**os.environ, **(env or {})}, stdout=out, stderr=subprocess.STDOUT,
                            start_new_session=True)
    router_url = f"http://127.0.0.1:{base}"
    system = RunningSystem(proc, router_url, f"http://127.0.0.1:{base + 19}", workdir)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"pdd up exited early:\n{(workdir / 'pdd-up.log').read_text()[-4000:]}")
        try:
            if httpx.get(f"{router_url}/health", timeout=2).status_code == 200:
                return system
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    system.stop()
    raise RuntimeError(f"system not healthy in {timeout_s}s:\n{(workdir / 'pdd-up.log').read_text()[-4000:]}")
