"""Peers that vanish: a main decoder that stops answering (frozen with SIGSTOP, as a
network partition would leave it) fails its requests fast with a clear error, and the
system serves again once it comes back."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from shared.system import RunningSystem, start_system


def _pid_of(service: str, workdir: Path) -> int:
    """The pid of `python -m services.<service>` started by this system's `pdd up`."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes().split(b"\0")
            env = (proc / "environ").read_bytes()
        except OSError:
            continue
        if f"services.{service}".encode() in cmd and str(workdir).encode() in env:
            return int(proc.name)
    raise LookupError(service)


@pytest.fixture(scope="module")
def system(tmp_path_factory) -> RunningSystem:
    # A long token timeout: passing proves the router noticed the lost MD by itself.
    sysm = start_system(tmp_path_factory.mktemp("pdd-faults"), {"PDD_ROUTER_TOKEN_TIMEOUT_S": "60"},
                        model_preset="small")
    yield sysm
    sysm.stop()


def test_frozen_main_decode_fails_its_stream_fast_then_recovers(system):
    md = _pid_of("main_decode", system.workdir)
    body = {"prompt": [(i * 3) % 250 for i in range(64)], "max_tokens": 3000, "temperature": 0,
            "ignore_eos": True, "stream": True, "pdd": {"pipeline": "p-md"}}
    tokens, error, frozen_at = 0, None, None
    try:
        with httpx.stream("POST", f"{system.router_url}/v1/completions", json=body, timeout=90) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    error = chunk["error"]
                    break
                tokens += len(chunk["choices"][0]["token_ids"])
                if tokens >= 10 and frozen_at is None:
                    os.kill(md, signal.SIGSTOP)
                    frozen_at = time.monotonic()
        waited = time.monotonic() - frozen_at
    finally:
        os.kill(md, signal.SIGCONT)
    assert error is not None and "lost" in error["message"], error
    assert waited < 15, f"error took {waited:.1f}s"

    deadline = time.monotonic() + 30  # MD reports again, the router routes to it again
    while time.monotonic() < deadline:
        r = httpx.post(f"{system.router_url}/v1/completions", timeout=60,
                       json={"prompt": "back again", "max_tokens": 4, "pdd": {"pipeline": "p-md"}})
        if r.status_code == 200:
            break
        time.sleep(1)
    assert r.status_code == 200, r.text
