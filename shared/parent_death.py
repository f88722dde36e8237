"""Children that die with their parent: even a SIGKILLed `pdd up` (or test run) leaves no orphans."""

from __future__ import annotations

import contextlib
import ctypes
import signal
import sys

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """A preexec_fn: the kernel sends this child SIGTERM when its parent dies (Linux only)."""
    if sys.platform == "linux":
        with contextlib.suppress(Exception):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
