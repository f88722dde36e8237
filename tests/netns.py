"""Two datacenters on one machine: a network namespace each, joined by a veth capped with
`tc tbf`, and a third veth from the test's own namespace into DC A for the clients (the router).
Processes run in a namespace with `ip netns exec`. Root only; `skip_reason()` says why not.

    test ns 10.201.0.1 ── 10.201.0.2  DC A  10.200.0.1 ══ tbf ══ 10.200.0.2  DC B
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

DC_A_IP, DC_B_IP, CLIENT_IP, DC_A_CLIENT_IP = "10.200.0.1", "10.200.0.2", "10.201.0.1", "10.201.0.2"
RATE = "1gbit"  # the line between the DCs; delay stays with `pdd wan`


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10)


def skip_reason() -> str | None:
    """Why namespaces cannot be made here, or None."""
    if os.geteuid() != 0:
        return "two-host test needs root (ip netns)"
    if not shutil.which("ip") or not shutil.which("tc"):
        return "two-host test needs iproute2 (ip, tc)"
    probe = f"pdd-probe-{os.getpid()}"
    made = _ip("netns", "add", probe)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    _ip("netns", "del", probe)
    return None


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    log: Path

    def text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


@dataclass
class TwoHosts:
    logs: Path
    tag: str = field(default_factory=lambda: str(os.getpid() % 100000))
    procs: dict[str, Proc] = field(default_factory=dict)

    @property
    def ns(self) -> dict[str, str]:
        return {"dc-a": f"pdd-a-{self.tag}", "dc-b": f"pdd-b-{self.tag}"}

    def up(self) -> TwoHosts:
        a, b = self.ns["dc-a"], self.ns["dc-b"]
        wan_a, wan_b, cli, cli_a = f"pa{self.tag}", f"pb{self.tag}", f"pc{self.tag}", f"pd{self.tag}"
        steps = [
            ["netns", "add", a],
            ["netns", "add", b],
            ["link", "add", wan_a, "type", "veth", "peer", "name", wan_b],
            ["link", "set", wan_a, "netns", a],
            ["link", "set", wan_b, "netns", b],
            ["-n", a, "addr", "add", f"{DC_A_IP}/24", "dev", wan_a],
            ["-n", b, "addr", "add", f"{DC_B_IP}/24", "dev", wan_b],
            ["link", "add", cli, "type", "veth", "peer", "name", cli_a],
            ["link", "set", cli_a, "netns", a],
            ["addr", "add", f"{CLIENT_IP}/24", "dev", cli],
            ["-n", a, "addr", "add", f"{DC_A_CLIENT_IP}/24", "dev", cli_a],
            ["link", "set", cli, "up"],
        ]
        for ns, devs in ((a, (wan_a, cli_a, "lo")), (b, (wan_b, "lo"))):
            steps += [["-n", ns, "link", "set", d, "up"] for d in devs]
        try:
            for step in steps:
                done = _ip(*step)
                if done.returncode != 0:
                    raise RuntimeError(f"ip {' '.join(step)}: {done.stderr.strip()}")
            for ns, dev in ((a, wan_a), (b, wan_b)):
                tbf = ["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf"]
                tbf += ["rate", RATE, "burst", "512kb", "latency", "50ms"]
                subprocess.run(tbf, check=True, capture_output=True, timeout=10)
        except BaseException:
            self.down()
            raise
        return self

    def start(self, dc: str, name: str, argv: list[str], env: dict[str, str], cwd: Path) -> Proc:
        log = self.logs / f"{name}.log"
        out = log.open("wb")
        popen = subprocess.Popen(
            ["ip", "netns", "exec", self.ns[dc], *argv],
            env={**os.environ, **env},
            cwd=cwd,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        self.procs[name] = proc = Proc(name, popen, log)
        return proc

    def run(self, dc: str, argv: list[str], env: dict[str, str] | None = None, timeout: float = 60):
        """A command to its end in a DC (e.g. `pdd check`)."""
        return subprocess.run(
            ["ip", "netns", "exec", self.ns[dc], *argv],
            env={**os.environ, **(env or {})},
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        p = self.procs[name].popen
        if p.poll() is None:
            os.killpg(p.pid, sig)
            p.wait(10)

    def stop_all(self) -> None:
        for proc in reversed(list(self.procs.values())):  # services first, NATS last
            if proc.popen.poll() is None:
                os.killpg(proc.popen.pid, signal.SIGTERM)
        deadline = time.monotonic() + 15
        for proc in self.procs.values():
            try:
                proc.popen.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(proc.popen.pid, signal.SIGKILL)
                proc.popen.wait(5)

    def down(self) -> None:
        self.stop_all()
        for ns in self.ns.values():
            _ip("netns", "del", ns)  # takes its veth ends (and so their peers) with it
        _ip("link", "del", f"pc{self.tag}")
