"""The benchmarks `pdd bench NAME` runs: every module of the bench package with a main(), each
described by the first line of its docstring (read from the source: importing some pulls in torch)."""

from __future__ import annotations

import ast
import importlib.util
import re
from pathlib import Path

HERE = Path(importlib.util.find_spec("bench").origin).parent  # found, not imported: bench imports this
MAIN = re.compile(r"^def main\(", re.MULTILINE)


def bench_names() -> list[str]:
    """Names of the modules with a top-level main(), sorted (a text search: `pdd` runs it for every command)."""
    return [path.stem for path in sorted(HERE.glob("*.py")) if MAIN.search(path.read_text())]


def benches() -> dict[str, str]:
    """{name: one-line description}, by name."""
    return {name: _summary(HERE / f"{name}.py") for name in bench_names()}


def _summary(path: Path) -> str:
    return (ast.get_docstring(ast.parse(path.read_text(), str(path))) or "").split("\n")[0]


def listing(known: dict[str, str]) -> str:
    """What `pdd bench --help` prints."""
    width = max(map(len, known))
    rows = "".join(f"  {name:{width}s}  {what}\n" for name, what in known.items())
    return (
        "usage: pdd bench NAME [ARGS ...]\n\nrun a benchmark; `pdd bench NAME --help` shows its options\n\n"
        f"benches:\n{rows}"
    )
