"""`pdd chaos`'s faults: what each one hits (the busiest instance of a role, or the first) and
how it is injected (a signal, a pause, a WAN link cut), by name."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx

from pdd.launch import DC_A, DC_B, nats_node_name, process_name
from pdd.supervisor import read_pid, request_restart
from pdd.system import RunningSystem


def _signal(system: RunningSystem, name: str, sig: signal.Signals) -> None:
    pid = read_pid(system.workdir, name)
    if pid is None:
        raise RuntimeError(f"{name} is not running (no pid file)")
    os.kill(pid, sig)


@dataclass(frozen=True)
class Fault:
    """`pick` names what the fault hits (it may wait for that to be busy); `act` injects it and
    returns once it is over."""

    pick: Callable[[RunningSystem], str]
    act: Callable[[RunningSystem, str], None]


ROLES = {"prefill": "prefill", "relay": "relay", "main_decode": "md"}  # role in /v1/instances -> count flag


def _first(role: str) -> Callable[[RunningSystem], str]:
    """The process name of the first instance of a role."""
    return lambda system: process_name(role, 0)


def _busiest(role: str, wait_s: float = 3.0) -> Callable[[RunningSystem], str]:
    """The process name of the instance of a role holding the most requests (waiting up to
    wait_s for one to hold any; the first on a tie, or when no router answers): a fault on an
    idle instance would test nothing."""

    def held_now(system: RunningSystem) -> dict[int, int]:
        for url in system.router_urls or [system.router_url]:
            try:
                view = httpx.get(f"{url}/v1/instances", timeout=2).json()
                return {int(k.split("/")[1]): v["held"] for k, v in view.items() if k.split("/")[0] == role}
            except (httpx.HTTPError, ValueError, KeyError, IndexError):
                continue
        return {}

    def pick(system: RunningSystem) -> str:
        deadline, held = time.monotonic() + wait_s, {}
        while time.monotonic() < deadline:
            held = held_now(system)
            if any(held.values()):
                break
            time.sleep(0.05)
        best = max(sorted(held), key=lambda i: held[i], default=0)
        return process_name(role, best if best < getattr(system.opts, ROLES[role]) else 0)

    return pick


def _first_nats(dc: str) -> Callable[[RunningSystem], str]:
    return lambda system: nats_node_name(dc, 0, system.opts.nats_cluster)


def _kill(target: Callable[[RunningSystem], str], sig: signal.Signals = signal.SIGKILL) -> Fault:
    return Fault(target, lambda system, name: _signal(system, name, sig))


def _pause(seconds: float) -> Callable[[RunningSystem, str], None]:
    def act(system: RunningSystem, name: str) -> None:
        _signal(system, name, signal.SIGSTOP)
        try:
            time.sleep(seconds)
        finally:
            _signal(system, name, signal.SIGCONT)

    return act


def _cut(links: tuple[str, ...], seconds: float) -> Fault:
    def act(system: RunningSystem, names: str) -> None:
        for link in names.split(","):
            system.wan(link, cut=True, cut_mode="drop")
        try:
            time.sleep(seconds)
        finally:
            for link in names.split(","):
                system.wan(link, cut=False)

    return Fault(lambda system: ",".join(n for link in links for n in _link_names(system, link)), act)


def _link_names(system: RunningSystem, link: str) -> list[str]:
    """gw-ab is gw-ab-0, gw-ab-1, ... with a NATS cluster per DC (every node's link is cut)."""
    n = system.opts.nats_cluster
    return [link] if link == "bulk" or n == 1 else [f"{link}-{i}" for i in range(n)]


FAULTS: dict[str, Fault] = {
    "kill-prefill": _kill(_busiest("prefill")),
    "kill-relay": _kill(_busiest("relay")),
    "kill-md": _kill(_busiest("main_decode")),
    "stop-md-5s": Fault(_busiest("main_decode"), _pause(5.0)),
    "restart-nats-a": _kill(_first_nats(DC_A)),
    "restart-nats-b": _kill(_first_nats(DC_B)),
    "cut-gateway-5s": _cut(("gw-ab", "gw-ba"), 5.0),
    "cut-bulk-2s": _cut(("bulk",), 2.0),
    "kill-router": _kill(_first("router")),
    "restart-router": Fault(_first("router"), lambda system, name: request_restart(system.workdir, name)),
}


NO_FAILURE_EXPECTED = ("restart-nats-a", "restart-nats-b", "cut-gateway-5s", "cut-bulk-2s", "stop-md-5s")


ROUTER_FAULTS = ("kill-router", "restart-router")


FAULTED_ROUTER = 0  # the router faults hit the first router
