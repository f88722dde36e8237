"""`pdd sim map`: where PDD pays. PDD's SLA goodput and BCR change against the best same-DC
split (and naive cross-DC's goodput change) over four axes an operator can read off a quote:

  B's decode per dollar  B's decode throughput per dollar over A's, at the scenario's context
                         and batch caps (the published H200: its own figure; higher: B's step
                         times divided by a factor, a faster or cheaper B);
  KV bytes per token     the model's KV set to this (compressed to uncompressed);
  line                   the cross-DC line's Gbit/s;
  mean prefix hit        the share of turns aiming above 95% (the axis shows the measured mean);
                         or, with `--fixed-hit`, every request of the traffic's mean prompt
                         hitting that share of it (the bathtub's workload);
  answer length          the answers' lengths times `--output-scale` (outliers' kept): where
                         decode outweighs prefill.

Each cell is `pdd sim paper`'s comparison (its fleets, prices at B = 1.2x A, SLA and
steady-state probes, pdd/sim/studies/paper.py) on one variant of its scenario, at a share of
the fleets (`--scale`). The published point (H200, 4,390 B per token, 10-100 Gbit/s, ~89%
hit) is marked.
"""

from __future__ import annotations

import argparse
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

from pdd.benchkit.progress import add_quiet_option, progress
from pdd.benchkit.report import pyplot, save_report
from pdd.sim.studies import paper, paper_fleets, paper_report

PAPER_POINT = {"b_speed": 1.0, "kv_bytes_per_token": 4390, "mean_hit": 0.89, "line_gbps": (10.0, 100.0)}


@dataclass(frozen=True)
class Cell:
    b_speed: float
    kv_bytes: int
    line_gbps: float
    high_share: float  # turns aiming above 95%
    fixed_hit: float | None = None  # every request hits this share instead (high_share unused)
    output_scale: float = 1.0  # answers (not the outliers') this many times as long


def decode_per_dollar(sc: paper_fleets.Scenario) -> float:
    """B's decode tokens/s per dollar over A's: each at its batch cap and the scenario's decode
    context (its step time then), B priced 1.2x A."""
    a = paper_fleets.chip(sc, sc.r.a, paper_fleets.BASELINE_A // 2, True)
    b = paper_fleets.chip(sc, sc.r.b, paper_fleets.PDD_B, True)
    ctx = paper_fleets.decode_context(sc.r)

    def rate(c) -> float:
        return c.max_seqs / c.step.decode_step_s(c.max_seqs, c.max_seqs * ctx)

    return rate(b) / rate(a) / paper_fleets.PREMIUMS[0]


def regime(base: paper_fleets.Regime, cell: Cell) -> paper_fleets.Regime:
    t, k = base.traffic, cell.output_scale
    traffic = replace(
        t,
        high_hit_frac=cell.high_share,
        output_min=round(t.output_min * k),
        output_max=round(t.output_max * k),
        turn_min_s=t.turn_min_s * k,  # a turn follows the last one's answer
    )
    return replace(
        base,
        kv_token_bytes=cell.kv_bytes,
        b_speed=cell.b_speed,
        traffic=traffic,
        fixed_hit=cell.fixed_hit,
    )


def run_cell(
    base: paper_fleets.Regime, cell: Cell, scale: float, lifetimes: float, rel_tol: float, warmup: float
) -> dict:
    """One cell's comparison (in a worker process)."""
    r = regime(base, cell)
    sc = paper_fleets.Scenario(
        scale=scale,
        lifetimes=lifetimes,
        warmup=warmup,
        wan_gbps=cell.line_gbps,
        regime=r,
        jobs=1,
        rel_tol=rel_tol,
    )
    fleets = paper_fleets.candidates(sc)
    found = [paper.search(sc, d) for d in fleets]
    best = {
        k: max(g.rate_rps for d, g in zip(fleets, found, strict=True) if d.kind == k)
        for k in ("same-dc", "pdd", "naive")
    }
    goodput = paper_report.change(best["pdd"], best["same-dc"])
    pdd_at = max((g for d, g in zip(fleets, found, strict=True) if d.kind == "pdd"), key=lambda g: g.rate_rps)
    at = pdd_at.at_goodput.result.summary() if pdd_at.at_goodput else {}
    workload = paper_fleets.make_workload(sc, max(best["pdd"], 0.5))
    cost = paper_fleets.cost_change(sc, paper_fleets.PREMIUMS[0])
    return {
        "b_speed": cell.b_speed,
        "b_decode_per_dollar": decode_per_dollar(sc),
        "kv_bytes_per_token": cell.kv_bytes,
        "line_gbps": cell.line_gbps,
        "high_share": cell.high_share,
        "fixed_hit": cell.fixed_hit,
        "output_scale": cell.output_scale,
        "output_tokens_mean": paper_report.window_profile(workload, sc.window)["output_tokens_mean"],
        "mean_hit": paper_report.window_profile(workload, sc.window)["mean"],
        "goodput_rps": best,
        "goodput_change": goodput,
        "bcr_change_20": (1.0 + goodput) / (1.0 + cost) - 1.0,
        "naive_goodput_change": paper_report.change(best["naive"], best["same-dc"]),
        "pdd_at_goodput": {  # PDD's pipelines at its goodput: does the relay take anything?
            k: at.get(k) for k in ("pipelines", "rld_token_share", "filtered", "requests", "wan_gbps_mean")
        },
    }


def run(args: argparse.Namespace) -> dict:
    started = time.perf_counter()
    base = paper_fleets.REGIMES[args.scenario]
    hits = [(None, share) for share in args.high_share] if args.fixed_hit is None else []
    hits += [(hit, 0.0) for hit in args.fixed_hit or ()]
    cells = [
        Cell(speed, kv, gbps, share, hit, out)
        for speed in args.b_speed
        for kv in args.kv_bytes
        for gbps in args.line_gbps
        for hit, share in hits
        for out in args.output_scale
    ]
    with progress("pdd sim map: cells", total=len(cells)) as advance, ProcessPoolExecutor(args.jobs) as pool:
        futures = [
            pool.submit(run_cell, base, c, args.scale, args.lifetimes, args.rel_tol, args.warmup)
            for c in cells
        ]
        out = []
        for f in futures:
            out.append(f.result())
            advance(1)
    return {
        "scenario": {
            "name": args.scenario,
            "model": base.model,
            "scale": args.scale,
            "lifetimes": args.lifetimes,
            "warmup": args.warmup,
        },
        "axes": {
            "b_speed": args.b_speed,
            "kv_bytes_per_token": args.kv_bytes,
            "line_gbps": args.line_gbps,
            "high_share": args.high_share if args.fixed_hit is None else [],
            "fixed_hit": args.fixed_hit or [],
            "output_scale": args.output_scale,
        },
        "paper_point": PAPER_POINT,
        "cells": out,
        "wall_s": time.perf_counter() - started,
    }


def published(c: dict) -> bool:
    p = PAPER_POINT
    return (
        c["b_speed"] == p["b_speed"]
        and c["kv_bytes_per_token"] == p["kv_bytes_per_token"]
        and c.get("fixed_hit") is None
        and c.get("output_scale", 1.0) == 1.0
    )


def print_table(result: dict) -> None:
    print(
        f"\n| {'B decode/$':>10s} | {'KV B/token':>10s} | {'Gbit/s':>6s} | {'mean hit':>13s} | {'answer':>6s} "
        f"| {'goodput':>8s} | {'BCR 1.2x':>8s} | {'naive':>8s} | {'P>MD/P>RLD>MD/RLD':>18s} | {'RLD tok':>7s} |"
    )
    print(
        f"|{'-' * 12}|{'-' * 12}|{'-' * 8}|{'-' * 15}|{'-' * 8}|{'-' * 10}|{'-' * 10}|{'-' * 10}|{'-' * 20}|{'-' * 9}|"
    )
    for c in result["cells"]:
        mark = " *" if published(c) else ""
        hit = f"{c['mean_hit']:.1%}" + (" (fixed)" if c.get("fixed_hit") is not None else "")
        at = c.get("pdd_at_goodput") or {}
        pipes = at.get("pipelines") or {}
        split = "/".join(f"{100 * pipes.get(k, 0.0):.0f}" for k in ("p-md", "p-rld-md", "rld-only"))
        print(
            f"| {c['b_decode_per_dollar']:>9.2f}x | {c['kv_bytes_per_token']:>10d} | {c['line_gbps']:>6.0f} | {hit:>13s} "
            f"| {c.get('output_tokens_mean', 0.0):>6.0f} | {c['goodput_change']:>+8.1%} | {c['bcr_change_20']:>+8.1%} "
            f"| {c['naive_goodput_change']:>+8.1%} | {split + '%':>18s} | {at.get('rld_token_share') or 0.0:>7.1%} |{mark}"
        )
    print("(* the published chips, KV and traffic; pipelines and RLD tokens: PDD at its goodput, in %)")


def figure(result: dict):
    """One panel per (line, mean hit): B's decode per dollar across, KV bytes per token up."""
    plt = pyplot()
    axes_ = result["axes"]
    hits = [("high_share", h) for h in axes_["high_share"]] + [
        ("fixed_hit", h) for h in axes_.get("fixed_hit", [])
    ]
    panels = [(g, h, o) for g in axes_["line_gbps"] for h in hits for o in axes_.get("output_scale", [1.0])]
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.4), squeeze=False)
    speeds, kvs = axes_["b_speed"], sorted(axes_["kv_bytes_per_token"])
    for j, (gbps, (key, hit_value), scale) in enumerate(panels):
        ax = axes[0][j]
        cells = [
            c
            for c in result["cells"]
            if c["line_gbps"] == gbps and c.get(key) == hit_value and c.get("output_scale", 1.0) == scale
        ]
        grid = [
            [
                next(
                    100 * c["bcr_change_20"]
                    for c in cells
                    if c["b_speed"] == s and c["kv_bytes_per_token"] == kv
                )
                for s in speeds
            ]
            for kv in kvs
        ]
        ax.imshow(grid, origin="lower", cmap="RdYlGn", vmin=-60, vmax=60, aspect="auto")
        for y, row in enumerate(grid):
            for x, v in enumerate(row):
                ax.text(x, y, f"{v:+.0f}%", ha="center", va="center", fontsize=7)
        ratio = {c["b_speed"]: c["b_decode_per_dollar"] for c in cells}
        ax.set_xticks(range(len(speeds)), [f"{ratio[s]:.1f}x" for s in speeds], fontsize=7)
        ax.set_yticks(range(len(kvs)), [f"{kv / 1000:.1f}K" for kv in kvs], fontsize=7)
        ax.set_xlabel("B's decode per dollar over A's")
        ax.set_ylabel("KV bytes per token")
        hit = next((c["mean_hit"] for c in cells), 0.0)
        out = next((c.get("output_tokens_mean", 0.0) for c in cells), 0.0)
        ax.set_title(
            f"PDD BCR vs same-DC (B at 1.2x)\n{gbps:.0f} Gbit/s, mean hit {hit:.0%}, {out:.0f}-token answers",
            fontsize=8,
        )
        if (
            1.0 in speeds
            and PAPER_POINT["kv_bytes_per_token"] in kvs
            and key == "high_share"
            and scale == 1.0
        ):
            ax.plot(
                [speeds.index(1.0)],
                [kvs.index(PAPER_POINT["kv_bytes_per_token"])],
                marker="*",
                color="black",
                markersize=12,
            )
    return fig


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdd sim map", description=__doc__.split("\n")[0])
    p.add_argument("--scenario", choices=sorted(paper_fleets.REGIMES), default=paper_fleets.DEFAULT_REGIME)
    p.add_argument("--quick", action="store_true", help="2 x 2 x 1 x 1 cells at a tenth of the fleets")
    p.add_argument("--b-speed", type=float, nargs="+", default=None, help="B's step times divided by these")
    p.add_argument("--kv-bytes", type=int, nargs="+", default=None, help="KV bytes per token")
    p.add_argument("--line-gbps", type=float, nargs="+", default=None)
    p.add_argument(
        "--high-share", type=float, nargs="+", default=None, help="shares of turns aiming above 95%%"
    )
    p.add_argument(
        "--fixed-hit",
        type=float,
        nargs="+",
        default=None,
        help="every request hits this share of its prompt (replaces --high-share)",
    )
    p.add_argument(
        "--output-scale", type=float, nargs="+", default=None, help="answers this many times as long"
    )
    p.add_argument("--scale", type=float, default=0.125, help="fleets' share (default 0.125)")
    p.add_argument("--lifetimes", type=float, default=2.0, help="probes' measuring window in SLA lifetimes")
    p.add_argument(
        "--warmup",
        type=float,
        default=None,
        help="probes' warm-up in SLA lifetimes (default: the window's, at most 1.5); a fixed hit's first"
        " requests compute each shared prefix once on every P",
    )
    p.add_argument("--rel-tol", type=float, default=0.05, help="each goodput search's resolution")
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--out", default="bench/out/sim_map.json")
    add_quiet_option(p)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    quick = args.quick
    args.b_speed = args.b_speed or ([1.0, 3.0] if quick else [1.0, 2.0, 4.0])
    args.kv_bytes = args.kv_bytes or ([4390, 35000] if quick else [4390, 17500, 70000])
    args.line_gbps = args.line_gbps or ([25.0] if quick else [10.0, 100.0])
    args.high_share = args.high_share or ([0.8] if quick else [0.5, 0.8])
    args.output_scale = args.output_scale or [1.0]
    args.warmup = args.warmup if args.warmup is not None else min(1.5, args.lifetimes)
    bad = [h for h in args.fixed_hit or () if not 0.0 <= h <= 1.0] + [k for k in args.output_scale if k <= 0]
    if bad:
        raise SystemExit(
            f"pdd sim map: --fixed-hit takes shares in [0, 1], --output-scale factors > 0: {bad}"
        )
    if quick:
        args.scale = min(args.scale, 0.1)
    args.jobs = max(1, args.jobs)
    result = run(args)
    save_report(result, Path(args.out), table=print_table, figures=figure)
    return 0
