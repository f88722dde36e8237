"""`pdd up --smoke` end to end: the real processes from shared/launch.py, on a free port block."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from shared.launch import PORT_BLOCK
from shared.ports import free_port_block


def test_pdd_up_smoke(tmp_path: Path) -> None:
    base = free_port_block(PORT_BLOCK)
    argv = [sys.executable, "-m", "shared.cli", "up", "--smoke", "--workdir", str(tmp_path), "--base-port", str(base)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=240, cwd=tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert f"pdd is up: http://127.0.0.1:{base}" in out
    assert "POST /v1/completions -> 200" in out
    assert "pdd up: stopping" in out
    assert (tmp_path / "traces").is_dir()  # the services wrote spans to the local store
