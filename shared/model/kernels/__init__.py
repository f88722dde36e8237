"""C++ kernels, compiled once into the venv and loaded from there.

`make install` builds them (`python -m shared.model.kernels build`); at run time the same call
finds them built and only loads them (torch's JIT extension loader with a fixed build
directory, so a changed source is rebuilt). Where they cannot be built or loaded (no compiler,
no ninja, a read-only venv) `paged_attention_ops()` is None and says why once, in the log.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import sys
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("paged_attention.cpp")
FLAGS = ["-O3", "-march=native", "-fopenmp-simd"]


def _cpu_key() -> str:
    """-march=native code runs only on the CPU it was built for: a venv moved to another
    machine builds its own copy instead of dying on an illegal instruction."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        info = ""
    lines = sorted({ln for ln in info.splitlines() if ln.startswith(("model name", "flags"))})
    return hashlib.sha1("\n".join(lines).encode()).hexdigest()[:10]


def build_dir() -> Path:
    return Path(sys.prefix) / "pdd-kernels" / f"torch-{torch.__version__}-{_cpu_key()}"


def build(verbose: bool = False) -> ModuleType:
    from torch.utils.cpp_extension import load

    where = build_dir()
    where.mkdir(parents=True, exist_ok=True)
    return load(
        name="pdd_paged_attention",
        sources=[str(SOURCE)],
        build_directory=str(where),
        extra_cflags=FLAGS,
        verbose=verbose,
    )


@functools.cache
def paged_attention_ops() -> ModuleType | None:
    try:
        return build()
    except Exception as e:  # any failure to build or load means the reference path, never a crash
        log.warning(
            "paged attention kernel unavailable (%s: %s); attention falls back to the reference backend",
            type(e).__name__,
            str(e).strip().splitlines()[-1] if str(e).strip() else "",
        )
        return None
