"""`pdd sim map`: where PDD pays. PDD's SLA goodput and BCR change against the same-DC fleet (and
naive cross-DC's goodput change) over KV bytes per token x the line's Gbit/s x mean prefix hit.

Each cell is `pdd sim paper`'s comparison (its fleets, prices, SLA and searches, pdd/sim/paper.py)
on one variant of its scenario (--scenario, default the paper's regime):
  KV bytes per token  the scenario's model with more or fewer of its layers on full attention
                      (each such layer adds its KV and its attention compute; weights unchanged);
  line                the cross-DC line's bandwidth (its RTT, jitter and price as the scenario's);
  mean prefix hit     the share of requests aiming above 95% (the rest aim uniformly at 0-95%,
                      outliers as the scenario's): the axis shows the workload's measured mean.
The paper's point (its fleets at ~50 KB per token, 90% mean hit; the line's bandwidth is not
published, 400 Gbit/s assumed as in `pdd sim paper`) is marked on every panel.
"""

from __future__ import annotations

import argparse
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

from pdd.benchkit.progress import add_quiet_option, progress
from pdd.benchkit.report import pyplot, save_report
from pdd.sim import paper
from pdd.sim.agentic import hit_profile

PAPER_POINT = {"kv_bytes_per_token": 50_000, "mean_hit": 0.9, "line_gbps": 400.0}
OUTLIERS = 0.035  # the scenario traffic's share of outliers (hit 0)


@dataclass(frozen=True)
class Cell:
    kv_layers: int
    line_gbps: float
    high_share: float  # requests aiming above 95% hit


def high_share_for(mean_hit: float, high_hit_min: float = 0.95, outliers: float = OUTLIERS) -> float:
    """The share of requests aiming above `high_hit_min` (uniformly to 99.9%) that gives
    `mean_hit` when the rest aim uniformly below it and `outliers` hit nothing."""
    high, low = (high_hit_min + 0.999) / 2, high_hit_min / 2
    share = (mean_hit / (1.0 - outliers) - low) / (high - low)
    return min(1.0, max(0.0, share))


def kv_layers_for(kv_bytes: int, base: paper.Regime) -> int:
    """Full-attention layers of the scenario's model that give about `kv_bytes` per token."""
    spec = paper.model_of(base)
    per_layer = spec.kv_bytes_per_token // spec.attn_layers
    return max(1, min(spec.layers, round(kv_bytes / per_layer)))


def regime(base: paper.Regime, cell: Cell) -> paper.Regime:
    traffic = replace(base.traffic, high_hit_frac=cell.high_share, low_hit_min=0.0)
    return replace(base, kv_layers=cell.kv_layers, traffic=traffic)


def run_cell(
    base: paper.Regime, cell: Cell, scale: float, duration_s: float, splits: tuple[float, ...], rel_tol: float
) -> dict:
    """One cell's comparison (in a worker process)."""
    r = regime(base, cell)
    sc = paper.Scenario(
        scale=scale, duration_s=duration_s, wan_gbps=cell.line_gbps, regime=r, jobs=1, rel_tol=0.15
    )
    a, b = paper.chips(sc)
    total = sc.count(paper.BASELINE_A)
    fleets = [paper.same_dc_fleet(sc, a, min(total - 1, max(1, round(total * f)))) for f in splits]
    pdd_a = sc.count(paper.PDD_A)
    fleets += [paper.pdd_fleet(sc, a, b, min(pdd_a - 1, 1)), paper.naive_fleet(sc, a, b)]
    found = [paper.search(sc, d) for d in fleets]
    best = {
        k: max(g.rate_rps for d, g in zip(fleets, found, strict=True) if d.kind == k)
        for k in ("same-dc", "pdd", "naive")
    }
    goodput = paper.change(best["pdd"], best["same-dc"])
    cost = paper.cost_change(a, sc.line_price, paper.PREMIUMS[0])
    return {
        "kv_bytes_per_token": paper.model_of(r).kv_bytes_per_token,
        "line_gbps": cell.line_gbps,
        "mean_hit": hit_profile(paper.make_workload(sc, max(best["pdd"], 1.0)))["mean"],
        "high_share": cell.high_share,
        "goodput_rps": best,
        "goodput_change": goodput,
        "bcr_change_20": (1.0 + goodput) / (1.0 + cost) - 1.0,
        "naive_goodput_change": paper.change(best["naive"], best["same-dc"]),
    }


def run(args: argparse.Namespace) -> dict:
    started = time.perf_counter()
    base = paper.REGIMES[args.scenario]
    cells = [
        Cell(kv_layers_for(kv, base), gbps, high_share_for(hit))
        for kv in args.kv_bytes
        for gbps in args.line_gbps
        for hit in args.mean_hit
    ]
    scale = args.scale if args.scale is not None else 0.1 if args.quick else 0.25
    duration = args.duration if args.duration is not None else 5.0 if args.quick else 10.0
    splits, rel_tol = ((0.5,), 0.3) if args.quick else (paper.SPLITS, 0.15)
    with progress("pdd sim map: cells", total=len(cells)) as advance, ProcessPoolExecutor(args.jobs) as pool:
        futures = [pool.submit(run_cell, base, c, scale, duration, splits, rel_tol) for c in cells]
        out = []
        for f in futures:
            out.append(f.result())
            advance(1)
    return {
        "scenario": {
            "name": args.scenario,
            "model": base.model,
            "tp": base.tp,
            "scale": scale,
            "duration_s": duration,
        },
        "axes": {"kv_bytes_per_token": args.kv_bytes, "line_gbps": args.line_gbps, "mean_hit": args.mean_hit},
        "paper_point": PAPER_POINT,
        "cells": out,
        "wall_s": time.perf_counter() - started,
    }


def print_table(result: dict) -> None:
    print(
        f"\n| {'KV B/token':>10s} | {'Gbit/s':>7s} | {'mean hit':>8s} | {'goodput':>8s} | {'BCR 1.2x':>8s} | {'naive':>8s} |"
    )
    print(f"|{'-' * 12}|{'-' * 9}|{'-' * 10}|{'-' * 10}|{'-' * 10}|{'-' * 10}|")
    for c in result["cells"]:
        print(
            f"| {c['kv_bytes_per_token']:>10d} | {c['line_gbps']:>7.0f} | {c['mean_hit']:>8.1%} | "
            f"{c['goodput_change']:>+8.1%} | {c['bcr_change_20']:>+8.1%} | {c['naive_goodput_change']:>+8.1%} |"
        )


def figure(result: dict):
    """One panel per line speed and figure (rows): KV bytes per token across, mean hit up."""
    plt = pyplot()
    lines = result["axes"]["line_gbps"]
    rows = [
        ("goodput_change", "PDD goodput vs same-DC"),
        ("bcr_change_20", "PDD BCR vs same-DC (B at 1.2x)"),
        ("naive_goodput_change", "naive goodput vs same-DC"),
    ]
    fig, axes = plt.subplots(len(rows), len(lines), figsize=(4 * len(lines), 3.2 * len(rows)), squeeze=False)
    kvs = sorted({c["kv_bytes_per_token"] for c in result["cells"]})
    targets = result["axes"]["mean_hit"]
    for j, gbps in enumerate(lines):
        cells = [c for c in result["cells"] if c["line_gbps"] == gbps]
        for i, (key, title) in enumerate(rows):
            ax = axes[i][j]
            grid = [
                [
                    100
                    * next(
                        c[key]
                        for c in cells
                        if c["kv_bytes_per_token"] == kv and abs(c["high_share"] - high_share_for(h)) < 1e-9
                    )
                    for kv in kvs
                ]
                for h in targets
            ]
            ax.imshow(grid, origin="lower", cmap="RdYlGn", vmin=-60, vmax=60, aspect="auto")
            for y, row in enumerate(grid):
                for x, v in enumerate(row):
                    ax.text(x, y, f"{v:+.0f}%", ha="center", va="center", fontsize=7)
            ax.set_xticks(range(len(kvs)), [f"{kv / 1000:.0f}K" for kv in kvs], fontsize=7)
            ax.set_yticks(range(len(targets)), [f"{h:.0%}" for h in targets], fontsize=7)
            ax.set_xlabel("KV bytes per token")
            ax.set_ylabel("mean prefix hit (target)")
            ax.set_title(f"{title}\n{gbps:.0f} Gbit/s line", fontsize=8)
            p = PAPER_POINT
            px = _where(kvs, p["kv_bytes_per_token"])
            py = _where(targets, p["mean_hit"])
            ax.plot([px], [py], marker="*", color="black", markersize=12)
    return fig


def _where(ticks: list[float], value: float) -> float:
    """`value`'s position on an axis of sorted `ticks` (linear between them, clamped)."""
    if value <= ticks[0]:
        return 0.0
    for k in range(1, len(ticks)):
        if value <= ticks[k]:
            return k - 1 + (value - ticks[k - 1]) / (ticks[k] - ticks[k - 1])
    return float(len(ticks) - 1)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdd sim map", description=__doc__.split("\n")[0])
    p.add_argument("--scenario", choices=sorted(paper.REGIMES), default=paper.DEFAULT_REGIME)
    p.add_argument(
        "--quick",
        action="store_true",
        help="2 x 2 x 2 cells, a tenth of each fleet, 5 s probes (well under a minute)",
    )
    p.add_argument(
        "--kv-bytes", type=int, nargs="+", default=None, help="KV bytes per token (about: whole layers)"
    )
    p.add_argument("--line-gbps", type=float, nargs="+", default=None)
    p.add_argument("--mean-hit", type=float, nargs="+", default=None, help="mean prefix hits aimed at")
    p.add_argument(
        "--scale", type=float, default=None, help="fleet counts, rates and line x this (default 0.25)"
    )
    p.add_argument("--duration", type=float, default=None)
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--out", default="bench/out/sim_map.json")
    add_quiet_option(p)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    quick = args.quick
    args.kv_bytes = args.kv_bytes or ([12_000, 48_000] if quick else [6_000, 24_000, 96_000])
    args.line_gbps = args.line_gbps or ([100.0, 400.0] if quick else [100.0, 400.0])
    args.mean_hit = args.mean_hit or ([0.6, 0.9] if quick else [0.6, 0.9, 0.97])
    args.jobs = max(1, args.jobs)
    result = run(args)
    save_report(result, Path(args.out), table=print_table, figures=figure)
    return 0
