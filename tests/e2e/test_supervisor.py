"""Supervisor and `pdd up`'s flow, with stand-in processes instead of the real services."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import signal
import sys
from pathlib import Path

import pytest

from pdd import up
from pdd.launch import NatsSpec, ProcessSpec, UpOptions
from pdd.supervisor import (
    Backoff,
    CrashLoop,
    ProcessDied,
    RestartPolicy,
    ServiceProcess,
    Supervisor,
    read_pid,
    request_restart,
)
from shared.ports import free_port
from tests.polling import until

FAST = RestartPolicy(backoff_initial_s=0.05, backoff_max_s=0.2, stable_after_s=30, crash_loop_crashes=3)


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


def _delays(caplog, name: str) -> list[str]:
    """The restart delays the supervisor logged for `name`, in order."""
    lines = [r.getMessage().splitlines()[-1] for r in caplog.records]
    return [line.rsplit(" in ", 1)[1] for line in lines if line.startswith(f"restarting {name} in ")]


# ---- the restart policy, on given times ----------------------------------------------------------


def test_backoff_doubles_to_its_cap() -> None:
    b = Backoff(RestartPolicy(backoff_initial_s=0.5, backoff_max_s=3, crash_loop_crashes=100))
    assert [b.on_crash(started_at=t, now=t + 1) for t in range(6)] == [0.5, 1, 2, 3, 3, 3]


def test_backoff_starts_over_after_a_stable_run() -> None:
    b = Backoff(RestartPolicy(backoff_initial_s=0.5, stable_after_s=30, crash_loop_crashes=100))
    assert [b.on_crash(0, 1), b.on_crash(2, 3)] == [0.5, 1]
    assert b.on_crash(started_at=10, now=40) == 0.5  # up 30 s
    assert b.on_crash(started_at=41, now=42) == 1


def test_crash_loop_is_n_crashes_within_the_window() -> None:
    b = Backoff(RestartPolicy(crash_loop_crashes=3, crash_loop_window_s=60))
    assert b.on_crash(0, 0) is not None and b.on_crash(0, 50) is not None
    assert b.on_crash(0, 70) is not None  # the crash at 0 left the window
    assert b.on_crash(0, 100) is None  # 50, 70, 100


# ---- real child processes ------------------------------------------------------------------------


async def test_pid_files_while_running_and_stop(tmp_path: Path) -> None:
    sup = Supervisor(tmp_path, grace_s=5)
    children = await sup.start_all(
        [_py("wan", "import time; time.sleep(60)"), _py("relay", "import time; time.sleep(60)")]
    )
    assert [read_pid(tmp_path, c.name) for c in children] == [c.pid for c in children]
    await sup.stop_all()
    assert all(_gone(c.pid) for c in children) and not sup.children
    assert read_pid(tmp_path, "wan") is None and read_pid(tmp_path, "relay") is None


async def test_dead_child_is_named_with_its_log(tmp_path: Path) -> None:
    sup = Supervisor(tmp_path)
    await sup.start_all(
        [_py("prefill", "import sys; print('boom: bad model path', flush=True); sys.exit(3)")]
    )
    with pytest.raises(ProcessDied, match=r"(?s)prefill exited with code 3.*boom: bad model path"):
        await asyncio.wait_for(sup.until_exit(), 20)
    await sup.stop_all()


async def test_stubborn_group_is_killed(tmp_path: Path) -> None:
    code = (
        "import signal, subprocess, sys, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        "print(p.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    sup = Supervisor(tmp_path, grace_s=0.5)
    (child,) = await sup.start_all([_py("stubborn", code)])
    await until(lambda: child.log_path.read_text().strip())
    grandchild = int(child.log_path.read_text())
    await sup.stop_all()
    assert _gone(child.pid)
    await until(lambda: _gone(grandchild))  # SIGKILL of the group reaches the grandchild asynchronously


async def test_exited_child_is_restarted_with_backoff_and_a_new_pid_file(tmp_path: Path, caplog) -> None:
    # Exits with code 3 on its first two runs, then stays up; each run leaves a line in its log.
    runs = tmp_path / "runs"
    code = (
        f"import pathlib, sys, time\np = pathlib.Path({str(runs)!r})\n"
        "n = len(p.read_text()) if p.exists() else 0\np.write_text('x' * (n + 1))\n"
        "print(f'run {n}', flush=True)\nsys.exit(3) if n < 2 else time.sleep(60)\n"
    )
    sup = Supervisor(tmp_path, grace_s=5, policy=dataclasses.replace(FAST, crash_loop_crashes=4))
    (child,) = await sup.start_all([_py("flaky", code)])
    first = child.pid
    caplog.set_level(logging.INFO, logger="pdd.supervisor")
    task = asyncio.create_task(sup.supervise(poll_s=0.02))
    try:
        await until(lambda: runs.exists() and len(runs.read_text()) == 3 and child.running)
        await until(lambda: read_pid(tmp_path, "flaky") == child.pid)
        assert child.pid != first
        assert _delays(caplog, "flaky") == ["0.05s", "0.1s"]
        assert "flaky exited with code 3" in caplog.text and "run 1" in caplog.text  # why, with the log tail
        assert child.log_path.read_text().split() == ["run", "0", "run", "1", "run", "2"]  # appended
        os.kill(child.pid, signal.SIGKILL)  # a signal is named too; the backoff keeps doubling
        await until(lambda: "flaky was killed by SIGKILL" in caplog.text)
        await until(lambda: child.running and read_pid(tmp_path, "flaky") == child.pid)
        assert _delays(caplog, "flaky") == ["0.05s", "0.1s", "0.2s"]
    finally:
        task.cancel()
        await sup.stop_all()
    assert read_pid(tmp_path, "flaky") is None


async def test_a_batch_started_with_its_own_policy_restarts_by_it(tmp_path: Path, caplog) -> None:
    """`pdd up` restarts its NATS servers sooner than its services (BUS_FIRST_RESTART_S)."""

    def once(name: str) -> ProcessSpec:  # exits 3 on its first run, then stays up
        mark = str(tmp_path / f"{name}.ran")
        code = f"import pathlib, sys, time\np = pathlib.Path({mark!r})\nif not p.exists():\n    p.touch(); sys.exit(3)\ntime.sleep(60)\n"
        return _py(name, code)

    sup = Supervisor(tmp_path, grace_s=5, policy=FAST)
    await sup.start_all([once("svc")])
    await sup.start(
        ServiceProcess(once("nats-x"), tmp_path / "logs", 5),
        policy=dataclasses.replace(FAST, backoff_initial_s=0.01),
    )
    caplog.set_level(logging.INFO, logger="pdd.supervisor")
    task = asyncio.create_task(sup.supervise(poll_s=0.02))
    try:
        await until(lambda: _delays(caplog, "svc") and _delays(caplog, "nats-x"))
        assert _delays(caplog, "nats-x") == ["0.01s"] and _delays(caplog, "svc") == ["0.05s"]
    finally:
        task.cancel()
        await sup.stop_all()


async def test_child_stopped_cleanly_from_outside_is_not_restarted(tmp_path: Path, caplog) -> None:
    # An operator scaling in: SIGTERM, the service drains and exits 0. A child that SIGTERM
    # kills instead (no clean exit) is still restarted.
    drains = (
        "import signal, sys, time\nsignal.signal(signal.SIGTERM, lambda *a: sys.exit(0))\n"
        "print('ready', flush=True)\ntime.sleep(60)\n"
    )
    sup = Supervisor(tmp_path, grace_s=5, policy=FAST)
    scaled_in, killed = await sup.start_all(
        [_py("relay-1", drains), _py("relay", "import time; time.sleep(60)")]
    )
    caplog.set_level(logging.INFO, logger="pdd.supervisor")
    task = asyncio.create_task(sup.supervise(poll_s=0.02))
    try:
        first = killed.pid
        os.kill(killed.pid, signal.SIGTERM)
        await until(
            lambda: killed.running and killed.pid != first and read_pid(tmp_path, "relay") == killed.pid
        )
        await until(lambda: "ready" in scaled_in.log_path.read_text())  # its handler is in place
        os.kill(scaled_in.pid, signal.SIGTERM)
        await until(lambda: "relay-1 stopped cleanly; not restarted" in caplog.text)
        assert scaled_in.returncode == 0 and scaled_in not in sup.children and killed in sup.children
        assert read_pid(tmp_path, "relay-1") is None
        assert _delays(caplog, "relay") == ["0.05s"] and _delays(caplog, "relay-1") == []
    finally:
        task.cancel()
        await sup.stop_all()
    assert scaled_in.returncode == 0 and not scaled_in.running


async def test_a_rolling_restart_drains_the_child_then_starts_it_again(tmp_path: Path, caplog) -> None:
    drains = (
        "import signal, sys, time\nsignal.signal(signal.SIGTERM, lambda *a: sys.exit(0))\n"
        "print('ready', flush=True)\ntime.sleep(60)\n"
    )
    sup = Supervisor(tmp_path, grace_s=5, policy=FAST)
    (router,) = await sup.start_all([_py("router-1", drains)])
    caplog.set_level(logging.INFO, logger="pdd.supervisor")
    task = asyncio.create_task(sup.supervise(poll_s=0.02))
    try:
        await until(lambda: "ready" in router.log_path.read_text())
        first = request_restart(tmp_path, "router-1")
        await until(
            lambda: router.running and router.pid != first and read_pid(tmp_path, "router-1") == router.pid
        )
        assert router in sup.children and "not restarted" not in caplog.text
        assert _delays(caplog, "router-1") == []  # not a crash: no backoff
        with pytest.raises(LookupError):
            request_restart(tmp_path, "nobody")
    finally:
        task.cancel()
        await sup.stop_all()


async def test_crash_loop_stops_supervising_with_the_childs_log(tmp_path: Path) -> None:
    sup = Supervisor(tmp_path, grace_s=5, policy=FAST)
    await sup.start_all([_py("wan", "import time; time.sleep(60)")])
    (crashing,) = await sup.start_all(
        [_py("relay", "print('cannot bind socket', flush=True); raise SystemExit(2)")]
    )
    with pytest.raises(
        CrashLoop, match=r"(?s)3 exits within 60s.*relay exited with code 2.*cannot bind socket"
    ):
        await asyncio.wait_for(sup.supervise(poll_s=0.02), 30)
    assert sup.children[0].running  # what stops the rest is the caller's stop_all
    await sup.stop_all()


# ---- `pdd up`'s flow: stand-in services, one real nats-server -------------------------------------


@pytest.fixture
def fake_system(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> UpOptions:
    opts = UpOptions(router_port=free_port(), workdir=tmp_path / "pdd")
    specs = [_py("wan", "import time; time.sleep(60)"), _fake_router(tmp_path, opts.router_port)]
    monkeypatch.setattr(up, "service_specs", lambda o: specs)
    # One real nats-server (no gateway: the stand-in wan forwards nothing).
    nats = NatsSpec("nats-a", "dc-a", free_port(), free_port())
    monkeypatch.setattr(up, "nats_specs", lambda o: [nats])
    return opts


async def _run_up_until_up(opts: UpOptions, lines: list[str]) -> asyncio.Task[int]:
    task = asyncio.create_task(up.run_up(opts, start_timeout_s=20, restart=FAST, out=lines.append))
    await until(lambda: task.done() or any("pdd is up" in line for line in lines), 30)
    assert not task.done(), task.result()
    return task


async def test_up_serves_until_sigterm_and_stops_all(fake_system: UpOptions) -> None:
    lines: list[str] = []
    task = await _run_up_until_up(fake_system, lines)
    assert f"http://127.0.0.1:{fake_system.router_port}" in lines[0]
    pids = {name: read_pid(fake_system.workdir, name) for name in ("wan", "nats-a", "router")}
    assert all(pids.values()), pids
    os.kill(os.getpid(), signal.SIGTERM)  # run_up's handler turns it into a clean stop
    assert await asyncio.wait_for(task, 20) == 0
    assert all(_gone(pid) for pid in pids.values())
    assert not list((fake_system.workdir / "run").iterdir())  # pid files removed
    assert (fake_system.workdir / "logs" / "router.log").exists()
    assert (fake_system.workdir / "nats" / "nats-a" / "nats-server.conf").exists()


async def test_up_starts_every_node_of_a_cluster_and_waits_for_its_routes(
    fake_system: UpOptions, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Two routed nodes of dc-a (no gateway: the stand-in wan forwards nothing). `pdd is up`
    # comes only once each node is routed to the other.
    cluster_ports = [free_port(), free_port()]
    routes = [f"nats-route://127.0.0.1:{p}" for p in cluster_ports]
    nodes = [
        NatsSpec(
            f"nats-a-{c}",
            "dc-a",
            free_port(),
            free_port(),
            cluster="nats-a",
            cluster_port=cluster_ports[c],
            routes=routes,
        )
        for c in range(2)
    ]
    monkeypatch.setattr(up, "nats_specs", lambda o: nodes)
    task = await _run_up_until_up(fake_system, [])
    try:
        for node in nodes:
            assert read_pid(fake_system.workdir, node.name)
            conf = (fake_system.workdir / "nats" / node.name / "nats-server.conf").read_text()
            assert "cluster {" in conf and all(r in conf for r in routes)
    finally:
        os.kill(os.getpid(), signal.SIGTERM)
        assert await asyncio.wait_for(task, 20) == 0


async def test_up_restarts_a_killed_nats_server_on_its_port(fake_system: UpOptions) -> None:
    task = await _run_up_until_up(fake_system, [])
    try:
        old = read_pid(fake_system.workdir, "nats-a")
        os.kill(old, signal.SIGKILL)
        await until(lambda: read_pid(fake_system.workdir, "nats-a") not in (None, old))
        port = up.nats_specs(fake_system)[0].port
        reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 10)
        assert (await asyncio.wait_for(reader.readline(), 10)).startswith(b"INFO")
        writer.close()
        assert not task.done()
    finally:
        os.kill(os.getpid(), signal.SIGTERM)
        assert await asyncio.wait_for(task, 20) == 0


async def test_up_stops_on_a_crash_loop(fake_system: UpOptions, monkeypatch, tmp_path: Path, capsys) -> None:
    # relay serves until told to fail, then fails at every start.
    flag = tmp_path / "fail"
    code = (
        f"import os, sys, time\nwhile not os.path.exists({str(flag)!r}): time.sleep(0.02)\n"
        "print('relay: socket in use', flush=True)\nsys.exit(4)\n"
    )
    specs = [*up.service_specs(fake_system), _py("relay", code)]
    monkeypatch.setattr(up, "service_specs", lambda o: specs)
    task = await _run_up_until_up(fake_system, [])
    pids = [read_pid(fake_system.workdir, name) for name in ("wan", "nats-a", "router")]
    flag.touch()
    assert await asyncio.wait_for(task, 30) == 1
    err = capsys.readouterr().err
    assert "crash loop" in err and "relay exited with code 4" in err and "relay: socket in use" in err
    assert all(_gone(pid) for pid in pids)


async def test_up_reports_a_service_dying_at_start(fake_system: UpOptions, monkeypatch, capsys) -> None:
    specs = [_py("wan", "import time; time.sleep(60)"), _py("main_decode", "raise SystemExit('no KV pool')")]
    monkeypatch.setattr(up, "service_specs", lambda o: specs)
    assert await up.run_up(fake_system, start_timeout_s=20, out=lambda s: None) == 1
    err = capsys.readouterr().err
    assert "main_decode exited with code 1" in err and "no KV pool" in err
