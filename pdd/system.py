"""Starts the whole two-DC system (`pdd up`) as real processes, for end-to-end tests and benchmarks."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from pdd.launch import PORT_BLOCK, UpOptions, router_urls, service_specs, with_base_port
from pdd.supervisor import read_pid
from shared.ports import free_port_block
from shared.security.credentials import Credentials


@dataclass
class RunningSystem:
    proc: subprocess.Popen
    router_url: str  # the first router
    wan_url: str
    workdir: Path
    router_urls: list[str] = field(default_factory=list)  # every router, interchangeable
    opts: UpOptions = field(default_factory=UpOptions)  # what `pdd up` was given

    def pid(self, name: str) -> int | None:
        """The pid of process `name` (prefill, main_decode-1, nats-a, ...); None while it is down."""
        return read_pid(self.workdir, name)

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
        """Where each service instance serves Prometheus metrics, by process name: a router on
        its HTTP port, the others on the ports `pdd up` gave them."""
        urls = {}
        for spec in service_specs(self.opts)[1:]:
            port = next((v for k, v in spec.env.items() if k.endswith("_METRICS_PORT")), None)
            if port is None:
                port = spec.env["PDD_ROUTER_PORT"]
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


def start_system(
    workdir: Path,
    env: dict[str, str] | None = None,
    *,
    delay_ms: float = 10,
    jitter_ms: float = 0,
    bandwidth_mbps: float = 1000,
    model_preset: str | None = "tiny",
    timeout_s: float = 180,
    prefill: int = 1,
    relay: int = 1,
    md: int = 1,
    routers: int = 1,
    nats_cluster: int = 1,
    model_path: str | None = None,
    api_keys: tuple[str, ...] = (),
    engine: str = "pdd",
    python: str | None = None,
) -> RunningSystem:
    """`pdd up` under `python` (default: this interpreter; vLLM engines want vLLM's environment)."""
    counts = dict(prefill=prefill, relay=relay, md=md, routers=routers, nats_cluster=nats_cluster)
    base = free_port_block(PORT_BLOCK)
    opts = with_base_port(
        UpOptions(
            workdir=Path(workdir),
            model_preset=model_preset,
            delay_ms=delay_ms,
            jitter_ms=jitter_ms,
            bandwidth_mbps=bandwidth_mbps,
            **counts,
        ),
        base,
    )
    args = [
        python or sys.executable,
        "-m",
        "pdd.cli",
        "up",
        "--workdir",
        str(workdir),
        "--base-port",
        str(base),
        "--delay-ms",
        str(delay_ms),
        "--jitter-ms",
        str(jitter_ms),
        "--bandwidth-mbps",
        str(bandwidth_mbps),
    ]
    args += [a for name, n in counts.items() for a in (f"--{name.replace('_', '-')}", str(n))]
    args += ["--model-preset", model_preset] if model_preset else []
    args += ["--model", model_path] if model_path else []
    args += [a for key in api_keys for a in ("--api-key", key)]
    args += ["--engine", engine] if engine != "pdd" else []
    out = open(workdir / "pdd-up.log", "wb")
    proc = subprocess.Popen(
        args, env={**os.environ, **(env or {})}, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
    )
    urls = router_urls(opts)
    system = RunningSystem(proc, urls[0], f"http://127.0.0.1:{opts.wan_control_port}", workdir, urls, opts)
    if _wait_healthy(system, timeout_s):
        return system
    system.stop()
    raise RuntimeError(f"system not healthy in {timeout_s}s:\n{(workdir / 'pdd-up.log').read_text()[-4000:]}")


def _wait_healthy(system: RunningSystem, timeout_s: float) -> bool:
    """Poll every router until it answers /health with 200 and lists every instance asked for
    (its counts in /health: a 200 needs only prefill and MD, and a relay not yet heard from
    would turn a forced p-rld-md into p-md). False on timeout; raise if `pdd up` exits."""
    deadline, pending = time.monotonic() + timeout_s, list(system.router_urls)
    while pending and time.monotonic() < deadline:
        if system.proc.poll() is not None:
            raise RuntimeError(f"pdd up exited early:\n{(system.workdir / 'pdd-up.log').read_text()[-4000:]}")
        try:
            if _sees_everything(pending[0], system.opts):
                pending.pop(0)
                continue
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    return not pending


def _sees_everything(router_url: str, opts: UpOptions) -> bool:
    r = httpx.get(f"{router_url}/health", timeout=2)
    live = r.json().get("instances", {}) if r.status_code == 200 else {}
    wanted = {"prefill": opts.prefill, "relay": opts.relay, "main_decode": opts.md}
    return bool(live) and all(live.get(role, 0) >= n for role, n in wanted.items())
