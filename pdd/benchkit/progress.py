"""Progress bars of the benchmarks' long phases, on stderr.

    with progress("agentic p-md", total=n) as advance:
        for ...:
            ...
            advance()

A total of None shows a spinner (a wait of unknown length, such as a system starting). The
bars are off, and cost nothing, when stderr is not a terminal (CI logs, tests), when
PDD_PROGRESS=0 or when the bench was given --quiet; what the bench prints on stdout never
changes. Bars vanish once their phase ends. `advance` may be called from any thread.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rich.console import Console

ENV = "PDD_PROGRESS"
Advance = Callable[..., None]  # advance(n=1)
_quiet = False
_stderr_console: Console | None = None


def _nothing(n: int = 1) -> None:
    pass


class _QuietAction(argparse.Action):
    """--quiet turns the bars off for this process; it adds nothing to the parsed arguments
    (benches write their arguments into their JSON results)."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs) -> None:
        super().__init__(option_strings, argparse.SUPPRESS, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        set_quiet(True)


def add_quiet_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quiet", action=_QuietAction, help=f"no progress bars on stderr (also {ENV}=0)")


def set_quiet(quiet: bool) -> None:
    global _quiet
    _quiet = quiet


def _default_console() -> Console | None:
    """One console for every bar (rich nests live displays that share a console)."""
    global _stderr_console
    if _stderr_console is None and sys.stderr.isatty():
        from rich.console import Console

        _stderr_console = Console(stderr=True)
    return _stderr_console


@contextmanager
def progress(
    description: str, total: int | None = None, *, console: Console | None = None
) -> Iterator[Advance]:
    """A bar of `total` steps (a spinner when None) while the block runs; yields advance(n=1).
    `console` replaces the stderr terminal (tests render into a string with it)."""
    if _quiet or os.environ.get(ENV, "1") == "0":
        yield _nothing
        return
    screen = console is None  # on the real terminal: stdout's lines go above the bar, not through it
    console = console or _default_console()
    if console is None or not console.is_terminal:
        yield _nothing
        return
    import rich.progress as rp

    name = rp.TextColumn("{task.description}", markup=False)  # "[kill-md]" is a name, not a style
    columns = [rp.SpinnerColumn(), name, rp.BarColumn(), rp.TimeElapsedColumn()]
    if total is not None:
        columns.insert(3, rp.MofNCompleteColumn())
    bar = rp.Progress(
        *columns,
        console=console,
        transient=True,
        refresh_per_second=4,
        redirect_stdout=screen and sys.stdout.isatty(),
        redirect_stderr=screen,
    )
    with bar:
        task = bar.add_task(description, total=total)
        yield lambda n=1: bar.advance(task, n)
