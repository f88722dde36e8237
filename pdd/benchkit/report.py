"""What every benchmark prints, writes and plots the same way."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

Figures = Any  # a matplotlib Figure, or {name: Figure} for several images


def print_targets(targets: list[dict]) -> None:
    """Each target as [met] / [MISSED] / [info] (met is None), or as its "verdict" where it has one
    (a goal judged on an interval: met / likely / MISSED, pdd/benchkit/bootstrap.py), with its value."""
    if not targets:
        return
    print("\ntargets:")
    for t in targets:
        mark = t.get("verdict") or ("info" if t.get("met") is None else ("met" if t["met"] else "MISSED"))
        print(f"  [{mark}] {t['what']}: {t['value']}")


def pyplot():
    """matplotlib.pyplot on the file-only backend (benchmarks run without a display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_report(
    result: dict,
    out: str | Path,
    *,
    table: Callable[[dict], None] | None = None,
    figures: Callable[[dict], Figures] | None = None,
) -> list[Path]:
    """The tail of every benchmark: print its table and its targets, write the result as JSON to
    `out` and its figures as PNGs next to it (one figure: out.png; {name: figure}: out_name.png).
    Returns the files written."""
    if table is not None:
        table(result)
    print_targets(result.get("targets", []))
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, default=str))
    written = [out]
    if figures is not None:
        written += _save_figures(figures(result), out)
    wall = f"  ({result['wall_s']:.0f} s)" if "wall_s" in result else ""
    print(f"\nwrote {', '.join(str(p) for p in written)}{wall}")
    return written


def _save_figures(figs: Figures, out: Path) -> list[Path]:
    named = figs if isinstance(figs, dict) else {"": figs}
    plt = pyplot()
    paths = []
    for name, fig in named.items():
        path = out.with_name(f"{out.stem}_{name}.png") if name else out.with_suffix(".png")
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths
