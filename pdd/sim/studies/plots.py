"""The figures of `pdd sim run`, drawn from its JSON result (so a saved result can be re-plotted):
latency CDFs per deployment, cross-DC bandwidth over time, the goodput sweep, the bathtub."""

from __future__ import annotations

import math

from pdd.benchkit.report import pyplot

LATENCIES = (("ttft", "TTFT"), ("tt2t", "2nd token"), ("tpot", "TPOT"), ("max_gap", "max gap"))


def figures(result: dict) -> dict:
    """{name: Figure} of what the result holds: "latency" and "wan" always, "goodput" with a
    sweep, "bathtub" with a bathtub."""
    figs = {"latency": latency_cdfs(result["deployments"]), "wan": wan_over_time(result["deployments"])}
    if any(d.get("probes") for d in result["deployments"]):
        figs["goodput"] = goodput_sweep(result["deployments"], result["settings"]["sla"]["attainment"])
    if result.get("bathtub"):
        figs["bathtub"] = bathtub(result["bathtub"])
    return figs


def latency_cdfs(deployments: list[dict]):
    plt = pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for ax, (key, title) in zip(axes.flat, LATENCIES, strict=True):
        for d in deployments:
            xs = [x for x in d["cdf"][key] if not math.isnan(x)]
            ax.plot(xs, [i / max(len(xs) - 1, 1) for i in range(len(xs))], label=d["name"])
        ax.set_title(title)
        ax.set_xlabel("seconds")
        ax.set_ylabel("share of requests")
        ax.grid(alpha=0.3)
    axes.flat[0].legend()
    return fig


def wan_over_time(deployments: list[dict]):
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(9, 4))
    for d in deployments:
        if d["kind"] != "same-dc":
            ax.plot(range(len(d["wan_gbps_series"])), d["wan_gbps_series"], label=d["name"], lw=0.8)
    ax.set_title("cross-DC bandwidth (1 s bins)")
    ax.set_xlabel("simulated seconds")
    ax.set_ylabel("Gbit/s")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend()
    return fig


def goodput_sweep(deployments: list[dict], target: float):
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for d in deployments:
        probes = sorted(d.get("probes") or [], key=lambda p: p["rate_rps"])
        line = ax.plot(
            [p["rate_rps"] for p in probes], [p["attainment"] for p in probes], "o-", label=d["name"]
        )
        if d.get("goodput_rps"):
            ax.axvline(d["goodput_rps"], color=line[0].get_color(), ls=":", lw=1)
    ax.axhline(target, color="grey", ls="--", lw=1, label=f"SLA attainment {target:.0%}")
    ax.set_title("SLA attainment vs offered rate (dotted: goodput)")
    ax.set_xlabel("offered requests/s")
    ax.set_ylabel("share of requests within the SLA")
    ax.grid(alpha=0.3)
    ax.legend()
    return fig


def bathtub(points: dict):
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    rows = points["points"]
    finite = [p for p in rows if math.isfinite(p["benefit"])]
    for key, label in (("benefit", "SLA goodput"), ("bcr_benefit", "BCR (goodput per $)")):
        ax.plot([p["hit"] for p in finite], [p[key] for p in finite], "o-", label=label)
    ax.legend()
    ax.axhline(1.0, color="grey", ls="--", lw=1)
    ax.set_title(f"{points['pdd']} over {points['baseline']}: SLA goodput benefit vs prefix hit rate")
    ax.set_xlabel("prefix hit rate")
    ax.set_ylabel("goodput benefit (×)")
    ax.grid(alpha=0.3)
    return fig
