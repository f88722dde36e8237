"""`python -m shared.model.kernels build`: compile the C++ kernels into the venv (make install)."""

from __future__ import annotations

import sys
import time

from shared.model.kernels import build, build_dir


def main(argv: list[str]) -> int:
    if argv != ["build"]:
        print("usage: python -m shared.model.kernels build", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    try:
        build()
    except Exception as e:
        print(
            f"warning: the C++ kernels did not build ({type(e).__name__}: {e}); "
            "what did not build runs as tensor code (attention: the reference backend)",
            file=sys.stderr,
        )
        return 1
    print(f"C++ kernels ready in {build_dir()} ({time.perf_counter() - t0:.1f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
