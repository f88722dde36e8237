"""The benchmarks `pdd bench NAME` runs: every module of this package with a main(), each
described by the first line of its docstring (read from the source: importing some pulls in torch)."""

from __future__ import annotations

import ast
from pathlib import Path


def benches() -> dict[str, str]:
    """{name: one-line description}, by name."""
    found = {}
    for path in sorted(Path(__file__).parent.glob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        if any(isinstance(node, ast.FunctionDef) and node.name == "main" for node in tree.body):
            found[path.stem] = (ast.get_docstring(tree) or "").split("\n")[0]
    return found


def listing(known: dict[str, str]) -> str:
    """What `pdd bench --help` prints."""
    width = max(map(len, known))
    rows = "".join(f"  {name:{width}s}  {what}\n" for name, what in known.items())
    return ("usage: pdd bench NAME [ARGS ...]\n\nrun a benchmark; `pdd bench NAME --help` shows its options\n\n"
            f"benches:\n{rows}")
