"""Transport benchmark: bulk channel vs raw socket, WAN emulator accuracy, NATS latency.

    python -m bench.transport [--quick] [--size-mib 32] [--pairs 40] [--rows tcp_1,tcp_32]
                              [--out bench/out/transport.json]

Receivers run in a child process (as in deployment), senders here. Rows: raw socket (against
itself: the noise floor), the bulk channel in plaintext over TCP (1 and 32 frames, checksums
on and off, and one request split over N parallel connections), the same over TLS 1.3 (mutual
certificates; each TLS row is also held against its plaintext twin, round by round: "TLS vs
plaintext") and over a Unix socket, and the rdma backend where bench/transport_rdma.py says
it is available. Each row runs in many short rounds, each paired with a raw-socket round (the
order alternates within pairs, and pairs go round-robin over the rows), so a slow spell of the
shared host hits both sides of a pair: the figure is the median of the per-pair ratios
(row GB/s over raw GB/s) with its interquartile range. CPU seconds per GB are the sender's (this
process) and the receiver's (the child); they move less with the host's load than GB/s.
"raw rounds kept N cores busy" tells the host's state: ~1 when the two ends shared one core
(neighbours held the other; then a row's "x raw" follows its CPU ratio), more when each end had
a core of its own (then it follows the slower end). Runs agree when that figure does.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
from typing import Any

from bench.transport_bulk import bench_bulk
from bench.transport_receivers import MiB
from bench.transport_wan_nats import bench_nats, bench_wan
from pdd.benchkit.progress import add_quiet_option
from pdd.benchkit.report import save_report


def _print(results: dict) -> None:
    bulk = results.get("bulk")
    if bulk:
        print(
            f"\nbulk channel vs raw socket, {bulk['bytes'] // MiB} MiB per round, loopback,"
            f" {bulk['pairs']} pairs per row (x raw, CPU x raw: medians of per-pair ratios [IQR])"
        )
        cores = statistics.median(row["raw_cores"] for row in bulk["rows"].values() if "raw_cores" in row)
        print(
            f"  raw rounds kept {cores:.2f} cores busy: ~1 when both ends shared one core (x raw then"
            " follows CPU x raw), more when each end had its own; compare runs whose figure agrees"
        )
        for name, row in bulk["rows"].items():
            if "skipped" in row:
                print(f"  {name:30s} skipped: {row['skipped']}")
                continue
            print(
                f"  {name:30s} {row['GBps']:6.2f} GB/s (raw {row['raw_GBps']:5.2f})"
                f"   x{row['ratio_vs_raw']:.2f} [{row['ratio_q1']:.2f}-{row['ratio_q3']:.2f}]"
                f"   CPU x{row['cpu_ratio_vs_raw']:.2f} [{row['cpu_ratio_q1']:.2f}-{row['cpu_ratio_q3']:.2f}]"
                f"   CPU s/GB send {row['send_cpu_s_per_GB']:.2f} recv {row['recv_cpu_s_per_GB']:.2f}"
            )
        if bulk.get("tls_vs_plain"):
            print(
                "TLS vs plaintext, round by round (TLS GB/s over plain GB/s, CPU: plain's CPU s over TLS's)"
            )
        for name, r in bulk.get("tls_vs_plain", {}).items():
            print(
                f"  {name:30s} plain {r['plain_GBps']:5.2f} GB/s  TLS {r['tls_GBps']:5.2f} GB/s"
                f"   x{r['ratio']:.2f} [{r['ratio_q1']:.2f}-{r['ratio_q3']:.2f}]"
                f"   CPU x{r['cpu_ratio']:.2f} [{r['cpu_ratio_q1']:.2f}-{r['cpu_ratio_q3']:.2f}]"
            )
    wan = results.get("wan")
    if wan:
        print("\nWAN emulator bandwidth (one direction)")
        for r in wan["bandwidth"]:
            print(
                f"  set {r['set_mbps']:6.0f} Mbit/s   measured {r['measured_mbps']:8.1f}   error {r['error_pct']:+5.1f}%"
            )
        print(f"WAN emulator round trip (direct loopback RTT {wan['direct_rtt_ms']:.3f} ms subtracted)")
        for r in wan["rtt"]:
            print(
                f"  delay {r['delay_ms']:4.0f} ms jitter {r['jitter_ms']:3.0f} ms: set RTT {r['set_rtt_ms']:5.1f}  "
                f"added p50 {r['added_rtt_ms_p50']:6.2f} ms  error {r['error_ms']:+5.2f} ms  max {r['rtt_ms_max']:.1f} ms"
            )
    nats = results.get("nats")
    if nats:
        print("\nNATS request/reply latency")
        for name, r in nats.items():
            print(f"  {name:16s} p50 {r['p50_ms']:.3f} ms   p99 {r['p99_ms']:.3f} ms   (n={r['count']})")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pdd bench transport", description=__doc__)
    p.add_argument("--size-mib", type=int, default=32, help="bytes per round (a multiple of 1 MiB)")
    p.add_argument("--pairs", type=int, default=40, help="paired rounds per row (after 2 warm-up pairs)")
    p.add_argument("--parallel", type=int, default=4, help="connections of the parallel row")
    p.add_argument("--rows", help="bulk rows whose name contains one of these comma-separated words")
    p.add_argument("--quick", action="store_true", help="shorter WAN and NATS runs")
    p.add_argument("--only", choices=["bulk", "wan", "nats"], action="append")
    p.add_argument("--out", default="bench/out/transport.json")
    add_quiet_option(p)
    args = p.parse_args(argv)
    only = set(args.only or ["bulk", "wan", "nats"])

    async def run() -> dict:
        results: dict[str, Any] = {"machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0]}}
        if "bulk" in only:
            results["bulk"] = await bench_bulk(args.size_mib * MiB, args.pairs, args.parallel, keep=args.rows)
        if "wan" in only:
            results["wan"] = await bench_wan(args.quick)
        if "nats" in only:
            results["nats"] = await bench_nats(args.quick)
        return results

    save_report(asyncio.run(run()), args.out, table=_print)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
