"""bench/e2e.py's `agentic` scenario, the report: ratios of the deployments (paired by planned
step), SLA goodput and its sweep, the figures by prefix-hit bucket, targets, table and plots."""

from __future__ import annotations

import math
from typing import Any

from bench.client import pct
from bench.e2e_common import fmt_ms
from pdd.benchkit.bootstrap import ratio_interval, ratio_of_sums
from pdd.benchkit.paired import fmt_ratio, paired_ratio, pairs, print_ratios, ratio_target
from pdd.benchkit.report import pyplot

HIT_BUCKETS = [(0.0, 0.2), (0.2, 0.5), (0.5, 0.8), (0.8, 0.95), (0.95, 0.99), (0.99, 1.01)]


def meets_sla(r: dict, ttft_s: float, tpot_s: float, gap_s: float | None) -> bool:
    """Whether a request met the SLA (TTFT, TPOT and, when given, the max gap)."""
    if not r["ok"] or r["ttft"] > ttft_s or r["tpot"] > tpot_s:
        return False
    return gap_s is None or r["max_gap"] <= gap_s


def _bucket_name(lo: float, hi: float) -> str:
    return f"{lo * 100:.0f}-{min(hi, 1.0) * 100:.0f}%"


def rows_by_hit(rows: list[dict]) -> dict:
    out = {}
    for lo, hi in HIT_BUCKETS:
        rs = [r for r in rows if r["ok"] and lo <= r["hit"] < hi]
        out[_bucket_name(lo, hi)] = {
            "n": len(rs),
            "ttft_p50": pct([r["ttft"] for r in rs], 50),
            "tt2t_p50": pct([r["tt2t"] for r in rs], 50),
            "max_gap_p50": pct([r["max_gap"] for r in rs], 50),
            "tpot_p50": pct([r["tpot"] for r in rs], 50),
        }
    return out


def goodput_sweep(args, rows: list[dict], busy: dict, deps: list[str]) -> list[dict]:
    out = []
    for tpot in sorted({0.05, 0.1, 0.2, args.sla_tpot_s}):
        row: dict[str, Any] = {"ttft_s": args.sla_ttft_s, "tpot_s": tpot}
        for d in deps:
            met = sum(
                meets_sla(r, args.sla_ttft_s, tpot, args.sla_max_gap_s) for r in rows if r["deployment"] == d
            )
            row[d] = met / busy[d]
        out.append(row)
    return out


AGENTIC_RATIOS = {
    f"{k}_p{q}": (k, q) for k in ("ttft", "tt2t", "max_gap", "tpot") for q in (50, 99)
}  # name: (row key, q)


def agentic_ratios(args, rows: list[dict], busy: dict, deps: list[str]) -> dict:
    """Each deployment over same-DC and PDD over naive: p50 and p99 ratios and SLA goodput, with
    90% bootstrap intervals over requests paired by planned step (client, step). Every deployment
    runs the same plan, so a step is the same prompt and output length on each side (greedy: the
    same tokens), and its hit rate and prompt length, which dominate its latency, move both sides
    of a pair alike."""
    comparisons = [(d, "same-dc") for d in deps if d != "same-dc" and "same-dc" in deps]
    if "pdd" in deps and "naive" in deps:
        comparisons.append(("pdd", "naive"))
    out = {}
    for x, y in comparisons:
        xs, ys = pairs(rows, "deployment", x, y, ("client", "step"))
        out[f"{x}/{y}"] = {name: paired_ratio(xs, ys, k, q) for name, (k, q) in AGENTIC_RATIOS.items()}
        out[f"{x}/{y}"]["sla_goodput"] = _goodput_ratio(args, xs, ys, busy[x], busy[y])
    return out


def _goodput_ratio(args, xs: list[dict], ys: list[dict], busy_x: float, busy_y: float) -> dict:
    """SLA goodput is (requests meeting the SLA) / busy seconds, and a deployment's busy seconds
    are its agents' requests back to back: the bootstrap resamples pairs of requests and takes,
    per side, requests meeting the SLA over their summed end-to-end seconds, then scales that
    ratio to the measured one (the factor, how busy time relates to summed request time on
    each side, is held fixed)."""

    def records(rs: list[dict]) -> list[tuple[float, float]]:
        return [
            (float(meets_sla(r, args.sla_ttft_s, args.sla_tpot_s, args.sla_max_gap_s)), r["e2e"]) for r in rs
        ]

    met_x, met_y = (sum(m for m, _ in records(rs)) for rs in (xs, ys))
    measured = (met_x / busy_x) / (met_y / busy_y) if met_y > 0 and busy_x > 0 and busy_y > 0 else math.nan
    iv = ratio_interval(records(xs), records(ys), ratio_of_sums, paired=True)
    if not iv.point > 0:  # nobody met the SLA on a side: a ratio of 0 or none, no interval
        return {"ratio": measured, "lo": math.nan, "hi": math.nan, "n": len(xs)}
    return {**iv.scaled(measured / iv.point).as_json(), "n": len(xs)}


def agentic_targets(ratios: dict) -> list[dict]:
    out = []
    if "pdd/naive" in ratios:
        r = ratios["pdd/naive"]
        for k, label in (
            ("tt2t_p99", "p99 time to 2nd token"),
            ("max_gap_p99", "p99 max inter-token gap"),
            ("ttft_p50", "TTFT p50"),
            ("ttft_p99", "TTFT p99"),
        ):
            out.append(
                ratio_target(
                    f"PDD vs naive cross-DC: {label} at most naive's", r[k], 1.0, q=AGENTIC_RATIOS[k][1]
                )
            )
        out.append(
            ratio_target(
                "PDD vs naive cross-DC: SLA goodput at least naive's", r["sla_goodput"], 1.0, at_most=False
            )
        )
    if "pdd/same-dc" in ratios:
        out.append(
            {
                "what": "PDD vs same-DC PD: SLA goodput",
                "value": fmt_ratio(ratios["pdd/same-dc"]["sla_goodput"]),
                "met": None,
            }
        )
    return out


def print_agentic(res: dict) -> None:
    c = res["config"]
    s = res["summary"]
    deps = list(s)
    print(
        f"\nagentic: {c['requests']} requests per deployment, {c['clients']} agents; WAN {c['delay_ms']:g} ms "
        f"one way ±{c['jitter_ms']:g} ms, {c['bandwidth_mbps']:g} Mbit/s; SLA TTFT <= {c['sla_ttft_s']:g} s, "
        f"TPOT <= {c['sla_tpot_s'] * 1000:g} ms"
        + (f", max gap <= {c['sla_max_gap_s']:g} s" if c["sla_max_gap_s"] else "")
    )
    w = 12
    print("  " + f"{'':26s}" + "".join(f"{d:>{w}s}" for d in deps))

    def row(label: str, fmt, key: str) -> None:
        print("  " + f"{label:26s}" + "".join(f"{fmt(s[d][key]):>{w}s}" for d in deps))

    def ms(x):
        return f"{x * 1000:.0f} ms"

    row("requests ok", lambda x: str(x), "ok")
    row("mean prefix hit", lambda x: f"{x:.1%}", "hit_mean")
    row("requests > 95% hit", lambda x: f"{x:.0%}", "hit_above_95")
    row("TTFT p50", ms, "ttft_p50")
    row("TTFT p99", ms, "ttft_p99")
    row("2nd token p50", ms, "tt2t_p50")
    row("2nd token p99", ms, "tt2t_p99")
    row("max inter-token gap p50", ms, "max_gap_p50")
    row("max inter-token gap p99", ms, "max_gap_p99")
    row("TPOT p50", ms, "tpot_p50")
    row("TPOT p99", ms, "tpot_p99")
    row("throughput (req/s)", lambda x: f"{x:.3f}", "rps")
    row("SLA goodput (req/s)", lambda x: f"{x:.3f}", "sla_goodput_rps")
    row("KV bytes MD received", lambda x: f"{x / 2**20:.0f} MiB", "wan_bytes")
    row("KV bytes per request", lambda x: f"{x / 2**10:.0f} KiB", "wan_bytes_per_request")
    row("bulk link bytes", lambda x: f"{x / 2**20:.0f} MiB", "bulk_link_bytes")
    row("RLD token share", lambda x: f"{x:.1%}", "rld_token_share")
    print(
        "  "
        + f"{'pipelines':26s}"
        + "".join(
            f"{' '.join(f'{k}:{v}' for k, v in sorted(s[d]['pipelines'].items())):>{w + 14}s}"
            if i == 0
            else f"  {' '.join(f'{k}:{v}' for k, v in sorted(s[d]['pipelines'].items()))}"
            for i, d in enumerate(deps)
        )
    )
    print_ratios(
        res["ratios"],
        [
            (f"{label} p{q}", f"{k}_p{q}", q)
            for label, k in (
                ("TTFT", "ttft"),
                ("2nd token", "tt2t"),
                ("max gap", "max_gap"),
                ("TPOT", "tpot"),
            )
            for q in (50, 99)
        ]
        + [("SLA goodput", "sla_goodput", 50)],
        "resampling requests (paired by planned step)",
    )
    _print_by_hit_and_goodput(res)


def _print_by_hit_and_goodput(res: dict) -> None:
    c = res["config"]
    deps = list(res["summary"])
    print("\n  by prefix hit rate (median TTFT / 2nd token / max gap, ms; n):")
    for b in res["by_hit"][deps[0]]:
        cells = []
        for d in deps:
            x = res["by_hit"][d][b]
            cells.append(
                f"{d}: {fmt_ms(x['ttft_p50']).strip()}/{fmt_ms(x['tt2t_p50']).strip()}/"
                f"{fmt_ms(x['max_gap_p50']).strip()} (n={x['n']})"
            )
        print(f"    {b:>8s}  " + "   ".join(cells))
    print(f"\n  SLA goodput (req/s) vs TPOT limit (TTFT <= {c['sla_ttft_s']:g} s):")
    for r in res["goodput_sweep"]:
        print(f"    TPOT <= {r['tpot_s'] * 1000:4.0f} ms  " + "  ".join(f"{d} {r[d]:.3f}" for d in deps))


def agentic_figures(res: dict) -> dict:
    return {"ttft_cdf": _latency_cdf_figure(res), "by_hit": _by_hit_figure(res)}


def _latency_cdf_figure(res: dict):
    import matplotlib.ticker
    import numpy as np

    rows = res["rows"]
    fig, axes = pyplot().subplots(1, 2, figsize=(11, 4))
    for ax, key, title in (
        (axes[0], "ttft", "TTFT (1st token, streamed by P)"),
        (axes[1], "tt2t", "time to 2nd token (1st decode-side token)"),
    ):
        for d in res["summary"]:
            xs = np.sort(
                [r[key] for r in rows if r["deployment"] == d and r["ok"] and not math.isnan(r[key])]
            )
            if len(xs):
                ax.plot(xs, np.arange(1, len(xs) + 1) / len(xs), label=d, drawstyle="steps-post")
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_xlabel("seconds")
        ax.set_ylabel("CDF")
        ax.set_title(title)
        ax.grid(alpha=0.3, which="both")
        ax.legend(loc="lower right")
    return fig


def _by_hit_figure(res: dict):
    import numpy as np

    deps = list(res["summary"])
    buckets = list(res["by_hit"][deps[0]])
    fig, axes = pyplot().subplots(1, 2, figsize=(12, 4))
    width = 0.8 / len(deps)
    x = np.arange(len(buckets))
    for ax, key, title in (
        (axes[0], "ttft_p50", "median TTFT by prefix hit rate"),
        (axes[1], "max_gap_p50", "median max inter-token gap by prefix hit rate"),
    ):
        for i, d in enumerate(deps):
            ys = [res["by_hit"][d][b][key] for b in buckets]
            ax.bar(
                x + (i - (len(deps) - 1) / 2) * width, [0 if math.isnan(y) else y for y in ys], width, label=d
            )
        ax.set_xticks(
            x,
            [f"{b}\n(n={'/'.join(str(res['by_hit'][d][b]['n']) for d in deps)})" for b in buckets],
            fontsize=8,
        )
        ax.set_xlabel("prefix hit rate at MD")
        ax.set_ylabel("seconds")
        ax.set_title(title)
        ax.grid(alpha=0.3, axis="y")
        ax.legend()
    return fig
