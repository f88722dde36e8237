"""C++ kernels, compiled once into the venv and loaded from there.

Three extensions: the paged attention kernel (paged_attention.cpp), the panel linear kernel
(panel_linear.cpp) and a decoder layer's small ops fused (fused_ops.cpp). `make install`
builds them (`python -m shared.model.kernels build`); at run time the same call finds them
built and only loads them (torch's JIT extension loader with a fixed build directory per
checkout, so a changed source is rebuilt). Where one cannot be built or
loaded (no compiler, no ninja, a read-only venv) its `*_ops()` is None and says why once, in
the log, and the model runs the tensor code it replaces.
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

HERE = Path(__file__).parent
# -fopenmp: at::parallel_for is an inline template that runs serially unless its caller is
# compiled with OpenMP; the library it links is the libgomp.so.1 torch has loaded already.
FLAGS = ["-O3", "-march=native", "-fopenmp"]
# name -> (source, extra flags). The fused ops round as the tensor ops they replace: no FMA.
KERNELS = {
    "pdd_paged_attention": (HERE / "paged_attention.cpp", []),
    "pdd_fused_ops": (HERE / "fused_ops.cpp", ["-ffp-contract=off"]),
    "pdd_panel_linear": (HERE / "panel_linear.cpp", []),
}


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


def build_one(name: str, verbose: bool = False) -> ModuleType:
    from torch.utils.cpp_extension import load

    source, flags = KERNELS[name]
    # One directory per kernel and per checkout: each load writes its own build.ninja, whose
    # commands name the source's path, so two checkouts sharing a venv would rebuild each
    # other's copy on every load.
    checkout = hashlib.sha1(str(source.resolve()).encode()).hexdigest()[:8]
    where = build_dir() / f"{name}-{checkout}"
    where.mkdir(parents=True, exist_ok=True)
    return load(
        name=name,
        sources=[str(source)],
        build_directory=str(where),
        extra_cflags=FLAGS + flags,
        extra_ldflags=["-fopenmp"],
        verbose=verbose,
    )


@functools.cache
def _ops(name: str, what: str, fallback: str) -> ModuleType | None:
    try:
        return build_one(name)
    except Exception as e:  # any failure to build or load means the tensor path, never a crash
        log.warning(
            "%s unavailable (%s: %s); %s",
            what,
            type(e).__name__,
            str(e).strip().splitlines()[-1] if str(e).strip() else "",
            fallback,
        )
        return None


def paged_attention_ops() -> ModuleType | None:
    return _ops(
        "pdd_paged_attention", "paged attention kernel", "attention falls back to the reference backend"
    )


def panel_linear_ops() -> ModuleType | None:
    return _ops("pdd_panel_linear", "panel linear kernel", "linear layers stay on oneDNN or F.linear")


def fused_ops() -> ModuleType | None:
    return _ops("pdd_fused_ops", "fused small ops", "RMSNorm and RoPE run as tensor ops")
