"""How fast `pdd sim` runs: one hour of paper-like agentic traffic on a 100-instance fleet, on one core.

The goal: one hour of traffic at 100 instances simulated in under 60 s of CPU. The fleets:
PDD with 50 P + 6 RLD on gpu-a in dc-a and 44 MD on gpu-b in dc-b behind one WAN line, and
same-DC PD with 50 P + 50 D on gpu-a. The traffic is the paper-like agentic mix (PAPER preset,
open loop) at --rate, or by default at the SLA goodput of short probe runs (the highest rate at
which PDD meets the SLA over --probe-s of traffic). That rate is a load to time, not one PDD
sustains for an hour: over the hour far fewer requests meet the SLA (the table's "SLA met").
Both fleets serve the same requests. CPU is time.process_time() of simulate() alone (the simulator runs
on one thread); making the workload is timed apart.

    python -m bench.sim [--quick] [--rate RPS] [--duration 3600] [--model NAME]

Writes bench/out/sim_speed.json.
"""

from __future__ import annotations

import argparse
import os
import time

from pdd.benchkit.progress import add_quiet_option, progress
from pdd.benchkit.report import save_report
from pdd.sim.fleet.deployment import Deployment, LinkSpec, RoleSpec, pdd, same_dc
from pdd.sim.fleet.records import SimResult
from pdd.sim.fleet.simulator import simulate
from pdd.sim.hardware.model_spec import ModelSpec
from pdd.sim.hardware.profiles import chip, model_names, model_spec
from pdd.sim.studies.goodput import sla_goodput
from pdd.sim.studies.sla import Sla
from pdd.sim.workloads.agentic import PAPER, agentic_open_loop
from pdd.sim.workloads.workload import Workload

GOAL_CPU_S = 60.0  # per simulated hour
HOUR_S = 3600.0
BLOCK_SIZE = 512  # as `pdd sim paper`
WAN = LinkSpec(100e9 / 8, 0.005, 0.001)  # a 100 Gb/s line, 5 ms one way, up to 1 ms jitter
SLA = Sla()


def default_model() -> str:
    """A 7B-class model with ~56 KB of KV per token where its file exists, else Llama 3.1 8B."""
    return "qwen2.5-7b" if "qwen2.5-7b" in model_names() else "llama-3.1-8b"


def fleets(model: ModelSpec) -> dict[str, Deployment]:
    a, b = chip("gpu-a", model), chip("gpu-b", model)
    return {
        "pdd": pdd(RoleSpec(50, a), RoleSpec(6, a), RoleSpec(44, b), WAN, name="pdd 50P+6RLD+44MD"),
        "same-dc": same_dc(RoleSpec(50, a), RoleSpec(50, a), name="same-dc 50P+50D"),
    }


def traffic(rate_rps: float, duration_s: float, seed: int) -> Workload:
    return agentic_open_loop(PAPER, rate_rps, duration_s, BLOCK_SIZE, seed)


def sustained_rate(fleet: Deployment, model: ModelSpec, args: argparse.Namespace) -> float:
    """The fleet's SLA goodput over a short run of the same traffic (a quick search)."""
    with progress(f"goodput probe of {fleet.name} ({args.probe_s:g} s runs)") as advance:
        found = sla_goodput(
            fleet,
            lambda r: traffic(r, args.probe_s, args.seed),
            model,
            SLA,
            start_rps=8.0,
            rel_tol=0.1,
            drain_s=30.0,
            on_probe=lambda p: advance(),
        )
    return found.rate_rps


def timed_run(fleet: Deployment, model: ModelSpec, rate_rps: float, args: argparse.Namespace) -> dict:
    """One simulation with its CPU time; the figures of the table."""
    t = time.process_time()
    workload = traffic(rate_rps, args.duration, args.seed)
    made_s = time.process_time() - t
    n = len(workload.requests)
    with progress(f"{fleet.name}: {n} requests", total=100) as advance:
        done = [0]

        def on_progress(fraction: float) -> None:
            step = int(fraction * 100)
            advance(step - done[0])
            done[0] = step

        t = time.process_time()
        result = simulate(fleet, workload, model, on_progress=on_progress)
        cpu_s = time.process_time() - t
    return _row(fleet, result, n, cpu_s, made_s, args.duration)


def _row(
    fleet: Deployment, result: SimResult, offered: int, cpu_s: float, made_s: float, duration_s: float
) -> dict:
    per_hour = cpu_s * HOUR_S / duration_s
    summary = result.summary()
    return {
        "fleet": fleet.name,
        "instances": fleet.prefill.count + fleet.decode.count + (fleet.relay.count if fleet.relay else 0),
        "requests": offered,
        "completed": len(result.records),
        "events": result.events,
        "sim_cpu_s": cpu_s,
        "workload_cpu_s": made_s,
        "events_per_s": result.events / cpu_s if cpu_s else 0.0,
        "us_per_request": 1e6 * cpu_s / offered if offered else 0.0,
        "cpu_s_per_sim_hour": per_hour,
        "goal_ratio": per_hour / GOAL_CPU_S,
        "sla_attainment": SLA.attained(result.records, offered),
        "ttft_p99_s": summary["ttft_p99_s"],
        "tpot_p99_s": summary["tpot_p99_s"],
    }


def run(args: argparse.Namespace) -> dict:
    started, load_before = time.monotonic(), os.getloadavg()[0]
    model = model_spec(args.model)
    by_kind = fleets(model)
    rate = args.rate if args.rate is not None else sustained_rate(by_kind["pdd"], model, args)
    rows = [timed_run(fleet, model, rate, args) for fleet in by_kind.values()]
    pdd_row = rows[0]
    targets = [
        {
            "what": f"{HOUR_S:g} s of traffic at {pdd_row['instances']} instances (PDD) in < {GOAL_CPU_S:g} s "
            f"of CPU{' (scaled from a shorter run)' if args.duration != HOUR_S else ''}",
            "value": f"{pdd_row['cpu_s_per_sim_hour']:.1f} s",
            "met": pdd_row["cpu_s_per_sim_hour"] < GOAL_CPU_S,
        }
    ]
    return {
        "model": args.model,
        "block_size": BLOCK_SIZE,
        "duration_s": args.duration,
        "rate_rps": rate,
        "rate_from": "--rate" if args.rate is not None else f"SLA goodput of {args.probe_s:g} s probe runs",
        "sla": SLA.describe(),
        "wan": vars(WAN),
        "goal_cpu_s_per_hour": GOAL_CPU_S,
        "rows": rows,
        "targets": targets,
        "args": vars(args),
        "wall_s": time.monotonic() - started,
        # CPU seconds grow on a busy host (shared caches and cores): its load beside the figures
        "host": {"cpus": os.cpu_count(), "load_avg_1m": [load_before, os.getloadavg()[0]]},
    }


def _print(res: dict) -> None:
    print(
        f"{res['model']}, block {res['block_size']}, {res['duration_s']:g} s of PAPER agentic traffic at "
        f"{res['rate_rps']:.2f} req/s ({res['rate_from']}); SLA: {res['sla']}"
    )
    host = res["host"]
    print(
        f"host: {host['cpus']} CPUs, 1-minute load average {host['load_avg_1m'][0]:.1f} before, "
        f"{host['load_avg_1m'][1]:.1f} after"
    )
    head = f"{'fleet':22s} {'requests':>8s} {'events':>9s} {'sim CPU s':>9s} {'events/s':>9s} {'µs/req':>7s} {'s/hour':>7s} {'÷ goal':>6s} {'SLA met':>7s}"
    print(head)
    for r in res["rows"]:
        print(
            f"{r['fleet']:22s} {r['requests']:8d} {r['events']:9d} {r['sim_cpu_s']:9.1f} {r['events_per_s']:9.0f} "
            f"{r['us_per_request']:7.0f} {r['cpu_s_per_sim_hour']:7.1f} {r['goal_ratio']:6.2f} {r['sla_attainment']:7.1%}"
        )


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="pdd bench sim",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="5 minutes of traffic (the CPU figure scaled to an hour), 2-minute probes",
    )
    p.add_argument("--duration", type=float, default=HOUR_S, help="seconds of traffic to simulate")
    p.add_argument("--rate", type=float, default=None, help="requests/s; None: the PDD fleet's SLA goodput")
    p.add_argument("--probe-s", type=float, default=300.0, help="traffic seconds of each goodput probe run")
    p.add_argument("--model", default=default_model(), choices=model_names())
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench/out/sim_speed.json")
    add_quiet_option(p)
    args = p.parse_args(argv)
    if args.quick:
        args.duration, args.probe_s = min(args.duration, 300.0), min(args.probe_s, 120.0)
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    res = run(args)
    save_report(res, args.out, table=_print)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
