"""`pdd up` supervises the real system: a SIGKILLed service comes back on its ports and
socket and serves the same greedy completion as before; a SIGKILLed `pdd up` takes every
child with it. Children are found through the pid files `pdd up` writes."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from pdd.supervisor import read_pid
from pdd.system import RunningSystem, start_system
from tests.polling import wait_until

CHILDREN = ("wan", "nats-a", "nats-b", "prefill", "relay", "main_decode", "router")
BACK_WITHIN_S = 20


@pytest.fixture(scope="module")
def system(tmp_path_factory) -> RunningSystem:
    sysm = start_system(tmp_path_factory.mktemp("pdd-supervision"))
    yield sysm
    sysm.stop()


def _gone(pid: int) -> bool:
    try:
        return "State:\tZ" in Path(f"/proc/{pid}/status").read_text()  # a zombie is dead too
    except FileNotFoundError:
        return True


def _complete(system: RunningSystem, pipeline: str) -> httpx.Response:
    body = {
        "prompt": "supervised restarts",
        "max_tokens": 12,
        "temperature": 0,
        "pdd": {"pipeline": pipeline},
    }
    return httpx.post(f"{system.router_url}/v1/completions", json=body, timeout=30)


def _tokens_once_back(system: RunningSystem, pipeline: str) -> list[int]:
    last = {"error": ""}

    def tokens() -> list[int] | None:
        try:
            r = _complete(system, pipeline)
        except httpx.HTTPError as e:
            last["error"] = repr(e)
            return None
        last["error"] = f"{r.status_code} {r.text}"
        return r.json()["choices"][0]["token_ids"] if r.status_code == 200 else None

    return wait_until(
        tokens, BACK_WITHIN_S, 0.5, lambda: f"{pipeline} served after the kill ({last['error']})"
    )


@pytest.mark.parametrize(
    ("service", "pipeline"),
    # MD: its bulk and metrics ports; relay: its unix socket; nats-b: its ports, the gateway, reconnects
    [("main_decode", "p-md"), ("relay", "p-rld-md"), ("nats-b", "p-md")],
)
def test_killed_service_is_restarted_and_serves_the_same(
    system: RunningSystem, service: str, pipeline: str
) -> None:
    before = _complete(system, pipeline)
    assert before.status_code == 200, before.text
    old = read_pid(system.workdir, service)
    os.kill(old, signal.SIGKILL)
    _wait_restarted(system, service, old)  # (meanwhile the router serves from the other instances)
    assert _tokens_once_back(system, pipeline) == before.json()["choices"][0]["token_ids"]
    assert f"{service} was killed by SIGKILL" in (system.workdir / "pdd-up.log").read_text()


def _wait_restarted(system: RunningSystem, service: str, old: int) -> None:
    """Until the service runs under a new pid and (an engine service) heartbeats to the router again."""
    deadline = time.monotonic() + BACK_WITHIN_S
    wait_until(
        lambda: read_pid(system.workdir, service) not in (None, old),
        BACK_WITHIN_S,
        0.2,
        f"{service} restarted",
    )
    if service in ("main_decode", "relay"):
        heartbeats = lambda: any(k.startswith(service) for k in _instances(system))  # noqa: E731
        wait_until(heartbeats, deadline - time.monotonic(), 0.2, f"{service} heartbeating")


def _instances(system: RunningSystem) -> dict:
    try:
        return system.instances()
    except httpx.HTTPError:
        return {}


def test_killing_pdd_up_takes_every_child_with_it(system: RunningSystem) -> None:
    pids = {name: read_pid(system.workdir, name) for name in CHILDREN}
    assert all(pids.values()), pids
    os.kill(system.proc.pid, signal.SIGKILL)
    system.proc.wait(timeout=10)
    with contextlib.suppress(TimeoutError):
        wait_until(lambda: all(_gone(pid) for pid in pids.values()), 15, 0.1)
    assert [name for name, pid in pids.items() if not _gone(pid)] == []
