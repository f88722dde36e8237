"""End-to-end benchmark against real `pdd up` systems (small preset, emulated WAN), client side.

Scenarios:
  single   one long, uncached prompt whose KV takes seconds to cross the WAN,
           1000 output tokens: P→MD vs P→RLD→MD vs the same request with no WAN delay
           or cap, in one run (rounds rotate the order). TTFT, time to the 2nd token,
           max inter-token gap, RLD share of the output tokens.
  agentic  (default) multi-turn agent sessions against three deployments side by side:
             same-dc  PD with no WAN delay or cap (P→MD forced: same-DC PD has no relay)
             naive    cross-DC PD: P→MD forced, every request's missing KV over the WAN
             pdd      cross-DC PDD: the router's policy picks P→MD or P→RLD→MD
           The three systems run at once; the workload runs in waves and each wave runs on
           each deployment in turn (rotating order), so machine noise hits all three alike.

Every ratio (a deployment or variant over another: p50 / p99 of TTFT, 2nd token, max gap, TPOT;
SLA goodput) is printed and written with its 90% bootstrap interval, "×0.62 [0.51–0.74]", and
"n.s." where the interval contains 1; targets on a ratio are judged on the interval (met /
likely / MISSED: pdd/benchkit/bootstrap.py). Requests are paired across deployments by planned step
(agentic) or by round (single).

In this system P streams the first token itself, straight after prefill, so TTFT never
includes the KV crossing the WAN; where P→MD waits for the KV shows in the time to the
2nd token and in the max inter-token gap, which are reported next to TTFT.

    python -m bench.e2e [--scenario agentic|single] [--quick] [options; see --help]

Writes bench/out/e2e_<scenario>.json (+ e2e_agentic_ttft_cdf.png, e2e_agentic_by_hit.png); its
"cpu" holds, per deployment (variant), the CPU seconds of each process over that deployment's
timed runs and the host's busy CPU seconds (pdd/benchkit/cpu.py), which `pdd sim validate` charges.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from bench.e2e_agentic import DEPLOYMENTS, run_agentic
from bench.e2e_agentic_report import agentic_figures, print_agentic
from bench.e2e_single import DEFAULT_SINGLE, SINGLE_VARIANTS, print_single, run_single
from pdd.benchkit.progress import add_quiet_option
from pdd.benchkit.report import save_report


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="pdd bench e2e",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--scenario", choices=["agentic", "single"], default="agentic")
    p.add_argument("--quick", action="store_true", help="a shorter run (about a minute and a half)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--torch-threads",
        type=int,
        default=1,
        help="OMP_NUM_THREADS of each service (0 = torch's default); 3 engines share this host's cores",
    )
    p.add_argument(
        "--prefill-chunk",
        type=int,
        default=256,
        help="P's tokens of one prompt per forward, so KV streams while the prompt is prefilled (0 = system default)",
    )
    g = p.add_argument_group("WAN (cross-DC deployments)")
    g.add_argument("--delay-ms", type=float, default=15.0, help="one-way delay (RTT = 2x)")
    g.add_argument("--jitter-ms", type=float, default=2.0)
    g.add_argument(
        "--bandwidth-mbps",
        type=float,
        default=100.0,
        help="scaled to the small model: 2048 tokens of KV (32 MiB) take 2.7 s",
    )
    g = p.add_argument_group("single")
    g.add_argument("--prompt-tokens", type=int, default=2048)
    g.add_argument("--output-tokens", type=int, default=1000)
    g.add_argument("--rounds", type=int, default=2)
    g.add_argument("--variants", default=DEFAULT_SINGLE, help=f"comma list from {', '.join(SINGLE_VARIANTS)}")
    add_agentic_args(p.add_argument_group("agentic workload"))
    p.add_argument("--out", default=None, help="default bench/out/e2e_<scenario>.json")
    add_quiet_option(p)
    args = p.parse_args(argv)
    if args.quick:
        if args.scenario == "single":
            args.output_tokens = min(args.output_tokens, 300)
            args.rounds = 1
        else:
            args.requests = min(args.requests, 9)
            args.wave = min(args.wave, 3)
            args.output_max = min(args.output_max, 96)
    return args


def add_agentic_args(g) -> None:
    g.add_argument("--deployments", default=",".join(DEPLOYMENTS))
    g.add_argument("--requests", type=int, default=48, help="requests per deployment")
    g.add_argument("--clients", type=int, default=3, help="concurrent agent sessions")
    g.add_argument("--wave", type=int, default=4, help="requests per agent before switching deployment")
    g.add_argument("--shared-prefix", type=int, default=1536, help="system prompt shared by every session")
    g.add_argument("--new-min", type=int, default=1024, help="prompt tokens of a new session, min")
    g.add_argument("--new-max", type=int, default=2560, help="prompt tokens of a new session, max")
    g.add_argument("--append-min", type=int, default=8, help="tokens a continuation adds at least")
    g.add_argument(
        "--context-max", type=int, default=3584, help="prompt + output cap; a longer session restarts"
    )
    g.add_argument(
        "--high-hit-frac", type=float, default=0.75, help="share of requests aiming above --high-hit-min"
    )
    g.add_argument("--high-hit-min", type=float, default=0.95)
    g.add_argument("--output-min", type=int, default=32)
    g.add_argument("--output-max", type=int, default=192)
    g.add_argument("--outlier-frac", type=float, default=0.04, help="long-input short-output requests")
    g.add_argument("--outlier-input", type=int, default=3072)
    g.add_argument("--outlier-output", type=int, default=8)
    g.add_argument("--think-s", type=float, default=0.0, help="agent pause between turns")
    g.add_argument("--md-kv-mb", type=float, default=768, help="KV pool of MD and P (prefix caches)")
    g.add_argument(
        "--no-share-in-flight",
        dest="share_in_flight",
        action="store_false",
        help="MD asks for every block it lacks, even one already crossing for another request "
        "(only to measure what sharing saves)",
    )
    g.add_argument("--sla-ttft-s", type=float, default=2.0)
    g.add_argument("--sla-tpot-s", type=float, default=0.1)
    g.add_argument("--sla-max-gap-s", type=float, default=None, help="optional third SLA bound")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t0, load0 = time.monotonic(), os.getloadavg()
    if args.scenario == "single":
        res, table, figures = run_single(args), print_single, None
    else:
        res, table, figures = run_agentic(args), print_agentic, agentic_figures
    res["wall_s"] = time.monotonic() - t0
    res["share_in_flight"] = getattr(args, "share_in_flight", True)
    # How contended the host was (`pdd sim validate` models it as CPU sharing).
    res["host"] = {"cores": os.cpu_count(), "loadavg_start": load0, "loadavg_end": os.getloadavg()}
    save_report(res, args.out or f"bench/out/e2e_{args.scenario}.json", table=table, figures=figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
