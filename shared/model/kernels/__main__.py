"""`python -m shared.model.kernels build`: compile the C++ kernels into the venv (make install)."""

from __future__ import annotations

import sys
import time

from shared.model.kernels import KERNELS, build_dir, build_one


def main(argv: list[str]) -> int:
    if argv != ["build"]:
        print("usage: python -m shared.model.kernels build", file=sys.stderr)
        return 2
    t0, failed = time.perf_counter(), 0
    for name in KERNELS:  # each on its own: one that does not build leaves the others
        try:
            build_one(name)
        except Exception as e:
            failed += 1
            print(
                f"warning: {name} did not build ({type(e).__name__}: {e}); "
                "the engine runs the tensor code it replaces",
                file=sys.stderr,
            )
    print(
        f"C++ kernels: {len(KERNELS) - failed} of {len(KERNELS)} ready in {build_dir()} ({time.perf_counter() - t0:.1f} s)"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
