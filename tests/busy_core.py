"""Run a command with one CPU core kept busy: `python -m tests.busy_core CMD ARGS...`.

`make test-loaded` runs the suite this way, to show that no test depends on one service being
faster than another: a hog process (a Python spin loop, what `stress-ng --cpu 1` does) takes one
core for as long as the command runs. The command's exit status is this one's."""

from __future__ import annotations

import subprocess
import sys

SPIN = "while True: pass"


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: python -m tests.busy_core CMD [ARGS...]", file=sys.stderr)
        return 2
    hog = subprocess.Popen([sys.executable, "-c", SPIN])
    try:
        return subprocess.call(argv)
    finally:
        hog.kill()
        hog.wait()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
