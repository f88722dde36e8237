"""What every benchmark prints and plots the same way."""

from __future__ import annotations


def print_targets(targets: list[dict]) -> None:
    """Each target as [met] / [MISSED] / [info] (met is None) with its measured value."""
    if not targets:
        return
    print("\ntargets:")
    for t in targets:
        mark = "info" if t.get("met") is None else ("met" if t["met"] else "MISSED")
        print(f"  [{mark}] {t['what']}: {t['value']}")


def pyplot():
    """matplotlib.pyplot on the file-only backend (benchmarks run without a display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
