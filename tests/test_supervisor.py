"""Supervisor and `pdd up`'s flow, with stand-in processes instead of the real services."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys
from pathlib import Path

import pytest

from shared import up
from shared.launch import NatsSpec, ProcessSpec, UpOptions
from shared.supervisor import ProcessDied, Supervisor


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _py(name: str, code: str) -> ProcessSpec:
    return ProcessSpec(name, [sys.executable, "-c", code], {}, "dc-a")


def _fake_router(tmp: Path, port: int) -> ProcessSpec:
    """http.server answers 200 on /health because a file of that name exists."""
    (tmp / "www").mkdir(exist_ok=True)
    (tmp / "www" / "health").write_text("ok")
    argv = [
        sys.executable,
        "-m",
        "http.server",
        str(port),
        "--bind",
        "127.0.0.1",
        "--directory",
        str(tmp / "www"),
    ]
    return ProcessSpec("router", argv, {}, "dc-a")


def _gone(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return True
    return "State:\tZ" in status  # a zombie waiting for init to reap it is dead too


async def test_health_gate_and_stop(tmp_path: Path) -> None:
    port = _free_port()
    sup = Supervisor(tmp_path / "logs", grace_s=5)
    sup.start(_fake_router(tmp_path, port))
    await sup.wait_http_ok(f"http://127.0.0.1:{port}/health", timeout_s=20)
    pid = sup.children[0].proc.pid
    await sup.stop_all()
    assert _gone(pid) and not sup.children


async def test_dead_child_is_named_with_its_log(tmp_path: Path) -> None:
    sup = Supervisor(tmp_path / "logs")
    sup.start(_py("prefill", "import sys; print('boom: bad model path', flush=True); sys.exit(3)"))
    with pytest.raises(ProcessDied, match=r"(?s)prefill exited with code 3.*boom: bad model path"):
        await sup.wait_http_ok(f"http://127.0.0.1:{_free_port()}/health", timeout_s=20)
    await sup.stop_all()


async def test_stubborn_group_is_killed(tmp_path: Path) -> None:
    code = (
        "import signal, subprocess, sys, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        "print(p.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    sup = Supervisor(tmp_path / "logs", grace_s=0.5)
    child = sup.start(_py("stubborn", code))
    for _ in range(100):
        if child.log_path.read_text().strip():
            break
        await asyncio.sleep(0.05)
    grandchild = int(child.log_path.read_text())
    await sup.stop_all()
    assert _gone(child.proc.pid)
    for _ in range(100):  # SIGKILL of the group is delivered asynchronously to the grandchild
        if _gone(grandchild):
            break
        await asyncio.sleep(0.02)
    assert _gone(grandchild)


@pytest.fixture
def fake_system(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> UpOptions:
    opts = UpOptions(router_port=_free_port(), workdir=tmp_path / "pdd")
    specs = [_py("wan", "import time; time.sleep(60)"), _fake_router(tmp_path, opts.router_port)]
    monkeypatch.setattr(up, "service_specs", lambda o: specs)
    # One real nats-server (no gateway: the stand-in wan forwards nothing).
    nats = NatsSpec("nats-a", "dc-a", _free_port(), _free_port())
    monkeypatch.setattr(up, "nats_specs", lambda o: [nats])
    return opts


async def test_up_serves_until_sigterm(fake_system: UpOptions) -> None:
    lines: list[str] = []
    task = asyncio.create_task(up.run_up(fake_system, start_timeout_s=20, out=lines.append))
    for _ in range(200):
        if any("pdd is up" in line for line in lines):
            break
        await asyncio.sleep(0.05)
    assert f"http://127.0.0.1:{fake_system.router_port}" in lines[0]
    os.kill(os.getpid(), signal.SIGTERM)  # run_up's handler turns it into a clean stop
    assert await asyncio.wait_for(task, 20) == 0
    assert (fake_system.workdir / "logs" / "router.log").exists()
    assert (fake_system.workdir / "nats" / "nats-a" / "nats-server.conf").exists()


async def test_up_reports_a_dying_service(fake_system: UpOptions, monkeypatch, capsys) -> None:
    specs = [_py("wan", "import time; time.sleep(60)"), _py("main_decode", "raise SystemExit('no KV pool')")]
    monkeypatch.setattr(up, "service_specs", lambda o: specs)
    assert await up.run_up(fake_system, start_timeout_s=20, out=lambda s: None) == 1
    err = capsys.readouterr().err
    assert "main_decode exited with code 1" in err and "no KV pool" in err
