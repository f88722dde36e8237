"""`pdd sim run`: deployments side by side under one workload, on the project's own policy code.

Per deployment: latencies (TTFT, 2nd token, TPOT, max gap: p50 and p99), the pipelines the
router chose, the relay's share of output tokens, requests the anomalous-traffic filter
ended, cross-DC Gbit/s (mean and p99 of 1 s bins), the fleet's cost per hour; with --sweep
its SLA goodput (the highest rate meeting the SLA) and BCR; with --bathtub PDD's goodput
benefit over a baseline across prefix hit rates. Ratios are against the first deployment.
Writes JSON (settings echoed, every sweep probe) and PNGs beside it.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

from pdd.benchkit.progress import add_quiet_option, progress
from pdd.benchkit.report import save_report
from pdd.sim.fleet.deployment import IN_DC, Deployment
from pdd.sim.fleet.link import link_codec
from pdd.sim.fleet.records import SimResult, percentile
from pdd.sim.fleet.simulator import SimSettings, simulate
from pdd.sim.hardware.model_spec import ModelSpec
from pdd.sim.studies import plots
from pdd.sim.studies.bathtub import GRID, bathtub
from pdd.sim.studies.goodput import bcr, sla_goodput
from pdd.sim.studies.sla import Sla
from pdd.sim.studies.specs import (
    SpecError,
    WorkloadSpec,
    add_deployment_options,
    add_settings_options,
    add_sla_options,
    add_workload_options,
    deployments_from_args,
    model_from_args,
    settings_from_args,
    sla_from_args,
    workload_from_args,
)
from pdd.sim.workloads.agentic import hit_profile
from pdd.sim.workloads.workload import Workload
from shared.kv.codec import CODECS, EXACT

OUT = "bench/out/sim_run.json"
LATENCY_KEYS = ("ttft", "tt2t", "tpot", "max_gap")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="pdd sim run", description=__doc__.split("\n")[0])
    add_deployment_options(ap)
    add_workload_options(ap)
    add_sla_options(ap)
    add_settings_options(ap)
    ap.add_argument(
        "--drain",
        type=float,
        default=120.0,
        help="seconds past the last arrival before unfinished requests count as missed (default 120)",
    )
    ap.add_argument("--sweep", action="store_true", help="find each deployment's SLA goodput and BCR")
    ap.add_argument(
        "--sweep-tol",
        type=float,
        default=0.05,
        help="relative precision of the goodput search (default 0.05)",
    )
    ap.add_argument(
        "--bathtub",
        action="store_true",
        help="PDD's goodput benefit over --bathtub-baseline across hit rates",
    )
    ap.add_argument(
        "--bathtub-baseline",
        choices=("same-dc", "naive"),
        default="same-dc",
        help="what PDD is compared with: the first of that kind in --deployment (default same-dc)",
    )
    ap.add_argument(
        "--bathtub-grid", default=",".join(f"{h:g}" for h in GRID), help="hit rates (default %(default)s)"
    )
    ap.add_argument(
        "--bathtub-duration", type=float, default=20.0, help="seconds of arrivals per probe (default 20)"
    )
    ap.add_argument(
        "--wan-codec",
        choices=CODECS,
        default=EXACT,
        help="KV codec on every cross-DC line (PDD_PREFILL_WAN_KV_CODEC; default exact)",
    )
    ap.add_argument("--out", default=OUT, help=f"JSON result; PNGs beside it (default {OUT})")
    add_quiet_option(ap)
    return ap


def with_wan_codec(deployments: list[Deployment], model: ModelSpec, name: str) -> list[Deployment]:
    """Every cross-DC line carries its KV in codec `name` (the in-DC paths stay exact)."""
    codec = link_codec(name, model.dtype_bytes, model.head_dim)
    return [
        d if d.wan is IN_DC else dataclasses.replace(d, wan=dataclasses.replace(d.wan, codec=codec))
        for d in deployments
    ]


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        model = model_from_args(args)
        deployments = with_wan_codec(deployments_from_args(args, model), model, args.wan_codec)
        spec, sla, settings = workload_from_args(args), sla_from_args(args), settings_from_args(args)
        hits = _grid(args.bathtub_grid) if args.bathtub else ()
        pair = _bathtub_pair(deployments, args.bathtub_baseline) if args.bathtub else None
    except SpecError as e:
        print(f"pdd sim run: {e}", file=sys.stderr)
        return 2
    started = time.perf_counter()
    workload = spec.at()
    result = {"settings": _settings(args, model, sla, settings, spec, workload)}
    print(_workload_line(result["settings"]["workload"]))
    rows = _run_all(deployments, workload, model, sla, settings, args.drain)
    if args.sweep:
        _sweep_all(deployments, rows, spec, model, sla, settings, args)
    _add_ratios(rows)
    result["deployments"] = rows
    if pair:
        result["bathtub"] = _bathtub(pair, spec, model, sla, settings, hits, args)
    result["wall_s"] = time.perf_counter() - started
    save_report(result, args.out, table=print_table, figures=plots.figures)
    return 0


def _grid(text: str) -> tuple[float, ...]:
    try:
        hits = tuple(float(x) for x in text.split(","))
    except ValueError:
        raise SpecError(f"--bathtub-grid {text!r}: expected comma-separated hit rates") from None
    if not hits or not all(0.0 <= h <= 1.0 for h in hits):
        raise SpecError(f"--bathtub-grid {text!r}: hit rates must lie in [0, 1]")
    return hits


def _bathtub_pair(deployments: list[Deployment], baseline: str) -> tuple[Deployment, Deployment]:
    """The first pdd deployment and the first of the baseline's kind in --deployment."""
    by_kind = {}
    for d in deployments:
        by_kind.setdefault(d.kind, d)
    missing = [k for k in ("pdd", baseline) if k not in by_kind]
    if missing:
        raise SpecError(
            f"--bathtub compares pdd with {baseline}: add {' and '.join(missing)} to --deployment"
        )
    return by_kind["pdd"], by_kind[baseline]


# ---- running ---------------------------------------------------------------------------
def _run_all(
    deployments: list[Deployment],
    workload: Workload,
    model: ModelSpec,
    sla: Sla,
    settings: SimSettings,
    drain_s: float,
) -> list[dict]:
    limit = dataclasses.replace(settings, time_limit_s=workload.duration_s + drain_s)
    rows = []
    with progress("simulate", total=100 * len(deployments)) as advance:
        for d in deployments:
            shown = [0]

            def on_progress(fraction: float, shown=shown) -> None:
                advance(int(fraction * 100) - shown[0])
                shown[0] = int(fraction * 100)

            result = simulate(d, workload, model, limit, on_progress)
            rows.append(deployment_row(d, result, len(workload.requests), sla))
    return rows


def deployment_row(d: Deployment, r: SimResult, offered: int, sla: Sla) -> dict:
    """What the table and the JSON show of one deployment's run."""
    roles = {"prefill": d.prefill, "relay": d.relay, "decode": d.decode}
    return {
        "name": d.name,
        "kind": d.kind,
        "roles": {
            k: {"count": s.count, "profile": s.chip.name, "price_per_hour": s.chip.price_per_hour}
            for k, s in roles.items()
            if s is not None
        },
        "wan": dataclasses.asdict(d.wan),
        "cost_per_hour": d.cost_per_hour,
        "offered": offered,
        "unfinished": offered - len(r.records),
        "sla_attainment": sla.attained(r.records, offered),
        **r.summary(),
        "cdf": {
            k: [percentile([getattr(x, f"{k}_s") for x in r.records], q) for q in range(101)]
            for k in LATENCY_KEYS
        },
        "wan_gbps_series": [b * 8 / 1e9 for b in r.wan_bytes_per_s],
        "sim_time_s": r.sim_time_s,
        "events": r.events,
        "wall_s": r.wall_s,
    }


def _sweep_all(
    deployments: list[Deployment],
    rows: list[dict],
    spec: WorkloadSpec,
    model: ModelSpec,
    sla: Sla,
    settings: SimSettings,
    args: argparse.Namespace,
) -> None:
    """Each deployment's SLA goodput (from --rate up or down) and BCR, into its row."""
    with progress("goodput sweep", total=len(deployments)) as advance:
        for d, row in zip(deployments, rows, strict=True):
            g = sla_goodput(
                d,
                spec.at,
                model,
                sla,
                settings,
                start_rps=spec.rate_rps,
                rel_tol=args.sweep_tol,
                drain_s=args.drain,
            )
            advance()
            row["goodput_rps"] = g.rate_rps
            row["bcr"] = bcr(g.rate_rps, d.cost_per_hour)
            row["probes"] = [p.row for p in g.probes]


RATIO_KEYS = (
    "ttft_p50_s",
    "ttft_p99_s",
    "tt2t_p50_s",
    "tt2t_p99_s",
    "tpot_p50_s",
    "tpot_p99_s",
    "max_gap_p50_s",
    "max_gap_p99_s",
    "wan_gbps_mean",
    "wan_gbps_p99",
    "cost_per_hour",
    "goodput_rps",
    "bcr",
)


def _add_ratios(rows: list[dict]) -> None:
    """Each row's figures over the first row's (None where the first is zero or missing)."""
    first = rows[0]
    for row in rows:
        row["vs_first"] = {k: _ratio(row.get(k), first.get(k)) for k in RATIO_KEYS if k in row}


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or not b or a != a or b != b:  # NaN != NaN
        return None
    return a / b


def _bathtub(
    pair: tuple[Deployment, Deployment],
    spec: WorkloadSpec,
    model: ModelSpec,
    sla: Sla,
    settings: SimSettings,
    hits: tuple[float, ...],
    args: argparse.Namespace,
) -> dict:
    base = dataclasses.replace(spec.with_hit(0.0), duration_s=args.bathtub_duration)

    def make(hit: float, rate: float) -> Workload:
        return base.with_hit(hit).at(rate)

    with progress(f"bathtub {pair[0].name} vs {pair[1].name}", total=len(hits)) as advance:
        points = bathtub(
            *pair,
            make,
            model,
            sla,
            settings,
            hits=hits,
            start_rps=spec.rate_rps,
            drain_s=min(args.drain, 30.0),
            on_point=lambda p: advance(),
        )
    per_cost = pair[1].cost_per_hour / pair[0].cost_per_hour  # BCR benefit = goodput benefit x this
    rows = [{**p.row, "bcr_benefit": p.benefit * per_cost} for p in points]
    return {
        "pdd": pair[0].name,
        "baseline": pair[1].name,
        "input_tokens": base.input_tokens,
        "output_tokens": base.output_tokens,
        "duration_s": base.duration_s,
        "points": rows,
    }


# ---- what is printed and echoed --------------------------------------------------------
def _settings(
    args: argparse.Namespace,
    model: ModelSpec,
    sla: Sla,
    settings: SimSettings,
    spec: WorkloadSpec,
    workload: Workload,
) -> dict:
    flags = {k: v for k, v in vars(args).items() if k != "deployment_default"}
    return {
        "flags": flags,
        "model": {**dataclasses.asdict(model), "kv_bytes_per_token": model.kv_bytes_per_token},
        "sla": dataclasses.asdict(sla),
        "sla_text": sla.describe(),
        "router": settings.router.model_dump(include=set(_overridden(args, "router"))),
        "relay": settings.relay.model_dump(include=set(_overridden(args, "relay"))),
        "max_batched_tokens": settings.max_batched_tokens,
        "prefill_chunk": settings.prefill_chunk,
        "max_num_seqs": settings.max_num_seqs,
        "workload": {
            "name": workload.name,
            "kind": spec.kind,
            "rate_rps": spec.rate_rps,
            "duration_s": spec.duration_s,
            "block_size": spec.block_size,
            **hit_profile(workload),
        },
    }


def _overridden(args: argparse.Namespace, section: str) -> list[str]:
    return [s.partition("=")[0].partition(".")[2] for s in args.set if s.startswith(section + ".")]


def _workload_line(w: dict) -> str:
    return (
        f"workload {w['name']}: {w['requests']} requests over {w['duration_s']:.0f} s ({w['rate_rps']:g} rps), "
        f"prompts {w['input_tokens_mean']:.0f} tokens, outputs {w['output_tokens_mean']:.0f}, "
        f"mean prefix hit {w['mean']:.0%} ({w['above_95']:.0%} above 95%)"
    )


def _pipelines(r: dict) -> str:
    return " / ".join(f"{r['pipelines'][p]:.0%}" for p in ("p-md", "p-rld-md", "rld-only"))


# (label, the row's key, format); a key in RATIO_KEYS also shows its ratio to the first deployment
TABLE: tuple[tuple[str, str, str], ...] = (
    ("requests done", "requests", "{:d}"),
    ("unfinished", "unfinished", "{:d}"),
    ("P→MD / P→RLD→MD / RLD only", "pipelines", ""),
    ("RLD share of tokens", "rld_token_share", "{:.1%}"),
    ("filtered (relay finished)", "filtered", "{:d}"),
    ("held for the line", "held", "{:d}"),
    ("refused (429)", "refused", "{:d}"),
    ("SLA attainment", "sla_attainment", "{:.1%}"),
    *(
        (f"{name} {q}", f"{key}_{q}_s", "{:.3f} s")
        for key, name in (("ttft", "TTFT"), ("tt2t", "2nd token"), ("tpot", "TPOT"), ("max_gap", "max gap"))
        for q in ("p50", "p99")
    ),
    ("WAN mean", "wan_gbps_mean", "{:.2f} Gb/s"),
    ("WAN p99 (1 s)", "wan_gbps_p99", "{:.2f} Gb/s"),
    ("cost", "cost_per_hour", "${:.2f}/h"),
    ("SLA goodput", "goodput_rps", "{:.2f} rps"),
    ("BCR (req per $)", "bcr", "{:.0f}"),
)


def _cell(row: dict, key: str, fmt: str, first: dict) -> str:
    if key not in row:
        return "-"
    value = row[key]
    text = _pipelines(row) if key == "pipelines" else fmt.format(value)
    ratio = row.get("vs_first", {}).get(key)
    return f"{text} ×{ratio:.2f}" if ratio is not None and row is not first else text


def print_table(result: dict) -> None:
    rows = result["deployments"]
    s = result["settings"]
    print(f"SLA: {s['sla_text']}; ratios (×) against {rows[0]['name']}")
    for r in rows:
        roles = ", ".join(f"{v['count']} {k} {v['profile']}" for k, v in r["roles"].items())
        print(f"  {r['name']}: {roles}")
    width = max(22, *(len(r["name"]) + 2 for r in rows))
    cells = [[_cell(r, key, fmt, rows[0]) for r in rows] for _, key, fmt in TABLE]
    width = max(width, *(len(c) + 2 for line in cells for c in line))
    print(f"{'':<28}" + "".join(f"{r['name']:>{width}}" for r in rows))
    for (label, _, _), line in zip(TABLE, cells, strict=True):
        if any(c != "-" for c in line):
            print(f"{label:<28}" + "".join(f"{c:>{width}}" for c in line))
    if "bathtub" in result:
        b = result["bathtub"]
        print(
            f"\nbathtub: {b['pdd']} over {b['baseline']}, SLA goodput ({b['input_tokens']} in, "
            f"{b['output_tokens']} out, {b['duration_s']:g} s per probe)"
        )
        for p in b["points"]:
            print(
                f"  hit {p['hit']:>5.0%}  {p['pdd_rps']:8.2f} vs {p['base_rps']:8.2f} rps  goodput ×{p['benefit']:.2f}"
                f"  BCR ×{p['bcr_benefit']:.2f}"
            )
