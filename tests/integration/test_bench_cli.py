"""`pdd bench NAME --help` is the bench's own help, `pdd bench --help` lists the benches, and
the progress bars of pdd/benchkit/progress.py: drawn only on a terminal, counting what was done."""

from __future__ import annotations

import argparse
import importlib
import io
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from rich.console import Console

from pdd import cli
from pdd.benchkit import progress as bars
from pdd.benchkit.catalog import benches

ROOT = Path(__file__).resolve().parents[2]
BENCHES = (
    "bandwidth",
    "chaos",
    "device_blocks",
    "e2e",
    "engine",
    "handoff",
    "peer",
    "scale",
    "sim",
    "structured",
    "transport",
    "vllm_sampling",
)
HELPERS = ("bootstrap", "catalog", "client", "progress", "report")
COLUMNS = "100"  # argparse wraps help to the terminal width: the same for both sides


@pytest.fixture(autouse=True)
def _clean_progress_settings(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv(bars.ENV, raising=False)
    monkeypatch.setenv("COLUMNS", COLUMNS)
    yield
    bars.set_quiet(False)


def _pdd(argv: list[str], capsys) -> tuple[int, str, str]:
    """`pdd ARGV` in this process: exit status, stdout, stderr."""
    try:
        code = cli.main(argv)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 0
    out = capsys.readouterr()
    return code, out.out, out.err


# `python -m bench.NAME --help` for every bench, in one fresh interpreter (runpy runs a module as
# `python -m` does) so torch is imported once.
MODULE_HELP = """
import contextlib, io, json, runpy, sys
helps = {}
for name in sys.argv[1:]:
    sys.argv, out = [name, "--help"], io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        runpy.run_module(f"bench.{name}", run_name="__main__", alter_sys=True)
    helps[name] = out.getvalue()
print(json.dumps(helps))
"""


def _module_help(names: tuple[str, ...]) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": COLUMNS}
    done = subprocess.run(
        [sys.executable, "-c", MODULE_HELP, *names],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return json.loads(done.stdout)


@pytest.mark.e2e  # imports every bench in a child interpreter: too slow for the inner loop
def test_bench_help_is_the_bench_own_help(capsys) -> None:
    expected = _module_help(BENCHES)
    for name in BENCHES:
        for flag in ("--help", "-h"):
            code, out, err = _pdd(["bench", name, flag], capsys)
            assert (code, err) == (0, "")
            assert out == expected[name], f"pdd bench {name} {flag}"
        assert "--quiet" in out  # every bench can turn its bars off
    code, out, _ = _pdd(["chaos", "--help"], capsys)
    assert (code, out) == (0, expected["chaos"])


def test_bench_list_names_every_bench_with_its_docstring(capsys) -> None:
    assert list(benches()) == sorted(BENCHES)
    for argv in (["bench", "--help"], ["bench", "-h"]):
        code, out, err = _pdd(argv, capsys)
        assert (code, err) == (0, "")
        rows = {
            line.split()[0]: line.split(maxsplit=1)[1] for line in out.split("benches:\n")[1].splitlines()
        }
        assert set(rows) == set(BENCHES)
        for name in BENCHES:
            assert rows[name] == importlib.import_module(f"bench.{name}").__doc__.splitlines()[0]
        assert not set(HELPERS) & set(rows)


def test_unknown_or_missing_bench_exits_2_naming_the_benches(capsys) -> None:
    code, out, err = _pdd(["bench", "nope", "--help"], capsys)
    assert code == 2 and out == "" and "'nope'" in err
    assert all(name in err for name in BENCHES)
    code, out, err = _pdd(["bench"], capsys)
    assert code == 2 and out == "" and all(f"  {name} " in err for name in BENCHES)


def test_other_arguments_reach_the_bench_unchanged() -> None:
    args, extra = cli.parse_args(["bench", "e2e", "--scenario", "single", "--quick", "-h"])
    assert (args.name, extra) == ("e2e", ["--scenario", "single", "--quick", "-h"])


def _terminal() -> tuple[Console, io.StringIO]:
    out = io.StringIO()
    return Console(file=out, force_terminal=True, width=100), out


def test_bar_counts_advances_and_reaches_its_total() -> None:
    console, out = _terminal()
    with bars.progress("agentic p-md", total=8, console=console) as advance:
        threads = [threading.Thread(target=advance) for _ in range(6)]  # agents advance from their threads
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        advance(2)
    text = out.getvalue()
    assert "agentic p-md" in text and "8/8" in text and "9/8" not in text

    console, out = _terminal()
    with bars.progress("rounds", total=3, console=console) as advance:
        advance()
        advance()
    assert "2/3" in out.getvalue() and "3/3" not in out.getvalue()


def test_spinner_without_total() -> None:
    console, out = _terminal()
    with bars.progress("[kill-md] settling", console=console):  # brackets: a name, not rich markup
        pass
    assert "[kill-md] settling" in out.getvalue() and "/" not in out.getvalue()


def test_no_bar_off_a_terminal_or_when_turned_off(capsys, monkeypatch: pytest.MonkeyPatch) -> None:
    with bars.progress("x", total=2) as advance:  # stderr is pytest's capture: not a terminal
        advance()
    assert capsys.readouterr() == ("", "")
    plain = io.StringIO()
    with bars.progress("x", total=2, console=Console(file=plain)) as advance:
        advance()
    assert plain.getvalue() == ""

    monkeypatch.setenv(bars.ENV, "0")
    console, out = _terminal()
    with bars.progress("x", total=2, console=console) as advance:
        advance()
    assert out.getvalue() == ""
    monkeypatch.delenv(bars.ENV)

    parser = argparse.ArgumentParser()
    bars.add_quiet_option(parser)
    assert vars(parser.parse_args(["--quiet"])) == {}  # nothing lands in a bench's JSON config
    console, out = _terminal()
    with bars.progress("x", total=2, console=console) as advance:
        advance()
    assert out.getvalue() == ""
