"""`pdd up` end to end: the real processes from pdd/launch.py, on a free port block; up, one
request, and down again (by itself, and by a terminal's Ctrl-C)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

from pdd.launch import PORT_BLOCK
from pdd.system import start_system
from shared.ports import free_port_block


def test_pdd_up_smoke(tmp_path: Path) -> None:
    base = free_port_block(PORT_BLOCK)
    argv = [
        sys.executable,
        "-m",
        "pdd.cli",
        "up",
        "--smoke",
        "--workdir",
        str(tmp_path),
        "--base-port",
        str(base),
    ]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=240, cwd=tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert f"pdd is up: http://127.0.0.1:{base}" in out
    assert "POST /v1/completions -> 200" in out
    assert "pdd up: stopping" in out
    assert (tmp_path / "traces").is_dir()  # the services wrote spans to the local store
    assert f"router 0 ready on http://127.0.0.1:{base}" in (tmp_path / "logs" / "router.log").read_text()


def test_ctrl_c_stops_every_service_cleanly_before_nats(tmp_path: Path) -> None:
    system = start_system(tmp_path)
    try:
        os.killpg(system.proc.pid, signal.SIGINT)  # a terminal's Ctrl-C: its whole foreground group
        code = system.proc.wait(timeout=60)
    finally:
        system.stop()
    log = (tmp_path / "pdd-up.log").read_text()
    assert code == 0, log[-3000:]
    assert "did not stop" not in log and not re.search(r"stopping \S+ failed", log), log[
        -3000:
    ]  # none killed
    for name in ("prefill", "relay", "main_decode", "router"):
        service_log = system.log(name)
        assert "Traceback" not in service_log, service_log[-3000:]
        assert "WARNING shared.bus.connection" not in service_log, service_log[
            -3000:
        ]  # NATS was up as it left
