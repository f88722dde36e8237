"""`pdd sim`: one subcommand per module; each module's main(argv) parses its own arguments.

A command's module is imported only when the command runs, so `pdd sim --help` stays fast
and a new command is one line here plus pdd/sim/<module>.py with a main(argv).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# name: (module with main(argv) -> int, one line for `pdd sim --help`)
COMMANDS: dict[str, tuple[str, str]] = {
    "run": (
        "pdd.sim.studies.run",
        "simulate one deployment under one workload: latencies, goodput, cost, bandwidth",
    ),
    "calibrate": (
        "pdd.sim.hardware.calibrate",
        "time the real engine here and write a calibrated hardware profile",
    ),
    "validate": (
        "pdd.sim.studies.validate",
        "simulate the `pdd bench e2e` scenarios and compare with measured runs",
    ),
    "paper": ("pdd.sim.studies.paper", "reproduce the paper's fleet table (88 A same-DC vs 43 A + 32 B PDD)"),
    "map": (
        "pdd.sim.studies.map",
        "where PDD pays: goodput and BCR change over KV bytes/token x line x prefix hit",
    ),
    "plan": ("pdd.sim.studies.plan", "cheapest (P, RLD, MD) counts per datacenter that meet an SLA"),
    "profiles": (
        "pdd.sim.hardware.list_profiles",
        "list the hardware profiles and model shapes with their key figures",
    ),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdd sim", description="Discrete-event simulator of a PDD fleet")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (_, line) in COMMANDS.items():
        sub.add_parser(name, help=line, add_help=False)  # its --help is its module's own
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if not argv or argv[0] not in COMMANDS:  # --help, nothing, or an unknown command
        parser.parse_args(argv)
        return 2
    module_name, _ = COMMANDS[argv[0]]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name != module_name:
            raise  # the command exists but something it needs is missing: show that
        print(
            f"pdd sim {argv[0]}: {module_name.replace('.', '/')}.py is missing from this installation",
            file=sys.stderr,
        )
        return 2
    return int(module.main(argv[1:]) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
