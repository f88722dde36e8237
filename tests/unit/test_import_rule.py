"""The layering rule: shared/ (the library) imports nothing above it; services/ import the library,
never the application (pdd/), the benchmarks or the tests. Read from the source with `ast`, so an
import inside a function counts too."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RULES = {  # package -> top-level packages it must not import
    "shared": ("pdd", "services", "bench", "tests"),
    "services": ("pdd", "bench", "tests"),
}


def imported_modules(path: Path, root: Path) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in the file; relative ones resolved."""
    package = list(path.relative_to(root).with_suffix("").parts)[:-1]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            found.append((node.lineno, ".".join([*base, *filter(None, [node.module])])))
    return found


def broken_imports(root: Path) -> list[str]:
    """`file:line imports module` for each import that runs against RULES."""
    broken = []
    for package, banned in RULES.items():
        for path in sorted((root / package).rglob("*.py")):
            for line, module in imported_modules(path, root):
                if module.split(".")[0] in banned:
                    broken.append(f"{path.relative_to(root)}:{line} imports {module}")
    return broken


def test_library_and_services_import_nothing_above_them():
    broken = broken_imports(ROOT)
    assert not broken, "imports against the layering rule:\n" + "\n".join(broken)


def test_only_the_vllm_package_imports_vllm():
    """vLLM is an engine pdd may run on, never a dependency: shared/vllm/ alone imports it."""
    found = [
        f"{path.relative_to(ROOT)}:{line}"
        for package in ("shared", "services", "pdd")
        for path in sorted((ROOT / package).rglob("*.py"))
        for line, module in imported_modules(path, ROOT)
        if module.split(".")[0] == "vllm" and path.parent != ROOT / "shared" / "vllm"
    ]
    assert not found, "vllm imported outside shared/vllm/:\n" + "\n".join(found)


def test_the_rule_names_file_and_line_of_a_bad_import(tmp_path):
    (tmp_path / "shared" / "kv").mkdir(parents=True)
    (tmp_path / "services" / "relay").mkdir(parents=True)
    (tmp_path / "shared" / "kv" / "ok.py").write_text("import shared.bus\nfrom . import frame\n")
    (tmp_path / "shared" / "kv" / "bad.py").write_text(
        "import os\n\ndef f():\n    from pdd.launch import SERVICES\n"
    )
    (tmp_path / "services" / "relay" / "bad.py").write_text(
        "from shared import config\nfrom bench.client import Client\n"
    )
    assert broken_imports(tmp_path) == [
        "shared/kv/bad.py:4 imports pdd.launch",
        "services/relay/bad.py:2 imports bench.client",
    ]
