"""CPU seconds a bench run's processes used, read from /proc (Linux), so `pdd sim validate` can
charge the host's non-engine work (router, NATS, WAN emulator, the bench's own client, other
tenants) to the engines it competes with.

A Meter takes a snapshot before and after each timed stretch of one deployment and adds the
difference to that deployment's account: wall seconds, the host's busy CPU seconds (/proc/stat),
and CPU seconds per process of every running system, named as `pdd up` names them (prefill,
relay, main_decode, router, wan, nats-a, ...; "up": the supervisor; "bench": this process), and
what its own system's engines did meanwhile (engine_figures.py)."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from pdd.benchkit import engine_figures
from pdd.supervisor import RUN_DIR

TICK = os.sysconf("SC_CLK_TCK")
ENGINE_ROLES = ("prefill", "relay", "main_decode")  # the services that run an engine in-process


def service_of(name: str) -> str:
    """A process's service as `pdd up` names it: relay-1 -> relay, router -> router."""
    return name.rsplit("-", 1)[0] if name[-1].isdigit() else name


def is_engine(name: str) -> bool:
    """prefill, relay-1, main_decode-2, ...: a process running an engine."""
    return service_of(name) in ENGINE_ROLES


def process_cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of a live process (all its threads); None if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) "; state is fields[0]
    return (int(fields[11]) + int(fields[12])) / TICK  # utime, stime: fields 14 and 15 of stat


def busy_ticks(cpu_line: str) -> int:
    """Not-idle ticks of a /proc/stat "cpu ..." line: user..steal less idle and iowait (guest
    time is already inside user)."""
    ticks = [int(x) for x in cpu_line.split()[1:9]]
    return sum(ticks) - ticks[3] - ticks[4]


def host_busy_s() -> float:
    """CPU seconds the whole host spent not idle (all cores), from the first line of /proc/stat."""
    return busy_ticks(Path("/proc/stat").read_text().split("\n", 1)[0]) / TICK


def system_pids(workdir: Path, supervisor_pid: int) -> dict[str, int]:
    """Every child of a `pdd up` by name (its pid files), and the supervisor as "up"."""
    out = {"up": supervisor_pid}
    for f in (workdir / RUN_DIR).glob("*.pid"):
        try:
            out[f.stem] = int(f.read_text())
        except (OSError, ValueError):
            continue
    return out


def snapshot(systems: dict, own: str | None = None) -> dict:
    """{"t", "host_busy_s", "bench_s", "procs": {system: {name: (pid, cpu_s)}}, "figures": {own:
    {engine: its figures (engine_figures.py)}}} now (the figures of the driven system only)."""
    procs = {}
    for d, s in systems.items():
        pids = system_pids(s.workdir, s.proc.pid)
        procs[d] = {n: (pid, cpu) for n, pid in pids.items() if (cpu := process_cpu_s(pid)) is not None}
    engines = {}
    if own is not None:
        urls = systems[own].metrics_urls()
        engines[own] = engine_figures.scrape({n: u for n, u in urls.items() if is_engine(n)})
    t = os.times()
    return {
        "t": time.monotonic(),
        "host_busy_s": host_busy_s(),
        "bench_s": t.user + t.system,
        "procs": procs,
        "figures": engines,
    }


@dataclass
class Account:
    """What one deployment's timed stretches used, summed."""

    wall_s: float = 0.0
    host_busy_s: float = 0.0
    bench_s: float = 0.0  # this process: the streaming clients (and the bench's bookkeeping)
    processes: dict[str, float] = field(default_factory=dict)  # its own system's processes
    other_systems_s: float = 0.0  # the other (idle) systems of the run, all processes
    # its own engines' figures: steps, step_s, gaps, between_s, KV tails (engine_figures.py)
    engine_figures: dict[str, dict[str, float]] = field(default_factory=dict)

    def add(self, before: dict, after: dict, own: str) -> None:
        self.wall_s += after["t"] - before["t"]
        self.host_busy_s += after["host_busy_s"] - before["host_busy_s"]
        self.bench_s += after["bench_s"] - before["bench_s"]
        for d, procs in after["procs"].items():
            for name, (pid, cpu) in procs.items():
                was = before["procs"].get(d, {}).get(name)
                used = cpu - was[1] if was and was[0] == pid else 0.0  # a restarted process: skipped
                if d == own:
                    self.processes[name] = self.processes.get(name, 0.0) + used
                else:
                    self.other_systems_s += used
        engines = engine_figures.difference(
            before.get("figures", {}).get(own, {}), after.get("figures", {}).get(own, {})
        )
        for name, figures in engines.items():
            mine = self.engine_figures.setdefault(name, {})
            for k, v in figures.items():
                mine[k] = mine.get(k, 0.0) + v

    def as_json(self) -> dict:
        engines = sum(v for n, v in self.processes.items() if is_engine(n))
        ours = sum(self.processes.values()) + self.bench_s + self.other_systems_s
        return {
            "wall_s": self.wall_s,
            "host_busy_s": self.host_busy_s,
            "bench_s": self.bench_s,
            "processes": dict(sorted(self.processes.items())),
            "other_systems_s": self.other_systems_s,
            "engines_s": engines,
            "non_engine_s": ours - engines,
            "other_tenants_s": max(0.0, self.host_busy_s - ours),
            "engine_figures": dict(sorted(self.engine_figures.items())),
        }


class Meter:
    """Accounts per deployment (or variant) of the systems being measured."""

    def __init__(self, systems: dict) -> None:
        self.systems = systems
        self.accounts: dict[str, Account] = {}

    def measure(self, name: str, system: str):
        """Context manager: the block's usage goes to account `name`; `system` is the one it drives."""
        return _Measured(self, name, system)

    def as_json(self) -> dict:
        return {"cores": os.cpu_count(), "accounts": {n: a.as_json() for n, a in self.accounts.items()}}


class _Measured:
    def __init__(self, meter: Meter, name: str, system: str) -> None:
        self.meter, self.name, self.system = meter, name, system

    def __enter__(self) -> None:
        self.before = snapshot(self.meter.systems, self.system)

    def __exit__(self, *exc) -> None:
        after = snapshot(self.meter.systems, self.system)
        self.meter.accounts.setdefault(self.name, Account()).add(self.before, after, self.system)
