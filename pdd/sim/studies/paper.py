"""`pdd sim paper`: the paper's fleet comparison, simulated, beside the paper's own figures.

`--scenario` picks what is served; the default, `published`, is the report's setup as far as
it is public, every figure with its source in `pdd sim paper --explain` (paper_explain.py).
The fleets are the paper's, in chips: same-DC 88 A split into P and D at the split with the
highest SLA goodput; PDD 43 A for P and the relay, 32 B for MD, one cross-DC line; naive
cross-DC the same chips without a relay. Every goodput is measured in a steady state
(goodput.py: a warm-up excluded, a window several request lifetimes long, Little's law
checked) to 3%. Latencies are compared at one offered rate, the same-DC fleet's goodput.

The older scenarios (64k-hybrid, 64k-moe, 7b-dense) keep their models, chips and traffic by
name: instances of `tp` chips, gpu-a (H100-class) and gpu-b (H20-class), a 400 Gbit/s line.
`--scale` simulates that share of every fleet's instances (rates and the line with them; each
instance keeps the memory and weights' share it has in the full fleet).
"""

from __future__ import annotations

import argparse
import time
from concurrent.futures import ProcessPoolExecutor
from functools import partial
from pathlib import Path

from pdd.benchkit.progress import add_quiet_option, progress
from pdd.benchkit.report import save_report
from pdd.sim.fleet.deployment import Deployment
from pdd.sim.studies import paper_report
from pdd.sim.studies.goodput import Goodput, Probe, probe, sla_goodput
from pdd.sim.studies.paper_fleets import (
    DEFAULT_REGIME,
    REGIMES,
    Scenario,
    candidates,
    make_workload,
    model_of,
)


# ---- the searches ----------------------------------------------------------------------------
def search(sc: Scenario, d: Deployment) -> Goodput:
    """SLA goodput of one deployment (run in a worker process: results only, no callbacks)."""
    return sla_goodput(
        d,
        partial(make_workload, sc),
        model_of(sc.r),
        sc.r.sla,
        sc.settings,
        start_rps=sc.r.start_rps * sc.scale,
        rel_tol=sc.rel_tol,
        window=sc.window,
        growth=1.5,
    )


def search_all(sc: Scenario, fleets: list[Deployment]) -> list[Goodput]:
    """Every fleet's goodput, `sc.jobs` searches at a time; the bar advances by their probes."""
    with (
        progress("pdd sim paper: searches", total=len(fleets)) as advance,
        ProcessPoolExecutor(sc.jobs) as pool,
    ):
        futures = [pool.submit(search, sc, d) for d in fleets]
        out = []
        for f in futures:
            out.append(f.result())
            advance(1)
    return out


def probe_at(sc: Scenario, d: Deployment, rate: float) -> Probe:
    return probe(d, make_workload(sc, rate), model_of(sc.r), sc.r.sla, rate, sc.settings, window=sc.window)


def best(fleets: list[Deployment], found: list[Goodput], kind: str) -> tuple[Deployment, Goodput]:
    """The highest goodput of a kind; on a tie the first listed (fewer P, fewer relays)."""
    pairs = [(d, g) for d, g in zip(fleets, found, strict=True) if d.kind == kind]
    return max(pairs, key=lambda dg: dg[1].rate_rps)  # max keeps the first of equals


# ---- the command -----------------------------------------------------------------------------
def run(sc: Scenario) -> dict:
    started = time.perf_counter()
    fleets = candidates(sc)
    found = search_all(sc, fleets)
    chosen = {kind: best(fleets, found, kind) for kind in ("same-dc", "naive", "pdd")}
    base_g = chosen["same-dc"][1]
    if base_g.at_goodput is None:
        raise SystemExit("pdd sim paper: the same-DC fleet met the SLA at no rate probed")
    rate = base_g.rate_rps
    with ProcessPoolExecutor(sc.jobs) as pool:  # the others at the same-DC fleet's goodput
        at = {k: pool.submit(probe_at, sc, chosen[k][0], rate) for k in ("naive", "pdd")}
        at = {"same-dc": base_g.at_goodput, **{k: f.result() for k, f in at.items()}}
    return paper_report.result(sc, fleets, found, chosen, at, time.perf_counter() - started)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdd sim paper", description=__doc__.split("\n")[0])
    d = Scenario()
    p.add_argument(
        "--scenario", choices=sorted(REGIMES), default=DEFAULT_REGIME, help="what is served, on what"
    )
    p.add_argument(
        "--explain", action="store_true", help="print every assumption with its source, run nothing"
    )
    p.add_argument("--quick", action="store_true", help="the scenario's quick scale, a 2-lifetime window")
    p.add_argument("--bathtub", action="store_true", help="also PDD's goodput over same-DC's by prefix hit")
    p.add_argument(
        "--no-share-in-flight", action="store_true", help="each request sends MD every block it lacks"
    )
    p.add_argument("--scale", type=float, default=None, help="share of every fleet's instances (default 1)")
    p.add_argument(
        "--lifetimes", type=float, default=None, help=f"measuring window (default {d.lifetimes:g})"
    )
    p.add_argument(
        "--warmup", type=float, default=None, help=f"warm-up in SLA lifetimes (default {d.warmup:g})"
    )
    p.add_argument("--rel-tol", type=float, default=d.rel_tol, help="the goodput search's resolution")
    p.add_argument("--wan-gbps", type=float, default=None, help="the line's Gbit/s (default: the scenario's)")
    p.add_argument("--rtt-ms", type=float, default=d.rtt_s * 1000, help="the line's round trip, ms")
    p.add_argument("--line-price", type=float, default=d.line_price, help="the line's USD per hour")
    p.add_argument("--jobs", type=int, default=d.jobs, help="searches run in parallel (processes)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--out", default="bench/out/sim_paper.json")
    add_quiet_option(p)
    return p


def scenario(args: argparse.Namespace) -> Scenario:
    regime = REGIMES[args.scenario]
    scale = args.scale if args.scale is not None else regime.quick_scale if args.quick else 1.0
    lifetimes = args.lifetimes if args.lifetimes is not None else 2.0 if args.quick else Scenario.lifetimes
    return Scenario(
        scale=scale,
        lifetimes=lifetimes,
        warmup=args.warmup if args.warmup is not None else 1.5 if args.quick else Scenario.warmup,
        seed=args.seed,
        wan_gbps=args.wan_gbps,
        rtt_s=args.rtt_ms / 1000,
        line_price=args.line_price,
        rel_tol=args.rel_tol,
        jobs=max(1, args.jobs),
        regime=args.scenario,
        share_in_flight=not args.no_share_in_flight,
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    sc = scenario(args)
    if args.explain:
        print(paper_report.explain(sc))
        return 0
    result = run(sc)
    if args.bathtub:
        result["bathtub"] = paper_report.bathtub_points(sc, result)
    save_report(result, Path(args.out), table=paper_report.print_table, figures=paper_report.figure)
    return 0
